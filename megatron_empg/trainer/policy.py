"""The policy a run trains (Megatron chunks wrapped in DDP, the optimizer, the LR scheduler) and
its EMA anchor, built from what ``trainer.bind.build.bind`` resolved. Megatron is imported lazily
(``mcore``), when they are built."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch

from megatron_empg.trainer.bind.build import Components
from megatron_empg.trainer.run.start import load_initial_weights

if TYPE_CHECKING:
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.lora.anchor import AdapterAnchor
    from megatron_empg.mcore.parallel_state import ParallelGroups
    from megatron_empg.mcore.teacher import FrozenTeacher

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class Policy:
    """This rank's policy: ``models`` its model chunks (one per virtual pipeline stage) wrapped in
    Megatron DDP, ``optimizer`` the Megatron optimizer over them, ``scheduler`` its LR schedule."""

    models: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any


def build_policy(components: Components, groups: ParallelGroups) -> Policy:
    """The policy of ``components`` on this rank's share of ``groups`` (model parallelism set up):
    its first weights from ``checkpoint.init_from`` (else random), in ``train.params_dtype``."""
    from megatron_empg.mcore.fusions import fusion_plan
    from megatron_empg.mcore.model import build_gpt_model, recompute_overrides
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp

    cfg, model = components.config, components.model
    recompute = recompute_overrides(cfg.train.recompute, cfg.train.recompute_num_layers)
    if recompute:
        log.info("activation recompute: %s", ", ".join(f"{k}={v}" for k, v in recompute.items()))
    fusions = fusion_plan(components.attention, cuda=torch.cuda.is_available())
    log.info("attention %s; %s", components.attention.describe(), fusions.describe())
    if components.experts is not None:
        bf16 = cfg.train.params_dtype == "bfloat16"
        gemm = components.experts.gemm(cuda=torch.cuda.is_available(), bf16=bf16)
        log.info("experts %s: %s", components.experts.describe(), gemm)
    chunks = build_gpt_model(
        model,
        cfg.parallel,
        params_dtype=DTYPES[cfg.train.params_dtype],
        fusions=fusions,
        lora_seed=cfg.train.seed,
        **recompute,
        **_routing_replay(components),
    )
    if model.lora is not None:
        lora = model.lora
        log.info(
            "LoRA: rank %d, alpha %g, targets %s; the base is frozen (%s trainable parameters on this rank)",
            lora.rank,
            lora.alpha,
            ", ".join(lora.resolved_targets(moe=model.is_moe)),
            f"{sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad):,}",
        )
    if cfg.checkpoint.init_from is not None:
        load_initial_weights(chunks, cfg.checkpoint.init_from, model, cfg, groups)
    models = wrap_with_ddp(chunks, cfg.optimizer)
    optimizer = build_optimizer(models, cfg.optimizer)
    return Policy(models, optimizer, build_scheduler(optimizer, cfg.optimizer))


def build_anchor(components: Components, policy: Policy) -> EmaAnchor | AdapterAnchor | None:
    """The EMA anchor of ``policy`` (built after its optimizer, whose main parameters its master
    pairs with), or None when the KL needs no anchor model (no KL, or the iterative reference
    whose anchor is the old pass's policy)."""
    from megatron_empg.mcore.anchor import EmaAnchor

    config = components.config
    algorithm = config.algorithm
    if components.stats.anchor_is_old:
        log.info(
            "iterative reference: the KL's anchor is each step's behaviour policy (tau 0 every %d optimizer "
            "steps), so the old pass's log-probs serve it; no anchor model is kept",
            algorithm.mini_batches,
        )
    if not components.stats.anchor:
        return None
    anchor = algorithm.anchor
    if components.model.lora is not None:
        from megatron_empg.mcore.lora.anchor import AdapterAnchor

        log.info(
            "EMA anchor: tau %g every %d optimizer steps over the adapters (the policy's base with averaged adapters)",
            anchor.tau,
            anchor.period,
        )
        return AdapterAnchor(
            policy.models, policy.optimizer, tau=anchor.tau, period=anchor.period, first_update=anchor.first_update
        )
    storage, why = components.anchor_storage
    log.info(
        "EMA anchor: tau %g every %d optimizer steps, %s weights, %s storage (%s)",
        anchor.tau,
        anchor.period,
        anchor.compute_dtype,
        storage,
        why,
    )
    return EmaAnchor.from_configs(
        components.model,
        config.parallel,
        policy.models,
        policy.optimizer,
        tau=anchor.tau,
        period=anchor.period,
        first_update=anchor.first_update,
        compute_dtype=DTYPES[anchor.compute_dtype],
        master_on_cpu=anchor.master_on_cpu,
        fp8=storage if storage in ("emulated", "torch") else "emulated",
        fp8_output_layer=anchor.fp8_output_layer,
        te_fp8=storage == "te",
        **_routing_replay(components),
    )


def build_teacher(components: Components, groups: ParallelGroups) -> FrozenTeacher | None:
    """The distillation teacher on the training ranks (``algorithm.distill``, placement trainer),
    its weights from ``teacher.checkpoint``; None without distillation."""
    from megatron_empg.mcore.fusions import fusion_plan
    from megatron_empg.mcore.teacher import FrozenTeacher

    binding = components.distill
    if binding is None:
        return None
    config = components.config
    spec = config.algorithm.distill.teacher
    log.info(
        "distillation teacher %s (%s, %s weights%s), loss %s",
        binding.model.name,
        spec.checkpoint,
        spec.dtype,
        ", offloaded between passes" if spec.offload else "",
        binding.term.loss.name,
    )
    return FrozenTeacher.build(
        binding.model,
        config.parallel,
        params_dtype=DTYPES[spec.dtype],
        load=lambda chunks: load_initial_weights(chunks, spec.checkpoint, binding.model, config, groups),
        offload=spec.offload,
        fusions=fusion_plan(components.attention, cuda=torch.cuda.is_available()),
    )


def _routing_replay(components: Components) -> dict[str, bool]:
    """The model builders' switch for ``algorithm.router_replay: rollout``: routers that replay
    the engine's experts (``mcore.moe.replay``; the micro-batches carry them)."""
    return {"routing_replay": True} if components.config.algorithm.router_replay == "rollout" else {}
