"""A mixture of experts in the Megatron build: its ``TransformerConfig`` fields and where its
experts lie. A rank holds ``num_experts / EP`` experts as ``mlp.experts.local_experts.<j>`` (TE's
grouped experts: ``mlp.experts.linear_fc<1|2>.weight<j>``; ``GroupedExperts``: row ``j`` of the
stacked ``mlp.experts.linear_fc<1|2>.weight``), expert ``j + expert_offset`` of the full model;
checkpoints and the weight sync use the global indices (``mcore.weights.global_name``) and the
per-expert names (``stacked_expert_names``: a stacked weight is named row by row)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from megatron_empg.config import ModelConfig, ParallelConfig

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")  # TE's grouped experts
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12]\.weight)$")  # GroupedExperts' weights


def moe_overrides(
    model: ModelConfig, parallel: ParallelConfig, *, te_grouped: bool, routing_replay: bool = False
) -> dict[str, Any]:
    """``TransformerConfig`` fields of a mixture of experts.

    Megatron's default router (top-k of the logits, then softmax over those k) gives HF's
    ``norm_topk_prob`` weights; ``moe_router_pre_softmax`` (softmax over all experts, then top-k)
    gives the weights without renormalization. The router runs in float32, as HF's softmax does.
    ``expert_model_parallel_size`` must be in the config as well as in the process groups: without it
    the experts' gradients are reduced as if every rank held the same experts. ``routing_replay``:
    a ``RouterReplay`` in every router (``mcore.moe.replay``; the fused top-k, off here, bypasses it).
    ``te_grouped``: the experts are Transformer Engine's (``moe_grouped_gemm``, which Megatron reads
    as TE's GroupedLinear; ``GroupedExperts`` needs no flag).
    """
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_pre_softmax=not model.moe_norm_topk_prob,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_token_dispatcher_type=parallel.moe_token_dispatcher_type,
        moe_grouped_gemm=te_grouped,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp_size,
        moe_enable_routing_replay=routing_replay,
    )


def shift_experts(name: str, offset: int) -> str:
    """``name`` with its local expert index (if any) shifted by ``offset``."""
    name = _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}.", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}", name)


def stacked_expert_names(name: str, num_local_experts: int) -> list[str] | None:
    """The per-expert names of a stacked ``GroupedExperts`` weight, row by row:
    ``<...>.mlp.experts.linear_fc1.weight`` -> ``<...>.mlp.experts.local_experts.<j>.linear_fc1.weight``
    for j < ``num_local_experts`` (local indices, as ``SequentialMLP`` names them); None for any
    other name."""
    match = _STACKED_EXPERTS.match(name)
    if match is None:
        return None
    return [f"{match.group(1)}local_experts.{j}.{match.group(2)}" for j in range(num_local_experts)]


def is_expert_parameter(name: str) -> bool:
    """Whether ``name`` is an expert's weight (split over the expert grid: EP, ETP)."""
    return ".mlp.experts." in name


def expert_offset(chunk: GPTModel) -> int:
    """Global index of this rank's first expert (0 without experts or expert parallelism, or for a
    module without a Megatron config)."""
    config = getattr(chunk, "config", None)
    if not getattr(config, "num_moe_experts", None) or config.expert_model_parallel_size == 1:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank() * (config.num_moe_experts // config.expert_model_parallel_size)
