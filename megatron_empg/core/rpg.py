"""RPG: KL-regularized policy-gradient losses (Zhang et al., arXiv:2505.17508, ICLR 2026).

Objective J_D = E_{pi_theta}[R] - beta D, estimated from tokens sampled from pi_old, with
w = pi_theta / pi_old (``exp(logprobs - old_logprobs)``), A = R - b (``advantages``; the baseline
b keeps the gradient unbiased), beta (``beta``: the divergence's coefficient inside the policy
loss, ``algorithm.loss.policy_loss_args.beta``, apart from ``algorithm.loss.kl_coef``, the
coefficient of the separate KL term) and Z = ``z_old``:

    divergence  D                 d(w), E_old[Z d(w)] = D   kappa(w)/beta = -w d'(w)   Z
    fkl         KL(pi_old||pi)    -log w                    1                          1
    rkl         KL(pi||pi_old)    w log w                   -w (log w + 1)             1
    ufkl        UKL(pi_old||pi)   w - log w - 1   (= k3(w)) 1 - w                      any
    urkl        UKL(pi||pi_old)   w log w - w + 1 (= w k3(1/w))  -w log w              any
    ujs         (UKL_f + UKL_r)/2 (w log w - log w)/2       -(w log w + w - 1)/2       any

(UKL(p||q) = sum p log(p/q) + sum (q - p) is the unnormalized KL; ``ujs`` is verl's ``rpg_ujs``,
not in the paper: half the symmetric UKL, not Jensen-Shannon. verl's ``rpg_js`` is left out: its
value (w log w + log w)/2 contradicts its own comment.) Without clipping, every loss below has
the per-token gradient (d/d log pi_theta) -Z psi with the REINFORCE weight psi = A w + kappa(w)
(paper Tables 1, 2, 4, App. F), whose expectation is exactly -grad J_D; the clipped forms mask or
truncate it:

    rpg_loss                      Z (-A w + beta d(w))                 fully differentiable
    rpg_reinforce_loss            -SG(Z psi) log pi_theta              REINFORCE
    rpg_reinforce_clip_loss       RPG-Style Clip: psi(w, w_bar) masked like dual-clip PPO
    rpg_reinforce_hard_clip_loss  -SG(Z (A w_bar + kappa(w_bar))) log pi_theta  (truncated IS)
    rpg_dual_clip_loss            Algorithm 1: dual-clip PPO on A_hat = SG(psi / w)

Unnormalized variants: ``old_logprobs`` is log of the (possibly unnormalized) measure pi_old, the
tokens are sampled from pi_old / Z, and ``z_old`` = Z (a float or a [*] tensor; 1 for a softmax).

KL penalty terms (verl ``kl_penalty(logprobs, ref_logprobs, 'rpg_<D>')``, w = pi_theta / pi_ref):
``rpg_kl_penalty`` returns d(w), clamped to +-10 like verl (zero gradient where the clamp is
active) except ``fkl``, which verl leaves unclamped. ``corrected_grpo_kl`` is the paper's
correction of GRPO's k3 term (Sec. 2.2, Remark 3.5): w_old k3(pi_anchor / pi_theta).

Where the released code (complex-reasoning/RPG @ ec8e30b) differs, the paper is followed:
``compute_policy_loss_reinforce`` is never called by the released actors (the RPG-REINFORCE scripts
actually train dual-clip PPO without a KL term), so the REINFORCE losses here are written from the
paper and from that function's ``*_clip_ppo`` branch; see each docstring for the details.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_empg.core.checks import check_choice, check_finite, check_same_shape
from megatron_empg.core.kl import KL_VALUE_CLAMP, LOG_RATIO_CLAMP
from megatron_empg.core.policy_loss import PolicyLoss, check_clip_range, ppo_clip_loss

BRANCH_ON = ("advantage", "regularized_advantage")


class Divergence(NamedTuple):
    """Per-sample pieces of one divergence, as functions of log w (see the module table).

    Attributes:
        value: log w -> d(w), the per-sample regularizer (E_old[Z d(w)] = D).
        kl_weight: log w -> kappa(w) / beta = -w d'(w), the KL part of the REINFORCE weight.
        unnormalized: whether the divergence is a UKL, the only ones that take ``z_old``.
        value_clamped: whether ``rpg_kl_penalty`` clamps the value to +-KL_VALUE_CLAMP (as verl).
    """

    value: Callable[[Tensor], Tensor]
    kl_weight: Callable[[Tensor], Tensor]
    unnormalized: bool
    value_clamped: bool


# expm1 keeps w - 1 accurate near w = 1, where the UKL values vanish quadratically.
DIVERGENCES: dict[str, Divergence] = {
    "fkl": Divergence(lambda lw: -lw, torch.ones_like, False, False),
    "rkl": Divergence(lambda lw: lw.exp() * lw, lambda lw: -lw.exp() * (lw + 1), False, True),
    "ufkl": Divergence(lambda lw: torch.expm1(lw) - lw, lambda lw: -torch.expm1(lw), True, True),
    "urkl": Divergence(lambda lw: lw.exp() * lw - torch.expm1(lw), lambda lw: -lw.exp() * lw, True, True),
    "ujs": Divergence(
        lambda lw: 0.5 * (lw.exp() * lw - lw),
        lambda lw: -0.5 * (lw.exp() * lw + torch.expm1(lw)),
        True,
        True,
    ),
}


def _check_rpg_inputs(
    divergence: str, beta: float, z_old: float | Tensor, validate: bool, **tensors: Tensor
) -> Divergence:
    """Validate the common arguments (errors name the argument); return the divergence spec."""
    check_choice("divergence", divergence, DIVERGENCES)
    spec = DIVERGENCES[divergence]
    if not beta >= 0.0:
        raise ValueError(f"beta={beta!r} must be >= 0")
    if isinstance(z_old, Tensor):
        tensors["z_old"] = z_old
    elif not z_old > 0.0:
        raise ValueError(f"z_old={z_old!r} must be > 0")
    z_is_one = not isinstance(z_old, Tensor) and z_old == 1.0
    if not spec.unnormalized and not z_is_one:
        raise ValueError(
            f"z_old applies only to the unnormalized divergences (ufkl, urkl, ujs); "
            f"divergence={divergence!r} needs z_old=1.0"
        )
    check_same_shape(**tensors)
    if validate:
        check_finite(**tensors)
    return spec


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """log w = logprobs - old_logprobs clamped to +-LOG_RATIO_CLAMP (overflow guard) [*]."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _metrics(log_w: Tensor, kl: Tensor, **indicators: Tensor) -> dict[str, Tensor]:
    """Detached per-token metrics: ``ratio`` w, ``kl`` Z d(w) and float indicators [*]."""
    metrics = {name: m.to(log_w.dtype) for name, m in indicators.items()}
    metrics["ratio"] = log_w.detach().exp()
    metrics["kl"] = kl.detach()
    return metrics


