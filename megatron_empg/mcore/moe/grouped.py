"""``GroupedExperts``: the experts of Megatron's ``MoELayer`` as one stacked weight per projection,
computed with PyTorch's grouped GEMM (``model.moe_experts: grouped``; ``mcore.moe.backends``).

Weights. This rank's ``E`` local experts (``num_experts / EP``), each split over the expert-tensor-
parallel ranks (ETP) as Megatron splits ``SequentialMLP``'s:

    linear_fc1.weight  [E, 2 F / ETP, H]   expert j's [gate; up] rows, Megatron's fc1 of expert j
                                           (partition dim 1, stride 2: each ETP rank holds its
                                           share of the gate rows, then of the up rows)
    linear_fc2.weight  [E, H, F / ETP]     expert j's down projection (partition dim 2)

with ``F = moe_ffn_hidden_size`` and ``H = hidden_size``: ``weight[j]`` is the ``[out, in]`` matrix
of ``SequentialMLP``'s ``local_experts.<j>.linear_fc{1,2}.weight`` (HF's per-expert
``gate_proj``/``up_proj`` stacked, ``down_proj``), so ``grouped_mm`` takes ``weight.transpose(-2,
-1)`` as a view. ``mcore.weights`` names ``weight[j]`` by its per-expert global name
(``mlp.experts.local_experts.<j + EP offset>.linear_fc1.weight``) wherever full tensors or the weight
sync need names; ``sharded_state_dict`` stores exactly ``SequentialMLP``'s checkpoint entries (keys,
global shapes, offsets, replica ids, the SwiGLU gate/up split, the linears' extra state), so a
checkpoint loads into either. The weights are initialized as ``SequentialMLP`` initializes its
experts (the same draws in the same order: fc1 then fc2, expert by expert). Both carry
``allreduce`` as Megatron's expert linears do; ``mcore.optimizer`` marks every expert weight
``allreduce=False`` by name.

Forward, ``(permuted_local_hidden_states [M, H], tokens_per_expert [E], permuted_probs [M])`` (the
tokens sorted by local expert, as Megatron's dispatchers hand them) -> ``([M, H], None)``:

    offsets = cumsum(tokens_per_expert) as int32 on the device      (no host read)
    h = grouped_linear(x, fc1, offsets)                              [M, 2 F / ETP]
    h = (silu(gate) * up * probs).to(dtype)                          [M, F / ETP]
    y = grouped_linear(h, fc2, offsets)                              [M, H]

``SequentialMLP``'s math with ``moe_apply_probs_on_input`` off (with it on, the probs scale the
input and the SwiGLU's weights are ones, as there). The expert linears need no communication of
their own: the dispatcher gathers and reduces over the expert grid (Megatron's
``explicit_expert_comm``; at ETP 1 and EP 1 its linears' copy and reduce are over one rank). The
SwiGLU is ``mcore.moe.gemm.WeightedSwiGLU`` (compiled once, fused backward) where the config's
``bias_activation_fusion`` is on (CUDA), else the plain ops in Megatron's order (bit-equal to
``SequentialMLP`` in fp32 on CPU, as the per-group GEMM fallback is).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.moe import gemm

cpu_shims.install_pre_import()

from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # noqa: E402
from megatron.core.tensor_parallel.layers import (  # noqa: E402
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.utils import (  # noqa: E402
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
)
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint  # noqa: E402


class StackedExpertWeight(torch.nn.Module):
    """One projection of the local experts: ``weight [E, out, in]``. Its (empty) extra state stands
    for the per-expert linears' ``_extra_state`` entries that ``SequentialMLP``'s checkpoints hold."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (Megatron's linears ignore theirs)."""


