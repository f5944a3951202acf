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


def _check_logits_ids(logits: Tensor, ids: Tensor) -> None:
    if ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    if logits.shape[:-1] != ids.shape[:-1]:
        raise ValueError(
            f"ids has leading shape {tuple(ids.shape[:-1])} but logits has {tuple(logits.shape[:-1])}"
        )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs (used by the exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_ranges(num_tokens: int, chunk_size: int):
    """(start, end) row ranges of at most ``chunk_size`` tokens."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for start in range(0, num_tokens, chunk_size):
        yield start, min(start + chunk_size, num_tokens)


class _GatherLogprobs(torch.autograd.Function):
    """log_softmax(logits)[ids] with a chunked, recomputing backward (see module docstring)."""

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, chunk_size: int) -> Tensor:
        # logits [T, V] (any float dtype), ids [T, M] int64 -> logprobs [T, M] float32 (fp64 in)
        acc = accumulation_dtype(logits.dtype)
        out = torch.empty(ids.shape, dtype=acc, device=logits.device)
        lse = torch.empty(ids.shape[0], dtype=acc, device=logits.device)
        for s, e in chunk_ranges(logits.shape[0], chunk_size):
            z = logits[s:e].to(acc)  # [c, V] the one fp32 temporary (a view if already fp32)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, ids[s:e]) - lse[s:e, None]
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, ids, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for s, e in chunk_ranges(logits.shape[0], ctx.chunk_size):
            g = grad_out[s:e].to(lse.dtype)  # [c, M]
            p = logits[s:e].to(lse.dtype, copy=True).sub_(lse[s:e, None]).exp_()  # softmax [c, V]
            p.mul_(-g.sum(dim=-1, keepdim=True)).scatter_add_(-1, ids[s:e], g)
            grad_logits[s:e] = p
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
    top = torch.topk(z, k, dim=-1, sorted=True)
    if k == 0:
        return top.values, top.indices
    kth = top.values[:, -1:]  # [N, 1]
    ambiguous = (z == kth).sum(-1) > (top.values == kth).sum(-1)  # [N] ties straddle the cut
    ids = top.indices.clone()
    rows = ambiguous.nonzero().squeeze(-1)
    if rows.numel():
        sub = z[rows]  # [n, V]
        greater = sub > kth[rows]
        tied = sub == kth[rows]
        room = k - greater.sum(-1, keepdim=True)  # [n, 1] how many tied ids fit
        keep = greater | (tied & (tied.cumsum(-1) <= room))  # exactly k per row
        ids[rows] = keep.nonzero()[:, 1].view(-1, k)  # ascending ids
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
    for s, e in chunk_ranges(flat.shape[0], chunk_size):
        z = flat[s:e].to(acc)
        top_values, ids[s:e] = topk_value_then_id(z, k)
        values[s:e] = top_values - torch.logsumexp(z, dim=-1, keepdim=True)
    return values.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k)


@torch.no_grad()
def logsumexp_and_entropy(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """Per-token logsumexp and entropy H = lse - sum softmax(z) z (no gradient).

    Args:
        logits: [*, V].

    Returns:
        (lse [*] float32, entropy [*] float32).
    """
    flat = logits.reshape(-1, logits.shape[-1])
    lse = torch.empty(flat.shape[0], dtype=accumulation_dtype(logits.dtype), device=logits.device)
    ent = torch.empty_like(lse)
    for s, e in chunk_ranges(flat.shape[0], chunk_size):
        z = flat[s:e].to(lse.dtype)
        lse[s:e] = torch.logsumexp(z, dim=-1)
        ent[s:e] = lse[s:e] - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
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