def rpg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    divergence: str,
    beta: float,
    z_old: float | Tensor = 1.0,
    validate: bool = True,
) -> PolicyLoss:
    """Fully differentiable RPG loss Z (-A w + beta d(w)) (paper Table 1 / Table 4).

    Its expectation under pi_old / Z is -J_D and its gradient is exactly -grad J_D (Props. 3.2,
    3.6, E.1, E.3). For fkl the paper writes -beta log pi_theta; -beta log w differs by a constant.

    Args:
        logprobs: [*] log pi_theta at the sampled tokens (carries the gradient).
        old_logprobs: [*] log pi_old (possibly unnormalized, see ``z_old``), a constant.
        advantages: [*] A = R - b broadcast over the tokens of a response.
        divergence: one of ``DIVERGENCES``.
        beta: the divergence's coefficient, >= 0.
        z_old: total mass Z of pi_old, float or [*]; must be 1 for fkl / rkl.
        validate: check the float inputs for NaN/inf (one host sync).

    Returns:
        ``PolicyLoss`` with values [*] and metrics ``ratio`` and ``kl`` (= Z d(w)) [*].
    """
    spec = _check_rpg_inputs(
        divergence,
        beta,
        z_old,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
    )
    log_w = _log_ratio(logprobs, old_logprobs.detach())  # [*]
    kl = z_old * spec.value(log_w)  # [*]
    values = -z_old * advantages * log_w.exp() + beta * kl  # [*]
    return PolicyLoss(values, _metrics(log_w, kl))


