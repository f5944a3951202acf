"""Where the EMA anchor's numbers live (``mcore.anchor``): the optimizer's float32 main parameters
its master pairs with, the flat buffers mirroring the policy's DDP buffers, and their all-gathers.
What the values are stored as (bf16, FP8, TE FP8) is ``anchor.storage``'s.

Distributed optimizer: the all-gather of the refresh. The anchor's weights of each policy DDP
buffer live in one flat tensor with *that buffer's layout* (``param_index_map``, padded buckets
split into DP-size equal shards: the layout of Megatron's own param buffer), the parameters being
views into it. Each rank casts its master ranges into its own shard of every bucket, then
``all_gather_into_tensor`` per bucket, in place (the input is the output's own shard), all issued
inside one ``torch.distributed._coalescing_manager`` (exactly Megatron's ``start_param_sync``):
one coalesced collective per refresh, no staging buffer, no copy after it, and the memory of the
anchor is its weights alone. (The alternative, one flat all-gather of every rank's ranges
concatenated, needs a second full-size receive buffer and a scatter copy, because a rank's ranges
are one piece per bucket.) With ``overlap_grad_reduce=False`` (``mcore.optimizer.wrap_with_ddp``)
each model chunk has one bucket, so without VPP a refresh issues a single ``all_gather_into_tensor``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402
from megatron.core.optimizer.optimizer import (  # noqa: E402
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
)


@dataclasses.dataclass(eq=False)
class Entry:
    """One parameter's part owned by this rank: master <-> main over ``[start, end)`` of the
    flattened parameter (the whole parameter without the distributed optimizer)."""

    key: str
    index: int  # position in EmaAnchor._params
    main: Tensor  # optimizer's float32 main param (or shard), flattened view
    master: Tensor  # float32, 1-D, numel end - start
    start: int
    end: int
    flat_offset: int | None  # start of [start, end) in the anchor's flat buffer (sharded only)


@dataclasses.dataclass(eq=False)
class Param:
    """One anchor parameter and where its stored (compute or FP8) values live."""

    key: str
    param: torch.nn.Parameter
    buffer: int | None  # index into EmaAnchor._flats (sharded only)
    offset: int | None  # param's start in that flat buffer
    te_fp8: bool  # a Transformer Engine FP8 tensor
    policy: Tensor | None  # the policy's parameter (construction only)
    fp8: Tensor | None = None  # row-wise FP8 storage, param-shaped (``storage.RowwiseFp8``)
    entry: Entry | None = None

    @property
    def rows(self) -> int:
        """The rows of the row-wise FP8 scales: all dimensions but the last (a matrix's dim 0,
        ``G x N`` of stacked experts ``[G, N, K]``), one for a vector."""
        return self.param.numel() // self.param.shape[-1] if self.param.dim() >= 2 else 1


class StoredAnchor(Protocol):
    """What an anchor's storage (``anchor.storage``) reads of the anchor (``EmaAnchor``)."""

    models: list
    params: list[Param]
    flats: list[Flat]
    entries: list[Entry]
    sharded: bool
    dp_group: Any

    def range_of(self, e: Entry, target: Tensor) -> Tensor: ...


@dataclasses.dataclass(eq=False)
class Flat:
    """Anchor storage mirroring one policy DDP buffer: ``data``, its buckets' [start, end) and the
    buffer's data-parallel group (the expert-DP group for an expert-parallel buffer)."""

    data: Tensor
    buckets: list[tuple[int, int]]
    group: Any


def optimizers(optimizer) -> Iterator[Any]:
    if isinstance(optimizer, ChainedOptimizer):
        for inner in optimizer.chained_optimizers:
            yield from optimizers(inner)
    else:
        yield optimizer


