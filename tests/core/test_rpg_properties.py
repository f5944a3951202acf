"""The 22 testable properties of RPG (arXiv:2505.17508) from docs/design/rpg.md section 10.

Common setup: float64, P = 3 independent positions over a vocabulary of V = 7, random logits
theta (the policy), theta_old (the sampler) and theta_ref (a separate reference), a reward
R in R^V and beta = 0.3 (large, so that a wrong KL term shows). Column y of a [P, V] tensor means
"the sampled token was y", so an expectation under pi_old is the sum over y weighted by
sg(pi_old(y)), and its gradient is the autograd gradient of that sum. The exact objective
J_D = sum_y pi_theta(y) R(y) - beta D and D itself (KL or UKL) are computed by summation, here,
independently of ``core/``. Token-level properties use random (old_logprobs, logprobs,
advantages) tensors placed in every clip region.

Tolerance: 1e-9 absolute (exact enumeration in float64 leaves only rounding error) unless stated.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from megatron_empg.core.advantages import advantage_estimator, token_advantages
from megatron_empg.core.aggregation import aggregate, divide_by_count
from megatron_empg.core.policy_loss import PolicyLoss, ppo_clip_loss
from megatron_empg.core.rpg import (
    DIVERGENCES,
    KL_VALUE_CLAMP,
    RPG_POLICY_LOSSES,
    corrected_grpo_kl,
    rpg_dual_clip_loss,
    rpg_kl_penalty,
    rpg_loss,
    rpg_reinforce_clip_loss,
    rpg_reinforce_hard_clip_loss,
    rpg_reinforce_loss,
)

DTYPE = torch.float64
P, V = 3, 7
BETA = 0.3
EXACT = dict(atol=1e-9, rtol=0.0)  # enumeration in float64: rounding only
PAPER_DIVERGENCES = ("fkl", "rkl", "ufkl", "urkl")
CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.28, clip_c=3.0)  # (eps_l, eps_h, c) of property 13
LOSS_FORMS = {"fully_differentiable": rpg_loss, "reinforce": rpg_reinforce_loss}


# ------------------------------------------------------------------------------------------------
# Independent references.


def make_logits(seed: int, spread: float = 1.0) -> dict[str, Tensor]:
    """theta, theta_old, theta_ref [P, V] and reward [V] (float64)."""
    g = torch.Generator().manual_seed(seed)
    theta_old = torch.randn(P, V, generator=g, dtype=DTYPE)
    return {
        "theta": theta_old + spread * torch.randn(P, V, generator=g, dtype=DTYPE),
        "theta_old": theta_old,
        "theta_ref": theta_old + 0.8 * torch.randn(P, V, generator=g, dtype=DTYPE),
        "reward": torch.randn(V, generator=g, dtype=DTYPE),
    }


def kl(p: Tensor, q: Tensor) -> Tensor:
    """sum_y p log(p / q) per position [P]."""
    return (p * (p / q).log()).sum(-1)


def ukl(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalized KL: sum_y p log(p / q) + sum_y (q - p) per position [P]."""
    return kl(p, q) + (q - p).sum(-1)


def exact_divergence(divergence: str, pi: Tensor, pi_old: Tensor) -> Tensor:
    """D(pi_theta, pi_old) of docs/design/rpg.md section 2 by summation [P]; pi_old may be unnormalized."""
    return {
        "fkl": lambda: kl(pi_old, pi),
        "rkl": lambda: kl(pi, pi_old),
        "ufkl": lambda: ukl(pi_old, pi),
        "urkl": lambda: ukl(pi, pi_old),
        "ujs": lambda: 0.5 * (ukl(pi_old, pi) + ukl(pi, pi_old)),
    }[divergence]()


def grad_of(fn, theta: Tensor) -> Tensor:
    """Gradient of the scalar fn(theta) w.r.t. theta [same shape]."""
    leaf = theta.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(leaf), leaf)
    return grad


def objective_grad(case: dict[str, Tensor], divergence: str, z_old: float = 1.0, beta: float = BETA) -> Tensor:
    """grad_theta J_D = grad [sum pi_theta R - beta D(pi_theta, z_old pi_old)], summed over P."""
    pi_old = z_old * case["theta_old"].softmax(-1)

    def objective(theta: Tensor) -> Tensor:
        pi = theta.softmax(-1)
        reward_term = (pi * case["reward"]).sum(-1)  # [P]
        return (reward_term - beta * exact_divergence(divergence, pi, pi_old)).sum()

    return grad_of(objective, case["theta"])


def expected_under_old(case: dict[str, Tensor], per_token, z_old: float = 1.0, baseline=0.0):
    """E_{pi_old}[per_token(logprobs, old_logprobs, advantages)] as a function of theta.

    Every token y of the vocabulary is a sample; ``old_logprobs`` is log(z_old pi_old) and the
    tokens are weighted by the normalized pi_old.
    """
    old_logprobs = case["theta_old"].log_softmax(-1) + math.log(z_old)  # [P, V]
    weights = case["theta_old"].softmax(-1)  # [P, V], the sampler
    advantages = (case["reward"] - baseline).expand(P, V)  # [P, V]

    def expectation(theta: Tensor) -> Tensor:
        values = per_token(theta.log_softmax(-1), old_logprobs, advantages)
        values = values.values if isinstance(values, PolicyLoss) else values
        return (weights * values).sum()

    return expectation