class GroupedExperts(MegatronModule):
    """The local experts of a ``MoELayer`` (module docstring); Megatron's ``ExpertsBuilder``
    signature. ``gemm_path``: ``auto`` (``mcore.moe.gemm.gemm_path``: grouped_mm on CUDA bf16) or
    one of ``gemm.GEMM_PATHS`` (tests run torch's grouped_mm on CPU); ``swiglu_backend``: the
    ``torch.compile`` backend of the fused SwiGLU (None: inductor; ``eager``: uncompiled)."""

    gemm_path: str = "auto"
    swiglu_backend: str | None = None
    # ``(x, weight, offsets, path=...) -> y``: the FP8 anchor swaps in its scaled grouped matmul
    grouped_linear: Callable[..., Tensor] = staticmethod(gemm.grouped_linear)

    def __init__(self, num_local_experts: int, config, *, pg_collection=None, name: str | None = None) -> None:
        super().__init__(config=config)
        _check_supported(config)
        if pg_collection is None:
            raise ValueError("GroupedExperts needs the MoE layer's pg_collection (ep, expt_tp, expt_dp)")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp, etp_rank = self.tp_group.size(), self.tp_group.rank()
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        if ffn % etp:
            raise ValueError(f"moe_ffn_hidden_size={ffn} does not split over {etp} expert-tensor-parallel ranks")
        self.fused_swiglu = bool(config.bias_activation_fusion)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()

        def stacked(out: int, inp: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.empty(num_local_experts, out, inp, dtype=config.params_dtype, device=device)
            )

        fc1, fc2 = stacked(2 * ffn // etp, hidden), stacked(hidden, ffn // etp)
        if config.perform_initialization:
            for j in range(num_local_experts):  # SequentialMLP's order: expert j's fc1, then its fc2
                _init_expert(
                    fc1[j], config, config.init_method, 2 * ffn, hidden, dim=0, stride=2, rank=etp_rank, size=etp
                )
                _init_expert(
                    fc2[j],
                    config,
                    config.output_layer_init_method,
                    hidden,
                    ffn,
                    dim=1,
                    stride=1,
                    rank=etp_rank,
                    size=etp,
                )
        # Megatron's expert linears: allreduce off where the expert grid differs from the dense one
        expert_grid = config.expert_model_parallel_size > 1 or config.expert_tensor_parallel_size != (
            config.tensor_model_parallel_size
        )
        for param, dim, stride in ((fc1, 1, 2), (fc2, 2, 1)):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=stride)
            param.allreduce = not expert_grid
        self.linear_fc1 = StackedExpertWeight(fc1)
        self.linear_fc2 = StackedExpertWeight(fc2)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_local_experts}, fc1={tuple(self.linear_fc1.weight.shape)}, "
            f"fc2={tuple(self.linear_fc2.weight.shape)}, fused_swiglu={self.fused_swiglu}"
        )

    def forward(
        self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor
    ) -> tuple[Tensor, None]:
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: top-1 routing, probs on the input
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        offsets = gemm.group_offsets(tokens_per_expert, x.device)
        path = None if self.gemm_path == "auto" else self.gemm_path
        fc1 = self.grouped_linear(x, self.linear_fc1.weight, offsets, path=path)
        hidden = gemm.weighted_swiglu(fc1, probs, fused=self.fused_swiglu, backend=self.swiglu_backend)
        return self.grouped_linear(hidden, self.linear_fc2.weight, offsets, path=path), None

    def backward_dw(self) -> None:
        """No deferred weight gradients: autograd computes them in the backward pass."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """``SequentialMLP``'s checkpoint entries (module docstring): per projection one
        ``ShardedTensorFactory`` over the stacked weight (so the optimizer's states follow it) that
        builds each local expert's ShardedTensors at its global index, and the linears' extra state
        as a list of ShardedObjects, one per local expert."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards", False):
            raise NotImplementedError("GroupedExperts stores experts along an expert axis (singleton_local_shards off)")
        experts = self.num_local_experts
        total, first = self.ep_group.size() * experts, self.ep_group.rank() * experts
        per_expert = [(*sharded_offsets, (len(sharded_offsets), first + j, total)) for j in range(experts)]
        expert_dp = self.dp_group.rank()
        out = {}
        for name, tp_axis in (("linear_fc1", 0), ("linear_fc2", 1)):
            key = f"{prefix}experts.{name}"
            swiglu = name == "linear_fc1" and self.config.gated_linear_unit
            groups = dict(tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
            out[f"{prefix}{name}.weight"] = ShardedTensorFactory(
                f"{key}.weight",
                getattr(self, name).weight,
                functools.partial(_build_experts, per_expert=per_expert, tp_axis=tp_axis, swiglu=swiglu, **groups),
                functools.partial(_merge_experts, swiglu=swiglu),
                (0, 0, expert_dp),  # as SequentialMLP's: replicated over expert-DP only
            )
            extra = []
            for offsets in per_expert:
                obj = make_sharded_object_for_checkpoint(
                    None, f"{key}._extra_state", offsets, replica_id=(0, self.tp_group.rank(), expert_dp)
                )
                extra.append(obj)
            out[f"{prefix}{name}._extra_state"] = extra
        return out


def _build_experts(key, stacked: Tensor, replica_id, flattened_range, *, per_expert, tp_axis, swiglu, **groups):
    """Each local expert's ShardedTensors of ``stacked`` [E, ...] (a weight or an optimizer state of
    it), as ``SequentialMLP``'s expert linears make them: the expert axis prepended at its global
    index, the ETP split, fc1's gate and up halves as two tensors."""
    if flattened_range is not None:
        raise NotImplementedError("GroupedExperts' checkpoint entries are not flattened")
    built = []
    for j, offsets in enumerate(per_expert):
        sharded = make_tp_sharded_tensor_for_checkpoint(stacked[j], key, tp_axis, prepend_offsets=offsets, **groups)
        sharded.replica_id = replica_id
        if swiglu:
            factory = apply_swiglu_sharded_factory(
                sharded, offsets, tp_group=groups["tp_group"], dp_group=groups["dp_cp_group"]
            )
            built.extend(factory.build())
        else:
            built.append(sharded)
    return built


def _merge_experts(loaded: list[Tensor], *, swiglu: bool) -> Tensor:
    """The stacked tensor from ``_build_experts``' pieces as loaded."""
    if swiglu:
        loaded = [torch.cat(loaded[i : i + 2], dim=0) for i in range(0, len(loaded), 2)]
    return torch.stack(loaded)


def _init_expert(weight: Tensor, config, init_method, out: int, inp: int, *, dim: int, stride: int, rank, size):
    """One expert's share of a projection, drawn as Megatron's Column/RowParallelLinear draw it."""
    if config.use_cpu_initialization:
        per_partition = (out if dim == 0 else inp) // size
        kwargs = {"params_dtype": config.params_dtype} if dim == 1 else {}  # as Row/ColumnParallelLinear
        _initialize_affine_weight_cpu(
            weight, out, inp, per_partition, dim, init_method, stride=stride, rank=rank, world_size=size, **kwargs
        )
    else:
        _initialize_affine_weight_gpu(weight, init_method, partition_dim=dim, stride=stride, is_expert=True)


def _check_supported(config) -> None:
    """What ``GroupedExperts`` computes: SwiGLU experts without biases, in the model's dtype."""
    import torch.nn.functional as F

    problems = []
    if not config.gated_linear_unit or config.activation_func is not F.silu:
        problems.append("SwiGLU experts (gated_linear_unit with silu)")
    if config.add_bias_linear:
        problems.append("no linear biases")
    if config.fp8 or getattr(config, "fp4", None):
        problems.append("no fp8/fp4 (those need Transformer Engine: moe_experts te)")
    if getattr(config, "moe_latent_size", None) is not None:
        problems.append("no moe_latent_size")
    if getattr(config, "activation_func_clamp_value", None) is not None or getattr(config, "glu_linear_offset", 0.0):
        problems.append("a plain SwiGLU (no clamp, no linear offset)")
    if getattr(config, "use_te_activation_func", False):
        problems.append("torch's activation (use_te_activation_func off)")
    if problems:
        raise ValueError("GroupedExperts (model.moe_experts grouped) needs " + "; ".join(problems))
