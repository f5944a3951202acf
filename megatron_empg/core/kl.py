"""Sampled per-token KL estimators K1..K5 and K3++ (EMA-PG Table 1; Schulman's k1/k2/k3).

Notation (per sampled token y, drawn from pi_theta unless an importance weight is used):
    l = log pi_theta(y) (``logprobs``, carries the gradient), l_r = log pi_ref(y) (``anchor_logprobs``),
    w = pi_ref(y) / pi_theta(y) = exp(l_r - l), r = exp(l - sg(l)) (= 1 in value, grad = grad l).

Each function returns a per-token *surrogate*: its value is the estimate and its gradient is the
gradient the estimator uses. Expectations under y ~ pi_theta (checked by exact enumeration in
tests/core/test_kl.py):

    name  value                               grad coef c (grad = c * grad l)   E[value]  E[grad]
    k1    l - l_r                             1                                 KL_rev    0
    k2    (l - l_r)^2 / 2                     l - l_r                           biased    grad KL_rev
    k3    w - log w - 1   (clamped)           1 - w                             KL_rev    grad KL_fwd
    k3pp  k3 * r          (K3++)              (1 - w) + k3 = l - l_r (unclamped) KL_rev   grad KL_rev
    k4    sg(l - l_r) * r                     l - l_r                           KL_rev    grad KL_rev
    k5    sg(w) log w + (l - sg l)            1 - w                             KL_fwd    grad KL_fwd

KL_rev = KL(pi_theta || pi_ref), KL_fwd = KL(pi_ref || pi_theta). With ``old_logprobs`` (samples
from pi_old) every estimator is multiplied by the importance weight s = sg(pi_theta / pi_old).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.core.checks import check_choice, check_finite, check_same_shape

KL_ESTIMATORS = ("k1", "k2", "k3", "k3pp", "k4", "k5")

# Log-ratios are clamped before exp() so that a token the two policies disagree on wildly cannot
# overflow: exp(20) ~ 4.9e8 is finite in fp32 and bf16. Same constant as verl / ema-pg.
LOG_RATIO_CLAMP = 20.0
# verl clamps K3 (`low_var_kl`) and the `rpg_*` KL values (except rpg_fkl) to [-10, 10]; where the
# clamp is active the gradient is 0, so a single far-off token cannot dominate.
KL_VALUE_CLAMP = 10.0


def straight_through_one(logprobs: Tensor) -> Tensor:
    """r = exp(l - sg(l)): equals 1 in value, its gradient is grad l [same shape]."""
    return torch.exp(logprobs - logprobs.detach())


def importance_weight(
    logprobs: Tensor,
    old_logprobs: Tensor,
    clip: tuple[float | None, float | None] = (None, None),
) -> Tensor:
    """s = sg(pi_theta / pi_old) at the sampled token, optionally clipped to ``clip`` [*], no grad."""
    log_ratio = (logprobs.detach() - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    low, high = clip
    if low is not None and high is not None and low > high:
        raise ValueError(f"iw_clip={clip!r}: lower bound exceeds upper bound")
    weight = log_ratio.exp()
    if low is None and high is None:  # torch.clamp raises when both bounds are None
        return weight
    return weight.clamp(min=low, max=high)


def _k3(logprobs: Tensor, anchor_logprobs: Tensor) -> Tensor:
    log_w = (anchor_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_w.exp() - log_w - 1).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def _k5(logprobs: Tensor, anchor_logprobs: Tensor) -> Tensor:
    log_w = (anchor_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_w.detach().exp() * log_w + (logprobs - logprobs.detach())


_ESTIMATOR_FNS = {
    "k1": lambda l, lr: l - lr,
    "k2": lambda l, lr: 0.5 * (l - lr).square(),
    "k3": _k3,
    "k3pp": lambda l, lr: _k3(l, lr) * straight_through_one(l),
    "k4": lambda l, lr: (l - lr).detach() * straight_through_one(l),
    "k5": _k5,
}


def sampled_kl(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    *,
    estimator: str,
    old_logprobs: Tensor | None = None,
    iw_clip: tuple[float | None, float | None] = (None, None),
    validate: bool = True,
) -> Tensor:
    """Per-token sampled KL surrogate (see the module table).

    Args:
        logprobs: [*] log pi_theta at the sampled tokens (carries the gradient).
        anchor_logprobs: [*] log pi_ref at the same tokens (no gradient is taken).
        estimator: one of ``KL_ESTIMATORS``.
        old_logprobs: [*] log pi_old of the sampler; when given, the surrogate is multiplied by
            the importance weight sg(pi_theta/pi_old) (ema-pg ``use_kl_iw``), clipped to ``iw_clip``.
        validate: check inputs for NaN/inf (one host sync).

    Returns:
        [*] surrogate in the dtype of ``logprobs``.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_same_shape(logprobs=logprobs, anchor_logprobs=anchor_logprobs, old_logprobs=old_logprobs)
    if validate:
        check_finite(logprobs=logprobs, anchor_logprobs=anchor_logprobs, old_logprobs=old_logprobs)
    values = _ESTIMATOR_FNS[estimator](logprobs, anchor_logprobs.detach())
    if old_logprobs is not None:
        values = values * importance_weight(logprobs, old_logprobs, iw_clip)
    return values
