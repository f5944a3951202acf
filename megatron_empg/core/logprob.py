"""Log-probabilities from logits without a [T, V] float32 temporary beyond one chunk of tokens.

``gather_logprobs`` is the primitive every vocabulary-level quantity of the update pass is built
on: log pi(j) = z_j - logsumexp(z) at a few ids per token, with a hand-written backward that
recomputes the softmax chunk by chunk from the saved logits and per-token logsumexp:

    d/dz [sum_m g_m log pi(id_m)] = scatter(g at ids) - (sum_m g_m) * softmax(z)

The ``full_*`` / ``exact_kl`` functions materialise the whole log-softmax and serve as the
references the tests compare against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.core.checks import check_choice, check_finite

# Tokens per chunk: at V = 151,936 one float32 [256, V] temporary is 156 MB (measured peak extra
# memory of the chunked Top-k KL: benchmarks/results/topk_kl_cpu_smoke.json, chunk sweep).
DEFAULT_CHUNK_SIZE = 256

# Bytes of the row blocks in which a chunk is reduced on CPU (6 rows at V = 151,936): the several
# elementwise ops and sums of a block run while its rows are in the cache, where whole-chunk ops
# would each stream the [chunk, V] buffer through memory; the entropy's second operand needs a
# buffer of one block only (benchmarks/README.md, topk_kl.py: the trainer's path).
CPU_BLOCK_BYTES = 4 << 20


def _check_logits_ids(logits: Tensor, ids: Tensor) -> None:
    if ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    if logits.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"ids has leading shape {tuple(ids.shape[:-1])} but logits has {tuple(logits.shape[:-1])}")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs (used by the exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_ranges(num_tokens: int, chunk_size: int):
    """(start, end) row ranges of at most ``chunk_size`` tokens."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for start in range(0, num_tokens, chunk_size):
        yield start, min(start + chunk_size, num_tokens)


def load_masked_(scratch: Tensor, rows: Tensor, n_valid: int) -> Tensor:
    """Copy ``rows`` [c, V] (any float dtype) into ``scratch`` [c, V] (the accumulation dtype) and
    set the padding columns ``n_valid:`` to -inf. Returns ``scratch``.

    One scratch buffer reused over all chunks of a call: a fresh [chunk, V] allocation per chunk
    costs its page faults again each time on CPU (the allocator returns large blocks to the OS).
    """
    scratch.copy_(rows)
    if n_valid < scratch.shape[1]:
        scratch[:, n_valid:] = float("-inf")
    return scratch


def _row_blocks(z: Tensor):
    """(start, end) row ranges of ``z`` [c, V] reduced together: about ``CPU_BLOCK_BYTES`` of rows
    on CPU; elsewhere the whole chunk (on a GPU every op of every block is a kernel launch)."""
    rows = z.shape[0]
    if z.device.type == "cpu":
        rows = CPU_BLOCK_BYTES // max(1, z.shape[1] * z.element_size())
    return chunk_ranges(z.shape[0], max(1, rows))


def logsumexp_(z: Tensor, *, with_mean: bool = False) -> tuple[Tensor, Tensor | None]:
    """Row logsumexp of ``z`` [c, V] (the accumulation dtype), overwriting ``z``.

    With ``with_mean`` the same pass also gives sum_j softmax(z)_j z_j (the entropy is lse minus
    it) from exp(z - max) in a block-sized buffer and z - max in ``z``: no [c, V] temporary, and no
    log of the probabilities.

    Returns:
        (lse [c]; sum_j softmax(z)_j z_j [c] when ``with_mean``, else None). A row of -inf only has
        lse = -inf (and mean 0).
    """
    lse = z.new_empty(z.shape[0])
    mean = z.new_empty(z.shape[0]) if with_mean else None
    buffer = None
    for s, e in _row_blocks(z):
        block = z[s:e]
        row_max = block.amax(-1, keepdim=True)  # [b, 1]
        row_max.masked_fill_(row_max.isinf(), 0)  # all -inf: exp stays 0 and lse = log 0 = -inf
        block.sub_(row_max)
        if not with_mean:
            total = block.exp_().sum(-1)
        else:
            if buffer is None:  # the first block is the largest
                buffer = torch.empty_like(block)
            unnormalized = torch.exp(block, out=buffer[: e - s])
            total = unnormalized.sum(-1)
            # sum_j e_j (z_j - max); -inf (padding) made finite first: 0 * -inf would be NaN
            weighted = unnormalized.mul_(block.clamp_(min=torch.finfo(z.dtype).min)).sum(-1)
            # total >= 1 (the max contributes exp 0) unless the row is all -inf, where the mean is 0
            mean[s:e] = weighted.div_(total.clamp(min=1)).add_(row_max.squeeze(-1))
        lse[s:e] = total.log_().add_(row_max.squeeze(-1))
    return lse, mean


