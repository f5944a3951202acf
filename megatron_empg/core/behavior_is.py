"""Importance correction of the per-token loss terms against the sampling (behaviour) policy mu.

The samples come from the rollout engine's mu: the trainer's weights under other numerics, or
weights one step older (one-step-off pipelining). The old pass recomputes log pi_old(y) with the
trainer's weights, and the engine reports log mu(y). A loss term whose expectation is over the
sampled token y is then an expectation under mu; the per-token weight w(y) makes it one under
pi_old (up to the bias of w's truncation). With r = log pi_old(y) - log mu(y), clamped to
+-LOG_RATIO_CLAMP before exp (so neither inf nor NaN can appear), rho = exp(r) and the cap C >= 1:

    mode   w                           source
    none   (no weights)                the caller leaves ``MicroBatch.behavior_weights`` None
    tis    min(rho, C)                 truncated IS (Ionides 2008); verl rollout_correction
                                       token-level TIS, NeMo-RL and slime TIS
    mis    rho if 1/C <= rho <= C,     masked IS: verl's token-level ``rollout_is_mode="mask"``
           else 0                      (volcengine/verl#3915, ``mismatch_helper.py``; today's
                                       ``rollout_rs="token_k1"`` with its default lower bound 1/C)

``mis`` differs from verl in one point: verl removes a rejected token from the response mask, so
it also leaves the loss's denominator; here it keeps its place in the count with weight 0 (the
loss mask, the entropy and the normalisation stay those of the unweighted loss). Off the loss
mask w = 1.

``behavior_stats`` sums, per micro-batch, what the metrics need; the sums add over micro-batches
and data-parallel ranks, and ``behavior_metrics`` turns the global sums into per-token means.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_empg.core.aggregation import masked_values
from megatron_empg.core.checks import check_bool, check_choice, check_same_shape
from megatron_empg.core.kl import LOG_RATIO_CLAMP


def _tis(ratio: Tensor, cap: float) -> Tensor:
    return ratio.clamp(max=cap)


def _mis(ratio: Tensor, cap: float) -> Tensor:
    kept = (ratio >= 1.0 / cap) & (ratio <= cap)
    return torch.where(kept, ratio, torch.zeros_like(ratio))


BEHAVIOR_IS: dict[str, Callable[[Tensor, float], Tensor] | None] = {"none": None, "tis": _tis, "mis": _mis}
"""Registry (``algorithm.behavior_is``): mode -> fn(rho [*], C) -> w [*]; ``none``: no weights."""

BEHAVIOR_STATS = ("behavior/ratio", "behavior/clipped", "behavior/k3", "behavior/tokens")
"""The keys of ``behavior_stats``: sums over the loss tokens."""


def _ratio(old_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """(r, rho) [B, S] float32, no grad, after checking the inputs; r is clamped."""
    check_same_shape(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, loss_mask=loss_mask)
    check_bool("loss_mask", loss_mask)
    if not cap >= 1:
        raise ValueError(f"cap={cap!r} must be >= 1")
    log_ratio = old_logprobs.detach().float() - sampler_logprobs.detach().float()
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, log_ratio.exp()


def behavior_weights(
    old_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, mode: str, cap: float
) -> Tensor | None:
    """Per-token weights w of ``mode`` (module table), or None for ``none``.

    Args:
        old_logprobs: [B, S] log pi_old(y) from the old pass.
        sampler_logprobs: [B, S] log mu(y) from the engine (any value off the mask).
        loss_mask: [B, S] bool, the loss tokens.
        mode: a key of ``BEHAVIOR_IS``; cap: C >= 1.

    Returns:
        [B, S] float32, detached, 1.0 off the mask; None for ``none``.
    """
    check_choice("mode", mode, BEHAVIOR_IS)
    _, ratio = _ratio(old_logprobs, sampler_logprobs, loss_mask, cap)
    weight_fn = BEHAVIOR_IS[mode]
    if weight_fn is None:
        return None
    return torch.where(loss_mask, weight_fn(ratio, cap), torch.ones_like(ratio))


def behavior_stats(old_logprobs: Tensor, sampler_logprobs: Tensor, loss_mask: Tensor, cap: float) -> dict[str, float]:
    """Sums over the loss tokens (one host sync), keyed by ``BEHAVIOR_STATS``: ``behavior/ratio``
    the untruncated rho, ``behavior/clipped`` the tokens with rho > C, ``behavior/k3`` K3 = rho - 1 - r
    (its mean estimates KL(mu || pi_old) without bias, y ~ mu), ``behavior/tokens`` the tokens.

    Args: as ``behavior_weights``.
    """
    log_ratio, ratio = _ratio(old_logprobs, sampler_logprobs, loss_mask, cap)
    per_token = torch.stack([ratio, (ratio > cap).float(), ratio - 1 - log_ratio, torch.ones_like(ratio)])
    sums = masked_values(per_token, loss_mask).flatten(1).sum(1)  # [4], in the order of BEHAVIOR_STATS
    return dict(zip(BEHAVIOR_STATS, sums.tolist()))


def behavior_metrics(totals: dict[str, float]) -> dict[str, float]:
    """The logged means per loss token of ``behavior_stats`` sums (added over micro-batches and
    ranks): ``rollout/is_ratio_mean``, ``rollout/is_clipped_fraction``, ``rollout/sampler_k3``."""
    tokens = max(totals["behavior/tokens"], 1.0)
    return {
        "rollout/is_ratio_mean": totals["behavior/ratio"] / tokens,
        "rollout/is_clipped_fraction": totals["behavior/clipped"] / tokens,
        "rollout/sampler_k3": totals["behavior/k3"] / tokens,
    }
