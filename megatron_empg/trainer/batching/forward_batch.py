"""The forward-only passes' micro-batches: the update's packed rows back to back, in order.

The old and anchor passes (``Trainer.old_pass`` / ``anchor_pass``) keep no activations for a
backward pass, so they can take larger micro-batches than the update
(``train.max_tokens_per_forward_microbatch``): fewer, larger GEMMs, fewer fixed costs per call.
``forward_rows`` concatenates consecutive update rows, as many as fit the budget:

    update rows    [a0 a1 .] [b0 .] [c0 c1 c2 .] [d0 .]        (. the row's padding segment)
    forward rows   [a0 a1 . b0 .] [c0 c1 c2 . d0 .]

Each row's sequences and its padding stay segments of their own (``cu_seqlens`` concatenated with
offsets, ``position_ids`` as they were, ``seq_ids`` renumbered), so attention and positions are
the update rows' and every per-token statistic is the same up to the rounding of other GEMM shapes.
``ForwardRows.split_stats`` cuts the passes' per-token outputs back into the update rows' columns.

Under pipeline parallelism every micro-batch of one call has one [1, s] (the stages exchange
fixed-size activations): the forward rows are padded to one width with one more padding segment,
the narrowest width that needs no more rows than the budget does; under VPP their number is a
multiple of PP (more rows, each under the budget). Fewer rows also mean a larger pipeline bubble.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_empg.core.microbatch import MicroBatch, StatsResult

FIELD = "train.max_tokens_per_forward_microbatch"


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """How the update's micro-batches of one step become the forward passes' (module docstring).

    ``max_tokens``: tokens per forward row, padding included; None: the update's micro-batches
    themselves. ``fixed_shape``: one [1, s] for every row of the call (pipeline parallelism).
    ``count_multiple``: the number of rows is a multiple of it (the interleaved schedule).
    """

    max_tokens: int | None = None
    fixed_shape: bool = False
    count_multiple: int = 1


@dataclasses.dataclass(frozen=True)
class RowSpan:
    """Where one update micro-batch lies: columns ``[start, start + width)`` of forward row ``row``."""

    row: int
    start: int
    width: int


@dataclasses.dataclass(frozen=True)
class ForwardRows:
    """The forward micro-batches of a list of update micro-batches, and where each of those lies.

    Attributes:
        batches: the forward micro-batches, packed [1, S_j] rows (an update micro-batch itself
            where it is alone in its row and needs no padding).
        spans: one ``RowSpan`` per update micro-batch, in their order.
    """

    batches: list[MicroBatch]
    spans: list[RowSpan]

    def split(self, values: Sequence[Tensor]) -> list[Tensor]:
        """One [1, S_j, ...] tensor per forward row -> one [1, s_i, ...] view per update micro-batch."""
        return [values[span.row][:, span.start : span.start + span.width] for span in self.spans]

    def split_stats(self, outputs: Sequence[StatsResult]) -> list[StatsResult]:
        """``mcore.step.forward_stats``' outputs per forward row (every tensor [1, S_j] or
        [1, S_j, k]) -> the same outputs per update micro-batch."""
        return [outputs[span.row].columns(span.start, span.start + span.width) for span in self.spans]


def forward_rows(micro: Sequence[MicroBatch], plan: ForwardPlan) -> ForwardRows:
    """The forward rows of ``micro`` (module docstring). With a budget every micro-batch must be a
    packed row no wider than it (else ValueError naming ``train.max_tokens_per_forward_microbatch``)."""
    if plan.max_tokens is None:
        return ForwardRows(list(micro), [RowSpan(i, 0, mb.shape[1]) for i, mb in enumerate(micro)])
    for mb in micro:
        if not mb.packed or mb.shape[0] != 1:
            raise ValueError(f"{FIELD} needs packed rows, got a micro-batch of shape {mb.shape}")
    widths = [mb.shape[1] for mb in micro]
    groups = forward_groups(widths, plan)
    row_widths = [sum(widths[i] for i in g) for g in groups]
    if plan.fixed_shape:
        row_widths = [max(row_widths, default=0)] * len(groups)
    batches, spans = [], []
    for row, (members, width) in enumerate(zip(groups, row_widths)):
        batches.append(_merge_rows([micro[i] for i in members], width))
        starts = itertools.accumulate((widths[i] for i in members), initial=0)
        spans.extend(RowSpan(row, start, widths[i]) for i, start in zip(members, starts))
    return ForwardRows(batches, spans)


def forward_groups(widths: Sequence[int], plan: ForwardPlan) -> list[list[int]]:
    """The indices of the update rows (of lengths ``widths``) each forward row holds: consecutive,
    as few forward rows as the budget allows (a multiple of ``count_multiple``), under
    ``fixed_shape`` at the narrowest common width; one each without a budget. A row wider than
    the budget is a ValueError naming ``train.max_tokens_per_forward_microbatch``."""
    if plan.max_tokens is None:
        return [[i] for i in range(len(widths))]
    if max(widths, default=0) > plan.max_tokens:
        raise ValueError(f"a row of {max(widths)} tokens exceeds {FIELD}={plan.max_tokens}")
    count = -(-len(_fill(widths, plan.max_tokens)) // plan.count_multiple) * plan.count_multiple
    width = plan.max_tokens
    if plan.fixed_shape:  # every row is padded to the widest: the narrowest width at this count
        low = max(widths, default=0)
        while low < width:
            mid = (low + width) // 2
            low, width = (low, mid) if len(_fill(widths, mid)) <= count else (mid + 1, width)
    groups = _fill(widths, width)
    while len(groups) < count:  # count <= len(widths): the update's count is a multiple as well
        i = max((i for i, g in enumerate(groups) if len(g) > 1), key=lambda i: sum(widths[j] for j in groups[i]))
        totals = list(itertools.accumulate(widths[j] for j in groups[i]))
        cut = min(range(1, len(totals)), key=lambda c: max(totals[c - 1], totals[-1] - totals[c - 1]))
        groups[i : i + 1] = [groups[i][:cut], groups[i][cut:]]
    return groups


def _fill(widths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive indices, greedily: a new row when the next width would pass ``budget``."""
    groups: list[list[int]] = []
    used = 0
    for i, width in enumerate(widths):
        if not groups or used + width > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += width
    return groups