def grad_wrt_logprobs(fn, logprobs: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
    """(values, d sum(values) / d logprobs) of a per-token function: the d/dl of docs/design/rpg.md [*]."""
    leaf = logprobs.detach().clone().requires_grad_(True)
    out = fn(leaf, *args, **kwargs)
    values = out.values if isinstance(out, PolicyLoss) else out
    (grad,) = torch.autograd.grad(values.sum(), leaf)
    return values.detach(), grad


def expected_kappa(divergence: str, w_bar: Tensor, beta: float = BETA) -> Tensor:
    """KL part of the REINFORCE weight, docs/design/rpg.md section 4.2 (L539-549 of the RPG code) [*]."""
    return {
        "fkl": lambda: beta * torch.ones_like(w_bar),
        "rkl": lambda: -beta * w_bar * (w_bar.log() + 1),
        "ufkl": lambda: beta * (1 - w_bar),
        "urkl": lambda: -beta * w_bar * w_bar.log(),
    }[divergence]()


def random_tokens(seed: int, n: int = 512, log_w_range=(-1.5, 1.5)) -> dict[str, Tensor]:
    """Token-level inputs: old_logprobs, logprobs (log w uniform in the range), advantages [n]."""
    g = torch.Generator().manual_seed(seed)
    old_logprobs = -0.1 - 4 * torch.rand(n, generator=g, dtype=DTYPE)
    low, high = log_w_range
    log_w = low + (high - low) * torch.rand(n, generator=g, dtype=DTYPE)
    advantages = torch.randn(n, generator=g, dtype=DTYPE)
    return dict(logprobs=old_logprobs + log_w, old_logprobs=old_logprobs, advantages=advantages)


# Bands of w, one per region of (eps_l, eps_h, c) = (0.2, 0.28, 3), away from the boundaries:
# w < 0.8, inside [0.8, 1.28], between 1.28 and c = 3, above c.
REGION_BANDS = ((0.5, 0.78), (0.82, 1.26), (1.3, 2.9), (3.1, 6.0))


def region_tokens(seed: int, per_region: int = 96) -> dict[str, Tensor]:
    """Tokens with 25% of w in each band of ``REGION_BANDS``; A of both signs, 1/8 exactly 0."""
    g = torch.Generator().manual_seed(seed)
    n = per_region * len(REGION_BANDS)
    u = torch.rand(len(REGION_BANDS), per_region, generator=g, dtype=DTYPE)
    log_low, log_high = torch.tensor(REGION_BANDS, dtype=DTYPE).log().unbind(-1)  # [4] each
    log_w = (log_low[:, None] + (log_high - log_low)[:, None] * u).flatten()  # [n]
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(DTYPE)
    advantages = sign * (0.05 + 1.5 * torch.rand(n, generator=g, dtype=DTYPE))
    advantages[::8] = 0.0
    old_logprobs = -0.1 - 4 * torch.rand(n, generator=g, dtype=DTYPE)
    return dict(logprobs=old_logprobs + log_w, old_logprobs=old_logprobs, advantages=advantages)


def token_mean(values: Tensor) -> Tensor:
    """The project's token-mean over a 1-D token tensor (all tokens unmasked) []."""
    loss_sum, count = aggregate(values[None, :], torch.ones(1, values.numel(), dtype=torch.bool))
    return divide_by_count(loss_sum, count)


def token_mean_grad(loss_fn, logprobs: Tensor, *args, **kwargs) -> Tensor:
    """d token-mean(loss_fn(logprobs, *args, **kwargs).values) / d logprobs [*]."""
    return grad_of(lambda t: token_mean(loss_fn(t, *args, **kwargs).values), logprobs)


# ------------------------------------------------------------------------------------------------
# 1-4: exact gradients of the eight surrogates.


@pytest.mark.parametrize("baseline", [0.0, 0.7])
@pytest.mark.parametrize("divergence", [*PAPER_DIVERGENCES, "ujs"])
def test_p01_exact_gradient_fully_differentiable(divergence, baseline):
    case = make_logits(seed=1)
    expected_grad = -objective_grad(case, divergence)
    loss = partial(rpg_loss, divergence=divergence, beta=BETA)
    actual_grad = grad_of(expected_under_old(case, loss, baseline=baseline), case["theta"])
    assert_close(actual_grad, expected_grad, **EXACT)
    assert expected_grad.abs().max() > 1e-2  # not a trivial 0 = 0


@pytest.mark.parametrize("baseline", [0.0, 0.7])
@pytest.mark.parametrize("divergence", [*PAPER_DIVERGENCES, "ujs"])
def test_p02_exact_gradient_reinforce(divergence, baseline):
    case = make_logits(seed=2)
    expected_grad = -objective_grad(case, divergence)
    loss = partial(rpg_reinforce_loss, divergence=divergence, beta=BETA)
    actual_grad = grad_of(expected_under_old(case, loss, baseline=baseline), case["theta"])
    assert_close(actual_grad, expected_grad, **EXACT)


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p03_per_sample_equivalence_for_any_w(divergence):
    # Per sampled token y (a row of the Jacobian d loss(y) / d theta), for any w, including w = 1.
    case = make_logits(seed=3)
    old_logprobs = case["theta_old"].log_softmax(-1)
    advantages = case["reward"].expand(P, V)
    kw = dict(divergence=divergence, beta=BETA)

    def per_token_jacobian(loss_fn, theta):
        return torch.autograd.functional.jacobian(
            lambda t: loss_fn(t.log_softmax(-1), old_logprobs, advantages, **kw).values, theta
        )  # [P, V, P, V]

    for theta in (case["theta"], case["theta_old"]):  # w arbitrary, then w = 1 exactly
        expected_jac = per_token_jacobian(rpg_loss, theta)
        actual_jac = per_token_jacobian(rpg_reinforce_loss, theta)
        assert_close(actual_jac, expected_jac, **EXACT)
    # ... and both equal the closed form d/dl = -(A w + kappa(w)) of docs/design/rpg.md section 2 (token level).
    tokens = random_tokens(seed=3)
    tokens["logprobs"][:16] = tokens["old_logprobs"][:16]  # w = 1 exactly
    w = (tokens["logprobs"] - tokens["old_logprobs"]).exp()
    expected_dl = -(tokens["advantages"] * w + expected_kappa(divergence, w))
    for loss_fn in (rpg_loss, rpg_reinforce_loss):
        _, actual_dl = grad_wrt_logprobs(
            loss_fn, tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"], **kw
        )
        assert_close(actual_dl, expected_dl, **EXACT)


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("divergence", ["ufkl", "urkl"])
def test_p04_z_old_unnormalized_measure(divergence, form):
    # m = Z pi_old with Z = 2.7; w = pi_theta / m; tokens from pi_old = m / Z.
    z_old = 2.7
    case = make_logits(seed=4)
    expected_grad = -objective_grad(case, divergence, z_old=z_old)  # uses UKL(m || pi) / (pi || m)
    loss = partial(LOSS_FORMS[form], divergence=divergence, beta=BETA, z_old=z_old)
    actual_grad = grad_of(expected_under_old(case, loss, z_old=z_old), case["theta"])
    assert_close(actual_grad, expected_grad, **EXACT)
    # Z matters: ignoring it (z_old=1 with the same unnormalized old_logprobs) is wrong.
    loss_z1 = partial(LOSS_FORMS[form], divergence=divergence, beta=BETA)
    wrong_grad = grad_of(expected_under_old(case, loss_z1, z_old=z_old), case["theta"])
    assert (wrong_grad - expected_grad).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------
# 5-11: the per-token KL terms.


@pytest.mark.parametrize("mass", [1.0, 2.7])
def test_p05_k3_equals_ukl(mass):
    case = make_logits(seed=5)
    logprobs = case["theta"].log_softmax(-1)
    m_logprobs = case["theta_old"].log_softmax(-1) + math.log(mass)  # log m, m = mass * pi_old
    pi, m = logprobs.exp(), m_logprobs.exp()
    # Forward: sum_y m k3(pi / m) = UKL(m || pi); rpg_ufkl is k3(w), w = pi / m.
    k3_forward = rpg_kl_penalty(logprobs, m_logprobs, divergence="ufkl", max_abs_value=None)
    actual_forward = (m * k3_forward).sum(-1)
    assert_close(actual_forward, ukl(m, pi), **EXACT)
    # Reverse: sum_y pi k3(m / pi) = UKL(pi || m); the corrected GRPO term with pi_old = pi_theta
    # (w_old = 1) is k3(pi_anchor / pi_theta).
    k3_reverse = corrected_grpo_kl(logprobs, logprobs, m_logprobs, max_abs_value=None)
    actual_reverse = (pi * k3_reverse).sum(-1)
    assert_close(actual_reverse, ukl(pi, m), **EXACT)
    if mass == 1.0:  # normalized: UKL = KL
        assert_close(actual_forward, kl(m, pi), **EXACT)
        assert_close(actual_reverse, kl(pi, m), **EXACT)


def test_p06_pointwise_identities():
    tokens = random_tokens(seed=6, log_w_range=(-2.0, 1.5))  # every value inside the +-10 clamp
    logprobs, old_logprobs = tokens["logprobs"], tokens["old_logprobs"]
    w = (logprobs - old_logprobs).exp()
    k3, k3_inv = w - 1 - w.log(), 1 / w - 1 - (1 / w).log()  # k3(w), k3(1/w)
    expected = {"ufkl": k3, "urkl": w * k3_inv, "rkl": w * w.log(), "fkl": -w.log()}
    for divergence, expected_values in expected.items():
        actual_values = rpg_kl_penalty(logprobs, old_logprobs, divergence=divergence)
        assert expected_values.abs().max() < KL_VALUE_CLAMP
        assert_close(actual_values, expected_values, atol=1e-12, rtol=0.0)


def test_p07_grpo_correction():
    from megatron_empg.core.kl import sampled_kl

    case = make_logits(seed=7)
    ref_logprobs = case["theta_ref"].log_softmax(-1)
    old_logprobs = case["theta_old"].log_softmax(-1)
    weights = old_logprobs.exp()
    pi_ref = ref_logprobs.exp()
    expected_grad = grad_of(lambda t: ukl(t.softmax(-1), pi_ref).sum(), case["theta"])
    unclamped = corrected_grpo_kl(case["theta"].log_softmax(-1), old_logprobs, ref_logprobs, max_abs_value=None)
    assert unclamped.abs().max() < KL_VALUE_CLAMP  # the clamp (tested in p10) is inactive here

    def corrected(theta):
        values = corrected_grpo_kl(theta.log_softmax(-1), old_logprobs, ref_logprobs)
        return (weights * values).sum()

    def uncorrected(theta):
        return (weights * sampled_kl(theta.log_softmax(-1), ref_logprobs, estimator="k3")).sum()

    assert_close(grad_of(corrected, case["theta"]), expected_grad, **EXACT)
    # GRPO's uncorrected k3 (low_var_kl) under the same pi_old samples is not that gradient.
    assert (grad_of(uncorrected, case["theta"]) - expected_grad).abs().max() > 1e-2
    # On-policy (pi_old = sg(pi_theta)): uncorrected -> grad KL(pi_ref || pi), corrected -> grad
    # KL(pi || pi_ref); the two differ.
    forward_grad = grad_of(lambda t: kl(pi_ref, t.softmax(-1)).sum(), case["theta"])
    reverse_grad = grad_of(lambda t: kl(t.softmax(-1), pi_ref).sum(), case["theta"])

    def on_policy(estimate):
        def expectation(theta):
            logprobs = theta.log_softmax(-1)
            return (logprobs.exp().detach() * estimate(logprobs)).sum()

        return grad_of(expectation, case["theta"])

    actual_uncorrected = on_policy(lambda l: sampled_kl(l, ref_logprobs, estimator="k3"))
    actual_corrected = on_policy(lambda l: corrected_grpo_kl(l, l.detach(), ref_logprobs))
    assert_close(actual_uncorrected, forward_grad, **EXACT)
    assert_close(actual_corrected, reverse_grad, **EXACT)
    assert (forward_grad - reverse_grad).abs().max() > 1e-2


def test_p08_normalized_vs_unnormalized():
    case = make_logits(seed=8)
    grads = {}
    for divergence in PAPER_DIVERGENCES:
        loss = partial(rpg_loss, divergence=divergence, beta=BETA)
        grads[divergence] = grad_of(expected_under_old(case, loss), case["theta"])
    assert_close(grads["ufkl"], grads["fkl"], **EXACT)
    assert_close(grads["urkl"], grads["rkl"], **EXACT)
    # Per sample the KL parts differ: -beta (fkl) vs beta (w - 1) (ufkl) per d/dl.
    tokens = random_tokens(seed=8)
    zero_advantages = torch.zeros_like(tokens["advantages"])
    w = (tokens["logprobs"] - tokens["old_logprobs"]).exp()
    per_sample = {}
    for divergence in ("fkl", "ufkl"):
        _, per_sample[divergence] = grad_wrt_logprobs(
            rpg_loss,
            tokens["logprobs"],
            tokens["old_logprobs"],
            zero_advantages,
            divergence=divergence,
            beta=BETA,
        )
    assert_close(per_sample["fkl"], torch.full_like(w, -BETA), **EXACT)
    assert_close(per_sample["ufkl"], BETA * (w - 1), **EXACT)
    assert (per_sample["fkl"] - per_sample["ufkl"]).abs().min() > 0


def test_p09_at_w_equal_one():
    case = make_logits(seed=9)
    old_logprobs = case["theta_old"].log_softmax(-1)
    weights = old_logprobs.exp()
    expected_dl = {"fkl": -1.0, "rkl": 1.0, "ufkl": 0.0, "urkl": 0.0, "ujs": 0.0}
    for divergence, dl in expected_dl.items():
        values, actual_dl = grad_wrt_logprobs(
            rpg_kl_penalty, old_logprobs, old_logprobs, divergence=divergence
        )  # logprobs == old_logprobs: w = 1
        assert torch.equal(values, torch.zeros_like(values))
        assert_close(actual_dl, torch.full_like(actual_dl, dl), **EXACT)
        penalty = partial(rpg_kl_penalty, anchor_logprobs=old_logprobs, divergence=divergence)
        expected_penalty = lambda t: (weights * penalty(t.log_softmax(-1))).sum()  # noqa: E731
        actual_grad = grad_of(expected_penalty, case["theta_old"])
        assert_close(actual_grad, torch.zeros_like(actual_grad), **EXACT)


def _low_var_kl(logprobs, anchor_logprobs):
    from megatron_empg.core.kl import sampled_kl

    return sampled_kl(logprobs, anchor_logprobs, estimator="k3")


CLAMPED_TERMS = {
    "rpg_rkl": lambda l, a, **kw: rpg_kl_penalty(l, a, divergence="rkl", **kw),
    "rpg_ufkl": lambda l, a, **kw: rpg_kl_penalty(l, a, divergence="ufkl", **kw),
    "rpg_urkl": lambda l, a, **kw: rpg_kl_penalty(l, a, divergence="urkl", **kw),
    "rpg_ujs": lambda l, a, **kw: rpg_kl_penalty(l, a, divergence="ujs", **kw),
    # corrected GRPO term with w_old = 1 (old_logprobs = logprobs detached).
    "corrected_grpo_kl": lambda l, a, **kw: corrected_grpo_kl(l, l.detach(), a, **kw),
}


@pytest.mark.parametrize("term", [*CLAMPED_TERMS, "low_var_kl"])
def test_p10_clamp_zeroes_gradient(term):
    tokens = random_tokens(seed=10, n=2048, log_w_range=(-15.0, 15.0))
    logprobs, anchor_logprobs = tokens["logprobs"], tokens["old_logprobs"]
    fn = _low_var_kl if term == "low_var_kl" else CLAMPED_TERMS[term]
    values, dl = grad_wrt_logprobs(fn, logprobs, anchor_logprobs)
    if term == "low_var_kl":
        log_y = anchor_logprobs - logprobs
        unclamped = log_y.exp() - log_y - 1
    else:
        unclamped, _ = grad_wrt_logprobs(fn, logprobs, anchor_logprobs, max_abs_value=None)
    outside = unclamped.abs() > KL_VALUE_CLAMP
    assert 0.1 < outside.double().mean() < 0.9  # both kinds of token are present
    assert torch.equal(dl[outside], torch.zeros_like(dl[outside]))
    assert_close(values[outside], unclamped[outside].clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP))
    assert (dl[~outside] != 0).all()
    if term != "low_var_kl":  # the clamp can be switched off
        _, dl_off = grad_wrt_logprobs(fn, logprobs, anchor_logprobs, max_abs_value=None)
        assert (dl_off[outside] != 0).all()


