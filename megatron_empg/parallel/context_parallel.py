"""Context parallelism (CP): one packed row split over the ranks of a CP group.

The split is Megatron's / Transformer Engine's load-balanced causal one. Every ``cu_seqlens``
segment of the row (each sequence, and the trailing padding segment) has a length L that is a
multiple of 2 * cp_size; it is cut into 2 * cp_size chunks of c = L / (2 * cp_size) tokens, and CP
rank r holds chunks r and 2 * cp_size - 1 - r of EVERY segment: an early chunk (few keys before
it) and a late one (many), so that every rank does the same causal attention work. The rank's
local row is, segment after segment, its chunk r then its chunk 2 * cp_size - 1 - r:

    full row  (one segment, cp_size 2)   [ c0 | c1 | c2 | c3 ]
    rank 0 local row                     [ c0 | c3 ]
    rank 1 local row                     [ c1 | c2 ]

so S_local = S_full / cp_size. ``cu_seqlens`` and ``max_seqlen`` stay the full row's on every rank.

    CpChunks          the index math of one rank's share (built once per micro-batch from
                      ``cu_seqlens``, one host read): which full-row positions are local, how the
                      rank-major all-gather maps back to the full row, and for attention each
                      local chunk's queries and keys (``QueryChunk``), packed for a variable-length
                      kernel (``KeyRanges``) or as masked batches (``ChunkBucket``)
    split_microbatch  a packed ``MicroBatch`` -> this rank's share (every per-token tensor)
    gather_from_cp    [S_local, ...] on every rank -> [S_full, ...] in full-row order (autograd:
                      backward sums the ranks' gradients and keeps this rank's rows)

Index tensors are int64 (``cu_seqlens``-like ones int32, as the attention kernels take them).
Collectives take an explicit process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.microbatch import MicroBatch

# torch 2.13 renamed the tensor collectives (the old names warn); 2.6 .. 2.12 have only the old.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# A bucket's chunks have key ranges within this ratio of its longest (as mcore.thd's length buckets).
BUCKET_RATIO = 1.25


@dataclasses.dataclass(frozen=True)
class QueryChunk:
    """One chunk of the local row (host ints).

    Attributes:
        local_start: its first row in the local row.
        length: its tokens.
        segment_start: the full-row position where its segment starts.
        full_start: the full-row position of its first token.
    Its queries attend causally to the keys of its segment up to themselves: full-row positions
    [segment_start, key_end), the query at full position p to those <= p.
    """

    local_start: int
    length: int
    segment_start: int
    full_start: int

    @property
    def key_end(self) -> int:
        """One past the last full-row key any of its queries sees."""
        return self.full_start + self.length

    @property
    def key_length(self) -> int:
        return self.key_end - self.segment_start


@dataclasses.dataclass(frozen=True)
class KeyRanges:
    """The keys of every local chunk, packed one range after another, for a variable-length kernel
    whose i-th query segment is the local row's chunk i and whose i-th key segment is that chunk's
    key range (a causal mask aligned to the bottom right then gives each query exactly its keys).

    Attributes:
        key_index: [sum of key lengths] int64 full-row positions of the packed keys.
        cu_seqlens_q: [chunks + 1] int32 chunk boundaries in the local row.
        cu_seqlens_k: [chunks + 1] int32 key-range boundaries in the packed keys.
        max_seqlen_q: the longest chunk.
        max_seqlen_k: the longest key range.
    """

    key_index: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclasses.dataclass(frozen=True)
class ChunkBucket:
    """Local chunks with key ranges of similar length as one padded batch, for an attention with an
    explicit mask: n chunks, [n, queries] query slots, [n, keys] key slots.

    Attributes:
        query_index: [n * queries] int64 local row of each query slot (a padding slot repeats its
            chunk's last query).
        key_index: [n * keys] int64 full-row position of each key slot (a padding slot repeats its
            range's last key; the mask hides it).
        mask: [n, 1, queries, keys] bool, True where the query sees the key: its segment's keys up
            to its own position.
        slots: [k] int64 the query slots (flattened n * queries) holding real tokens.
        rows: [k] int64 their local rows (every local row is in exactly one bucket).
    """

    batch: int
    queries: int
    keys: int
    query_index: Tensor
    key_index: Tensor
    mask: Tensor
    slots: Tensor
    rows: Tensor


@dataclasses.dataclass(frozen=True)
class CpChunks:
    """CP rank ``cp_rank``'s share of a packed row of segments ``lengths`` (module docstring).

    With ``cp_size`` 1 the share is the whole row (one chunk per segment, any lengths); above 1,
    every length must be a multiple of 2 * cp_size (ValueError naming the segment otherwise).
    Tensors are built on first use, per device, and kept (the object lives for one micro-batch).
    """

    lengths: tuple[int, ...]
    cp_size: int
    cp_rank: int
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.cp_size < 1 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"CP rank {self.cp_rank} of {self.cp_size}: expected 0 <= rank < size, size >= 1")
        if self.cp_size > 1:
            for i, length in enumerate(self.lengths):
                if length % (2 * self.cp_size):
                    raise ValueError(
                        f"segment {i} of the packed row has {length} tokens, not a multiple of "
                        f"2 * cp_size = {2 * self.cp_size} (pad every sequence to that)"
                    )

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor | Sequence[int], cp_size: int, cp_rank: int) -> CpChunks:
        """From a packed row's [N + 1] boundaries (a tensor is read to the host once)."""
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
        return cls(tuple(int(b - a) for a, b in zip(cu[:-1], cu[1:])), cp_size, cp_rank)

    @property
    def full_length(self) -> int:
        return sum(self.lengths)

    @property
    def local_length(self) -> int:
        return self.full_length // self.cp_size

    def for_rank(self, cp_rank: int) -> CpChunks:
        """The same row's share on another rank of the group."""
        return CpChunks(self.lengths, self.cp_size, cp_rank)

    @property
    def query_chunks(self) -> tuple[QueryChunk, ...]:
        """The local row's chunks in local order (empty segments have none)."""
        if "chunks" not in self._cache:
            chunks, local, start = [], 0, 0
            for length in self.lengths:
                if self.cp_size == 1:
                    pieces = [(0, length)] if length else []
                else:
                    c = length // (2 * self.cp_size)
                    pieces = [(self.cp_rank * c, c), ((2 * self.cp_size - 1 - self.cp_rank) * c, c)] if c else []
                for offset, size in pieces:
                    chunks.append(QueryChunk(local, size, start, start + offset))
                    local += size
                start += length
            self._cache["chunks"] = tuple(chunks)
        return self._cache["chunks"]

    def _cached(self, name: str, device, build):
        """``build(device)`` on the first call per (name, device), the same object after."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if (name, device) not in self._cache:
            self._cache[name, device] = build(device)
        return self._cache[name, device]

    def local_index(self, device=None) -> Tensor:
        """[S_full / cp_size] int64: the full-row position of each local token, in local order."""
        bounds = [(q.full_start, q.key_end) for q in self.query_chunks]
        return self._cached("local_index", device, lambda d: _ranges(bounds, self.local_length).to(d))

    def gathered_positions(self, device=None) -> Tensor:
        """[S_full] int64: the full-row position of each row of a rank-major all-gather of the ranks'
        local rows ([cp_size * S_local]: rank 0's rows, then rank 1's, ...)."""
        ranks = range(self.cp_size)
        return self._cached(
            "gathered_positions", device, lambda d: torch.cat([self.for_rank(r).local_index() for r in ranks]).to(d)
        )

    def full_order(self, device=None) -> Tensor:
        """[S_full] int64: the index into a rank-major all-gather that gives the full-row order
        (the inverse permutation of ``gathered_positions``)."""
        return self._cached("full_order", device, lambda d: torch.argsort(self.gathered_positions()).to(d))

    def key_ranges(self, device=None) -> KeyRanges:
        """Every local chunk's key range, packed (``KeyRanges``), for a variable-length kernel."""
        return self._cached("key_ranges", device, self._key_ranges)

    def _key_ranges(self, device: torch.device) -> KeyRanges:
        chunks = self.query_chunks
        cu_q = torch.tensor([0, *(q.length for q in chunks)]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0, *(q.key_length for q in chunks)]).cumsum(0).to(torch.int32)
        index = _ranges([(q.segment_start, q.key_end) for q in chunks], int(cu_k[-1]))
        longest_q = max((q.length for q in chunks), default=0)
        longest_k = max((q.key_length for q in chunks), default=0)
        return KeyRanges(index.to(device), cu_q.to(device), cu_k.to(device), longest_q, longest_k)

    def chunk_buckets(self, device=None) -> tuple[ChunkBucket, ...]:
        """The local chunks grouped by key-range length, longest first, each within
        ``BUCKET_RATIO`` of its longest (``ChunkBucket``): a few batched masked calls per row, with
        at most ``BUCKET_RATIO`` x the keys a chunk needs."""
        return self._cached("chunk_buckets", device, self._chunk_buckets)

    def _chunk_buckets(self, device: torch.device) -> tuple[ChunkBucket, ...]:
        groups: list[list[QueryChunk]] = []
        for chunk in sorted(self.query_chunks, key=lambda q: -q.key_length):
            if not groups or chunk.key_length * BUCKET_RATIO < groups[-1][0].key_length:
                groups.append([])
            groups[-1].append(chunk)
        buckets = []
        for members in groups:
            queries, keys = max(q.length for q in members), members[0].key_length
            length, local_start, segment_start, full_start, key_length = (
                torch.tensor([getattr(q, name) for q in members])[:, None]
                for name in ("length", "local_start", "segment_start", "full_start", "key_length")
            )
            offset = torch.minimum(torch.arange(queries)[None, :], length - 1)  # [n, queries]
            query_index = local_start + offset
            position = full_start - segment_start + offset  # the query's position in its segment
            key = torch.arange(keys)[None, :]
            mask = key[:, None, :] <= position[:, :, None]  # [n, queries, keys]
            slots = (torch.arange(queries)[None, :] < length).reshape(-1).nonzero().squeeze(1)
            buckets.append(
                ChunkBucket(
                    len(members),
                    queries,
                    keys,
                    query_index.reshape(-1).to(device),
                    (segment_start + torch.minimum(key, key_length - 1)).reshape(-1).to(device),
                    mask.unsqueeze(1).to(device),
                    slots.to(device),
                    query_index.reshape(-1)[slots].to(device),
                )
            )
        return tuple(buckets)


def _ranges(bounds: list[tuple[int, int]], total: int) -> Tensor:
    """[total] int64: the integers of the ranges [a, b) of ``bounds``, one range after another."""
    if not bounds:
        return torch.zeros(0, dtype=torch.int64)
    starts = torch.tensor([a for a, _ in bounds])
    sizes = torch.tensor([b - a for a, b in bounds])
    offsets = sizes.cumsum(0) - sizes
    first = torch.repeat_interleave(starts - offsets, sizes, output_size=total)
    return first + torch.arange(total)


def split_microbatch(batch: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's share of a packed micro-batch (one row, b = 1; every segment a multiple of
    2 * cp_size): every per-token tensor ([1, S] or [1, S, K]) at ``CpChunks.local_index``;
    ``cu_seqlens`` and ``max_seqlen`` unchanged (the full row's). ``cp_size`` 1: ``batch`` itself."""
    if cp_size == 1:
        return batch
    if not batch.packed or batch.shape[0] != 1:
        raise ValueError(
            f"context parallelism splits one packed row; got {'a packed' if batch.packed else 'padded'} "
            f"batch of shape {batch.shape}"
        )
    if batch.cp_size != 1:
        raise ValueError(f"the micro-batch is already CP rank {batch.cp_rank}'s share of {batch.cp_size}")
    chunks = CpChunks.from_cu_seqlens(batch.cu_seqlens, cp_size, cp_rank)
    if chunks.full_length != batch.shape[1]:
        raise ValueError(f"cu_seqlens covers {chunks.full_length} tokens; the row has {batch.shape[1]}")
    index = chunks.local_index(batch.input_ids.device)
    values = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, Tensor) and field.name != "cu_seqlens":
            values[field.name] = value.index_select(1, index)
    return dataclasses.replace(batch, **values, cp_size=cp_size, cp_rank=cp_rank)


class _GatherFromCp(torch.autograd.Function):
    """All-gather of the local rows, reordered to the full row; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, chunks: CpChunks, group) -> Tensor:
        ctx.chunks, ctx.group = chunks, group
        x = x.contiguous()
        gathered = x.new_empty(chunks.cp_size * x.size(0), *x.shape[1:])
        _all_gather_single(gathered, x, group=group)
        return gathered.index_select(0, chunks.full_order(x.device))

    @staticmethod
    def backward(ctx, grad: Tensor):
        chunks = ctx.chunks
        # every rank's gradient of the full row, in rank-major order, summed over ranks; this rank
        # keeps its own rows. NCCL reduce-scatters; gloo's reduce-scatter (torch >= 2.2) is an
        # all-reduce of the whole tensor and a slice of it, correct at twice the traffic.
        grad_rank_major = grad.index_select(0, chunks.gathered_positions(grad.device))
        out = grad.new_empty(chunks.local_length, *grad.shape[1:])
        _reduce_scatter_single(out, grad_rank_major, group=ctx.group)
        return out, None, None


def gather_from_cp(x: Tensor, chunks: CpChunks, group) -> Tensor:
    """[S_local, ...] this rank's rows (local order) -> [S_full, ...] every rank's, in full-row
    order. Backward: the gradient of this rank's rows summed over the group's ranks (each rank's
    [S_full, ...] gradient is reduce-scattered). ``chunks``: this rank's ``CpChunks``."""
    if chunks.cp_size == 1:
        return x
    if group.size() != chunks.cp_size or group.rank() != chunks.cp_rank:
        raise ValueError(
            f"CpChunks of CP rank {chunks.cp_rank} of {chunks.cp_size} on rank {group.rank()} of a "
            f"group of {group.size()}"
        )
    if x.size(0) != chunks.local_length:
        raise ValueError(f"{x.size(0)} local rows; CP rank {chunks.cp_rank} holds {chunks.local_length}")
    return _GatherFromCp.apply(x, chunks, group)
