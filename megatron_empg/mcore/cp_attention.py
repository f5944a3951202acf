"""Context-parallel causal core attention of the ``sdpa`` backend, on packed THD rows split over a
CP group (``parallel.context_parallel``: rank r holds chunks r and 2 * cp - 1 - r of every segment).

    query        [S_local, heads, dim]   this rank's rows, local order, RoPE at their global positions
    key, value   [S_local, groups, dim]
    output       [S_local, heads * dim]  (dtype of the query)

``context_parallel_attention`` does two steps:

1. ``gather_from_cp`` of cat(K, V) over the CP group (one all-gather per layer): [S_full,
   2 * groups, dim] in full-row order; its backward reduce-scatters the K / V gradient.
2. ``attend_gathered`` (callable on its own, as the one-GPU test does): every local query chunk
   attends causally to its own segment's keys from the segment start up to the chunk's end, the
   query at full-row position p to the keys <= p.

   CUDA with ``varlen_attn``: ONE call. Its query segments are the local row as it is (each chunk a
   segment); its key segments each chunk's key range, packed by one ``index_select`` of the full K
   and V (``CpChunks.key_ranges``: (2 * cp + 1) / (2 * cp) x S_full rows). A chunk ends its key
   range, and flash attention (FlashAttention >= 2.1, which ``varlen_attn`` runs) aligns the
   causal mask to the bottom right when a key segment is longer than its query segment: query i of
   a chunk of c sees keys j <= i + (L_k - c) of its range, which is exactly its own position in
   the segment. That alignment is probed once per process (``_bottom_right_causal``, a tiny
   call against an explicit mask); a kernel that aligns otherwise gets the exact path below.
   Elsewhere (CPU, no ``varlen_attn``): SDPA per ``ChunkBucket`` (chunks with key ranges of
   similar length as one padded batch) with an explicit boolean mask: exact, a few calls per row.

Balance: per segment of length L (c = L / (2 * cp)) a rank's two chunks see (r + 1) c and
(2 * cp - r) c keys, and, the causal halves of their own diagonal blocks left out, 2 * cp * c^2 =
L^2 / (2 * cp) query-key pairs: the same on every rank, the causal work split evenly.

Memory: what backward keeps per layer is the packed key ranges, (2 * cp + 1) / (2 * cp) x the
FULL row's K and V (the gathered row itself is not kept). A key in the first chunks of its segment
is in both of a rank's ranges, so its gradient is the sum of two ``index_select`` backward terms
(on CUDA by atomic adds: the order of those two terms is not fixed).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_empg.mcore.thd import ThdLayout
from megatron_empg.parallel.context_parallel import CpChunks, gather_from_cp

log = logging.getLogger(__name__)


def context_parallel_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: ThdLayout, group, scale: float, varlen=None
) -> Tensor:
    """This rank's causal attention over the whole packed row (module docstring): local [S_local,
    heads, dim] query, [S_local, groups, dim] key / value -> [S_local, heads * dim]. ``layout``:
    the split micro-batch's ``ThdLayout`` (its ``cp_chunks``); ``group``: the CP process group;
    ``varlen``: ``mcore.attention.varlen_attention()`` on CUDA, else None."""
    chunks = layout.cp_chunks
    if chunks is None:
        raise ValueError(
            "context-parallel attention needs the ThdLayout of a CP rank's share of a packed row "
            "(mcore.thd.thd_layout of parallel.context_parallel.split_microbatch's micro-batch)"
        )
    groups = key.size(1)
    kv = gather_from_cp(torch.cat([key, value], dim=1), chunks, group)  # [S_full, 2 * groups, dim]
    return attend_gathered(query, kv[:, :groups], kv[:, groups:], chunks, scale, varlen)


def attend_gathered(query: Tensor, key: Tensor, value: Tensor, chunks: CpChunks, scale: float, varlen=None) -> Tensor:
    """The attention after the gather: local query [S_local, heads, dim], the FULL row's key /
    value [S_full, groups, dim] (full-row order) -> [S_local, heads * dim]. ``varlen``
    (``mcore.attention._Varlen``; the caller passes it on CUDA only) is used where its causal mask
    is aligned to the bottom right; otherwise (or None) the exact masked SDPA path."""
    if varlen is not None and _bottom_right_causal(varlen, query.device):
        ranges = chunks.key_ranges(query.device)
        k, v = (x.index_select(0, ranges.key_index) for x in (key, value))
        return varlen.segments(
            query, k, v, ranges.cu_seqlens_q, ranges.cu_seqlens_k, ranges.max_seqlen_q, ranges.max_seqlen_k, scale
        )
    return _masked_buckets(query, key, value, chunks, scale)


def _masked_buckets(query: Tensor, key: Tensor, value: Tensor, chunks: CpChunks, scale: float) -> Tensor:
    """SDPA per ``ChunkBucket``: [n, heads, queries, dim] against [n, groups, keys, dim] under the
    bucket's [n, 1, queries, keys] mask, the real query slots written back to their local rows."""
    heads, groups, dim = query.size(1), key.size(1), query.size(2)
    out = query.new_empty(query.size(0), heads * dim)
    for bucket in chunks.chunk_buckets(query.device):
        q = query.index_select(0, bucket.query_index).view(bucket.batch, bucket.queries, heads, dim)
        k, v = (x.index_select(0, bucket.key_index).view(bucket.batch, bucket.keys, groups, dim) for x in (key, value))
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=bucket.mask,
            scale=scale,
            enable_gqa=groups != heads,
        )
        flat = context.transpose(1, 2).reshape(bucket.batch * bucket.queries, heads * dim)
        out.index_copy_(0, bucket.rows, flat.index_select(0, bucket.slots))
    return out


@functools.cache
def _bottom_right_causal(varlen, device: torch.device) -> bool:
    """Whether ``varlen``'s causal mask, for a query segment shorter than its key segment, is
    aligned to the bottom right (query i of q sees keys j <= i + k - q), as flash attention's is:
    one tiny call on ``device`` against SDPA with that mask, once per process and device."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(4, 2, 64, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(12, 2, 64, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, n], device=device, dtype=torch.int32) for n in (4, 12))
    out = varlen.segments(q, k, v, cu_q, cu_k, 4, 12, 0.125).view(4, 2, 64)
    mask = torch.arange(12, device=device)[None, :] <= torch.arange(4, device=device)[:, None] + 8
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=0.125
    ).transpose(0, 1)
    aligned = bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=0))
    if not aligned:
        log.warning(
            "varlen_attn's causal mask is not aligned to the bottom right: context-parallel attention "
            "uses masked SDPA instead"
        )
    return aligned