def test_p10_rpg_fkl_is_unclamped():
    tokens = random_tokens(seed=10, n=256, log_w_range=(-15.0, 15.0))
    values, dl = grad_wrt_logprobs(rpg_kl_penalty, tokens["logprobs"], tokens["old_logprobs"], divergence="fkl")
    expected_values = tokens["old_logprobs"] - tokens["logprobs"]  # -log w, up to +-15
    assert expected_values.abs().max() > 2 * KL_VALUE_CLAMP - 6
    assert_close(values, expected_values, atol=1e-12, rtol=0.0)
    assert_close(dl, torch.full_like(dl, -1.0), **EXACT)


def test_p11_kl_term_derivative_table():
    # docs/design/rpg.md section 5 table, token by token inside the clamp. rpg_js (a bug, not in the paper) is
    # not implemented; low_var_kl and kl come from core/kl.py.
    from megatron_empg.core.kl import sampled_kl

    tokens = random_tokens(seed=11, log_w_range=(-2.0, 1.5))
    logprobs, anchor_logprobs = tokens["logprobs"], tokens["old_logprobs"]
    w = (logprobs - anchor_logprobs).exp()
    expected_dl = {
        "rpg_fkl": -torch.ones_like(w),
        "rpg_rkl": w * (w.log() + 1),
        "rpg_ufkl": w - 1,
        "rpg_urkl": w * w.log(),
        "rpg_ujs": 0.5 * (w * w.log() + w - 1),
        "low_var_kl": 1 - 1 / w,  # 1 - pi_ref / pi_theta
        "kl": torch.ones_like(w),
    }
    terms = {f"rpg_{d}": lambda l, a, d=d: rpg_kl_penalty(l, a, divergence=d) for d in DIVERGENCES}
    terms["low_var_kl"] = lambda l, a: sampled_kl(l, a, estimator="k3")
    terms["kl"] = lambda l, a: sampled_kl(l, a, estimator="k1")
    assert set(terms) == set(expected_dl)
    for name, fn in terms.items():
        _, actual_dl = grad_wrt_logprobs(fn, logprobs, anchor_logprobs)
        assert_close(actual_dl, expected_dl[name], **EXACT, msg=name)


