"""Packed (THD) rows for the local layer spec: one micro-batch's layout, computed once and carried
to every layer, and the RoPE of such rows.

A packed row holds several sequences back to back, then a padding segment (``core.microbatch``).
Megatron passes its ``PackedSeqParams`` to every layer's attention and RoPE; ``ThdLayout`` is
that object with what the layers need besides the boundaries, built once per micro-batch by
``thd_layout``:

    positions  [t] int64, each token's position within its sequence: the decoder's pre-hook
               (``install_per_token_rope``) gathers the RoPE table at these positions ONCE per
               forward, so that every layer's RoPE is one elementwise rotation with no lookup and
               no host sync
    buckets    the sequences grouped by length (``LengthBucket``), with the index tensors that
               unpack a bucket into a right-padded batch and pack it back; built on first use
               (one host read of ``cu_seqlens`` per micro-batch), only by the attentions that need
               them (the unfused one, and SDPA where ``varlen_attn`` is not available)
    cp_chunks  under context parallelism (a micro-batch split by ``parallel.context_parallel.
               split_microbatch``: local rows, the full row's ``cu_seqlens``), this rank's
               ``CpChunks``: what the CP attention (``mcore.cp_attention``) needs, for every layer

Sequences go into a bucket with others within ``BUCKET_RATIO`` of its longest, so a row costs a
few batched calls (one per bucket) and at most ``BUCKET_RATIO``^2 x sum L^2 scores.

Importing this module also replaces megatron-core 0.19's THD RoPE (``rope_utils.
_apply_rotary_pos_emb_thd``, used unless ``apply_rope_fusion``), which rotates one sequence at a
time in a Python loop with host syncs, by ``vectorized_thd_rope``: the same rotation at every
token's own position in one call. Under context parallelism the decoder's pre-hook has already
gathered the table at the local tokens' global positions, so the rotation is the same; a table
given as is under CP goes to megatron-core's function (which slices it per CP rank).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import Tensor

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.mcore import cpu_shims
from megatron_empg.parallel.context_parallel import CpChunks

cpu_shims.install_pre_import()

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

BUCKET_RATIO = 1.25


@dataclasses.dataclass
class LengthBucket:
    """Sequences of similar length of a packed row, as one right-padded batch [n, L].

    Attributes:
        batch: n sequences, L = the longest of them.
        gather: [n * L] int64 row index of each batch slot (padding slots repeat a real row of the
            same sequence: under a causal mask no real query reaches them).
        slots: [k] int64 batch slots (flattened n * L) that hold real tokens.
        rows: [k] int64 their row indices (every row of the packed row is in exactly one bucket).
    """

    batch: int
    longest: int
    gather: Tensor
    slots: Tensor
    rows: Tensor

    def unpack(self, x: Tensor) -> Tensor:
        """[t, heads, dim] packed -> [n, L, heads, dim] right-padded."""
        return x.index_select(0, self.gather).view(self.batch, self.longest, *x.shape[1:])

    def pack_(self, out: Tensor, batched: Tensor) -> None:
        """Write the real slots of ``batched`` [n, L, width] into ``out`` [t, width]."""
        out.index_copy_(0, self.rows, batched.reshape(self.batch * self.longest, -1).index_select(0, self.slots))


def length_buckets(lengths: list[int], device: torch.device | None = None) -> list[LengthBucket]:
    """The segments of ``lengths`` (a packed row's, in row order) grouped longest first, each
    within ``BUCKET_RATIO`` of its longest; zero-length segments are left out."""
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    groups: list[list[int]] = []
    for i in sorted((i for i in range(len(lengths)) if lengths[i]), key=lambda i: -lengths[i]):
        if not groups or lengths[i] * BUCKET_RATIO < lengths[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    buckets = []
    for members in groups:
        longest = lengths[members[0]]
        offset = torch.arange(longest)
        lengths_t = torch.tensor([lengths[i] for i in members])
        starts_t = torch.tensor([starts[i] for i in members])
        real = offset[None, :] < lengths_t[:, None]  # [n, L]
        gather = starts_t[:, None] + torch.minimum(offset[None, :], lengths_t[:, None] - 1)
        slots = real.reshape(-1).nonzero().squeeze(1)
        buckets.append(
            LengthBucket(
                len(members),
                longest,
                gather.reshape(-1).to(device),
                slots.to(device),
                gather.reshape(-1)[slots].to(device),
            )
        )
    return buckets


@dataclasses.dataclass
class ThdLayout(PackedSeqParams):
    """Megatron's THD ``PackedSeqParams`` of one packed row, with its ``positions`` ([t] int64),
    under context parallelism this rank's ``cp_chunks`` and, on first use, its length buckets
    (module docstring). Megatron reads only the base class's fields."""

    positions: Tensor | None = None
    cp_chunks: CpChunks | None = None
    _buckets: list[LengthBucket] | None = dataclasses.field(default=None, repr=False)

    def buckets(self) -> list[LengthBucket]:
        """The row's length buckets: built on the first call (one read of ``cu_seqlens_q`` to the
        host), the same objects for every later layer and for recompute."""
        if self.cp_chunks is not None:  # cu_seqlens are the full row's, the rows a CP rank's share
            raise ValueError("length buckets of a CP rank's share of a row: its attention reads cp_chunks")
        if self._buckets is None:
            cu = self.cu_seqlens_q.tolist()
            self._buckets = length_buckets([b - a for a, b in zip(cu[:-1], cu[1:])], self.cu_seqlens_q.device)
        return self._buckets


def thd_layout(batch: MicroBatch) -> ThdLayout:
    """The ``ThdLayout`` of a packed micro-batch (``batch.packed``); no host sync, except one read
    of ``cu_seqlens`` for a CP rank's share (``batch.cp_size`` > 1), whose ``CpChunks`` it builds.
    ``cu_seqlens`` / ``max_seqlen`` are the full row's either way: GPTModel sizes the RoPE table by
    ``max_seqlen_q``, the longest full segment, and does not slice it per CP rank for THD rows."""
    cp_chunks = None
    if batch.cp_size > 1:
        cp_chunks = CpChunks.from_cu_seqlens(batch.cu_seqlens, batch.cp_size, batch.cp_rank)
    return ThdLayout(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        max_seqlen_q=batch.max_seqlen,
        max_seqlen_kv=batch.max_seqlen,
        positions=batch.position_ids.reshape(-1),
        cp_chunks=cp_chunks,
    )


# --------------------------------------------------------------------------------------------
# RoPE.


def _per_token_rope(module, args, kwargs):
    """The decoder's forward pre-hook: for a ``ThdLayout`` row, RoPE table rows [max_s, 1, 1, d]
    -> one row per token [t, 1, 1, d] (the table at ``positions``), which ``vectorized_thd_rope``
    applies as is in every layer. Without CP a table already of t rows is the row's own (one
    sequence filling it: positions 0 .. t-1); a CP rank's t local tokens can equal the longest
    full segment in number while their positions are not 0 .. t-1, so under CP it always gathers."""
    layout, table = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")
    if isinstance(layout, ThdLayout) and layout.positions is not None and isinstance(table, Tensor):
        if layout.cp_chunks is not None or table.size(0) != layout.positions.numel():
            kwargs["rotary_pos_emb"] = table[layout.positions]
    return args, kwargs


def install_per_token_rope(decoder: torch.nn.Module) -> None:
    """Register ``_per_token_rope`` on a local-spec ``TransformerBlock`` (not on the TE spec,
    whose fused RoPE indexes the table per sequence itself)."""
    decoder.register_forward_pre_hook(_per_token_rope, with_kwargs=True)


_LOOPED_THD_ROPE = rope_utils._apply_rotary_pos_emb_thd
_THD_ROPE_PARAMETERS = (
    "t",
    "cu_seqlens",
    "freqs",
    "rotary_interleaved",
    "mla_rotary_interleaved",
    "mscale",
    "cp_group",
    "multi_latent_attention",
)


def vectorized_thd_rope(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    cp_group=None,
    multi_latent_attention=None,
) -> Tensor:
    """RoPE of a packed row ``t`` [t, heads, dim]: token i rotated by ``freqs`` at its position in
    its ``cu_seqlens`` sequence, as megatron-core's loop does, in one call and without a host sync.
    ``freqs`` with one row per token ([t, 1, 1, d]: ``_per_token_rope``'s, or a row of one
    sequence) is applied as it is, whatever the CP group (under CP ``_per_token_rope`` gathers
    the table at the local tokens' global positions); a table [max_s, 1, 1, d] is indexed per
    token first. A table under CP (and the deprecated argument) go to megatron-core's function."""
    per_token = freqs.size(0) == t.size(0)
    if cp_group is None or (cp_group.size() != 1 and not per_token) or multi_latent_attention is not None:
        return _LOOPED_THD_ROPE(
            t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, cp_group, multi_latent_attention
        )
    if not per_token:  # a table: per-sequence positions from the boundaries
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=t.size(0))
        freqs = freqs[torch.arange(t.size(0), device=t.device) - starts]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs,
        rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


if tuple(inspect.signature(_LOOPED_THD_ROPE).parameters) == _THD_ROPE_PARAMETERS:  # the 0.19 function it replaces
    rope_utils._apply_rotary_pos_emb_thd = vectorized_thd_rope