def rpg_reinforce_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    divergence: str,
    beta: float,
    z_old: float | Tensor = 1.0,
    validate: bool = True,
) -> PolicyLoss:
    """RPG-REINFORCE loss -SG(psi) log pi_theta, psi = Z (A w + kappa(w)) (Table 2 / App. F).

    Same per-token gradient as ``rpg_loss`` for every w (Props. 4.1, F.1, F.3-F.5). The value is
    the paper's and is proportional to log pi_theta, so it is not a meaningful loss to report.
    Arguments and metrics as ``rpg_loss``.
    """
    spec = _check_rpg_inputs(
        divergence,
        beta,
        z_old,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
    )
    log_w = _log_ratio(logprobs.detach(), old_logprobs)  # [*], no grad
    psi = z_old * (advantages.detach() * log_w.exp() + beta * spec.kl_weight(log_w))  # [*]
    values = -psi * logprobs  # [*]
    return PolicyLoss(values, _metrics(log_w, z_old * spec.value(log_w)))


def rpg_reinforce_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    divergence: str,
    beta: float,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_c: float | None = None,
    branch_on: str = "advantage",
    z_old: float | Tensor = 1.0,
    validate: bool = True,
) -> PolicyLoss:
    """RPG-REINFORCE with RPG-Style Clip: dual-clip PPO's gradient mask on the REINFORCE weight.

    Per-token gradient -Z (A w + kappa(w_bar)) M, with w_bar = clip(w, 1 - eps_low, 1 + eps_high)
    inside the KL part (Remark F.2) and the mask

        M = [pos and w < 1 + eps_high] or [not pos and 1 - eps_low <= w < c]   (c = inf if None)

    ``branch_on="advantage"`` (default): pos = A > 0, as verl's ``rpg_rf_*_clip_ppo`` (A = 0 takes
    the negative branch); with beta = 0 this is exactly ``ppo_clip_loss``'s gradient.
    ``branch_on="regularized_advantage"``: pos = A' >= 0 with A' = A + kappa(w_bar) / w, i.e. the
    sign of the weight, as Algorithm 2 writes it (the unused ``*_clip_ppo_v3`` branch of the code
    uses the opposite sign, which looks like a bug).

    The value is Algorithm 2's: -SG(Z (A w_eff + kappa(w_bar))) log pi_theta, where w_eff is w
    clipped to the bound that is active, and log pi_theta is detached outside M. (The code's
    clipped branches give the KL term the opposite sign; only the reported value differs.)

    Args:
        clip_eps_low, clip_eps_high, clip_c: as ``ppo_clip_loss``.
        branch_on: one of ``BRANCH_ON``.
        Others: as ``rpg_loss``.

    Returns:
        ``PolicyLoss``; metrics ``clipped_low``, ``clipped_high``, ``dual_clipped`` (indicators of
        M = 0 by reason), ``ratio``, ``kl`` [*].
    """
    spec = _check_rpg_inputs(
        divergence,
        beta,
        z_old,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
    )
    clip_eps_low, clip_eps_high = check_clip_range(clip_eps_low, clip_eps_high, clip_c)
    check_choice("branch_on", branch_on, BRANCH_ON)
    log_w = _log_ratio(logprobs.detach(), old_logprobs)  # [*], no grad
    w, adv = log_w.exp(), advantages.detach()  # [*]
    log_w_bar = log_w.clamp(math.log1p(-clip_eps_low), math.log1p(clip_eps_high))  # [*]
    kappa = beta * spec.kl_weight(log_w_bar)  # [*]
    pos = adv > 0 if branch_on == "advantage" else adv + kappa / w >= 0  # [*] bool
    c = w.new_tensor(math.inf if clip_c is None else clip_c)
    high = torch.where(pos, w.new_tensor(1.0 + clip_eps_high), c)  # [*]
    low = torch.where(pos, w.new_tensor(0.0), w.new_tensor(1.0 - clip_eps_low))  # [*]
    flows = (w >= low) & (w < high)  # [*] bool, M
    psi_eff = z_old * (adv * torch.minimum(torch.maximum(w, low), high) + kappa)  # [*]
    values = -psi_eff * torch.where(flows, logprobs, logprobs.detach())  # [*]
    indicators = {
        "clipped_low": ~pos & (w < low),
        "clipped_high": pos & (w >= high),
        "dual_clipped": ~pos & (w >= high),
    }
    return PolicyLoss(values, _metrics(log_w, z_old * spec.value(log_w), **indicators))