# ------------------------------------------------------------------------------------------------
# 12-16: RPG-Style Clip and the hard clip, token level.


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p12_no_clip_equivalence(divergence):
    # eps_l -> 1, eps_h and c -> 1e6: dual-clip PPO(A) + beta * token-mean(D_t) (what the RPG
    # scripts run) has the gradient of RPG-Style-Clip REINFORCE.
    no_clip = dict(clip_eps_low=1 - 1e-6, clip_eps_high=1e6, clip_c=1e6)
    tokens = random_tokens(seed=12)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]

    def scripts_loss(logprobs):
        pg = token_mean(ppo_clip_loss(logprobs, lo, a, **no_clip).values)
        return pg + BETA * token_mean(rpg_kl_penalty(logprobs, lo, divergence=divergence))

    def style_clip_loss(logprobs):
        values = rpg_reinforce_clip_loss(logprobs, lo, a, divergence=divergence, beta=BETA, **no_clip).values
        return token_mean(values)

    assert_close(grad_of(style_clip_loss, l), grad_of(scripts_loss, l), **EXACT)


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p13_beta_zero_style_clip_is_dual_clip_ppo(divergence):
    tokens = region_tokens(seed=13)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]
    _, expected_dl = grad_wrt_logprobs(ppo_clip_loss, l, lo, a, **CLIP)
    style = rpg_reinforce_clip_loss(l, lo, a, divergence=divergence, beta=0.0, **CLIP)
    _, actual_dl = grad_wrt_logprobs(rpg_reinforce_clip_loss, l, lo, a, divergence=divergence, beta=0.0, **CLIP)
    assert_close(actual_dl, expected_dl, **EXACT)
    ppo_metrics = ppo_clip_loss(l, lo, a, **CLIP).metrics
    nonzero = a != 0  # A = 0 tokens take the style clip's negative branch; PPO counts A < 0 only
    for name in ("clipped_low", "clipped_high", "dual_clipped", "ratio"):
        assert_close(style.metrics[name][nonzero], ppo_metrics[name][nonzero], **EXACT, msg=name)
    for name in ("clipped_low", "clipped_high", "dual_clipped"):
        assert 0 < ppo_metrics[name].mean() < 0.5, name  # every region is exercised