def main_params(optimizer) -> tuple[dict[Tensor, tuple[Tensor, int, int]], bool]:
    """policy model param -> (float32 main param or shard, start, end in the flattened param);
    and whether the optimizer is distributed.

    Where each optimizer keeps them: ``Float16OptimizerWithFloat16Params`` in
    ``fp32_from_float16_groups`` / ``fp32_from_fp32_groups``; ``FP32Optimizer``: the model
    parameters themselves; ``DistributedOptimizer``: the main-parameter *shards*,
    ``shard_fp32_from_float16_groups`` / ``shard_fp32_groups``, each covering
    ``_get_model_param_range_map(p)["param"]`` of its flattened parameter; ``ChainedOptimizer``:
    each chained optimizer."""
    out: dict[Tensor, tuple[Tensor, int, int]] = {}
    kinds = set()

    def add(param: Tensor, main: Tensor | None, start: int, end: int) -> None:
        if main is None:
            raise NotImplementedError(
                "the optimizer holds no float32 main parameter for a model parameter (precision-aware "
                "optimizer: main params live inside the fused Adam); EmaAnchor needs them as tensors"
            )
        if main.dtype != torch.float32 or main.numel() != end - start:
            raise RuntimeError(
                f"main parameter of dtype {main.dtype} and {main.numel()} elements for the range [{start}, {end})"
            )
        if param in out:
            raise RuntimeError("a model parameter appears twice in the optimizer")
        out[param] = (main.detach().view(-1), start, end)

    for opt in optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if isinstance(opt, DistributedOptimizer):
            kinds.add("distributed")
            pairs = [
                (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                (opt.model_fp32_groups, opt.shard_fp32_groups),
            ]
            for model_groups, main_groups in pairs:
                for model_group, main_group in zip(model_groups, main_groups, strict=True):
                    for param, main in zip(model_group, main_group, strict=True):
                        r = opt._get_model_param_range_map(param)["param"]
                        add(param, main, r.start, r.end)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            kinds.add("full")
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                for param, main in zip(model_group, main_group, strict=True):
                    add(param, main, 0, param.numel())
            for group in opt.fp32_from_fp32_groups:
                for param in group:
                    add(param, param, 0, param.numel())
        elif isinstance(opt, FP32Optimizer):
            kinds.add("full")
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    add(param, param, 0, param.numel())
        else:
            raise NotImplementedError(f"EmaAnchor does not know where {type(opt).__name__} keeps its main parameters")
    if len(kinds) > 1:
        raise NotImplementedError("a ChainedOptimizer mixing distributed and non-distributed optimizers")
    return out, kinds == {"distributed"}


def _all_gather_buckets(pairs: list[tuple[Tensor, Tensor]], group) -> None:
    """In place, ``all_gather_into_tensor(out, shard)`` for every pair (``shard`` is this rank's
    part of ``out``), as one coalesced collective (torch >= 2.13 names it ``all_gather_single``)."""
    if not pairs:
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if len(pairs) == 1:
        gather(pairs[0][0], pairs[0][1], group=group)
        return
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(group):
        for out, shard in pairs:
            gather(out, shard, group=group)


def gather_flats(flats: list[tuple[Flat, Tensor]], *, as_bytes: bool = False) -> None:
    """In place, every DP rank's shard of each bucket of ``flats`` (flat, tensor laid out as its
    ``data``) on every rank of the flat's group: one coalesced all-gather per group (the policy's
    DP group; a mixture of experts adds its expert-DP group). ``as_bytes``: gather the raw bytes."""
    by_group: dict[Any, list[tuple[Tensor, Tensor]]] = {}
    for flat, tensor in flats:
        size_of_group = flat.group.size()
        if size_of_group == 1:
            continue
        rank = flat.group.rank()
        for start, end in flat.buckets:
            out = raw_bytes(tensor[start:end]) if as_bytes else tensor[start:end]
            size = out.numel() // size_of_group
            by_group.setdefault(flat.group, []).append((out, out[rank * size : (rank + 1) * size]))
    for group, pairs in by_group.items():
        _all_gather_buckets(pairs, group)


def te_fp8_model_init(te_missing: str) -> Callable[[], contextlib.AbstractContextManager]:
    """Transformer Engine's ``fp8_model_init`` (current scaling where TE supports recipes), or a
    RuntimeError when TE or CUDA is missing. Lazy: TE is a GPU extra."""
    import inspect

    try:
        import transformer_engine.pytorch as te
    except ImportError as error:
        raise RuntimeError(f"te_fp8=True needs Transformer Engine. {te_missing}") from error
    if not torch.cuda.is_available():
        raise RuntimeError("Transformer Engine FP8 parameters (te_fp8=True) need a GPU")
    kwargs: dict[str, Any] = {"enabled": True}
    if "recipe" in inspect.signature(te.fp8_model_init).parameters:
        try:
            from transformer_engine.common.recipe import Float8CurrentScaling

            kwargs["recipe"] = Float8CurrentScaling()
        except ImportError:  # TE < 2.2: delayed scaling
            pass
    return lambda: te.fp8_model_init(**kwargs)


def raw_bytes(t: Tensor) -> Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
