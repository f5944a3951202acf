"""Log-probs, entropy, top-k and Top-k KL over tensor-parallel vocabulary shards.

Megatron's output layer leaves each TP rank with ``vocab_parallel_logits`` [T, V_local]: the
columns [vocab_start, vocab_start + V_local) of a vocabulary padded to TP * V_local. Columns at
global ids >= ``vocab_size`` (the real vocabulary) are padding and are masked to -inf before every
softmax, logsumexp and top-k. Nothing here gathers the vocabulary:

    forward   per chunk of tokens: local logsumexp, sum_j exp(z_j - lse_local) z_j, and the logits
              at the requested ids this rank owns -> ONE all-gather of [T, 2 + M] per call
              ([T, 1 + M] with_entropy=False: no entropy pass at all)
    backward  no collective: the upstream gradient is replicated over the TP group, so each rank
              writes the gradient of its own columns,
              d/dz_j = [j in ids] g - p_j (sum_m g_m + g_H (log p_j + H))
    top-k     local top-k (ties to the lower id) -> all-gather [T, k] values and global ids ->
              re-rank the TP * k candidates by (value, -id)

Only one [chunk, V_local] float32 temporary exists at a time (two when the entropy gradient is
needed). On CUDA, the local pass and the backward are instead fused Triton kernels, with no
temporary (``kernels.vocab_logprob_triton``: one read of the logits forward, one read and one
write backward; with top-k, ``kernels.topk_triton`` reads them once more for the local top-k, up
to k = ``topk_triton.MAX_K``; ``EMPG_VOCAB_KERNEL`` selects).
With ``inplace_backward=True`` the gradient is written into the logits buffer, as Megatron's
vocab-parallel cross-entropy does; use it only when nothing else reads those logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.logprob import (
    DEFAULT_CHUNK_SIZE,
    accumulation_dtype,
    chunk_ranges,
    load_masked_,
    logsoftmax_backward_,
    logsumexp_,
    rank_by_value_then_id,
    topk_value_then_id,
)
from megatron_empg.core.topk_kl import TopkKL, topk_kl_from_gathered, topk_kl_ids
from megatron_empg.kernels import vocab_logprob_kernels, vocab_topk_kernel


class VocabShard(NamedTuple):
    """Where this rank's logits columns sit: global ids [vocab_start, vocab_start + V_local)."""

    vocab_start: int
    vocab_size: int  # real (unpadded) global vocabulary
    tp_group: dist.ProcessGroup | None  # None: a single device, no collective

    def num_valid(self, local_width: int) -> int:
        """Columns of this shard that are real vocabulary (the padding is a suffix)."""
        return max(0, min(local_width, self.vocab_size - self.vocab_start))


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """[*] -> [world, *] over ``group`` (a view of ``tensor`` when the group has one rank)."""
    if _world(group) == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(_world(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


class TokenStats(NamedTuple):
    """Per-token statistics of a forward-only pass; float32 (fp64 for fp64 logits), identical on
    every rank of the TP group.

    Attributes:
        logprobs: [T, M] log pi at the requested global ids.
        lse: [T] logsumexp over the real vocabulary.
        entropy: [T], or None when not requested.
        topk_logprobs: [T, k] descending (ties: lower id first); topk_ids: [T, k] int64 global ids.
    """

    logprobs: Tensor
    lse: Tensor
    entropy: Tensor | None
    topk_logprobs: Tensor
    topk_ids: Tensor


def _owned_local_ids(ids: Tensor, shard: VocabShard, n_valid: int) -> tuple[Tensor, Tensor]:
    """Global ids [T, M] -> (local column [T, M] (0 where not owned), owned [T, M] bool)."""
    local_ids = ids - shard.vocab_start
    owned = (local_ids >= 0) & (local_ids < n_valid)
    return torch.where(owned, local_ids, torch.zeros_like(local_ids)), owned


def _local_pass(
    logits: Tensor, local_ids: Tensor, owned: Tensor, shard: VocabShard, *, k: int, with_entropy: bool, chunk_size: int
) -> Tensor:
    """This rank's statistics, packed for ONE all-gather: [T, 1 + E + M + 2 k_local] in the
    accumulation dtype, columns (E = with_entropy, k_local = min(k, V_local)):

        lse_local | sum_j p_j^local z_j (E) | z at the M owned ids (0 elsewhere) | top-k_local z | their global ids

    A shard of padding only reports lse_local = -inf (no mass, no entropy term, no candidates);
    past its n_valid real columns, the top-k columns hold its padding ids at -inf, as the torch
    top-k of the masked chunk ranks them. Ids travel as floats: exact below 2^24 (float32).

    With the kernels selected (``kernels.vocab_logprob_kernels``; at k > 0 also
    ``vocab_topk_kernel``: k_local <= ``topk_triton.MAX_K``), two fused reads of the logits
    (``local_stats``, ``topk``) and no [chunk, V_local] temporary; else the chunked torch path.
    """
    acc = accumulation_dtype(logits.dtype)
    num_tokens, width = logits.shape
    n_valid = shard.num_valid(width)
    local_k = min(k, width)
    kernels = vocab_logprob_kernels(logits)
    topk_kernel = vocab_topk_kernel(logits, local_k) if local_k else None
    if kernels is not None and (local_k == 0 or topk_kernel is not None):
        stats = kernels.local_stats(logits, torch.where(owned, local_ids, -1), n_valid, with_entropy=with_entropy)
        if not local_k:
            return stats
        packed = torch.empty(num_tokens, stats.shape[1] + 2 * local_k, dtype=acc, device=logits.device)
        packed[:, : stats.shape[1]] = stats
        top_values, top_ids = _topk_columns(packed, local_k, shard.vocab_start)
        real_k = min(local_k, n_valid)  # the rest stays padding at -inf
        if real_k:
            values, ids = topk_kernel(logits, real_k, n_valid)
            top_values[:, :real_k], top_ids[:, :real_k] = values, (ids + shard.vocab_start).to(acc)
        return packed
    first_id = 2 if with_entropy else 1
    packed = torch.zeros(num_tokens, first_id + local_ids.shape[1] + 2 * local_k, dtype=acc, device=logits.device)
    packed[:, 0] = float("-inf")
    top_values, top_ids = _topk_columns(packed, local_k, shard.vocab_start)
    if n_valid:
        scratch = torch.empty(min(chunk_size, num_tokens), width, dtype=acc, device=logits.device)
        for s, e in chunk_ranges(num_tokens, chunk_size):
            z = load_masked_(scratch[: e - s], logits[s:e], n_valid)  # [c, V_local]
            if local_k:
                values, ids = topk_value_then_id(z, local_k)
                top_values[s:e], top_ids[s:e] = values, (ids + shard.vocab_start).to(acc)
            packed[s:e, 0], mean_logit = logsumexp_(z, with_mean=with_entropy)  # z is overwritten
            if with_entropy:
                packed[s:e, 1] = mean_logit
        del scratch
    packed[:, first_id : first_id + local_ids.shape[1]] = torch.where(owned, logits.gather(-1, local_ids).to(acc), 0)
    return packed


def _topk_columns(packed: Tensor, local_k: int, vocab_start: int) -> tuple[Tensor, Tensor]:
    """The last 2 k_local columns of ``packed`` [T, C] as (values, global ids) views, set to what a
    shard of padding only offers: -inf at its own (padded, distinct) ids."""
    width = packed.shape[1]
    top_values = packed[:, width - 2 * local_k : width - local_k]
    top_ids = packed[:, width - local_k :]
    top_values.fill_(float("-inf"))
    top_ids.copy_(torch.arange(vocab_start, vocab_start + local_k, dtype=packed.dtype).expand_as(top_ids))
    return top_values, top_ids


def _reduce_pass(gathered: Tensor, *, num_ids: int, k: int, with_entropy: bool) -> TokenStats:
    """[world, T, C] packed statistics of every rank (``_local_pass``) -> ``TokenStats``."""
    first_id = 2 if with_entropy else 1
    local_k = (gathered.shape[2] - first_id - num_ids) // 2
    lse = torch.logsumexp(gathered[:, :, 0], dim=0)  # [T]; -inf for ranks without real columns
    entropy = None
    if with_entropy:
        rank_mass = (gathered[:, :, 0] - lse).exp()  # [world, T] share of each rank's columns
        entropy = lse - (rank_mass * gathered[:, :, 1]).sum(0)
    logprobs = gathered[:, :, first_id : first_id + num_ids].sum(0) - lse[:, None]
    num_tokens = gathered.shape[1]
    candidates = gathered[:, :, first_id + num_ids :].permute(1, 0, 2)  # [T, world, 2 k_local]
    cand_values = candidates[:, :, :local_k].reshape(num_tokens, -1)
    cand_ids = candidates[:, :, local_k:].reshape(num_tokens, -1).to(torch.int64)
    top_values, top_ids = rank_by_value_then_id(cand_values, cand_ids, k)
    return TokenStats(logprobs, lse, entropy, top_values - lse[:, None], top_ids)


def upstream_grads(
    grad_logprobs: Tensor | None, owned: Tensor, acc: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """The log-probs' gradient [T, M] -> (at the ids this rank owns [T, M], summed over every id [T]),
    in ``acc``; (None, None) when the log-probs get no gradient."""
    if grad_logprobs is None:
        return None, None
    grad = grad_logprobs.to(acc)
    return torch.where(owned, grad, 0), grad.sum(-1)


class _VocabParallelLogprobs(torch.autograd.Function):
    """log pi at global ids [T, M] (and the entropy [T]) from a vocab shard; no collective backward."""

    @staticmethod
    def forward(ctx, logits, ids, shard: VocabShard, chunk_size: int, inplace_backward: bool, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no work for it
        local_ids, owned = _owned_local_ids(ids, shard, shard.num_valid(logits.shape[1]))
        packed = _local_pass(logits, local_ids, owned, shard, k=0, with_entropy=with_entropy, chunk_size=chunk_size)
        stats = _reduce_pass(_all_gather(packed, shard.tp_group), num_ids=ids.shape[1], k=0, with_entropy=with_entropy)
        ctx.shard, ctx.chunk_size, ctx.inplace_backward = shard, chunk_size, inplace_backward
        ctx.kernels = vocab_logprob_kernels(logits)  # the backward follows the forward's choice
        if not with_entropy:
            ctx.save_for_backward(logits, local_ids, owned, stats.lse)
            return stats.logprobs
        ctx.save_for_backward(logits, local_ids, owned, stats.lse, stats.entropy)
        return stats.logprobs, stats.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, local_ids, owned, lse, *entropy = ctx.saved_tensors
        entropy = entropy[0] if grad_entropy is not None else None
        num_tokens, width = logits.shape
        n_valid = ctx.shard.num_valid(width)
        acc = lse.dtype
        grad_ids, grad_total = upstream_grads(grad_logprobs, owned, acc)
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        if ctx.kernels is not None:  # one read and one write of the logits
            ctx.kernels.logsoftmax_backward(
                logits,
                grad_logits,
                n_valid,
                lse,
                torch.where(owned, local_ids, -1),
                grad_ids,
                grad_total,
                entropy,
                grad_entropy,
            )
        else:
            scratch = torch.empty(min(ctx.chunk_size, num_tokens), width, dtype=acc, device=logits.device)
            for s, e in chunk_ranges(num_tokens, ctx.chunk_size):
                grad_logits[s:e] = logsoftmax_backward_(
                    load_masked_(scratch[: e - s], logits[s:e], n_valid),
                    lse[s:e],
                    local_ids[s:e],
                    grad_ids[s:e] if grad_ids is not None else None,
                    grad_total[s:e] if grad_total is not None else None,
                    entropy=entropy[s:e] if entropy is not None else None,
                    grad_entropy=grad_entropy[s:e].to(acc) if grad_entropy is not None else None,
                )
        # One None per forward argument after logits: ids, shard, chunk_size, inplace_backward, with_entropy.
        return grad_logits, None, None, None, None, None


def _check(logits: Tensor, shard: VocabShard) -> None:
    if logits.dim() != 2:
        raise ValueError(f"vocab_parallel_logits must be [T, V_local], got shape {tuple(logits.shape)}")
    if shard.vocab_size < 1 or shard.vocab_start < 0:
        raise ValueError(f"invalid vocab shard: vocab_start={shard.vocab_start}, vocab_size={shard.vocab_size}")


def _check_ids(ids: Tensor, num_tokens: int, vocab_size: int, validate: bool) -> None:
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"ids must be int64 [T, M] with T={num_tokens}, got {ids.dtype} {tuple(ids.shape)}")
    if validate and ids.numel() and not bool(((ids >= 0) & (ids < vocab_size)).all()):
        raise ValueError(f"ids must be in [0, vocab_size={vocab_size}); padded or negative ids have no log-prob")


def vocab_parallel_logprobs(
    vocab_parallel_logits: Tensor,
    ids: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    inplace_backward: bool = False,
    with_entropy: bool = True,
    validate: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs at global ids and the entropy, from this rank's vocabulary shard.

    Args:
        vocab_parallel_logits: [T, V_local] (bf16 or fp32; accumulation in fp32).
        ids: [T, M] int64 global ids in [0, vocab_size) (e.g. the top-k index set and the sampled
            token); the owner rank reads each one.
        vocab_start: global id of this shard's first column.
        vocab_size: real vocabulary size; columns at ids >= vocab_size are padding.
        tp_group: the tensor-parallel group (None on a single device).
        chunk_size: tokens per chunk.
        inplace_backward: write the gradient into ``vocab_parallel_logits`` (saves [T, V_local]).
        with_entropy: also compute the entropy (one more pass over each chunk forward, and one
            more [chunk, V_local] temporary backward when the entropy receives a gradient).
        validate: check that every id is in [0, vocab_size) (one host sync).

    Returns:
        (logprobs [T, M], entropy [T] or None), float32, identical on every rank of the group.
    """
    shard = VocabShard(vocab_start, vocab_size, tp_group)
    _check(vocab_parallel_logits, shard)
    _check_ids(ids, vocab_parallel_logits.shape[0], vocab_size, validate)
    out = _VocabParallelLogprobs.apply(vocab_parallel_logits, ids, shard, chunk_size, inplace_backward, with_entropy)
    return out if with_entropy else (out, None)


@torch.no_grad()
def vocab_parallel_token_stats(
    vocab_parallel_logits: Tensor,
    ids: Tensor | None,
    k: int,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    with_entropy: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    validate: bool = True,
) -> TokenStats:
    """Everything a forward-only pass needs, in one pass over the shard and ONE all-gather.

    Log-probs at given global ids (the sampled token; for the anchor, also the policy's top-k),
    logsumexp, entropy, and the global top-k: local top-k per shard (padding masked, ties to the
    lower id) -> all-gather (values, global ids) -> re-rank the TP * k candidates by value, then id,
    which equals ``core.logprob.topk_logprobs`` on the full vocabulary, ties included. No gradient.

    Args:
        vocab_parallel_logits: [T, V_local] (bf16 or fp32; accumulation in fp32).
        ids: [T, M] int64 global ids in [0, vocab_size), or None (M = 0).
        k: top-k size, 0 <= k <= vocab_size (0: no top-k).
        Other arguments: as ``vocab_parallel_logprobs``.

    Returns:
        ``TokenStats``.
    """
    shard = VocabShard(vocab_start, vocab_size, tp_group)
    _check(vocab_parallel_logits, shard)
    num_tokens, width = vocab_parallel_logits.shape
    if ids is None:
        ids = torch.empty(num_tokens, 0, dtype=torch.int64, device=vocab_parallel_logits.device)
    _check_ids(ids, num_tokens, vocab_size, validate)
    if not 0 <= k <= vocab_size:
        raise ValueError(f"k={k} must be in [0, vocab_size={vocab_size}]")
    local_ids, owned = _owned_local_ids(ids, shard, shard.num_valid(width))
    packed = _local_pass(
        vocab_parallel_logits, local_ids, owned, shard, k=k, with_entropy=with_entropy, chunk_size=chunk_size
    )
    return _reduce_pass(_all_gather(packed, tp_group), num_ids=ids.shape[1], k=k, with_entropy=with_entropy)


def vocab_parallel_topk(
    vocab_parallel_logits: Tensor,
    k: int,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Global top-k (logprobs [T, k] descending, float32; ids [T, k] int64), no gradient: the
    top-k part of ``vocab_parallel_token_stats``."""
    stats = vocab_parallel_token_stats(
        vocab_parallel_logits,
        None,
        k,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=tp_group,
        with_entropy=False,
        chunk_size=chunk_size,
    )
    return stats.topk_logprobs, stats.topk_ids


def vocab_parallel_topk_kl(
    vocab_parallel_logits: Tensor,
    token_ids: Tensor,
    index_set: Tensor,
    head_anchor_logprobs: Tensor,
    anchor_logprobs: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    direction: str,
    tail: bool = True,
    tail_grad: str = "unbiased",
    old_logprobs: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] = (None, None),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    inplace_backward: bool = False,
    validate: bool = True,
) -> tuple[TopkKL, Tensor]:
    """Top-k KL of ``core.topk_kl`` from a vocab shard; also returns log pi(token) for the PG loss.

    Args:
        vocab_parallel_logits: [T, V_local].
        token_ids: [T] int64 sampled tokens. index_set: [T, K] int64 global ids from an earlier
            pass (top-k of pi_old for reverse, of the anchor for forward).
        head_anchor_logprobs: [T, K]; anchor_logprobs: [T]; old_logprobs: [T] or None.
        Other arguments: as ``vocab_parallel_logprobs`` and ``core.topk_kl.topk_kl_from_logprobs``.

    Returns:
        (``TopkKL`` of [T] tensors, logprobs [T] at ``token_ids`` carrying the gradient).
    """
    ids = topk_kl_ids(index_set, token_ids, lead_shape=vocab_parallel_logits.shape[:1], vocab_size=vocab_size)
    gathered, _ = vocab_parallel_logprobs(
        vocab_parallel_logits,
        ids,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        tp_group=tp_group,
        chunk_size=chunk_size,
        inplace_backward=inplace_backward,
        with_entropy=False,
        validate=validate,
    )
    kl = topk_kl_from_gathered(
        gathered,
        index_set,
        token_ids,
        head_anchor_logprobs,
        anchor_logprobs,
        direction=direction,
        tail=tail,
        tail_grad=tail_grad,
        old_logprobs=old_logprobs,
        iw_clip=iw_clip,
        validate=validate,
    )
    return kl, gathered[:, -1]
