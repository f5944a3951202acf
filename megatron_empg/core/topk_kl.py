"""Top-k KL (EMA-PG, arXiv 2602.04417, Alg. 1/2): exact KL over k ids plus a sampled tail.

Per token, with q the index set (k ids), y the sampled token, a_j = log pi_theta(j),
b_j = log pi_ref(j), l = a_y, l_r = b_y, r = exp(l - sg l), s = sg(pi_theta(y)/pi_old(y)):

    reverse, KL(pi_theta || pi_ref), q = top-k of pi_old:
        head = sum_{j in q} exp(a_j) (a_j - b_j)
        tail = 1[y not in q] * r * sg(l - l_r)                      ("reference", ema-pg code)
        tail = 1[y not in q] * (r * sg(l - l_r + 1) - 1)            ("unbiased", default)
    forward, KL(pi_ref || pi_theta), q = top-k of pi_ref:
        head = sum_{j in q} exp(b_j) (b_j - a_j)
        tail = 1[y not in q] * (sg(w) log w + (l - sg l)), log w = clamp(l_r - l, +-20)   ("reference")
        tail = 1[y not in q] * sg(w) log w                                               ("unbiased")
    value = head + s * tail      (tail off = "truncated" Top-k KL: value = head)

``tail_weights`` w_mu [*] (the behaviour-policy correction, ``core.behavior_is``) multiplies the
sampled tail only: value = head + w_mu * s * tail. The head is an exact sum at the position.

Both tail forms have the same value, so E[value] is the exact KL for any fixed q (with s, also
when y ~ pi_old). The gradients differ: the reference surrogate's expected gradient is
grad KL + grad pi_theta(q) (reverse) or grad KL + grad pi_theta(V \\ q) (forward), because
sum_{j not in q} grad pi(j) only vanishes over the whole vocabulary (docs/design/ema-pg.md section 5).
"unbiased" adds the missing term (reverse) or drops the spurious one (forward), so
E[grad] = grad KL exactly. Both are verified by exact enumeration in tests/core/test_topk_kl.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from megatron_empg.core.checks import check_bool, check_choice, check_finite, check_same_shape
from megatron_empg.core.kl import LOG_RATIO_CLAMP, importance_weight, straight_through_one
from megatron_empg.core.logprob import DEFAULT_CHUNK_SIZE, gather_logprobs

DIRECTIONS = ("reverse", "forward")
TAIL_GRADS = ("unbiased", "reference")


class TopkKL(NamedTuple):
    """Per-token Top-k KL parts, each [*]: ``values`` = ``head`` + w_mu * s * ``tail`` (the
    surrogate; w_mu = ``tail_weights``, 1 when None)."""

    values: Tensor
    head: Tensor
    tail: Tensor


def _reverse_tail(logprobs: Tensor, anchor_logprobs: Tensor, tail_grad: str) -> Tensor:
    log_ratio = (logprobs - anchor_logprobs).detach()
    r = straight_through_one(logprobs)
    if tail_grad == "reference":
        return r * log_ratio
    return r * log_ratio + (r - 1)  # = r * sg(l - l_r + 1) - 1, same value bit for bit


def _forward_tail(logprobs: Tensor, anchor_logprobs: Tensor, tail_grad: str) -> Tensor:
    log_w = (anchor_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    tail = log_w.detach().exp() * log_w
    if tail_grad == "reference":
        return tail + (logprobs - logprobs.detach())
    return tail


def topk_kl_from_logprobs(
    head_logprobs: Tensor,
    head_anchor_logprobs: Tensor,
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    in_head: Tensor,
    *,
    direction: str,
    tail: bool = True,
    tail_grad: str = "unbiased",
    old_logprobs: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] = (None, None),
    tail_weights: Tensor | None = None,
    validate: bool = True,
) -> TopkKL:
    """Top-k KL from log-probs already gathered at the index set (see the module docstring).

    This is the local math shared by the single-device path (``topk_kl``) and the vocab-parallel
    one: only [*, K] and [*] tensors enter.

    Args:
        head_logprobs: [*, K] log pi_theta at the index set q (carries the gradient).
        head_anchor_logprobs: [*, K] log pi_ref at q (no gradient).
        logprobs: [*] log pi_theta at the sampled token y (carries the gradient).
        anchor_logprobs: [*] log pi_ref(y).
        in_head: [*] bool, whether y is in q.
        direction: "reverse" (q must be top-k of pi_old) or "forward" (q = top-k of pi_ref).
        tail: add the sampled tail correction; False gives the truncated Top-k KL.
        tail_grad: "unbiased" (default) or "reference" (reproduces ema-pg, biased gradient).
        old_logprobs: [*] log pi_old(y); when given, the tail is weighted by sg(pi_theta/pi_old).
        iw_clip: optional (low, high) clip of that importance weight.
        tail_weights: [*] further weights of the tail (no gradient is taken), or None.
        validate: check inputs for NaN/inf (one host sync).

    Returns:
        ``TopkKL`` of [*] tensors in float32.
    """
    check_choice("direction", direction, DIRECTIONS)
    check_choice("tail_grad", tail_grad, TAIL_GRADS)
    check_same_shape(head_logprobs=head_logprobs, head_anchor_logprobs=head_anchor_logprobs)
    check_same_shape(
        logprobs=logprobs,
        anchor_logprobs=anchor_logprobs,
        in_head=in_head,
        old_logprobs=old_logprobs,
        tail_weights=tail_weights,
    )
    check_bool("in_head", in_head)
    if head_logprobs.shape[:-1] != logprobs.shape:
        raise ValueError(
            f"head_logprobs has leading shape {tuple(head_logprobs.shape[:-1])} but logprobs has "
            f"shape {tuple(logprobs.shape)}"
        )
    if validate:
        check_finite(
            head_logprobs=head_logprobs,
            head_anchor_logprobs=head_anchor_logprobs,
            logprobs=logprobs,
            anchor_logprobs=anchor_logprobs,
            old_logprobs=old_logprobs,
            tail_weights=tail_weights,
        )
    a, b = head_logprobs, head_anchor_logprobs.detach()
    if direction == "reverse":
        head = (a.exp() * (a - b)).sum(-1)
    else:
        head = (b.exp() * (b - a)).sum(-1)
    if not tail:
        zeros = torch.zeros_like(head)
        return TopkKL(head, head, zeros)
    tail_fn = _reverse_tail if direction == "reverse" else _forward_tail
    tail_values = tail_fn(logprobs, anchor_logprobs.detach(), tail_grad)
    tail_values = torch.where(in_head, torch.zeros_like(tail_values), tail_values)
    weighted_tail = tail_values
    if old_logprobs is not None:
        weighted_tail = tail_values * importance_weight(logprobs, old_logprobs, iw_clip)
    if tail_weights is not None:
        weighted_tail = weighted_tail * tail_weights.detach()
    return TopkKL(head + weighted_tail, head, tail_values)


def topk_kl_ids(index_set: Tensor, token_ids: Tensor, *, lead_shape: torch.Size, vocab_size: int) -> Tensor:
    """The ids whose policy log-probs a Top-k KL needs: the index set, then the sampled token.

    Args:
        index_set: [*, K] int64 ids q; token_ids: [*] int64 sampled tokens y.
        lead_shape: the logits' leading shape [*]; vocab_size: V (K must not exceed it).

    Returns:
        [*, K+1] int64.
    """
    for name, ids in (("token_ids", token_ids), ("index_set", index_set)):
        if ids.dtype != torch.int64:  # torch.cat below would silently promote a mix of int dtypes
            raise ValueError(f"{name} must be int64, got {ids.dtype}")
    if index_set.shape[-1] > vocab_size:
        raise ValueError(f"index_set has k={index_set.shape[-1]} ids per token but V={vocab_size}")
    if token_ids.shape != lead_shape:
        raise ValueError(f"token_ids has shape {tuple(token_ids.shape)}, expected {tuple(lead_shape)}")
    if index_set.shape[:-1] != token_ids.shape:
        raise ValueError(f"index_set has shape {tuple(index_set.shape)}, expected {tuple(token_ids.shape)} + (K,)")
    return torch.cat([index_set, token_ids.unsqueeze(-1)], dim=-1)


def topk_kl_from_gathered(
    gathered: Tensor,
    index_set: Tensor,
    token_ids: Tensor,
    head_anchor_logprobs: Tensor,
    anchor_logprobs: Tensor,
    **estimator_args,
) -> TopkKL:
    """Top-k KL from the policy's log-probs at ``topk_kl_ids`` (single-device or vocab-parallel).

    Args:
        gathered: [*, K+1] log pi_theta at (q, y), carrying the gradient.
        index_set: [*, K]; token_ids: [*]; head_anchor_logprobs: [*, K]; anchor_logprobs: [*].
        estimator_args: keyword arguments of ``topk_kl_from_logprobs``.
    """
    in_head = (index_set == token_ids.unsqueeze(-1)).any(-1)  # [*]
    return topk_kl_from_logprobs(
        gathered[..., :-1], head_anchor_logprobs, gathered[..., -1], anchor_logprobs, in_head, **estimator_args
    )


def topk_kl(
    logits: Tensor,
    token_ids: Tensor,
    index_set: Tensor,
    head_anchor_logprobs: Tensor,
    anchor_logprobs: Tensor,
    *,
    direction: str,
    tail: bool = True,
    tail_grad: str = "unbiased",
    old_logprobs: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] = (None, None),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    validate: bool = True,
) -> TopkKL:
    """Top-k KL from the policy's full logits, chunked over tokens.

    The policy's log-probs at the k ids and at the sampled token are gathered with
    ``gather_logprobs``, so at most one [chunk_size, V] float32 temporary exists in forward and
    in backward; everything the anchor contributes was computed by an earlier pass.

    Args:
        logits: [*, V] policy logits (bf16 or fp32).
        token_ids: [*] int64 sampled tokens y.
        index_set: [*, K] int64 ids q (top-k of pi_old for reverse, of pi_ref for forward).
        head_anchor_logprobs: [*, K] log pi_ref at ``index_set``.
        anchor_logprobs: [*] log pi_ref(y).
        Remaining arguments: as ``topk_kl_from_logprobs``.

    Returns:
        ``TopkKL`` of [*] float32 tensors.
    """
    ids = topk_kl_ids(index_set, token_ids, lead_shape=logits.shape[:-1], vocab_size=logits.shape[-1])
    gathered = gather_logprobs(logits, ids, chunk_size=chunk_size)  # [*, K+1] float32
    if validate:  # a NaN/inf anywhere in a row of logits reaches its lse: [*, K+1], not [*, V], checked
        check_finite(logits=gathered)
    return topk_kl_from_gathered(
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