def logsoftmax_backward_(
    z: Tensor,
    lse: Tensor,
    ids: Tensor,
    grad_ids: Tensor | None,
    grad_total: Tensor | None,
    *,
    entropy: Tensor | None = None,
    grad_entropy: Tensor | None = None,
) -> Tensor:
    """Gradient w.r.t. z of sum_m g_m log p(id_m) + g_H H, written into ``z``.

        d/dz_j = [j = id_m] g_m - p_j (sum_m g_m + g_H (log p_j + H)),   p = softmax(z)

    Args:
        z: [c, V] scratch holding the (padding-masked) logits in the accumulation dtype.
        lse: [c] logsumexp of the rows (over every rank's columns under tensor parallelism).
        ids: [c, M] int64 columns of ``z`` that receive ``grad_ids``.
        grad_ids: [c, M] gradient of the log-probs at ``ids`` (0 where another rank owns the id),
            or None (no gradient through the log-probs).
        grad_total: [c] sum_m g_m over ALL ids, wherever they live; None with ``grad_ids``.
        entropy, grad_entropy: [c] or None (no gradient through the entropy).

    Returns:
        ``z``, now the [c, V] gradient (0 on padding columns).
    """
    coef = grad_total[:, None] if grad_total is not None else z.new_zeros(z.shape[0], 1)
    buffer = None
    for s, e in _row_blocks(z):
        log_p = z[s:e].sub_(lse[s:e, None])
        if grad_entropy is None:
            log_p.exp_().mul_(-coef[s:e])
        else:  # needs p and log p at once: p goes to a block-sized buffer
            if buffer is None:  # the first block is the largest
                buffer = torch.empty_like(log_p)
            p = torch.exp(log_p, out=buffer[: e - s])
            log_p.nan_to_num_(nan=0.0, neginf=0.0)  # -inf only where p = 0: avoids 0 * -inf
            log_p.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None]).add_(coef[s:e]).mul_(p).neg_()
    if grad_ids is not None:
        z.scatter_add_(-1, ids, grad_ids)
    return z


