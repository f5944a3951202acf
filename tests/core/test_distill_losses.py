"""Distillation losses (``core/distill``) against independent computations.

Expectations under the student's samples are exact enumerations over a small vocabulary (float64):
column y of a [P, V] tensor is "the student sampled y". verl's per-token losses and their token-mean
(``verl/trainer/distillation/losses.py``, ``kl_penalty``, per-strategy ``compute_forward_kl_topk``)
are written out here in plain Python floats from their definitions, not from ``core/``.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_empg.core.aggregation import aggregate
from megatron_empg.core.distill.losses import DISTILL_LOSSES, distill_values, forward_kl_topk
from megatron_empg.core.distill.objective import distill_objective

ATOL = 1e-10


def _case(vocab: int = 7, positions: int = 3, seed: int = 0, spread: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    student = 1.3 * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    teacher = student + spread * torch.randn(positions, vocab, generator=g, dtype=torch.float64)
    return torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)


def _enumerated(name: str, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """sum_y pi_s(y) value(y) per position [P]: every token of the vocabulary as the sample."""
    values = distill_values(DISTILL_LOSSES[name], logprobs=s, teacher_logprobs=t)  # [P, V]
    return (s.exp() * values).sum(-1)


def _python_kl(p_log: list[float], q_log: list[float]) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(p_log, q_log))


@pytest.mark.parametrize("name", ["k1", "kl", "k3", "low_var_kl"])
def test_unbiased_estimators_average_to_the_reverse_kl(name):
    s, t = _case()
    expected = torch.tensor([_python_kl(a.tolist(), b.tolist()) for a, b in zip(s, t)], dtype=torch.float64)
    assert DISTILL_LOSSES[name].reverse_kl_unbiased
    torch.testing.assert_close(_enumerated(name, s, t), expected, atol=ATOL, rtol=0)
    # negative control: the forward KL is a different number on the same case
    forward = torch.tensor([_python_kl(b.tolist(), a.tolist()) for a, b in zip(s, t)], dtype=torch.float64)
    assert (forward - expected).abs().min() > 1e-3


@pytest.mark.parametrize("name", ["k2", "mse", "abs"])
def test_biased_estimators_are_their_formula_and_not_the_kl(name):
    s, t = _case()
    formula = {"k2": lambda d: 0.5 * d * d, "mse": lambda d: 0.5 * d * d, "abs": abs}[name]
    values = distill_values(DISTILL_LOSSES[name], logprobs=s, teacher_logprobs=t)
    expected = [[formula(a - b) for a, b in zip(ra, rb)] for ra, rb in zip(s.tolist(), t.tolist())]
    torch.testing.assert_close(values, torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)
    assert not DISTILL_LOSSES[name].reverse_kl_unbiased
    exact = torch.tensor([_python_kl(a.tolist(), b.tolist()) for a, b in zip(s, t)], dtype=torch.float64)
    assert (_enumerated(name, s, t) - exact).abs().max() > 1e-3  # negative control: biased


def test_k3_expected_gradient_is_the_forward_kl_gradient_and_k1_ignores_the_teacher():
    """Why verl refuses k1 as a direct loss: grad (s - t) = grad s, whatever the teacher."""
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.log_softmax(theta.detach() + torch.randn(2, 6, generator=g, dtype=torch.float64), -1)
    s = torch.log_softmax(theta, -1)
    values = distill_values(DISTILL_LOSSES["k3"], logprobs=s, teacher_logprobs=t)
    (grad,) = torch.autograd.grad((s.exp().detach() * values).sum(), theta, retain_graph=True)
    exact = (t.exp() * (t - torch.log_softmax(theta, -1))).sum()  # KL(teacher || student)
    (exact_grad,) = torch.autograd.grad(exact, theta)
    torch.testing.assert_close(grad, exact_grad, atol=ATOL, rtol=0)
    k1 = lambda teacher: torch.autograd.grad(  # noqa: E731
        (s.exp().detach() * distill_values(DISTILL_LOSSES["k1"], logprobs=s, teacher_logprobs=teacher)).sum(),
        theta,
        retain_graph=True,
    )[0]
    torch.testing.assert_close(k1(t), k1(t.flip(-1)), atol=ATOL, rtol=0)


def test_forward_kl_topk_over_the_whole_vocabulary_is_the_forward_kl():
    s, t = _case(vocab=5)
    ids = torch.argsort(t, dim=-1, descending=True)  # the teacher's top-5 of 5
    values = forward_kl_topk(s.gather(-1, ids), t.gather(-1, ids), None)
    expected = [_python_kl(b, a) for a, b in zip(s.tolist(), t.tolist())]
    torch.testing.assert_close(values, torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)
    reverse = torch.tensor([_python_kl(a, b) for a, b in zip(s.tolist(), t.tolist())], dtype=torch.float64)
    assert (values - reverse).abs().min() > 1e-3  # negative control: not the reverse KL


def _verl_forward_kl_topk(s_row, t_row, k, floor, cap):
    """verl's per-token forward_kl_topk written out: the teacher's top-k ids, both log-probs there
    clamped from below at ``floor``, sum p_t (log p_t - log p_s), clamped at 0, then to [-cap, cap]."""
    ids = sorted(range(len(t_row)), key=lambda j: -t_row[j])[:k]
    kl = 0.0
    for j in ids:
        a, b = max(t_row[j], floor), max(s_row[j], floor)
        kl += math.exp(a) * (a - b)
    return min(max(max(kl, 0.0), -cap), cap)


def _verl_estimator(name, a, b, cap):
    d = a - b
    if name in ("k1", "kl"):
        v = d
    elif name == "abs":
        v = abs(d)
    elif name in ("k2", "mse"):
        v = 0.5 * d * d
    else:
        x = min(max(b - a, -20.0), 20.0)
        v = min(max(math.exp(x) - x - 1, -10.0), 10.0)
    return min(max(v, -cap), cap)


@pytest.mark.parametrize("name", sorted(DISTILL_LOSSES))
def test_per_token_losses_and_token_mean_equal_verls(name):
    # wide spread: some tokens pass the clamps (loss 0.5, log-probs -3), so they are exercised
    s, t = _case(vocab=9, positions=4, seed=5, spread=3.0)
    mask = torch.tensor([True, True, False, True])
    cap, floor, k = 0.5, -3.0, 4
    loss = DISTILL_LOSSES[name]
    targets = torch.tensor([0, 3, 5, 8])
    if loss.topk:
        ids = torch.topk(t, k, dim=-1).indices
        values = distill_values(
            loss,
            logprobs=s.gather(-1, targets[:, None])[:, 0],
            head_logprobs=s.gather(-1, ids),
            teacher_head_logprobs=t.gather(-1, ids),
            log_prob_min_clamp=floor,
            loss_max_clamp=cap,
        )
        expected = [_verl_forward_kl_topk(a, b, k, floor, cap) for a, b in zip(s.tolist(), t.tolist())]
    else:
        a, b = s.gather(-1, targets[:, None])[:, 0], t.gather(-1, targets[:, None])[:, 0]
        values = distill_values(loss, logprobs=a, teacher_logprobs=b, loss_max_clamp=cap)
        expected = [_verl_estimator(name, x, y, cap) for x, y in zip(a.tolist(), b.tolist())]
    torch.testing.assert_close(values, torch.tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0)
    assert any(abs(e) == cap for e in expected) or name in ("k3", "low_var_kl")  # the clamp is exercised
    total = distill_objective(values[None], mask[None], use_policy_gradient=False)
    kept = [e for e, m in zip(expected, mask.tolist()) if m]
    assert total.count.item() == 3
    assert math.isclose(total.loss_sum.item() / total.count.item(), sum(kept) / len(kept), abs_tol=ATOL)


def test_policy_gradient_form_has_the_values_as_per_token_gradient_and_vanishes_at_the_teacher():
    """loss = -A w with A = -sg(v), w = exp(l - l_old) = 1 on-policy: d loss / d l = v per token
    (verl's vanilla PPO loss, ratio inside every clip); a teacher equal to the student gives v = 0."""
    s, t = _case(vocab=6, positions=5, seed=2)
    targets = torch.tensor([1, 2, 3, 4, 5])
    logprobs = s.gather(-1, targets[:, None])[:, 0].clone().requires_grad_(True)
    teacher = t.gather(-1, targets[:, None])[:, 0]
    mask = torch.ones(1, 5, dtype=torch.bool)
    values = distill_values(DISTILL_LOSSES["k1"], logprobs=logprobs, teacher_logprobs=teacher)
    out = distill_objective(
        values[None], mask, use_policy_gradient=True, logprobs=logprobs[None], old_logprobs=logprobs.detach()[None]
    )
    (grad,) = torch.autograd.grad(out.loss_sum, logprobs)
    torch.testing.assert_close(grad, (logprobs - teacher).detach(), atol=ATOL, rtol=0)
    assert math.isclose(out.loss_sum.item(), (logprobs - teacher).sum().item(), abs_tol=ATOL)
    same = distill_values(DISTILL_LOSSES["k1"], logprobs=logprobs, teacher_logprobs=logprobs.detach())
    zero = distill_objective(
        same[None], mask, use_policy_gradient=True, logprobs=logprobs[None], old_logprobs=logprobs.detach()[None]
    )
    (grad0,) = torch.autograd.grad(zero.loss_sum, logprobs)
    assert zero.loss_sum.item() == 0.0 and torch.count_nonzero(grad0) == 0
    assert aggregate(same[None].detach(), mask).loss_sum.item() == 0.0
