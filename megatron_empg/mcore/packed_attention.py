"""Packed (THD) sequences for the local layer spec.

With Transformer Engine, Megatron runs a packed row (several sequences back to back,
``PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)``) through TE's fused attention, which
never attends across ``cu_seqlens``. The local spec's ``DotProductAttention`` refuses packed
sequences. ``PackedDotProductAttention`` takes its place in the local spec: everything before the
core attention is Megatron's own THD path (the per-sequence RoPE of ``_apply_rotary_pos_emb_thd``,
the [t, heads, dim] layout), and the core attention is the local one run on each segment of
``cu_seqlens`` under its causal mask, so a row costs sum_i L_i^2 scores, not t^2. A reference for
CPU runs and tests (one call per sequence), not a GPU kernel.
"""

from __future__ import annotations

import torch

from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention``, which also takes THD ``packed_seq_params``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in qkv_format {packed_seq_params.qkv_format!r}: expected 'thd'")
        # Each segment as a batch of one: [L, heads, dim] -> [L, 1, heads, dim], causal within.
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds[-1] != query.size(0):
            raise ValueError(f"cu_seqlens ends at {bounds[-1]}, the packed row has {query.size(0)} positions")
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            mask = torch.ones(1, 1, end - start, end - start, dtype=torch.bool, device=query.device).triu_(1)
            segment = slice(start, end)
            out.append(super().forward(query[segment].unsqueeze(1), key[segment].unsqueeze(1),
                                       value[segment].unsqueeze(1), mask, attn_mask_type, attention_bias))  # fmt: skip
        return torch.cat(out).squeeze(1)  # [t, heads * dim], as TE's THD attention returns
