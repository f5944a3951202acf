"""Packed (THD) sequences for the local layer spec.

With Transformer Engine, Megatron runs a packed row (several sequences back to back,
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)``) through TE's fused attention, which
never attends across ``cu_seqlens``. The local spec's ``DotProductAttention`` refuses packed
sequences. ``PackedDotProductAttention`` takes its place in the local spec: everything before the
core attention is Megatron's own THD path (the per-sequence RoPE of ``_apply_rotary_pos_emb_thd``,
the [t, heads, dim] layout), and the core attention is the local one under a block-diagonal
causal mask built from ``cu_seqlens``. It materialises a [t, t] mask and [heads, t, t] scores:
a reference for CPU runs and tests, not a GPU kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


def block_causal_mask(cu_seqlens: Tensor, total: int) -> Tensor:
    """[1, 1, total, total] bool, True where position i may NOT attend position j: j > i, or j in
    another segment of ``cu_seqlens`` ([N + 1] int, ``cu_seqlens[-1] == total``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if segment.numel() != total:
        raise ValueError(f"cu_seqlens ends at {segment.numel()}, the packed row has {total} positions")
    mask = segment[:, None] != segment[None, :]
    mask |= torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device).triu_(1)
    return mask[None, None]


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention``, which also takes THD ``packed_seq_params``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in qkv_format {packed_seq_params.qkv_format!r}: expected 'thd'")
        # [t, heads, dim] -> [t, 1, heads, dim]: one row, the segments masked from each other.
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, query.size(0))
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask, attn_mask_type,
                              attention_bias)  # fmt: skip
        return out.squeeze(1)  # [t, heads * dim], as TE's THD attention returns