class _GatherLogprobs(torch.autograd.Function):
    """log_softmax(logits)[ids] with a chunked, recomputing backward (see module docstring)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, chunk_size: int) -> Tensor:
        # logits [T, V] (any float dtype), ids [T, M] int64 -> logprobs [T, M] float32 (fp64 in)
        acc = accumulation_dtype(logits.dtype)
        num_tokens, vocab = logits.shape
        lse = torch.empty(num_tokens, dtype=acc, device=logits.device)
        scratch = torch.empty(min(chunk_size, num_tokens), vocab, dtype=acc, device=logits.device)
        for s, e in chunk_ranges(num_tokens, chunk_size):
            lse[s:e], _ = logsumexp_(load_masked_(scratch[: e - s], logits[s:e], vocab))
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_size = chunk_size
        return logits.gather(-1, ids).to(acc) - lse[:, None]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors
        num_tokens, vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        scratch = torch.empty(min(ctx.chunk_size, num_tokens), vocab, dtype=lse.dtype, device=logits.device)
        for s, e in chunk_ranges(num_tokens, ctx.chunk_size):
            z = load_masked_(scratch[: e - s], logits[s:e], vocab)
            grad_ids = grad_out[s:e].to(lse.dtype)
            grad_logits[s:e] = logsoftmax_backward_(z, lse[s:e], ids[s:e], grad_ids, grad_ids.sum(-1))
        # One None per forward argument after logits: ids, chunk_size.
        return grad_logits, None, None


def gather_logprobs(logits: Tensor, ids: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """log pi(ids) under softmax(logits), differentiable w.r.t. ``logits``.

    Args:
        logits: [*, V] any float dtype (accumulation is float32).
        ids: [*, M] int64 vocabulary ids in [0, V).
        chunk_size: tokens per chunk; bounds the float32 temporaries to [chunk_size, V].

    Returns:
        [*, M] log-probabilities in float32 (float64 for float64 logits).
    """
    _check_logits_ids(logits, ids)
    lead = ids.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    # Explicit row count: reshape(-1, 0) is ambiguous and raises when there are no ids (k = 0).
    flat_ids = ids.reshape(flat_logits.shape[0], ids.shape[-1])
    flat = _GatherLogprobs.apply(flat_logits, flat_ids, chunk_size)
    return flat.reshape(*lead, ids.shape[-1])


def rank_by_value_then_id(values: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best (value descending, ties to the lower id) of a small candidate set.

    Args:
        values: [N, C]; ids: [N, C] int64 (distinct per row); k <= C.

    Returns:
        (values [N, k], ids [N, k]) in that order.
    """
    by_id = torch.sort(ids, dim=-1, stable=True)  # ids ascending
    values = values.gather(-1, by_id.indices)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True)  # ties keep id order
    top = by_value.indices[:, :k]
    return by_value.values[:, :k], by_id.values.gather(-1, top)