def rpg_reinforce_hard_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    divergence: str,
    beta: float,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    z_old: float | Tensor = 1.0,
    validate: bool = True,
) -> PolicyLoss:
    """RPG-REINFORCE with a truncated ratio: -SG(Z (A w_bar + kappa(w_bar))) log pi_theta.

    verl's ``rpg_rf_*`` names without ``_clip_ppo`` (e.g. ``_clip_hard``): no mask, the ratio is
    clipped in the weight, so the gradient is -Z (A w_bar + kappa(w_bar)) for every token (biased:
    truncated importance sampling). Arguments as ``rpg_reinforce_clip_loss``.

    Returns:
        ``PolicyLoss``; metrics ``clipped_low`` (w < 1 - eps_low), ``clipped_high``
        (w > 1 + eps_high), ``ratio``, ``kl`` [*].
    """
    spec = _check_rpg_inputs(
        divergence,
        beta,
        z_old,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
    )
    clip_eps_low, clip_eps_high = check_clip_range(clip_eps_low, clip_eps_high, None)
    log_w = _log_ratio(logprobs.detach(), old_logprobs)  # [*], no grad
    log_w_bar = log_w.clamp(math.log1p(-clip_eps_low), math.log1p(clip_eps_high))  # [*]
    psi = z_old * (advantages.detach() * log_w_bar.exp() + beta * spec.kl_weight(log_w_bar))
    indicators = {"clipped_low": log_w < log_w_bar, "clipped_high": log_w > log_w_bar}
    return PolicyLoss(-psi * logprobs, _metrics(log_w, z_old * spec.value(log_w), **indicators))


def rpg_dual_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    divergence: str,
    beta: float,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_c: float | None = None,
    z_old: float | Tensor = 1.0,
    validate: bool = True,
) -> PolicyLoss:
    """Fully differentiable RPG with dual clip (Algorithm 1): Z * ppo_clip_loss(w, A_hat).

    A_hat = SG(psi / w) = A + SG(kappa(w) / w) is the regularized advantage (A - beta log w for
    urkl, A - beta (log w + 1) for rkl, as in Sec. 3.3). Where no clip is active the per-token
    gradient is -Z w A_hat = -Z psi, exactly ``rpg_loss``'s; with beta = 0 it is
    ``ppo_clip_loss``.

    Deviations from the paper, both deliberate: (1) A_hat is detached. Letting the gradient flow
    through A_hat, as the text of Algorithm 1 says, adds -Z w dA_hat/dlog pi per token: beta w for
    rkl/urkl (zero mean only for a normalized pi_theta) and beta for fkl/ufkl (biased). (2) fkl and
    ufkl also use A_hat = psi / w; the paper suggests plain A for them, which would leave this
    loss without a KL term.

    Arguments as ``rpg_reinforce_clip_loss`` (no ``branch_on``: the clip branches on A_hat).

    Returns:
        ``PolicyLoss``; metrics of ``ppo_clip_loss`` plus ``kl`` [*].
    """
    spec = _check_rpg_inputs(
        divergence,
        beta,
        z_old,
        validate,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
    )
    log_w = _log_ratio(logprobs.detach(), old_logprobs)  # [*], no grad
    reg_advantages = advantages.detach() + beta * spec.kl_weight(log_w) / log_w.exp()  # [*]
    ppo = ppo_clip_loss(
        logprobs,
        old_logprobs,
        reg_advantages,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        clip_c=clip_c,
        validate=False,
    )
    metrics = {**ppo.metrics, "kl": (z_old * spec.value(log_w)).detach()}
    return PolicyLoss(z_old * ppo.values, metrics)