def _merge_rows(rows: Sequence[MicroBatch], width: int) -> MicroBatch:
    """One packed [1, ``width``] row: ``rows`` (packed [1, s_i] rows) back to back, then padding
    to ``width`` as a segment of its own. Every per-token field is concatenated (zeros in the
    padding; ``position_ids`` 0, 1, ... there), ``seq_ids`` renumbered, ``cu_seqlens`` offset, and
    ``max_seqlen`` the longest segment. A single row that needs no padding is returned itself.
    Context-parallel shares (``cp_size`` > 1) merge as their full rows would (a share of the merged
    row is the shares back to back): ``cu_seqlens`` in full-row tokens, the padding a segment of
    ``cp_size`` x its local width (even: both of a rank's chunks)."""
    used = sum(mb.shape[1] for mb in rows)
    if used > width:
        raise ValueError(f"rows of {used} tokens do not fit a forward row of {width}")
    if len(rows) == 1 and used == width:
        return rows[0]
    pad = width - used
    segments = [len(mb.cu_seqlens) - 1 for mb in rows]
    device = rows[0].input_ids.device
    cp = rows[0].cp_size  # context-parallel shares: cu_seqlens describe the full rows (CP x as long)
    values: dict[str, object] = {}
    for field in dataclasses.fields(MicroBatch):
        name = field.name
        parts = [getattr(mb, name) for mb in rows]
        if name in ("cp_size", "cp_rank"):
            if len(set(parts)) != 1:
                raise ValueError(f"{name} differs between the micro-batches of a forward row: {parts}")
            values[name] = parts[0]
        elif name == "max_seqlen":
            values[name] = max(*parts, pad * cp)
        elif name == "cu_seqlens":
            offsets = itertools.accumulate((mb.shape[1] * cp for mb in rows), initial=0)
            bounds = [parts[0][:1]] + [cu[1:] + offset for cu, offset in zip(parts, offsets)]
            if pad:
                bounds.append(torch.tensor([width * cp], dtype=parts[0].dtype, device=device))
            values[name] = torch.cat(bounds)
        elif all(part is None for part in parts):
            values[name] = None
        elif any(part is None for part in parts):
            raise ValueError(f"{name} is set on some micro-batches of a forward row and not on others")
        else:
            padding = parts[0].new_zeros((1, pad, *parts[0].shape[2:]))
            if name == "seq_ids":  # numbered on from the rows before; the padding is the last segment
                parts = [ids + first for ids, first in zip(parts, itertools.accumulate(segments, initial=0))]
                padding += sum(segments)
            elif name == "position_ids":
                padding = torch.arange(pad, dtype=padding.dtype, device=device)[None]
            elif name == "routed_experts":  # no engine routing there: experts 0 .. k-1 (trainer.batching.batch)
                padding[:] = torch.arange(padding.shape[-1], dtype=padding.dtype, device=device)
            values[name] = torch.cat([*parts, padding], dim=1)
    return MicroBatch(**values)
