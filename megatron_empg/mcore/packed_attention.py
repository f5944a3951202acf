"""Packed (THD) sequences for the local layer spec.

With Transformer Engine, Megatron runs a packed row (several sequences back to back,
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)``) through TE's fused attention, which
never attends across ``cu_seqlens``. The local spec's ``DotProductAttention`` refuses packed
sequences. ``PackedDotProductAttention`` takes its place in the local spec: everything before the
core attention is Megatron's own THD path (the per-sequence RoPE of ``_apply_rotary_pos_emb_thd``,
the [t, heads, dim] layout), and the core attention is the local one on the row's sequences
unpacked into right-padded batches [L, n, heads, dim], under a causal mask that also hides the
padding keys. Sequences go into a batch with others within ``_BUCKET_RATIO`` of its longest, so a
row costs a few batched calls (one per length bucket) and at most ``_BUCKET_RATIO``^2 x sum L^2
scores: a Python loop over sequences is slow for many short ones, one padded batch for mixed
lengths. A reference for CPU runs and tests, not a GPU kernel.

Importing this module also replaces megatron-core 0.19's THD RoPE (``rope_utils.
_apply_rotary_pos_emb_thd``, used unless ``apply_rope_fusion``), which applies the rotation one
sequence at a time in a Python loop, by the same rotation at every token's own position in one
call (``vectorized_thd_rope``); context parallelism keeps the original.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

import inspect  # noqa: E402

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention``, which also takes THD ``packed_seq_params``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in qkv_format {packed_seq_params.qkv_format!r}: expected 'thd'")
        lengths = (packed_seq_params.cu_seqlens_q[1:] - packed_seq_params.cu_seqlens_q[:-1]).long()
        if int(lengths.sum()) != query.size(0):
            raise ValueError(f"cu_seqlens ends at {int(lengths.sum())}, the packed row has {query.size(0)} positions")
        # position t of the row is position ``offset[t]`` of sequence ``segment[t]``
        device = lengths.device
        segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        offset = torch.arange(query.size(0), device=device) - (lengths.cumsum(0) - lengths)[segment]
        out = query.new_empty(query.size(0), query.size(1) * query.size(2))
        for members in _length_buckets(lengths.tolist()):
            ids = torch.tensor(members, device=device)
            slot = torch.full((lengths.numel(),), -1, dtype=torch.long, device=device)
            slot[ids] = torch.arange(len(members), device=device)  # sequence -> column in the bucket
            rows = (slot[segment] >= 0).nonzero().squeeze(1)
            where = (offset[rows], slot[segment[rows]])
            longest = int(lengths[ids].max())

            def unpack(x: Tensor) -> Tensor:  # [t, heads, dim] -> [L, n, heads, dim], zeros after each end
                batch = x.new_zeros(longest, len(members), *x.shape[1:])
                batch[where] = x[rows]
                return batch

            hidden = torch.arange(longest, device=device)[None, :] >= lengths[ids][:, None]  # [n, L] padding keys
            mask = torch.ones(longest, longest, dtype=torch.bool, device=device).triu_(1)[None, None]
            context = super().forward(unpack(query), unpack(key), unpack(value), mask | hidden[:, None, None],
                                      attn_mask_type, attention_bias)  # fmt: skip
            out[rows] = context[where]
        return out  # [t, heads * dim], as TE's THD attention returns


_BUCKET_RATIO = 1.25


def _length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups, longest first, each within ``_BUCKET_RATIO`` of its longest."""
    buckets: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if not buckets or lengths[i] * _BUCKET_RATIO < lengths[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(i)
    return buckets


_LOOPED_THD_ROPE = rope_utils._apply_rotary_pos_emb_thd
_THD_ROPE_PARAMETERS = ("t", "cu_seqlens", "freqs", "rotary_interleaved", "mla_rotary_interleaved", "mscale",
                        "cp_group", "multi_latent_attention")  # fmt: skip


def vectorized_thd_rope(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                        mla_rotary_interleaved: bool = False, mscale: float = 1.0, cp_group=None,
                        multi_latent_attention=None) -> Tensor:  # fmt: skip
    """RoPE of a packed row ``t`` [t, heads, dim]: token i rotated by ``freqs`` [max_s, 1, 1, d] at its
    position in its ``cu_seqlens`` sequence (or at i itself when ``freqs`` covers the whole row,
    Megatron's "packed freqs" case), as megatron-core's loop does, in one call. Context parallelism
    (and the deprecated argument) go to megatron-core's own function."""
    if cp_group is None or cp_group.size() != 1 or multi_latent_attention is not None:
        return _LOOPED_THD_ROPE(t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, cp_group,
                                multi_latent_attention)  # fmt: skip
    positions = torch.arange(t.size(0), device=t.device)
    if freqs.size(0) != int(cu_seqlens[-1]):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        positions = positions - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
                                                 mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)


if tuple(inspect.signature(_LOOPED_THD_ROPE).parameters) == _THD_ROPE_PARAMETERS:  # the 0.19 function it replaces
    rope_utils._apply_rotary_pos_emb_thd = vectorized_thd_rope