def style_clip_mask(w: Tensor, positive: Tensor) -> Tensor:
    """M of docs/design/rpg.md section 4.2: [pos and w < 1+eps_h] or [not pos and 1-eps_l <= w < c]."""
    eps_low, eps_high, c = CLIP["clip_eps_low"], CLIP["clip_eps_high"], CLIP["clip_c"]
    return (positive & (w < 1 + eps_high)) | (~positive & (w >= 1 - eps_low) & (w < c))


@pytest.mark.parametrize("branch_on", ["advantage", "regularized_advantage"])
@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p14_style_clip_mask_formula(divergence, branch_on):
    tokens = region_tokens(seed=14)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]
    w = (l - lo).exp()
    w_bar = w.clamp(1 - CLIP["clip_eps_low"], 1 + CLIP["clip_eps_high"])
    kappa = expected_kappa(divergence, w_bar)
    code_positive = a > 0  # verl's *_clip_ppo: sign of A; A = 0 takes the negative branch
    algorithm2_positive = a + kappa / w >= 0  # Algorithm 2: sign of A' = A + kappa / w
    positive = code_positive if branch_on == "advantage" else algorithm2_positive
    assert (code_positive != algorithm2_positive).any()  # the two options differ on this data
    mask = style_clip_mask(w, positive).to(DTYPE)
    expected_dl = -(a * w + kappa) * mask / w.numel()
    actual_dl = token_mean_grad(
        rpg_reinforce_clip_loss,
        l,
        lo,
        a,
        divergence=divergence,
        beta=BETA,
        branch_on=branch_on,
        **CLIP,
    )
    assert_close(actual_dl, expected_dl, **EXACT)