def topk_value_then_id(z: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk`` with a deterministic tie rule: ties at the k-th value go to the lower ids.

    ``torch.topk`` picks an arbitrary subset of equal values, which would make top-k ids depend on
    the kernel and on the vocab sharding. Rows whose k-th value is tied beyond the selection are
    re-selected by id; the result is ordered by value descending, then id ascending.

    Args:
        z: [N, V]; k: 0 <= k <= V.

    Returns:
        (values [N, k] in z's dtype, ids [N, k] int64).
    """
    if k == 0 or k == z.shape[-1]:
        top = torch.topk(z, k, dim=-1, sorted=True)  # nothing left out: no tie can straddle the cut
        return rank_by_value_then_id(top.values, top.indices, k)
    top = torch.topk(z, k + 1, dim=-1, sorted=True)  # the (k+1)-th value tells whether a tie straddles
    kth = top.values[:, k - 1 : k]  # [N, 1]
    ids = top.indices[:, :k].clone()
    rows = (top.values[:, k : k + 1] == kth).squeeze(-1).nonzero().squeeze(-1)  # ambiguous rows
    if rows.numel():  # no sync of its own (nonzero() has synced): skips the [N, V] scan below
        # Every value > kth is selected and sorted first; the remaining slots (where the selection
        # holds kth) take the lowest tied ids. nonzero() lists the tied ids row by row, ascending.
        tie_row, tie_id = (z == kth).nonzero(as_tuple=True)  # all rows: cheaper than copying z[rows]
        row_of = torch.full((z.shape[0],), -1, dtype=torch.int64, device=z.device)
        row_of[rows] = torch.arange(rows.numel(), device=z.device)
        tie_row = row_of[tie_row]
        keep = tie_row >= 0
        tie_row, tie_id = tie_row[keep], tie_id[keep]
        tie_count = torch.bincount(tie_row, minlength=rows.numel())  # [n]
        rank_in_row = torch.arange(tie_row.numel(), device=z.device) - (tie_count.cumsum(0) - tie_count)[tie_row]
        slots = top.values[rows, :k] == kth[rows]  # [n, k] a suffix of each row
        row_ids = ids[rows]
        row_ids[slots] = tie_id[rank_in_row < slots.sum(-1)[tie_row]]
        ids[rows] = row_ids
    values = z.gather(-1, ids)
    return rank_by_value_then_id(values, ids, k)


@torch.no_grad()
def topk_logprobs(logits: Tensor, k: int, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The k most likely ids per token and their log-probs (no gradient).

    Ties go to the lower id (``topk_value_then_id``), the same rule as the vocab-parallel top-k.

    Args:
        logits: [*, V]; k: 0 <= k <= V.

    Returns:
        (logprobs [*, K] sorted descending, float32 (float64 for float64 logits); ids [*, K] int64).
    """
    vocab = logits.shape[-1]
    if not 0 <= k <= vocab:
        raise ValueError(f"k={k} must be in [0, V={vocab}]")
    flat = logits.reshape(-1, vocab)
    acc = accumulation_dtype(logits.dtype)
    values = torch.empty(flat.shape[0], k, dtype=acc, device=logits.device)
    ids = torch.empty(flat.shape[0], k, dtype=torch.int64, device=logits.device)
    scratch = torch.empty(min(chunk_size, flat.shape[0]), vocab, dtype=acc, device=logits.device)
    for s, e in chunk_ranges(flat.shape[0], chunk_size):
        z = load_masked_(scratch[: e - s], flat[s:e], vocab)
        top_values, ids[s:e] = topk_value_then_id(z, k)
        values[s:e] = top_values - logsumexp_(z)[0][:, None]
    return values.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k)


@torch.no_grad()
def logsumexp_and_entropy(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Per-token logsumexp and entropy H = lse - sum softmax(z) z (no gradient).

    Args:
        logits: [*, V].

    Returns:
        (lse [*] float32, entropy [*] float32).
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    lse = torch.empty(flat.shape[0], dtype=accumulation_dtype(logits.dtype), device=logits.device)
    ent = torch.empty_like(lse)
    scratch = torch.empty(min(chunk_size, flat.shape[0]), vocab, dtype=lse.dtype, device=logits.device)
    for s, e in chunk_ranges(flat.shape[0], chunk_size):
        lse[s:e], mean_logit = logsumexp_(load_masked_(scratch[: e - s], flat[s:e], vocab), with_mean=True)
        ent[s:e] = lse[s:e] - mean_logit
    return lse.reshape(logits.shape[:-1]), ent.reshape(logits.shape[:-1])


def full_log_softmax(logits: Tensor) -> Tensor:
    """Reference: log-softmax over the whole vocabulary [*, V] (materialises [*, V]), >= float32."""
    return torch.log_softmax(logits.to(accumulation_dtype(logits.dtype)), dim=-1)


def exact_kl(logits: Tensor, anchor_logits: Tensor, *, direction: str, validate: bool = True) -> Tensor:
    """Reference: exact per-token KL over the full vocabulary, differentiable w.r.t. ``logits``.

    reverse: KL(pi_theta || pi_ref) = sum_j pi(j) (log pi(j) - log pi_ref(j))
    forward: KL(pi_ref || pi_theta) = sum_j pi_ref(j) (log pi_ref(j) - log pi(j))

    Args:
        logits: [*, V] policy logits; anchor_logits: [*, V] reference logits (no gradient).
        direction: "reverse" or "forward".

    Returns:
        [*] float32.
    """
    check_choice("direction", direction, ("reverse", "forward"))
    if logits.shape != anchor_logits.shape:
        raise ValueError(f"anchor_logits has shape {tuple(anchor_logits.shape)}, logits {tuple(logits.shape)}")
    if validate:
        check_finite(logits=logits, anchor_logits=anchor_logits)
    logp = full_log_softmax(logits)
    logp_ref = full_log_softmax(anchor_logits.detach())
    if direction == "reverse":
        return (logp.exp() * (logp - logp_ref)).sum(-1)
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)
