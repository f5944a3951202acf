"""Sampled KL estimators K1..K5, K3++ (``core/kl.py``) checked by exact enumeration.

For a per-sample surrogate f(y; theta) with y ~ pi (the sampler), a training step averages f over
samples and differentiates f, never the sampling distribution. So, with every token of a small
vocabulary enumerated at once (column y of a [P, V] tensor is "the sample was y"):

    expected value    = sum_y sg(pi(y)) f(y; theta)
    expected gradient = sum_y sg(pi(y)) grad_theta f(y; theta)  = grad_theta of the line above

where pi is pi_theta on-policy and pi_old off-policy (then f carries the importance weight).
theta = the policy logits [P, V], float64. The exact KLs and their gradients are computed here by
summation over the vocabulary, independently of ``core/``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megatron_empg.core.kl import KL_ESTIMATORS, KL_VALUE_CLAMP, importance_weight, sampled_kl

# Exact enumeration in float64: the only error is rounding, ~1e-15 relative.
ENUM_ATOL = 1e-10

CASES = [(5, 0), (17, 1), (50, 2)]  # (vocab, seed)


def _make_case(vocab: int, seed: int, positions: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """float64 logits of the policy, anchor and old policy, [positions, vocab] each.

    Anchor and old policy are perturbations of the policy (as in training), small enough that the
    K3 clamp at 10 is inactive (checked by ``_assert_k3_unclamped``).
    """
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    anchor_logits = logits + 0.5 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    old_logits = logits + 0.5 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    return logits, anchor_logits, old_logits


def _exact_kl(logits: Tensor, anchor_logits: Tensor, direction: str) -> Tensor:
    """Exact per-position KL by summation over the vocabulary [P], differentiable w.r.t. logits."""
    logp = torch.log_softmax(logits, dim=-1)
    logp_ref = torch.log_softmax(anchor_logits, dim=-1)
    if direction == "reverse":  # KL(pi || pi_ref)
        return (logp.exp() * (logp - logp_ref)).sum(-1)
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)  # KL(pi_ref || pi)


def _exact_kl_and_grad(logits: Tensor, anchor_logits: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    theta = logits.clone().requires_grad_(True)
    kl = _exact_kl(theta, anchor_logits, direction)
    (grad,) = torch.autograd.grad(kl.sum(), theta)  # positions are independent: row p = grad KL_p
    return kl.detach(), grad


def _enumerate(
    estimator: str,
    logits: Tensor,
    anchor_logits: Tensor,
    old_logits: Tensor | None = None,
    use_iw: bool = True,
) -> tuple[Tensor, Tensor]:
    """(expected value [P], expected gradient [P, V]) of ``sampled_kl`` by exact enumeration.

    Samples come from pi_theta, or from pi_old when ``old_logits`` is given (with the importance
    weight unless ``use_iw`` is False).
    """
    theta = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)  # [P, V]: l for every candidate sample y
    logp_ref = torch.log_softmax(anchor_logits, dim=-1)
    if old_logits is None:
        sampler_probs = logp.detach().exp()
        old_logprobs = None
    else:
        logp_old = torch.log_softmax(old_logits, dim=-1)
        sampler_probs = logp_old.exp()
        old_logprobs = logp_old if use_iw else None
    per_sample = sampled_kl(logp, logp_ref, estimator=estimator, old_logprobs=old_logprobs)
    expected_value = (sampler_probs * per_sample).sum(-1)
    (expected_grad,) = torch.autograd.grad(expected_value.sum(), theta)
    return expected_value.detach(), expected_grad


def _assert_k3_unclamped(logits: Tensor, anchor_logits: Tensor) -> None:
    log_w = torch.log_softmax(anchor_logits, -1) - torch.log_softmax(logits, -1)
    unclamped_k3 = log_w.exp() - log_w - 1
    assert unclamped_k3.max() < KL_VALUE_CLAMP, "test case left the unclamped regime of K3"


def _sampler_logits(sampler: str, old_logits: Tensor) -> Tensor | None:
    return None if sampler == "on_policy" else old_logits


SAMPLERS = ["on_policy", "off_policy_iw"]


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(
    "estimator,direction",
    [("k1", "reverse"), ("k3", "reverse"), ("k3pp", "reverse"), ("k4", "reverse"), ("k5", "forward")],
)
def test_expected_value_is_exact_kl(estimator, direction, sampler, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    _assert_k3_unclamped(logits, anchor_logits)
    expected_kl, _ = _exact_kl_and_grad(logits, anchor_logits, direction)
    actual_value, _ = _enumerate(estimator, logits, anchor_logits, _sampler_logits(sampler, old_logits))
    torch.testing.assert_close(actual_value, expected_kl, rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(
    "estimator,direction",
    [("k2", "reverse"), ("k3pp", "reverse"), ("k4", "reverse"), ("k5", "forward")],
)
def test_expected_gradient_is_exact_kl_gradient(estimator, direction, sampler, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    _assert_k3_unclamped(logits, anchor_logits)
    _, expected_grad = _exact_kl_and_grad(logits, anchor_logits, direction)
    _, actual_grad = _enumerate(estimator, logits, anchor_logits, _sampler_logits(sampler, old_logits))
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_k1_expected_gradient_is_zero(sampler, vocab, seed):
    # E[grad l] = sum_y pi(y) grad log pi(y) = grad sum_y pi(y) = 0.
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    _, actual_grad = _enumerate("k1", logits, anchor_logits, _sampler_logits(sampler, old_logits))
    torch.testing.assert_close(actual_grad, torch.zeros_like(actual_grad), rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_k2_expected_value_is_half_mean_square_log_ratio_not_kl(sampler, vocab, seed):
    # E_pi[(l - l_r)^2 / 2] = sum_y pi(y) (log pi(y) - log pi_ref(y))^2 / 2, a biased KL estimate.
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    logp = torch.log_softmax(logits, -1)
    log_ratio = logp - torch.log_softmax(anchor_logits, -1)
    expected_value = 0.5 * (logp.exp() * log_ratio.square()).sum(-1)
    actual_value, _ = _enumerate("k2", logits, anchor_logits, _sampler_logits(sampler, old_logits))
    torch.testing.assert_close(actual_value, expected_value, rtol=0, atol=ENUM_ATOL)
    kl, _ = _exact_kl_and_grad(logits, anchor_logits, "reverse")
    assert (actual_value - kl).abs().max() > 1e-3, "K2's bias should be visible in this case"


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_k3_expected_gradient_is_forward_kl_gradient(sampler, vocab, seed):
    # Per sample grad = (1 - w) grad l; E_pi[(1 - pi_ref/pi) grad log pi] = -sum_y pi_ref grad log pi
    # = grad KL(pi_ref || pi): K3 estimates the reverse KL but follows the forward KL's gradient.
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    _assert_k3_unclamped(logits, anchor_logits)
    _, expected_grad = _exact_kl_and_grad(logits, anchor_logits, "forward")
    _, reverse_grad = _exact_kl_and_grad(logits, anchor_logits, "reverse")
    _, actual_grad = _enumerate("k3", logits, anchor_logits, _sampler_logits(sampler, old_logits))
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=ENUM_ATOL)
    assert (actual_grad - reverse_grad).abs().max() > 1e-3, "forward and reverse gradients must differ here"


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_importance_weighted_off_policy_equals_on_policy(estimator, vocab, seed):
    # sum_y pi_old(y) sg(pi(y)/pi_old(y)) f(y) = sum_y pi(y) f(y), value and gradient, for every f.
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    expected_value, expected_grad = _enumerate(estimator, logits, anchor_logits)
    actual_value, actual_grad = _enumerate(estimator, logits, anchor_logits, old_logits)
    torch.testing.assert_close(actual_value, expected_value, rtol=0, atol=ENUM_ATOL)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("estimator,direction", [("k3pp", "reverse"), ("k4", "reverse"), ("k5", "forward")])
def test_off_policy_without_importance_weight_is_biased(estimator, direction):
    # Makes the off-policy tests above non-vacuous: pi_old differs enough from pi to matter.
    logits, anchor_logits, old_logits = _make_case(17, 1)
    kl, kl_grad = _exact_kl_and_grad(logits, anchor_logits, direction)
    actual_value, actual_grad = _enumerate(estimator, logits, anchor_logits, old_logits, use_iw=False)
    assert (actual_value - kl).abs().max() > 1e-3
    assert (actual_grad - kl_grad).abs().max() > 1e-3


def test_k3_clamp_zeroes_the_gradient_where_active():
    # log w = l_r - l. Unclamped K3 = w - log w - 1:
    #   log w = 1:   e - 2          = 0.718   (inactive, grad coefficient 1 - w = 1 - e)
    #   log w = 3:   e^3 - 4        = 16.09   (> 10: clamped to 10, gradient exactly 0)
    #   log w = -12: e^-12 + 11     = 11.00   (> 10: clamped)
    #   log w = 25:  beyond the +-20 log-ratio clamp as well; clamped to 10
    #   log w = -2:  e^-2 + 1       = 1.135   (inactive, coefficient 1 - e^-2)
    log_w = torch.tensor([1.0, 3.0, -12.0, 25.0, -2.0], dtype=torch.float64)
    logprobs = torch.full_like(log_w, -3.0).requires_grad_(True)
    anchor_logprobs = logprobs.detach() + log_w
    actual_value = sampled_kl(logprobs, anchor_logprobs, estimator="k3")
    (actual_grad,) = torch.autograd.grad(actual_value.sum(), logprobs)

    clamped = torch.tensor([False, True, True, True, False])
    expected_value = torch.where(clamped, torch.full_like(log_w, KL_VALUE_CLAMP), log_w.exp() - log_w - 1)
    expected_grad = torch.where(clamped, torch.zeros_like(log_w), 1 - log_w.exp())
    torch.testing.assert_close(actual_value.detach(), expected_value, rtol=0, atol=1e-12)
    assert torch.equal(actual_grad[clamped], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-12)


def test_estimators_keep_dtype_and_shape():
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(2, 3, generator=g)  # [B, S] float32
    anchor_logprobs = -torch.rand(2, 3, generator=g)
    for estimator in KL_ESTIMATORS:
        actual = sampled_kl(logprobs, anchor_logprobs, estimator=estimator)
        assert actual.shape == (2, 3) and actual.dtype == torch.float32, estimator


# --- bad input ---------------------------------------------------------------------------------


def test_unknown_estimator_raises():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="estimator='k9'"):
        sampled_kl(x, x, estimator="k9")


def test_mismatched_shapes_raise_naming_the_argument():
    with pytest.raises(ValueError, match="^anchor_logprobs has shape"):
        sampled_kl(torch.zeros(3), torch.zeros(4), estimator="k3")
    with pytest.raises(ValueError, match="^old_logprobs has shape"):
        sampled_kl(torch.zeros(3), torch.zeros(3), estimator="k3", old_logprobs=torch.zeros(2, 3))


@pytest.mark.parametrize("bad", ["logprobs", "anchor_logprobs", "old_logprobs"])
def test_nan_input_raises_naming_the_argument(bad):
    inputs = {name: torch.zeros(3) for name in ("logprobs", "anchor_logprobs", "old_logprobs")}
    inputs[bad][1] = float("nan")
    with pytest.raises(ValueError, match=f"^{bad} contains NaN"):
        sampled_kl(inputs["logprobs"], inputs["anchor_logprobs"], estimator="k4", old_logprobs=inputs["old_logprobs"])


def test_inverted_iw_clip_raises():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="iw_clip"):
        sampled_kl(x, x, estimator="k4", old_logprobs=x, iw_clip=(2.0, 0.5))


def test_importance_weight_clip_bounds():
    # s = pi/pi_old = exp(l - l_old) at log-ratios ln(0.25), 0, ln(4)  ->  0.25, 1, 4.
    log_ratio = torch.log(torch.tensor([0.25, 1.0, 4.0], dtype=torch.float64))
    logprobs = torch.full_like(log_ratio, -1.0).requires_grad_(True)
    old_logprobs = logprobs.detach() - log_ratio
    cases = {
        (None, None): [0.25, 1.0, 4.0],
        (0.5, 2.0): [0.5, 1.0, 2.0],
        (None, 2.0): [0.25, 1.0, 2.0],
        (0.5, None): [0.5, 1.0, 4.0],
    }
    for clip, expected in cases.items():
        actual = importance_weight(logprobs, old_logprobs, clip)
        assert not actual.requires_grad, "the importance weight is a stop-gradient"
        torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