def test_p14_style_clip_mask_next_to_region_boundaries():
    # w = b (1 +- 1e-7) at each boundary b of (eps_l, eps_h, c) = (0.2, 0.28, 3), A in {1, 0, -1}.
    bounds = torch.tensor([0.8, 1.28, 3.0], dtype=DTYPE)
    w_target = torch.cat([bounds * (1 - 1e-7), bounds * (1 + 1e-7)]).repeat(3)  # [18]
    a = torch.tensor([1.0, 0.0, -1.0], dtype=DTYPE).repeat_interleave(6)  # [18]
    lo = torch.full_like(w_target, -2.0)
    l = lo + w_target.log()
    w = (l - lo).exp()
    w_bar = w.clamp(1 - CLIP["clip_eps_low"], 1 + CLIP["clip_eps_high"])
    expected_dl = -(a * w + expected_kappa("urkl", w_bar)) * style_clip_mask(w, a > 0).to(DTYPE)
    _, actual_dl = grad_wrt_logprobs(rpg_reinforce_clip_loss, l, lo, a, divergence="urkl", beta=BETA, **CLIP)
    assert_close(actual_dl, expected_dl, **EXACT)


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p15_hard_clip_formula(divergence):
    tokens = region_tokens(seed=15)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]
    w_bar = (l - lo).exp().clamp(1 - CLIP["clip_eps_low"], 1 + CLIP["clip_eps_high"])
    expected_dl = -(a * w_bar + expected_kappa(divergence, w_bar)) / l.numel()
    hard_clip = dict(clip_eps_low=CLIP["clip_eps_low"], clip_eps_high=CLIP["clip_eps_high"])
    actual_dl = token_mean_grad(rpg_reinforce_hard_clip_loss, l, lo, a, divergence=divergence, beta=BETA, **hard_clip)
    assert_close(actual_dl, expected_dl, **EXACT)


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p16_zero_advantage_tokens(divergence):
    tokens = region_tokens(seed=16)
    l, lo = tokens["logprobs"], tokens["old_logprobs"]
    a = torch.zeros_like(l)
    w = (l - lo).exp()
    w_bar = w.clamp(1 - CLIP["clip_eps_low"], 1 + CLIP["clip_eps_high"])
    inside = (w >= 1 - CLIP["clip_eps_low"]) & (w < CLIP["clip_c"])
    expected_dl = torch.where(inside, -expected_kappa(divergence, w_bar), torch.zeros_like(w))
    _, actual_dl = grad_wrt_logprobs(rpg_reinforce_clip_loss, l, lo, a, divergence=divergence, beta=BETA, **CLIP)
    assert_close(actual_dl, expected_dl, **EXACT)
    assert 0.2 < inside.double().mean() < 0.8


# ------------------------------------------------------------------------------------------------
# 17-20: advantage, aggregation, iterative reference, EMA limits (pieces other modules own).


def test_p17_advantage():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.5, -0.25, 3.0], dtype=DTYPE)
    group_ids = torch.tensor([7, 7, 7, 2, 2, 2, 9])  # groups of 3, 3 and a singleton
    actual = advantage_estimator("rpg")(rewards, group_ids)
    # A_i = R_i - mean_group(R), no std scaling. Group 7: mean -1/3; group 2: mean 5/12.
    expected = torch.tensor([4 / 3, -2 / 3, -2 / 3, 7 / 12, 1 / 12, -2 / 3, 3.0], dtype=DTYPE)
    # The singleton (id 9) has baseline 0, so A = R (RPG code and docs/design/rpg.md property 17).
    assert_close(actual, expected, **EXACT)
    for gid in (7, 2):
        assert_close(actual[group_ids == gid].sum(), torch.zeros((), dtype=DTYPE), **EXACT)
    loss_mask = torch.tensor([[True, True, False]] * 7)
    per_token = token_advantages(actual, loss_mask)  # broadcast over the masked tokens
    assert_close(per_token, torch.where(loss_mask, actual[:, None], 0.0), **EXACT)
    batch_mean = advantage_estimator("rpg_batchmean")(rewards, group_ids)
    assert_close(batch_mean, rewards - rewards.sum() / 7, **EXACT)


def test_p18_aggregation_and_padding():
    tokens = random_tokens(seed=18, n=4 * 6)
    l, lo, a = (tokens[k].reshape(4, 6) for k in ("logprobs", "old_logprobs", "advantages"))
    loss_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]).bool()
    l = torch.where(loss_mask, l, 50.0)  # garbage log-probs on padding must not matter
    values = rpg_reinforce_clip_loss(l, lo, a, divergence="urkl", beta=BETA, **CLIP).values
    m = loss_mask.to(DTYPE)
    n_seq = 3  # sequences with at least one token
    expected = {
        "token-mean": (m * values).sum() / m.sum(),
        "seq-mean-token-mean": ((m * values).sum(1) / m.sum(1).clamp(min=1)).sum() / n_seq,
        "seq-mean-token-sum": (m * values).sum(1).sum() / n_seq,
    }
    for mode, expected_loss in expected.items():

        def loss(logprobs, mode=mode):
            out = rpg_reinforce_clip_loss(logprobs, lo, a, divergence="urkl", beta=BETA, **CLIP)
            return divide_by_count(*aggregate(out.values, loss_mask, mode))

        assert_close(loss(l), expected_loss, **EXACT, msg=mode)
        grad = grad_of(loss, l)
        assert torch.equal(grad[~loss_mask], torch.zeros_like(grad[~loss_mask])), mode
        assert (grad[loss_mask] != 0).any(), mode