def rpg_kl_penalty(
    logprobs: Tensor,
    anchor_logprobs: Tensor,
    *,
    divergence: str,
    max_abs_value: float | None = KL_VALUE_CLAMP,
    validate: bool = True,
) -> Tensor:
    """verl's ``kl_penalty(logprobs, anchor_logprobs, 'rpg_<divergence>')``: d(w), w = pi/pi_anchor.

    The RPG fully differentiable scripts add ``kl_loss_coef`` (here ``algorithm.loss.kl_coef``)
    times the token-mean of this to dual-clip PPO with the anchor = pi_old
    (``use_iterative_ref_model``); then it is ``rpg_loss``'s KL part. The KL term is neither
    clipped nor masked. d/dlog pi = w d'(w) = -kappa(w)/beta: -1 (fkl),
    w (log w + 1) (rkl), w - 1 (ufkl), w log w (urkl), (w log w + w - 1)/2 (ujs).

    Args:
        logprobs: [*] log pi_theta at the sampled tokens (carries the gradient).
        anchor_logprobs: [*] log pi_anchor (reference, EMA anchor or pi_old), a constant.
        divergence: one of ``DIVERGENCES``.
        max_abs_value: clamp of the value (zero gradient where active), None = off. Not applied to
            fkl, which verl leaves unclamped (log w is limited to +-LOG_RATIO_CLAMP, as everywhere
            in this module).
        validate: check the float inputs for NaN/inf (one host sync).

    Returns:
        [*] per-token penalty values.
    """
    spec = _check_rpg_inputs(divergence, 0.0, 1.0, validate, logprobs=logprobs, anchor_logprobs=anchor_logprobs)
    values = spec.value(_log_ratio(logprobs, anchor_logprobs.detach()))  # [*]
    if max_abs_value is not None and spec.value_clamped:
        values = values.clamp(-max_abs_value, max_abs_value)
    return values


def corrected_grpo_kl(
    logprobs: Tensor,
    old_logprobs: Tensor,
    anchor_logprobs: Tensor,
    *,
    max_abs_value: float | None = KL_VALUE_CLAMP,
    validate: bool = True,
) -> Tensor:
    """The paper's corrected GRPO KL term w_old k3(pi_anchor / pi_theta), w_old = pi_theta/pi_old.

    With tokens from pi_old its expectation is UKL(pi_theta || pi_anchor) and its gradient is
    exactly grad UKL(pi_theta || pi_anchor) (coefficient w_old log(pi_theta / pi_anchor)) for any
    pi_old and any anchor (fixed, EMA or reset). GRPO's k3 (``low_var_kl``) lacks w_old and even
    on-policy has the gradient of KL(pi_anchor || pi_theta). With the anchor = pi_old this equals
    ``rpg_kl_penalty(divergence="urkl")``. EMA-PG's s * K3++ (``kl.sampled_kl``) has the same value
    and gradient wherever no clamp is active.

    Clamp: the *product* is clamped to +-max_abs_value (zero gradient beyond), like the
    ``rpg_*`` terms. Clamping k3 before the multiplication (as K3++ does) would leave the
    gradient w_old * max_abs_value, whose sign is wrong where pi_theta < pi_anchor.

    Args:
        logprobs: [*] log pi_theta at the sampled tokens (carries the gradient).
        old_logprobs: [*] log pi_old of the sampler, a constant.
        anchor_logprobs: [*] log pi_anchor, a constant.
        max_abs_value: clamp of the value, None = off.
        validate: check the float inputs for NaN/inf (one host sync).

    Returns:
        [*] per-token values.
    """
    tensors = dict(logprobs=logprobs, old_logprobs=old_logprobs, anchor_logprobs=anchor_logprobs)
    check_same_shape(**tensors)
    if validate:
        check_finite(**tensors)
    w_old = _log_ratio(logprobs, old_logprobs.detach()).exp()  # [*]
    log_y = _log_ratio(anchor_logprobs.detach(), logprobs)  # [*] log(pi_anchor / pi_theta)
    values = w_old * (torch.expm1(log_y) - log_y)  # [*]
    if max_abs_value is not None:
        values = values.clamp(-max_abs_value, max_abs_value)
    return values


# KL terms of the update objective (``algorithm.loss.kl``) beside ``kl.sampled_kl`` and the Top-k
# KL: RPG's penalties d(pi / pi_anchor) (``rpg_<divergence>``) and the corrected GRPO KL.
RPG_KL_PENALTIES: dict[str, Callable[..., Tensor]] = {
    f"rpg_{name}": functools.partial(rpg_kl_penalty, divergence=name) for name in DIVERGENCES
}
RPG_KL_TERMS: dict[str, Callable[..., Tensor]] = {**RPG_KL_PENALTIES, "grpo_corrected": corrected_grpo_kl}


RPG_POLICY_LOSSES = {
    "rpg": rpg_loss,
    "rpg_reinforce": rpg_reinforce_loss,
    "rpg_reinforce_clip": rpg_reinforce_clip_loss,
    "rpg_reinforce_hard_clip": rpg_reinforce_hard_clip_loss,
    "rpg_dual_clip": rpg_dual_clip_loss,
}
