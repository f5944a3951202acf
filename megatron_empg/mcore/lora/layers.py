"""Megatron's column- and row-parallel linears with LoRA adapters (``model.lora``).

Each adapted HF projection p of a linear holds ``lora.<p>.lora_A`` and ``lora.<p>.lora_B`` (PEFT's
matrices, ``A [r, in]``, ``B [rows of p, r]``), sharded as the base is:

    column-parallel (QKV, fc1)  B split over TP on its rows (the rows of p this rank's output
                                holds), A whole on every TP rank
    row-parallel (proj, fc2)    A split over TP on its input columns, B whole on every TP rank

Forward, for the linear's input ``x`` (``[s, b, in]``; with sequence parallelism a column-parallel
linear gets ``[s / TP, b, in]``, a row-parallel one ``[s, b, in / TP]``)::

    y = base(x) + (alpha / r) * layout(p -> tp_comm(dropout(x) A_p^T) B_p^T)

``tp_comm`` is the one collective of the narrow ``[.., P r]`` activations that the adapters add:

    column, no SP   identity forward, all-reduce backward (``copy_to_tensor_model_parallel_region``):
                    A's gradient is the sum over the ranks' output shards, the same on each
    column, SP      all-gather over the sequence (backward: reduce-scatter); A's gradient is then a
                    sum over this rank's tokens: it is marked ``sequence_parallel`` and Megatron
                    all-reduces it over TP (``finalize_model_grads``), as it does the norms'
    row, no SP      all-reduce forward (the input columns' partial sums), identity backward
    row, SP         reduce-scatter over the sequence; B's gradient is marked ``sequence_parallel``

``layout`` places each part's rows where the fused output keeps them: QKV per query group
``[q heads of the group, k, v]`` (Megatron's ``linear_qkv`` layout), fc1 ``[gate; up]`` (this rank's
gate rows, then its up rows), proj and fc2 whole. A part without an adapter gets zeros. Context
parallelism and pipeline stages need nothing: the adapters act per token and per layer.

The adapters' parameters are allocated here and drawn by ``mcore.lora.init.initialize_adapters``
(from the run's seed and each adapter's global name, so that every layout starts alike).
``sharded_state_dict`` adds the adapters to the base linear's checkpoint entries with their TP axes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.config.lora import LORA_TARGETS
from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: E402

# The HF projections on each adapted linear, by its role.
ROLES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"),
    "fc2": ("down_proj",),
}
COLUMN_ROLES, ROW_ROLES = ("qkv", "fc1"), ("proj", "fc2")


class LoraPair(torch.nn.Module):
    """One HF projection's adapter on this rank: ``lora_A [r, in]``, ``lora_B [rows, r]`` (its
    TP shard of each)."""

    def __init__(self, rank: int, inputs: int, rows: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, inputs, dtype=dtype, device=device))
        self.lora_B = torch.nn.Parameter(torch.zeros(rows, rank, dtype=dtype, device=device))


def part_rows(role: str, config, tp: int) -> dict[str, int]:
    """The output rows of each part of a ``role`` linear on one of ``tp`` ranks: QKV's q, k, v,
    fc1's gate and up, or ``all``."""
    if role == "qkv":
        groups = config.num_query_groups // tp
        heads = config.num_attention_heads // config.num_query_groups
        return {
            "q": groups * heads * config.kv_channels,
            "k": groups * config.kv_channels,
            "v": groups * config.kv_channels,
        }
    if role == "fc1":
        return {"gate": config.ffn_hidden_size // tp, "up": config.ffn_hidden_size // tp}
    return {"all": config.hidden_size}  # proj and fc2 project back to the hidden size


def layout(role: str, parts: dict[str, Tensor], rows: dict[str, int], config, tp: int) -> Tensor:
    """The fused output ``[.., out]`` of the per-part ``[.., rows of p]`` tensors (zeros where a
    part has none); the module docstring's ``layout``."""
    if role in ROW_ROLES:
        return parts["all"]
    some = next(iter(parts.values()))
    lead = some.shape[:-1]

    def part(name: str) -> Tensor:
        return parts[name] if name in parts else some.new_zeros(*lead, rows[name])

    if role == "fc1":
        return torch.cat((part("gate"), part("up")), dim=-1)
    groups = config.num_query_groups // tp
    q, k, v = (part(name).reshape(*lead, groups, -1) for name in ("q", "k", "v"))
    return torch.cat((q, k, v), dim=-1).reshape(*lead, -1)


class _LoraMixin:
    """The adapters of a column- or row-parallel linear (module docstring)."""

    lora_role: str

    def _init_lora(self, role: str, lora, targets: tuple[str, ...]) -> None:
        self.lora_role, self.lora_rank, self.lora_scale = role, lora.rank, lora.scale
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        self.lora = torch.nn.ModuleDict()
        tp = self.tp_group.size()
        self.lora_rows = part_rows(role, self.config, tp)
        weight = self.weight
        column = role in COLUMN_ROLES
        inputs = weight.shape[1]  # this rank's: whole for a column-parallel linear, a TP shard for a row one
        for name in ROLES[role]:
            if name not in targets:
                continue
            rows = self.lora_rows[LORA_TARGETS[name][1]]
            pair = LoraPair(lora.rank, inputs, rows, weight.dtype, weight.device)
            sharded, replicated = (pair.lora_B, pair.lora_A) if column else (pair.lora_A, pair.lora_B)
            set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=0 if column else 1, stride=1)
            set_tensor_model_parallel_attributes(replicated, is_parallel=False, dim=-1, stride=1)
            if self.sequence_parallel:  # a sum over this rank's tokens: Megatron all-reduces it over TP
                replicated.sequence_parallel = True
            self.lora[name] = pair

    def lora_delta(self, x: Tensor) -> Tensor:
        """``(alpha / r) layout(p -> tp_comm(dropout(x) A_p^T) B_p^T)`` in ``x``'s dtype."""
        x = self.lora_dropout(x)
        pairs = list(self.lora.items())
        a = torch.cat([x.matmul(pair.lora_A.to(x.dtype).t()) for _, pair in pairs], dim=-1)
        group = self.tp_group
        if self.lora_role in COLUMN_ROLES:
            if self.sequence_parallel:
                a = gather_from_sequence_parallel_region(a, group=group)
            else:
                a = copy_to_tensor_model_parallel_region(a, group=group)
        elif self.sequence_parallel:
            a = reduce_scatter_to_sequence_parallel_region(a, group=group)
        else:
            a = reduce_from_tensor_model_parallel_region(a, group=group)
        parts = {}
        for (name, pair), piece in zip(pairs, a.split(self.lora_rank, dim=-1), strict=True):
            parts[LORA_TARGETS[name][1]] = piece.matmul(pair.lora_B.to(x.dtype).t())
        return layout(self.lora_role, parts, self.lora_rows, self.config, self.tp_group.size()) * self.lora_scale

    def lora_sharded_state_dict(self, prefix: str, sharded_offsets, metadata, base_axes: dict[str, int]) -> dict:
        """The base linear's checkpoint entries and its adapters', each with its TP axis."""
        axes = dict(base_axes)
        column = self.lora_role in COLUMN_ROLES
        for name in self.lora:
            axes[f"lora.{name}.lora_B" if column else f"lora.{name}.lora_A"] = 0 if column else 1
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


class LoraColumnParallelLinear(_LoraMixin, ColumnParallelLinear):
    """``ColumnParallelLinear`` with the adapters of ``targets`` (QKV or fc1: ``role``)."""

    def __init__(self, input_size, output_size, *, config, init_method, role, lora, targets, **kw):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kw)
        self._init_lora(role, lora, targets)

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if len(self.lora):
            output = output + self.lora_delta(input_).to(output.dtype)
        return output, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.lora_sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})


class LoraRowParallelLinear(_LoraMixin, RowParallelLinear):
    """``RowParallelLinear`` with the adapters of ``targets`` (proj or fc2: ``role``)."""

    def __init__(self, input_size, output_size, *, config, init_method, role, lora, targets, **kw):
        super().__init__(input_size, output_size, config=config, init_method=init_method, **kw)
        self._init_lora(role, lora, targets)

    def forward(self, input_: Tensor):
        output, bias = super().forward(input_)
        if len(self.lora):
            output = output + self.lora_delta(input_).to(output.dtype)
        return output, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self.lora_sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 1})