def _softmax_policy_step(policy: torch.nn.Parameter, seed: int) -> None:
    """One SGD step on a random linear loss of the policy's log-probs (moves the policy)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(policy.shape, generator=g)
    loss = (policy.log_softmax(-1) * target).sum()
    (grad,) = torch.autograd.grad(loss, policy)
    with torch.no_grad():
        policy -= 0.5 * grad


def test_p19_iterative_reference_is_old_policy():
    from megatron_empg.core.ema import ema_update_

    g = torch.Generator().manual_seed(19)
    policy = torch.nn.Parameter(torch.randn(P, V, generator=g))  # float32 logits
    anchor = policy.detach().clone()
    for step in range(1, 4):
        old_logprobs = policy.detach().log_softmax(-1)  # recomputed at the start of the step
        anchor_logprobs = anchor.log_softmax(-1)
        assert torch.equal(anchor_logprobs, old_logprobs), step  # ref_logp is bitwise old_logp
        _softmax_policy_step(policy, seed=step)
        ema_update_([anchor], [policy.detach()], tau=0.0)  # period 1
    # With the anchor = pi_old, rpg_urkl is w k3(pi_old / pi_theta) (the corrected GRPO term).
    tokens = random_tokens(seed=19, log_w_range=(-2.0, 1.5))
    l, lo = tokens["logprobs"], tokens["old_logprobs"]
    w = (l - lo).exp()
    expected_values = w * (1 / w - 1 - (1 / w).log())
    actual_urkl = rpg_kl_penalty(l, lo, divergence="urkl")
    actual_corrected = corrected_grpo_kl(l, lo, lo)
    assert_close(actual_urkl, expected_values, atol=1e-12, rtol=0.0)
    assert_close(actual_corrected, actual_urkl, atol=1e-12, rtol=0.0)
    _, dl_urkl = grad_wrt_logprobs(rpg_kl_penalty, l, lo, divergence="urkl")
    _, dl_corrected = grad_wrt_logprobs(corrected_grpo_kl, l, lo, lo)
    assert_close(dl_corrected, dl_urkl, atol=1e-12, rtol=0.0)


def test_p20_ema_limits():
    from megatron_empg.core.ema import ema_update_

    g = torch.Generator().manual_seed(20)
    initial = torch.randn(P, V, generator=g)
    policy = torch.nn.Parameter(initial.clone())
    _softmax_policy_step(policy, seed=20)
    moved = policy.detach().clone()
    assert not torch.equal(moved, initial)
    anchor = initial.clone()
    ema_update_([anchor], [moved], tau=0.0)
    assert torch.equal(anchor, moved)  # and so anchor logp = old logp at the next step (p19)
    assert torch.equal(anchor.log_softmax(-1), moved.log_softmax(-1))
    anchor = initial.clone()
    ema_update_([anchor], [moved], tau=1.0)
    assert torch.equal(anchor, initial)
    anchor = initial.clone()
    ema_update_([anchor], [moved], tau=0.5)
    expected_average = 0.5 * (initial.double() + moved.double())
    # One float32 rounding of the exact average: 2^-24 relative, values are O(1).
    assert_close(anchor.double(), expected_average, atol=1e-6, rtol=0.0)


# ------------------------------------------------------------------------------------------------
# 21: EMA-PG estimators <-> RPG terms.


def test_p21_ema_pg_correspondence():
    from megatron_empg.core.kl import sampled_kl

    tokens = random_tokens(seed=21, log_w_range=(-1.0, 1.0))
    l, lo = tokens["logprobs"], tokens["old_logprobs"]
    g = torch.Generator().manual_seed(21)
    ref = l.detach() + 0.8 * torch.randn(l.shape, generator=g, dtype=DTYPE)  # k3 stays < 10

    def s_k(estimator, anchor):
        return lambda t: sampled_kl(t, anchor, estimator=estimator, old_logprobs=lo)

    # s K3++ == w k3(pi_ref / pi_theta): value and per-token gradient.
    value_k3pp, dl_k3pp = grad_wrt_logprobs(s_k("k3pp", ref), l)
    value_corrected, dl_corrected = grad_wrt_logprobs(corrected_grpo_kl, l, lo, ref)
    assert value_corrected.abs().max() < KL_VALUE_CLAMP
    assert_close(value_k3pp, value_corrected, **EXACT)
    assert_close(dl_k3pp, dl_corrected, **EXACT)
    # grad K4 == grad K3++ per token.
    _, dl_k4 = grad_wrt_logprobs(s_k("k4", ref), l)
    assert_close(dl_k4, dl_k3pp, **EXACT)
    # With pi_ref = pi_old: grad(s K5) == grad rpg_ufkl and value(s K5) == -log w (rpg_fkl).
    value_k5, dl_k5 = grad_wrt_logprobs(s_k("k5", lo), l)
    value_fkl = rpg_kl_penalty(l, lo, divergence="fkl")
    _, dl_ufkl = grad_wrt_logprobs(rpg_kl_penalty, l, lo, divergence="ufkl")
    assert_close(value_k5, value_fkl, **EXACT)
    assert_close(dl_k5, dl_ufkl, **EXACT)


# ------------------------------------------------------------------------------------------------
# 22: Monte Carlo.

MC_SAMPLES = 200_000
MC_SIGMAS = 4.0


def mc_gradient(case, loss_fn, samples: Tensor, baseline: float, **kwargs) -> tuple[Tensor, Tensor]:
    """Mean and standard error of per-sample gradients d loss(x_i) / d theta, x_i ~ pi_old [V].

    Single position (row 0). Per sample: (d loss / d logprob) * (onehot(x_i) - pi_theta).
    """
    theta, theta_old = case["theta"][0], case["theta_old"][0]
    logprobs_all = theta.log_softmax(-1)  # [V]
    logprobs = logprobs_all[samples]  # [N]
    old_logprobs = theta_old.log_softmax(-1)[samples]  # [N]
    advantages = case["reward"][samples] - baseline  # [N]
    _, dl = grad_wrt_logprobs(loss_fn, logprobs, old_logprobs, advantages, **kwargs)  # [N]
    onehot = torch.nn.functional.one_hot(samples, V).to(DTYPE)  # [N, V]
    per_sample = dl[:, None] * (onehot - logprobs_all.exp()[None, :])  # [N, V]
    return per_sample.mean(0), per_sample.std(0) / math.sqrt(len(samples))


def mc_case(seed: int, spread: float) -> tuple[dict[str, Tensor], Tensor]:
    case = make_logits(seed, spread=spread)
    g = torch.Generator().manual_seed(seed)
    samples = torch.multinomial(case["theta_old"][0].softmax(-1), MC_SAMPLES, True, generator=g)
    return case, samples


def single_position_objective_grad(case, divergence, beta=BETA):
    row0 = {**case, "theta": case["theta"][:1], "theta_old": case["theta_old"][:1]}
    return objective_grad(row0, divergence, beta=beta)[0]


@pytest.mark.parametrize("baseline", [0.0, 0.5])
@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p22_monte_carlo_reinforce(divergence, baseline):
    case, samples = mc_case(seed=22, spread=0.5)
    expected_grad = -single_position_objective_grad(case, divergence)
    mean, stderr = mc_gradient(case, rpg_reinforce_loss, samples, baseline, divergence=divergence, beta=BETA)
    assert (stderr > 0).all()
    assert ((mean - expected_grad).abs() <= MC_SIGMAS * stderr).all(), (mean, expected_grad, stderr)


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_p22_monte_carlo_style_clip_inside_trust_region(divergence):
    # Near pi_old the KL gradient is small, so beta = 2 here: then a KL weight off by 50% is
    # already more than 4 sigma away for every divergence (checked when writing this test).
    beta = 2.0
    case, samples = mc_case(seed=122, spread=0.1)
    w = (case["theta"][0].log_softmax(-1) - case["theta_old"][0].log_softmax(-1)).exp()
    assert ((w > 1 - CLIP["clip_eps_low"]) & (w < 1 + CLIP["clip_eps_high"])).all()
    expected_grad = -single_position_objective_grad(case, divergence, beta=beta)
    mean, stderr = mc_gradient(case, rpg_reinforce_clip_loss, samples, 0.3, divergence=divergence, beta=beta, **CLIP)
    assert ((mean - expected_grad).abs() <= MC_SIGMAS * stderr).all(), (mean, expected_grad, stderr)


# ------------------------------------------------------------------------------------------------
# Beyond section 10: Algorithm 1, the registry, and the input contract.


@pytest.mark.parametrize("divergence", PAPER_DIVERGENCES)
def test_algorithm1_dual_clip_gradient(divergence):
    # Unclipped: the gradient of rpg_loss. Clipped: -Z w A_hat on PPO's mask for A_hat = psi / w.
    tokens = region_tokens(seed=23)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]
    kw = dict(divergence=divergence, beta=BETA)
    no_clip = dict(clip_eps_low=1 - 1e-9, clip_eps_high=1e9, clip_c=None)
    _, expected_dl = grad_wrt_logprobs(rpg_loss, l, lo, a, **kw)
    _, actual_dl = grad_wrt_logprobs(rpg_dual_clip_loss, l, lo, a, **kw, **no_clip)
    assert_close(actual_dl, expected_dl, **EXACT)
    w = (l - lo).exp()
    reg_advantages = a + expected_kappa(divergence, w) / w
    positive = reg_advantages > 0
    flows = (positive & (w < 1 + CLIP["clip_eps_high"])) | (
        (reg_advantages < 0) & (w > 1 - CLIP["clip_eps_low"]) & (w < CLIP["clip_c"])
    )
    expected_clipped_dl = torch.where(flows, -w * reg_advantages, torch.zeros_like(w))
    _, actual_clipped_dl = grad_wrt_logprobs(rpg_dual_clip_loss, l, lo, a, **kw, **CLIP)
    assert_close(actual_clipped_dl, expected_clipped_dl, **EXACT)
    _, ppo_dl = grad_wrt_logprobs(ppo_clip_loss, l, lo, a, **CLIP)
    _, beta0_dl = grad_wrt_logprobs(rpg_dual_clip_loss, l, lo, a, divergence=divergence, beta=0.0, **CLIP)
    assert_close(beta0_dl, ppo_dl, **EXACT)


@pytest.mark.parametrize("name", RPG_POLICY_LOSSES)
def test_registry_contract(name):
    # float32 in, float32 per-token values and detached float metrics of the same shape out.
    tokens = {k: v.float().reshape(8, -1) for k, v in region_tokens(seed=24, per_region=16).items()}
    out = RPG_POLICY_LOSSES[name](**tokens, divergence="ufkl", beta=BETA, z_old=2.0)
    assert isinstance(out, PolicyLoss)
    assert out.values.shape == (8, 8) and out.values.dtype == torch.float32
    assert {"ratio", "kl"} <= set(out.metrics)
    for metric in out.metrics.values():
        assert metric.shape == (8, 8) and metric.dtype == torch.float32 and not metric.requires_grad


def test_z_old_scales_every_form():
    tokens = region_tokens(seed=25)
    l, lo, a = tokens["logprobs"], tokens["old_logprobs"], tokens["advantages"]
    for name, fn in RPG_POLICY_LOSSES.items():
        _, dl_1 = grad_wrt_logprobs(fn, l, lo, a, divergence="urkl", beta=BETA)
        z_old = torch.full_like(l, 2.5)  # a per-token Z is accepted too
        _, dl_z = grad_wrt_logprobs(fn, l, lo, a, divergence="urkl", beta=BETA, z_old=z_old)
        assert_close(dl_z, 2.5 * dl_1, **EXACT, msg=name)


def _bad_call(**overrides):
    tokens = random_tokens(seed=26, n=8)
    kwargs = dict(tokens, divergence="urkl", beta=BETA, **CLIP)
    kwargs.update(overrides)
    return rpg_reinforce_clip_loss(**kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(divergence="js"), "divergence"),
        (dict(beta=-1.0), "beta"),
        (dict(z_old=0.0), "z_old"),
        (dict(divergence="fkl", z_old=2.0), "z_old"),
        (dict(advantages=torch.zeros(7, dtype=DTYPE)), "advantages"),
        (dict(logprobs=torch.full((8,), math.nan, dtype=DTYPE)), "logprobs"),
        (dict(old_logprobs=torch.full((8,), math.inf, dtype=DTYPE)), "old_logprobs"),
        (dict(clip_c=1.0), "clip_c"),
        (dict(clip_eps_low=1.0), "clip_eps_low"),
        (dict(branch_on="psi"), "branch_on"),
    ],
)
def test_bad_input_raises_naming_argument(overrides, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(**overrides)


def test_bad_input_other_functions():
    tokens = random_tokens(seed=27, n=8)
    l, lo = tokens["logprobs"], tokens["old_logprobs"]
    with pytest.raises(ValueError, match="divergence"):
        rpg_kl_penalty(l, lo, divergence="js")
    with pytest.raises(ValueError, match="anchor_logprobs"):
        rpg_kl_penalty(l, lo[:4], divergence="urkl")
    with pytest.raises(ValueError, match="anchor_logprobs"):
        corrected_grpo_kl(l, lo, torch.full_like(lo, math.nan))
    for fn in RPG_POLICY_LOSSES.values():
        with pytest.raises(ValueError, match="divergence"):
            fn(l, lo, tokens["advantages"], divergence="kl", beta=BETA)
