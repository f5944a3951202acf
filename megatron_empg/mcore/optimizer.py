"""Megatron DDP, ``get_megatron_optimizer`` and the LR schedule for the policy.

Loss normalisation contract (docs/design/architecture.md "Numerical contracts"): the loss function
returns (sum, count) per micro-batch and the model config sets ``calculate_per_token_loss``. Megatron then
neither divides by the micro-batch count nor by the DP size; ``finalize_model_grads`` sums the
counts over micro-batches, broadcasts them over PP, all-reduces them over DP and scales every
gradient by 1 / global count: the single division of the step.
"""

from __future__ import annotations

import torch

from megatron_empg.config import OptimizerConfig
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.moe.routing import use_plain_aux_loss_path

cpu_shims.install_pre_import()

from megatron.core.distributed import (  # noqa: E402  (after the pre-import shims)
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402


def wrap_with_ddp(models: list[torch.nn.Module], settings: OptimizerConfig) -> list[DistributedDataParallel]:
    """Wrap each model chunk in Megatron DDP (fp32 grad buffers) and set the per-token-loss contract.

    Every chunk shares one ``TransformerConfig``; this sets on it ``calculate_per_token_loss``,
    ``finalize_model_grads_func`` and ``no_sync_func`` as Megatron-LM's training loop does.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        bucket_size=settings.bucket_size,
    )
    config = models[0].config
    config.calculate_per_token_loss = True
    _mark_experts_expert_parallel(models)
    wrapped = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, disable_bucketing=i > 0)
        for i, model in enumerate(models)
    ]
    use_plain_aux_loss_path(models)  # a mixture of experts: train_step scales the router losses
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def _mark_experts_expert_parallel(models: list[torch.nn.Module]) -> None:
    """Give every expert weight ``allreduce=False``, as Megatron does only at EP > 1 (or ETP != TP).

    The flag puts a parameter into DDP's expert-parallel buffers (gradients over the expert-DP
    group, at EP 1 the DP group itself: the same sums) and ``get_megatron_optimizer``'s expert
    optimizer. With it at every EP size the optimizer is always the same chain (dense, experts), so
    its checkpoint has one structure and loads at another EP size (``mcore.checkpoint``).
    """
    from megatron_empg.mcore.moe.layout import is_expert_parameter

    for model in models:
        for name, param in model.named_parameters():
            if is_expert_parameter(name):
                param.allreduce = False


def build_optimizer(ddp_models: list[DistributedDataParallel], settings: OptimizerConfig):
    """``get_megatron_optimizer`` for Adam with the model's precision (bf16 params: fp32 main params)."""
    model_config = ddp_models[0].config
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=model_config.params_dtype == torch.bfloat16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, ddp_models)


def build_scheduler(optimizer, settings: OptimizerConfig) -> OptimizerParamScheduler:
    """Linear warmup from 0 to ``lr`` over ``lr_warmup_steps``, then ``lr_decay_style`` to ``min_lr``."""
    decay_steps = settings.lr_decay_steps if settings.lr_decay_steps is not None else settings.lr_warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.lr_warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr if settings.lr_decay_steps is not None else settings.lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=settings.lr_decay_style if settings.lr_decay_steps is not None else "constant",
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )
