"""Top-k KL (``core/topk_kl.py``) by exact enumeration, closed-form biases and Monte-Carlo.

Enumeration as in test_kl.py: column y of a [P, V] tensor is "the sampled token was y"; the
expected value is sum_y sg(pi_s(y)) value(y) and the expected gradient is its gradient w.r.t. the
float64 policy logits theta, with pi_s the sampler (pi_theta on-policy, pi_old off-policy). Both
entry points run: ``topk_kl`` (from logits; the logits are repeated once per candidate y) and
``topk_kl_from_logprobs`` (from log-probs gathered here).

Closed forms used below, per position, with a = log pi, b = log pi_ref, q the index set and
Q' = V \\ q (docs/design/ema-pg.md sections 3 and 5):
    reverse KL = sum_j pi_j (a_j - b_j),   head = sum_{j in q} ..., tail part = sum_{j in Q'} ...
    forward KL = sum_j pi_ref_j (b_j - a_j), split the same way
    E[grad], tail_grad="reference":  grad KL + grad pi(q) (reverse), grad KL + grad pi(Q') (forward)
    E[value], y ~ pi_old without importance weight, minus KL:
        reverse: sum_{j in Q'} (pi_old_j - pi_j) (a_j - b_j)
        forward: sum_{j in Q'} (pi_old_j / pi_j - 1) pi_ref_j (b_j - a_j)
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from megatron_empg.core.kl import sampled_kl
from megatron_empg.core.logprob import exact_kl, topk_logprobs
from megatron_empg.core.topk_kl import TopkKL, topk_kl, topk_kl_from_logprobs

# Exact enumeration in float64: the only error is rounding, ~1e-15 relative.
ENUM_ATOL = 1e-10

CASES = [(7, 0), (20, 1)]  # (vocab, seed)
K_CHOICES = ["0", "1", "3", "V//2", "V"]
PATHS = ["logits", "logprobs"]
DIRECTIONS = ["reverse", "forward"]


def _k(choice: str, vocab: int) -> int:
    return {"0": 0, "1": 1, "3": 3, "V//2": vocab // 2, "V": vocab}[choice]


def _make_case(vocab: int, seed: int, positions: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """float64 logits of policy, anchor and old policy [positions, vocab]; anchor and old policy
    are perturbations of the policy, as in training."""
    g = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    anchor_logits = logits + 0.7 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    old_logits = logits + 0.7 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    return logits, anchor_logits, old_logits


def _index_set(direction: str, k: int, logits: Tensor, anchor_logits: Tensor, old_logits: Tensor | None) -> Tensor:
    """Top-k of pi_old (reverse; pi_old = pi_theta on-policy) or of pi_ref (forward) [P, k]."""
    if direction == "forward":
        source = anchor_logits
    else:
        source = logits if old_logits is None else old_logits
    return topk_logprobs(source, k)[1]


def _head_mask(index_set: Tensor, vocab: int) -> Tensor:
    """[P, V] bool, True at the ids of the index set."""
    mask = torch.zeros(index_set.shape[0], vocab, dtype=torch.bool)
    return mask.scatter(-1, index_set, True)


def _per_candidate(
    path: str,
    theta: Tensor,
    anchor_logits: Tensor,
    index_set: Tensor,
    direction: str,
    old_logprobs: Tensor | None = None,
    **kwargs,
) -> TopkKL:
    """Top-k KL parts for every candidate sample y at once: TopkKL of [P, V] tensors."""
    positions, vocab = theta.shape
    k = index_set.shape[-1]
    logp_ref = torch.log_softmax(anchor_logits, dim=-1)
    head_anchor = logp_ref.gather(-1, index_set)[:, None, :].expand(positions, vocab, k)
    if path == "logits":
        return topk_kl(
            theta[:, None, :].expand(positions, vocab, vocab),  # the same logits for every y
            torch.arange(vocab).expand(positions, vocab),  # token_ids: y = column
            index_set[:, None, :].expand(positions, vocab, k),
            head_anchor,
            logp_ref,
            direction=direction,
            old_logprobs=old_logprobs,
            chunk_size=5,
            **kwargs,
        )
    logp = torch.log_softmax(theta, dim=-1)
    return topk_kl_from_logprobs(
        logp.gather(-1, index_set)[:, None, :].expand(positions, vocab, k),
        head_anchor,
        logp,
        logp_ref,
        _head_mask(index_set, vocab),
        direction=direction,
        old_logprobs=old_logprobs,
        **kwargs,
    )


def _enumerate(
    path: str,
    logits: Tensor,
    anchor_logits: Tensor,
    index_set: Tensor,
    direction: str,
    old_logits: Tensor | None = None,
    use_iw: bool = True,
    **kwargs,
) -> tuple[Tensor, Tensor, TopkKL]:
    """(expected value [P], expected gradient [P, V], per-candidate parts) by exact enumeration."""
    theta = logits.clone().requires_grad_(True)
    if old_logits is None:
        sampler_probs = torch.softmax(logits, dim=-1)
        old_logprobs = None
    else:
        logp_old = torch.log_softmax(old_logits, dim=-1)
        sampler_probs = logp_old.exp()
        old_logprobs = logp_old if use_iw else None
    parts = _per_candidate(path, theta, anchor_logits, index_set, direction, old_logprobs, **kwargs)
    expected_value = (sampler_probs * parts.values).sum(-1)
    (expected_grad,) = torch.autograd.grad(expected_value.sum(), theta)
    return expected_value.detach(), expected_grad, parts


def _exact_kl_and_grad(logits: Tensor, anchor_logits: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    """Exact per-position KL [P] by summation (independent of core/) and its gradient [P, V]."""
    theta = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    logp_ref = torch.log_softmax(anchor_logits, dim=-1)
    if direction == "reverse":
        kl = (logp.exp() * (logp - logp_ref)).sum(-1)
    else:
        kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    (grad,) = torch.autograd.grad(kl.sum(), theta)
    return kl.detach(), grad


def _tail_part(logits: Tensor, anchor_logits: Tensor, index_set: Tensor, direction: str) -> Tensor:
    """The part of the exact KL outside the index set [P] (either sign), differentiable."""
    logp = torch.log_softmax(logits, dim=-1)
    logp_ref = torch.log_softmax(anchor_logits, dim=-1)
    outside = ~_head_mask(index_set, logits.shape[-1])
    if direction == "reverse":
        terms = logp.exp() * (logp - logp_ref)
    else:
        terms = logp_ref.exp() * (logp_ref - logp)
    return (terms * outside).sum(-1)


def _sampler(sampler: str, old_logits: Tensor) -> Tensor | None:
    return None if sampler == "on_policy" else old_logits


SAMPLERS = ["on_policy", "off_policy_iw"]


# --- k = V: the exact KL ----------------------------------------------------------------------


@pytest.mark.parametrize("tail_grad", ["unbiased", "reference"])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_full_index_set_equals_exact_kl_per_token(path, direction, tail_grad):
    logits, anchor_logits, old_logits = _make_case(20, 3)
    index_set = _index_set(direction, 20, logits, anchor_logits, old_logits)
    theta = logits.clone().requires_grad_(True)
    parts = _per_candidate(
        path, theta, anchor_logits, index_set, direction, torch.log_softmax(old_logits, -1), tail_grad=tail_grad
    )
    # Every candidate y is in the head, so the tail is identically 0 and each sample's value and
    # gradient are the exact KL's.
    assert torch.equal(parts.tail, torch.zeros_like(parts.tail))
    leaf = logits.clone().requires_grad_(True)
    expected_kl = exact_kl(leaf, anchor_logits, direction=direction)
    (expected_grad,) = torch.autograd.grad(expected_kl.sum(), leaf)
    torch.testing.assert_close(parts.values.detach(), expected_kl.detach()[:, None].expand(3, 20), rtol=0, atol=1e-12)
    for y in (0, 7, 19):  # per-sample gradient of a few single samples
        (actual_grad,) = torch.autograd.grad(parts.values[:, y].sum(), theta, retain_graph=True)
        torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-12)


# --- expected values ----------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k_choice", K_CHOICES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_expected_value_is_exact_kl(path, direction, sampler, k_choice, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    sampler_logits = _sampler(sampler, old_logits)
    index_set = _index_set(direction, _k(k_choice, vocab), logits, anchor_logits, sampler_logits)
    expected_kl, _ = _exact_kl_and_grad(logits, anchor_logits, direction)
    for tail_grad in ("unbiased", "reference"):  # the two tail forms have the same value
        actual_value, _, _ = _enumerate(
            path, logits, anchor_logits, index_set, direction, sampler_logits, tail_grad=tail_grad
        )
        torch.testing.assert_close(actual_value, expected_kl, rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k_choice", K_CHOICES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_off_policy_without_importance_weight_value_bias(path, direction, k_choice, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    k = _k(k_choice, vocab)
    index_set = _index_set(direction, k, logits, anchor_logits, old_logits)
    kl, _ = _exact_kl_and_grad(logits, anchor_logits, direction)
    actual_value, _, _ = _enumerate(path, logits, anchor_logits, index_set, direction, old_logits, use_iw=False)

    logp, logp_ref = torch.log_softmax(logits, -1), torch.log_softmax(anchor_logits, -1)
    pi, pi_ref, pi_old = logp.exp(), logp_ref.exp(), torch.softmax(old_logits, -1)
    outside = ~_head_mask(index_set, vocab)
    if direction == "reverse":
        bias_terms = (pi_old - pi) * (logp - logp_ref)
    else:
        bias_terms = (pi_old / pi - 1) * pi_ref * (logp_ref - logp)
    expected_bias = (bias_terms * outside).sum(-1)
    torch.testing.assert_close(actual_value - kl, expected_bias, rtol=0, atol=ENUM_ATOL)
    if k < vocab:
        assert expected_bias.abs().max() > 1e-4, "the bias should be visible here"
    else:
        assert torch.equal(expected_bias, torch.zeros_like(expected_bias))


# --- expected gradients -------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k_choice", K_CHOICES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_unbiased_tail_expected_gradient_is_exact_kl_gradient(path, direction, sampler, k_choice, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    sampler_logits = _sampler(sampler, old_logits)
    index_set = _index_set(direction, _k(k_choice, vocab), logits, anchor_logits, sampler_logits)
    _, expected_grad = _exact_kl_and_grad(logits, anchor_logits, direction)
    _, actual_grad, _ = _enumerate(
        path, logits, anchor_logits, index_set, direction, sampler_logits, tail_grad="unbiased"
    )
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=ENUM_ATOL)


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k_choice", K_CHOICES)
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_reference_tail_expected_gradient_bias_closed_form(path, direction, sampler, k_choice, vocab, seed):
    logits, anchor_logits, old_logits = _make_case(vocab, seed)
    k = _k(k_choice, vocab)
    sampler_logits = _sampler(sampler, old_logits)
    index_set = _index_set(direction, k, logits, anchor_logits, sampler_logits)
    _, kl_grad = _exact_kl_and_grad(logits, anchor_logits, direction)
    _, actual_grad, _ = _enumerate(
        path, logits, anchor_logits, index_set, direction, sampler_logits, tail_grad="reference"
    )
    # Bias = grad pi_theta(q) (reverse) or grad pi_theta(V \ q) (forward), w.r.t. the logits.
    theta = logits.clone().requires_grad_(True)
    in_head = _head_mask(index_set, vocab)
    biased_set = in_head if direction == "reverse" else ~in_head
    mass = (torch.softmax(theta, dim=-1) * biased_set).sum(-1)
    (expected_bias,) = torch.autograd.grad(mass.sum(), theta)
    torch.testing.assert_close(actual_grad - kl_grad, expected_bias, rtol=0, atol=ENUM_ATOL)
    if 0 < k < vocab:
        assert expected_bias.abs().max() > 1e-3, "the bias should be visible here"


# --- truncated Top-k KL -------------------------------------------------------------------------


@pytest.mark.parametrize("vocab,seed", CASES)
@pytest.mark.parametrize("k_choice", K_CHOICES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_truncated_is_head_and_misses_the_tail_part(path, direction, k_choice, vocab, seed):
    logits, anchor_logits, _ = _make_case(vocab, seed)
    index_set = _index_set(direction, _k(k_choice, vocab), logits, anchor_logits, None)
    kl, kl_grad = _exact_kl_and_grad(logits, anchor_logits, direction)
    actual_value, actual_grad, parts = _enumerate(path, logits, anchor_logits, index_set, direction, tail=False)
    assert torch.equal(parts.values, parts.head)
    assert torch.equal(parts.tail, torch.zeros_like(parts.tail))
    # E[value] = KL - tail part; the tail part sum_{j not in q} of the KL's terms has either sign
    # for the reverse KL (log pi/pi_ref < 0 where pi < pi_ref), so "truncated" is not a lower bound.
    theta = logits.clone().requires_grad_(True)
    tail_part = _tail_part(theta, anchor_logits, index_set, direction)
    (tail_part_grad,) = torch.autograd.grad(tail_part.sum(), theta)
    torch.testing.assert_close(actual_value, kl - tail_part.detach(), rtol=0, atol=ENUM_ATOL)
    torch.testing.assert_close(actual_grad, kl_grad - tail_part_grad, rtol=0, atol=ENUM_ATOL)


# --- k = 0: the sampled K4 / K5 estimators ------------------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("direction,estimator", [("reverse", "k4"), ("forward", "k5")])
@pytest.mark.parametrize("path", PATHS)
def test_empty_index_set_reference_tail_is_sampled_k4_or_k5(path, direction, estimator, sampler):
    logits, anchor_logits, old_logits = _make_case(20, 4, positions=6)
    g = torch.Generator().manual_seed(7)
    token_ids = torch.randint(0, 20, (6,), generator=g)
    logp_ref = torch.log_softmax(anchor_logits, -1)
    anchor_logprobs = logp_ref.gather(-1, token_ids[:, None]).squeeze(-1)
    old_logprobs = None
    if sampler == "off_policy_iw":
        old_logprobs = torch.log_softmax(old_logits, -1).gather(-1, token_ids[:, None]).squeeze(-1)
    empty_ids = torch.empty(6, 0, dtype=torch.int64)
    empty_logprobs = torch.empty(6, 0, dtype=torch.float64)

    expected_leaf = logits.clone().requires_grad_(True)
    logprobs = torch.log_softmax(expected_leaf, -1).gather(-1, token_ids[:, None]).squeeze(-1)
    expected_value = sampled_kl(logprobs, anchor_logprobs, estimator=estimator, old_logprobs=old_logprobs)
    (expected_grad,) = torch.autograd.grad(expected_value.sum(), expected_leaf)

    actual_leaf = logits.clone().requires_grad_(True)
    kwargs = dict(direction=direction, tail_grad="reference", old_logprobs=old_logprobs)
    if path == "logits":
        actual = topk_kl(actual_leaf, token_ids, empty_ids, empty_logprobs, anchor_logprobs, **kwargs)
    else:
        actual_logprobs = torch.log_softmax(actual_leaf, -1).gather(-1, token_ids[:, None]).squeeze(-1)
        actual = topk_kl_from_logprobs(
            empty_logprobs,
            empty_logprobs,
            actual_logprobs,
            anchor_logprobs,
            torch.zeros(6, dtype=torch.bool),
            **kwargs,
        )
    (actual_grad,) = torch.autograd.grad(actual.values.sum(), actual_leaf)
    assert torch.equal(actual.head, torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(actual.values.detach(), expected_value.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(actual_grad, expected_grad, rtol=0, atol=1e-12)


# --- Monte-Carlo ------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("path", PATHS)
def test_monte_carlo_off_policy_mean_within_four_standard_errors(path, direction):
    positions, vocab, k, num_samples = 3, 50, 8, 20_000
    logits, anchor_logits, old_logits = _make_case(vocab, 8, positions)
    expected_kl, _ = _exact_kl_and_grad(logits, anchor_logits, direction)
    index_set = _index_set(direction, k, logits, anchor_logits, old_logits)

    g = torch.Generator().manual_seed(9)
    token_ids = torch.multinomial(torch.softmax(old_logits, -1), num_samples, replacement=True, generator=g)  # [P, N]
    logp, logp_ref = torch.log_softmax(logits, -1), torch.log_softmax(anchor_logits, -1)
    logp_old = torch.log_softmax(old_logits, -1)
    index_rep = index_set[:, None, :].expand(positions, num_samples, k)
    head_anchor = logp_ref.gather(-1, index_set)[:, None, :].expand(positions, num_samples, k)
    kwargs = dict(direction=direction, old_logprobs=logp_old.gather(-1, token_ids))
    if path == "logits":
        samples = topk_kl(
            logits[:, None, :].expand(positions, num_samples, vocab),
            token_ids,
            index_rep,
            head_anchor,
            logp_ref.gather(-1, token_ids),
            **kwargs,
        ).values
    else:
        samples = topk_kl_from_logprobs(
            logp.gather(-1, index_set)[:, None, :].expand(positions, num_samples, k),
            head_anchor,
            logp.gather(-1, token_ids),
            logp_ref.gather(-1, token_ids),
            (index_rep == token_ids[..., None]).any(-1),
            **kwargs,
        ).values
    actual_mean = samples.mean(-1)
    standard_error = samples.std(-1) / num_samples**0.5
    assert (standard_error < 0.1 * expected_kl).all(), "too few samples for a meaningful check"
    assert ((actual_mean - expected_kl).abs() < 4 * standard_error).all(), (actual_mean, expected_kl, standard_error)


# --- bf16 logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_bf16_logits_close_to_fp32(direction):
    positions, vocab, k = 16, 50, 8
    logits, anchor_logits, old_logits = (t.to(torch.float32) for t in _make_case(vocab, 10, positions))
    g = torch.Generator().manual_seed(11)
    token_ids = torch.multinomial(torch.softmax(old_logits, -1), 1, generator=g).squeeze(-1)
    index_set = _index_set(direction, k, logits, anchor_logits, old_logits)
    logp_ref = torch.log_softmax(anchor_logits, -1)
    args = (token_ids, index_set, logp_ref.gather(-1, index_set), logp_ref.gather(-1, token_ids[:, None]).squeeze(-1))
    old_logprobs = torch.log_softmax(old_logits, -1).gather(-1, token_ids[:, None]).squeeze(-1)

    expected = topk_kl(logits, *args, direction=direction, old_logprobs=old_logprobs)
    bf16_logits = logits.to(torch.bfloat16).requires_grad_(True)
    actual = topk_kl(bf16_logits, *args, direction=direction, old_logprobs=old_logprobs)
    (actual_grad,) = torch.autograd.grad(actual.values.sum(), bf16_logits)
    assert actual.values.dtype == torch.float32 and actual_grad.dtype == torch.bfloat16
    assert torch.isfinite(actual.values).all() and torch.isfinite(actual_grad).all()
    # bf16 rounds logits of size ~5 by up to ~1e-2; docs/design/ema-pg.md section 11 saw 1.4e-2 per token.
    torch.testing.assert_close(actual.values.detach(), expected.values, rtol=0, atol=2e-2)


# --- bad input ----------------------------------------------------------------------------------


def _valid_topk_kl_args(dtype=torch.float32):
    positions, vocab, k = 4, 10, 3
    logits = torch.zeros(positions, vocab, dtype=dtype)
    return dict(
        logits=logits,
        token_ids=torch.zeros(positions, dtype=torch.int64),
        index_set=torch.arange(k).expand(positions, k).contiguous(),
        head_anchor_logprobs=torch.full((positions, k), -2.3),
        anchor_logprobs=torch.full((positions,), -2.3),
    )


def test_valid_topk_kl_args_are_accepted():
    # The bad-input tests below change one argument of this call at a time.
    topk_kl(**_valid_topk_kl_args(), direction="reverse", old_logprobs=torch.zeros(4))


@pytest.mark.parametrize(
    "name,bad_value,message",
    [
        ("index_set", torch.zeros(3, 3, dtype=torch.int64), "^index_set has shape"),
        ("index_set", torch.zeros(4, 11, dtype=torch.int64), "^index_set has k=11"),
        ("token_ids", torch.zeros(5, dtype=torch.int64), "^token_ids has shape"),
        ("index_set", torch.zeros(4, 3, dtype=torch.int32), "^index_set must be int64"),
        ("token_ids", torch.zeros(4, dtype=torch.int32), "^token_ids must be int64"),
        ("head_anchor_logprobs", torch.zeros(4, 2), "^head_anchor_logprobs has shape"),
        ("anchor_logprobs", torch.zeros(3), "^anchor_logprobs has shape"),
    ],
)
def test_topk_kl_bad_shapes_and_dtypes_raise_naming_the_argument(name, bad_value, message):
    args = _valid_topk_kl_args()
    args[name] = bad_value
    with pytest.raises(ValueError, match=message):
        topk_kl(**args, direction="reverse")


@pytest.mark.parametrize("name", ["logits", "head_anchor_logprobs", "anchor_logprobs", "old_logprobs"])
def test_topk_kl_nan_input_raises_naming_the_argument(name):
    args = _valid_topk_kl_args()
    args["old_logprobs"] = torch.zeros(4)
    args[name] = args[name].clone()
    args[name].view(-1)[1] = float("nan")
    with pytest.raises(ValueError, match=f"^{name} contains NaN"):
        topk_kl(**args, direction="reverse")


def test_topk_kl_unknown_direction_or_tail_grad_raises():
    with pytest.raises(ValueError, match="^direction='both'"):
        topk_kl(**_valid_topk_kl_args(), direction="both")
    with pytest.raises(ValueError, match="^tail_grad='exact'"):
        topk_kl(**_valid_topk_kl_args(), direction="forward", tail_grad="exact")


def test_topk_kl_from_logprobs_bad_input_raises_naming_the_argument():
    head = torch.zeros(4, 3)
    per_token = torch.zeros(4)
    in_head = torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="^in_head must be a bool"):
        topk_kl_from_logprobs(head, head, per_token, per_token, in_head.to(torch.int64), direction="reverse")
    with pytest.raises(ValueError, match="^head_logprobs has leading shape"):
        topk_kl_from_logprobs(torch.zeros(5, 3), torch.zeros(5, 3), per_token, per_token, in_head, direction="reverse")
    with pytest.raises(ValueError, match="^head_anchor_logprobs has shape"):
        topk_kl_from_logprobs(head, torch.zeros(4, 2), per_token, per_token, in_head, direction="reverse")
    with pytest.raises(ValueError, match="^in_head has shape"):
        topk_kl_from_logprobs(head, head, per_token, per_token, in_head[:3], direction="reverse")
    with pytest.raises(ValueError, match="^tail_grad='exact'"):
        topk_kl_from_logprobs(head, head, per_token, per_token, in_head, direction="reverse", tail_grad="exact")
    nan_head = head.clone()
    nan_head[2, 1] = float("nan")
    with pytest.raises(ValueError, match="^head_logprobs contains NaN"):
        topk_kl_from_logprobs(nan_head, head, per_token, per_token, in_head, direction="forward")


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_unbiased_and_reference_tails_have_bitwise_equal_values(direction):
    # The two tail forms differ only in the gradient; the value (what is logged) must not change.
    gen = torch.Generator().manual_seed(11)
    logprobs = torch.log_softmax(torch.randn(64, 9, generator=gen), -1)[:, 0]
    anchor_logprobs = torch.log_softmax(torch.randn(64, 9, generator=gen), -1)[:, 0]
    head = torch.log_softmax(torch.randn(64, 3, generator=gen), -1)
    head_anchor = torch.log_softmax(torch.randn(64, 3, generator=gen), -1)
    in_head = torch.rand(64, generator=gen) < 0.3
    common = dict(direction=direction, old_logprobs=logprobs - 0.1)
    expected = topk_kl_from_logprobs(
        head, head_anchor, logprobs, anchor_logprobs, in_head, tail_grad="reference", **common
    )
    actual = topk_kl_from_logprobs(
        head, head_anchor, logprobs, anchor_logprobs, in_head, tail_grad="unbiased", **common
    )
    assert torch.equal(actual.values, expected.values)
    assert torch.equal(actual.tail, expected.tail)
