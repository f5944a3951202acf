"""What the EMA anchor's compute weights are stored as: one class per kind, chosen once when the
anchor is built (``STORAGES``; ``EmaAnchor`` holds the layout, the master and the collectives, and
asks its storage for the rest).

    plain     the parameters in bf16 / fp16 / fp32: the refresh casts the master into them.
    emulated  row-wise FP8 (``core.fp8``): every parameter quantized from the master with one
              float32 scale per row (dim 0; one per tensor for a vector). The decoder's linear
              weights are kept *only* as FP8 (the ``Parameter`` holds float8_e4m3fn) and their
              forward quantizes its input per token and multiplies in float32 from the dequantized
              operands; the other parameters (embeddings, output layer, norms, grouped experts)
              hold the dequantized values in the forward dtype.
    torch     the same storage and scales as ``emulated``; the linear forward runs
              ``torch._scaled_mm`` (FP8 tensor cores on Hopper / Ada). ``emulated`` computes what it
              computes (same scales, same e4m3 rounding), up to the float32 summation order.
    te        Transformer Engine FP8 parameters (``fp8_param``), re-quantized by Megatron's TE
              wrappers (GPU with TE only; NOT TESTED here).

With the distributed optimizer the FP8 kinds keep one float8 flat buffer per policy DDP buffer
(1 byte per element, gathered as bytes); a row cut by a rank's range has its maximum combined over
the ranks by one all-reduce(MAX) of all rows' maxima per group before anything is quantized, so the
scales equal the unsharded ones.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core import fp8 as fp8_math
from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core import fp8_utils  # noqa: E402

from megatron_empg.mcore.anchor import fp8_linear  # noqa: E402

if TYPE_CHECKING:
    from megatron_empg.mcore.anchor.layout import Entry, Param, StoredAnchor


class AnchorStorage:
    """The interface ``EmaAnchor`` calls, in this order: ``check`` (the builder's parameters),
    ``flat_dtype`` / ``place`` (distributed optimizer: a parameter's range in a flat buffer),
    ``attach`` (after the layout), then at every refresh ``write`` (the master's ranges into the
    storage, before the gather) and ``finish`` (after it)."""

    name: ClassVar[str]

    def __init__(self, compute_dtype: torch.dtype, *, output_layer: bool = False) -> None:
        self.compute_dtype = compute_dtype
        self.output_layer = output_layer  # the row-wise FP8 kinds: the output layer in FP8 too

    def check(self, named_params: list[tuple[str, Tensor]]) -> None:
        """ValueError if the built parameters cannot hold this kind."""
        for name, p in named_params:
            if fp8_utils.is_float8tensor(p):
                raise ValueError(
                    f"{name}: the anchor's parameters are Transformer Engine FP8 tensors; "
                    f"{self.name} storage cannot hold them"
                )

    def flat_dtype(self, params: list[Tensor], policy_param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the flat buffer mirroring a policy DDP buffer of ``params``."""
        return self.compute_dtype

    def place(self, name: str, param: Tensor, view: Tensor) -> None:
        """Make ``param`` hold its range ``view`` of a flat buffer."""
        if param.dtype != view.dtype:
            raise ValueError(
                f"{name}: the anchor's parameter is {param.dtype}, its DDP bucket neighbours' {view.dtype}"
            )
        param.data = view

    def check_expert_buffer(self) -> None:
        """Raise where this kind cannot mirror an expert-parallel DDP buffer."""

    def attach(self, anchor: StoredAnchor) -> None:
        """Allocate what the kind keeps beside the parameters."""

    def write(self, anchor: StoredAnchor) -> None:
        raise NotImplementedError

    def finish(self, anchor: StoredAnchor) -> None:
        """After the gather."""


class PlainStorage(AnchorStorage):
    """bf16 / fp16 / fp32 parameters: the master's cast."""

    name = "plain"

    def check(self, named_params: list[tuple[str, Tensor]]) -> None:
        super().check(named_params)
        for name, p in named_params:
            if p.dtype != self.compute_dtype:
                raise ValueError(
                    f"{name}: the anchor's parameter is {p.dtype}; build the anchor with "
                    f"params_dtype={self.compute_dtype} (compute_dtype)"
                )

    def write(self, anchor: StoredAnchor) -> None:
        for e in anchor.entries:
            anchor.range_of(e, anchor.params[e.index].param.data).copy_(e.master)


def _row_pieces(start: int, end: int, cols: int) -> list[tuple[int, int, int, int]]:
    """``[start, end)`` of a flattened ``[rows, cols]`` tensor as at most three blocks of whole or
    partial rows: (lo, hi) offsets in the range, the first row, the number of rows."""
    pieces, pos = [], start
    while pos < end:
        row, col = divmod(pos, cols)
        if col or end - pos < cols:  # a row cut by the range
            hi = min(end, (row + 1) * cols)
            pieces.append((pos - start, hi - start, row, 1))
        else:
            hi = pos + (end - pos) // cols * cols
            pieces.append((pos - start, hi - start, row, (hi - pos) // cols))
        pos = hi
    return pieces


class RowwiseFp8(AnchorStorage):
    """FP8 with one scale per row (see the module docstring); subclasses pick the matmul."""

    matmul: ClassVar[str]

    def flat_dtype(self, params: list[Tensor], policy_param_dtype: torch.dtype) -> torch.dtype:
        return fp8_math.FP8_DTYPE

    def place(self, name: str, param: Tensor, view: Tensor) -> None:
        """The parameter keeps its forward-dtype tensor; ``attach`` takes the FP8 view."""

    def attach(self, anchor: StoredAnchor) -> None:
        params = anchor.params
        device = params[0].param.device
        self.row_counts = [p.rows for p in params]
        self.row_offsets = list(itertools.accumulate(self.row_counts, initial=0))[:-1]
        total = sum(self.row_counts)
        self.scale_inv = torch.ones(total, dtype=torch.float32, device=device)
        self._amax = torch.zeros(total, dtype=torch.float32, device=device)
        linears = fp8_linear.fp8_modules(anchor.models, output_layer=self.output_layer)
        self.linear = [False] * len(params)
        for i, p in enumerate(params):
            if p.buffer is not None:
                flat = anchor.flats[p.buffer].data
                p.fp8 = flat[p.offset : p.offset + p.param.numel()].view(p.param.shape)
            module = linears.get(p.key)
            if module is None or not self._fits(p.param):
                continue
            if p.fp8 is None:
                p.fp8 = torch.zeros(p.param.shape, dtype=fp8_math.FP8_DTYPE, device=p.param.device)
            p.param.data = p.fp8  # the forward-dtype weight is freed: the FP8 values are the parameter
            fp8_linear.install(module, p.param, self._scale_inv(i), self.matmul)
            self.linear[i] = True
        self._rows_by_group = self._group_rows(anchor) if anchor.sharded else {}

    def _fits(self, weight: Tensor) -> bool:
        return True

    def _scale_inv(self, i: int, scales: Tensor | None = None) -> Tensor:
        """Parameter ``i``'s rows of ``scales`` (default: the inverse scales kept)."""
        scales = self.scale_inv if scales is None else scales
        return scales[self.row_offsets[i] : self.row_offsets[i] + self.row_counts[i]]

    def _group_rows(self, anchor: StoredAnchor) -> dict:
        """Data-parallel group -> int64 indices of the scale rows of the parameters in its buffers."""
        by_group: dict = {}
        for i, p in enumerate(anchor.params):
            rows = range(self.row_offsets[i], self.row_offsets[i] + p.rows)
            by_group.setdefault(anchor.flats[p.buffer].group, []).extend(rows)
        device = self.scale_inv.device
        return {g: torch.tensor(rows, device=device) for g, rows in by_group.items() if g.size() > 1}

    def write(self, anchor: StoredAnchor) -> None:
        """The master quantized into the storage, without a host sync. Unsharded: each parameter's
        rows in one pass (``fp8_linear.quantize_rows``: one Triton kernel on CUDA). Sharded: the
        row maxima of this rank's ranges, combined over DP, then each range quantized (a range's
        boundaries are Python ints)."""
        masters = {e.index: e.master.to(self.scale_inv.device) for e in anchor.entries}
        if anchor.sharded:
            self._write_ranges(anchor, masters)
            return
        for e in anchor.entries:
            p = anchor.params[e.index]
            q, scale_inv = fp8_linear.quantize_rows(masters[e.index].view(p.rows, -1))
            self._scale_inv(e.index).copy_(scale_inv)
            if p.fp8 is None:  # not a linear: the dequantized values only
                p.param.data.copy_(fp8_math.dequantize(q, scale_inv, p.param.dtype).view(p.param.shape))
            else:
                p.fp8.copy_(q.view(p.param.shape))

    def _write_ranges(self, anchor: StoredAnchor, masters: dict[int, Tensor]) -> None:
        self._amax.zero_()
        for e in anchor.entries:
            cols = anchor.params[e.index].param.numel() // anchor.params[e.index].rows
            for lo, hi, row, n in _row_pieces(e.start, e.end, cols):
                rows = self._amax[self.row_offsets[e.index] + row :][:n]
                torch.maximum(rows, masters[e.index][lo:hi].view(n, -1).abs().amax(dim=1), out=rows)
        for group, indices in self._rows_by_group.items():
            part = self._amax[indices]
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
            self._amax[indices] = part
        scale = fp8_math.scales_from_amax(self._amax)
        torch.reciprocal(scale, out=self.scale_inv)
        for e in anchor.entries:
            p = anchor.params[e.index]
            store = anchor.range_of(e, p.fp8)
            for lo, hi, row, n in _row_pieces(e.start, e.end, p.param.numel() // p.rows):
                s = scale[self.row_offsets[e.index] + row :][:n]
                store[lo:hi].view(n, -1).copy_(fp8_math.quantize(masters[e.index][lo:hi].view(n, -1), s))

    def finish(self, anchor: StoredAnchor) -> None:
        """Sharded: the gathered FP8 values of the non-linear parameters, dequantized into them."""
        if not anchor.sharded:
            return
        for i, p in enumerate(anchor.params):
            if not self.linear[i]:
                deq = fp8_math.dequantize(p.fp8.view(p.rows, -1), self._scale_inv(i), p.param.dtype)
                p.param.data.copy_(deq.view(p.param.shape))

    def fp8_weights(self, anchor: StoredAnchor) -> dict[str, tuple[Tensor | None, Tensor]]:
        """key -> (float8_e4m3fn in the parameter's shape, or None where only the dequantized
        values are kept; float32 ``scale_inv`` ``[rows]``)."""
        return {p.key: (p.fp8, self._scale_inv(i)) for i, p in enumerate(anchor.params)}


class EmulatedFp8(RowwiseFp8):
    name = "emulated"
    matmul = "emulated"


class TorchFp8(RowwiseFp8):
    name = "torch"
    matmul = "torch"

    def _fits(self, weight: Tensor) -> bool:
        """``torch._scaled_mm``'s shape rule; a weight that breaks it keeps the dequantized values.
        Grouped experts ``[G, N, K]`` always fit: their matmul falls back to the emulation."""
        return weight.dim() == 3 or fp8_math.scaled_mm_fits(weight.shape, weight.device)


class TeFp8(AnchorStorage):
    """Transformer Engine FP8 parameters, re-quantized through Megatron's TE wrappers."""

    name = "te"

    def check(self, named_params: list[tuple[str, Tensor]]) -> None:
        if not any(fp8_utils.is_float8tensor(p) for _, p in named_params):
            raise ValueError("te storage needs the anchor built with Transformer Engine FP8 parameters (te_fp8=True)")

    def flat_dtype(self, params: list[Tensor], policy_param_dtype: torch.dtype) -> torch.dtype:
        te = [fp8_utils.is_float8tensor(p) for p in params]
        if any(te) and not (all(te) and policy_param_dtype == torch.uint8):
            raise NotImplementedError(
                "with the distributed optimizer, Transformer Engine FP8 anchor parameters need an FP8 "
                "(fp8_param) policy: the anchor mirrors the policy's DDP buffers, which then hold FP8 "
                "parameters apart from the others"
            )
        return torch.uint8 if any(te) else params[0].dtype  # TE FP8 raw bytes, or what TE keeps high

    def place(self, name: str, param: Tensor, view: Tensor) -> None:
        if fp8_utils.is_float8tensor(param):
            fp8_utils.modify_underlying_storage(param, view)
        else:
            super().place(name, param, view)

    def check_expert_buffer(self) -> None:
        raise NotImplementedError(
            "Transformer Engine FP8 anchor parameters with expert-parallel DDP buffers (the FP8 "
            "re-quantization is over one DP group)"
        )

    def write(self, anchor: StoredAnchor) -> None:
        te_params, te_masters, te_starts = [], [], []
        for p in anchor.params:
            e: Entry | None = p.entry
            master = None if e is None else e.master.to(p.param.device)
            if not p.te_fp8:
                if e is not None:
                    anchor.range_of(e, p.param.data).copy_(master)
            elif anchor.sharded:
                te_params.append(p.param)
                te_masters.append(master)
                te_starts.append(None if e is None else e.start)
            else:
                fp8_utils.copy_tensor_to_quantized_param(p.param, master.view(p.param.shape))
        if te_params:
            fp8_utils.quantize_param_shard(te_params, te_masters, te_starts, anchor.dp_group)

    def finish(self, anchor: StoredAnchor) -> None:
        if anchor.sharded:
            fp8_utils.post_all_gather_processing([p.param for p in anchor.params if p.te_fp8])


STORAGES: dict[str, type[AnchorStorage]] = {cls.name: cls for cls in (PlainStorage, EmulatedFp8, TorchFp8, TeFp8)}
FP8_STORAGES = ("emulated", "torch", "te")


def storage_params(params: list[Param]) -> int:
    """Bytes the anchor's compute weights take on this rank (parameters and FP8 buffers, the scales
    included; a flat buffer counted once)."""
    seen, total = set(), 0
    for p in params:
        for t in (p.param.data, p.fp8):
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
