"""PPO's clipped surrogate, with DAPO's asymmetric clip ("clip-higher") and dual-clip.

With w = pi_theta / pi_old at the sampled token (the ratio), A the advantage and
w_bar = clip(w, 1 - eps_low, 1 + eps_high), the per-token loss is (verl ``compute_policy_loss``)

    l = max(-A w, -A w_bar)                      (pessimistic clip; Schulman et al. 2017)
    l = min(max(-A w, -A w_bar), -A c)  if A < 0 and dual-clip is on (Ye et al. 2020, c > 1)

so d l / d log pi_theta = -A w where the gradient flows and 0 where a clip is active:

    A > 0:  flows for w < 1 + eps_high                       (``clipped_high`` otherwise)
    A < 0:  flows for 1 - eps_low < w (< c with dual-clip)   (``clipped_low`` / ``dual_clipped``)

DAPO (arXiv:2503.14476) is ``clip_eps_high > clip_eps_low``. Losses here are elementwise: they take
per-token tensors of any shape [*] and return per-token values; ``aggregation.aggregate`` reduces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from megatron_empg.core.checks import check_finite, check_same_shape
from megatron_empg.core.kl import LOG_RATIO_CLAMP  # inside the clamp the ratio is exact; beyond it

# the ratio is constant, so the (anyway clipped) token gets no gradient


class PolicyLoss(NamedTuple):
    """Per-token policy loss and per-token metrics.

    Attributes:
        values: [*] per-token loss, a surrogate whose gradient is the intended one. Reduce it with
            ``aggregation.aggregate``.
        metrics: name -> [*] float tensor without gradient (indicators such as ``clipped_high``, or
            ``ratio``); the caller reduces each with ``aggregate(..., "token-mean")``.
    """

    values: Tensor
    metrics: dict[str, Tensor]


def importance_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """w = exp(clamp(logprobs - old_logprobs, +-LOG_RATIO_CLAMP)), differentiable [*]."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def check_clip_range(clip_eps_low: float, clip_eps_high: float | None, clip_c: float | None) -> tuple[float, float]:
    """Validate the clip constants; return (clip_eps_low, clip_eps_high) with None resolved.

    Raises:
        ValueError: naming the argument, unless 0 <= clip_eps_low < 1, clip_eps_high >= 0 and
            clip_c is None or > 1.
    """
    if not 0.0 <= clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low={clip_eps_low!r} must lie in [0, 1)")
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_high < 0.0:
        raise ValueError(f"clip_eps_high={clip_eps_high!r} must be >= 0 (None means clip_eps_low)")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c={clip_c!r} must be > 1 (dual-clip constant), or None to disable")
    return clip_eps_low, clip_eps_high


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_c: float | None = None,
    validate: bool = True,
) -> PolicyLoss:
    """PPO clipped surrogate with asymmetric (DAPO) and optional dual clip (module docstring).

    Args:
        logprobs: [*] log pi_theta at the sampled tokens (carries the gradient).
        old_logprobs: [*] log pi_old of the sampler (treated as a constant).
        advantages: [*] per-token advantage (gradient flows through it if it has one).
        clip_eps_low: ratio lower clip 1 - clip_eps_low, in [0, 1).
        clip_eps_high: ratio upper clip 1 + clip_eps_high; None means symmetric (= clip_eps_low).
        clip_c: dual-clip constant c > 1 bounding the loss of A < 0 tokens at -A c; None = off.
        validate: check the float inputs for NaN/inf (one host sync).

    Returns:
        ``PolicyLoss`` with values [*] and metrics ``clipped_low``, ``clipped_high``,
        ``dual_clipped`` (indicators of a zero-gradient region) and ``ratio`` (w), each [*].
    """
    clip_eps_low, clip_eps_high = check_clip_range(clip_eps_low, clip_eps_high, clip_c)
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if validate:
        check_finite(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    ratio = importance_ratio(logprobs, old_logprobs.detach())  # [*]
    clipped_ratio = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # [*]
    values = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)  # [*]
    negative = advantages < 0
    dual_clipped = torch.zeros_like(negative)
    if clip_c is not None:
        values = torch.where(negative, torch.minimum(values, -advantages * clip_c), values)
        dual_clipped = negative & (ratio > clip_c)
    r = ratio.detach()
    metrics = {
        "clipped_low": negative & (r < 1.0 - clip_eps_low),
        "clipped_high": (advantages > 0) & (r > 1.0 + clip_eps_high),
        "dual_clipped": dual_clipped,
    }
    metrics = {name: m.to(r.dtype) for name, m in metrics.items()}
    metrics["ratio"] = r
    return PolicyLoss(values, metrics)


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss}
