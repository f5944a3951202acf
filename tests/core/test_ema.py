"""EMA anchor update and schedule: exact limits, float64 recursion, the bf16 stall, validation."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_empg.core.ema import EmaSchedule, ema_update_


def tensors(seed: int, shapes=((4, 3), (7,), (2, 2, 2)), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


# --------------------------------------------------------------------------------------------
# ema_update_


def test_tau_one_leaves_anchor_bits_unchanged():
    anchor = tensors(0)
    expected = [a.clone() for a in anchor]
    policy = tensors(1)
    policy[0][0, 0] = 3e38  # policy - anchor would overflow in a naive lerp; must not matter
    ema_update_(anchor, policy, 1.0)
    for a, e in zip(anchor, expected):
        assert torch.equal(a, e)


@pytest.mark.parametrize("policy_dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tau_zero_copies_policy_exactly(policy_dtype):
    anchor = tensors(0)
    policy = tensors(1, dtype=policy_dtype)
    ema_update_(anchor, policy, 0.0)
    for a, p in zip(anchor, policy):
        assert a.dtype == torch.float32
        assert torch.equal(a, p.to(torch.float32))


def test_tau_half_is_the_exact_average():
    # dyadic values (k / 64, |k| < 2^10): every intermediate is exact in float32
    g = torch.Generator().manual_seed(2)
    anchor = [torch.randint(-1000, 1000, (5, 6), generator=g).float() / 64]
    policy = [torch.randint(-1000, 1000, (5, 6), generator=g).float() / 64]
    expected = (anchor[0].double() + policy[0].double()) / 2
    ema_update_(anchor, policy, 0.5)
    assert torch.equal(anchor[0].double(), expected)


def test_random_tau_half_within_one_rounding():
    anchor, policy = tensors(3), tensors(4)
    expected = [((a.double() + p.double()) / 2) for a, p in zip(anchor, policy)]
    ema_update_(anchor, policy, 0.5)
    for a, e in zip(anchor, expected):
        # lerp rounds twice at most (b - a, then the sum): within 2 float32 ulps of the exact mean
        torch.testing.assert_close(a.double(), e, rtol=2.5e-7, atol=1e-7)


def test_matches_float64_recursion_over_100_steps():
    tau = 0.9
    g = torch.Generator().manual_seed(5)
    anchor = tensors(6)
    expected = [a.double() for a in anchor]
    policy = [a.clone() for a in anchor]
    for _ in range(100):
        for p in policy:  # a random walk of the policy, std 1e-2 per step
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        ema_update_(anchor, policy, tau)
        expected = [tau * e + (1 - tau) * p.double() for e, p in zip(expected, policy)]
    for a, e in zip(anchor, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-6, atol=1e-6)


def test_bf16_policy_is_cast_and_matches_float32_policy():
    anchor_from_bf16, anchor_from_fp32 = tensors(7), tensors(7)
    policy_bf16 = tensors(8, dtype=torch.bfloat16)
    mixed = [policy_bf16[0], policy_bf16[1].float(), policy_bf16[2]]  # mixed dtypes in one call
    ema_update_(anchor_from_bf16, mixed, 0.8)
    ema_update_(anchor_from_fp32, [p.float() for p in policy_bf16], 0.8)
    for actual, expected in zip(anchor_from_bf16, anchor_from_fp32):
        assert torch.equal(actual, expected)


def test_parameters_that_require_grad_are_updated_without_autograd_errors():
    anchor = [torch.nn.Parameter(torch.zeros(3))]
    ema_update_(anchor, [torch.ones(3)], 0.75)
    torch.testing.assert_close(anchor[0].detach(), torch.full((3,), 0.25))
    assert anchor[0].grad_fn is None


def test_bf16_ema_stalls_on_small_drifts_while_float32_tracks_float64():
    """Why the anchor is float32 (docs/design/ema-pg.md 7.3): lr-1e-6-sized drifts vanish in a bf16 EMA.

    The policy moves by about 1e-6 per step (Adam-like, consistent sign per coordinate) from
    weights of order 1, where a bf16 ulp is 2^-8..2^-7 (4e-3..8e-3). A bf16 EMA never moves:
    neither with the same lerp as ``ema_update_`` run in bf16 (the cast of the policy to bf16
    already erases the drift), nor with the update computed in float32 from the float32 policy
    and stored back in bf16 (the step (1 - tau) * |policy - anchor| ~ 1e-5 is below half an ulp).
    The float32 anchor follows the float64 EMA.
    """
    tau, steps, lr = 0.9, 100, 1e-6
    g = torch.Generator().manual_seed(9)
    start = (torch.rand(4096, generator=g) + 0.5).to(torch.bfloat16).float()  # |w| in [0.5, 1.5]
    direction = torch.randn(4096, generator=g).sign()
    policy = start.double().clone()
    expected = start.double().clone()  # float64 EMA
    anchor_fp32 = [start.clone()]
    anchor_bf16 = start.to(torch.bfloat16)
    anchor_bf16_fp32_math = start.to(torch.bfloat16)
    for _ in range(steps):
        policy += lr * direction * (1 + 0.1 * torch.randn(4096, generator=g, dtype=torch.float64))
        expected = tau * expected + (1 - tau) * policy
        ema_update_(anchor_fp32, [policy.float()], tau)
        anchor_bf16.lerp_(policy.to(torch.bfloat16), 1 - tau)  # what a bf16 anchor would do
        anchor_bf16_fp32_math.copy_(anchor_bf16_fp32_math.float().lerp(policy.float(), 1 - tau))
    expected_shift = expected - start.double()
    assert expected_shift.abs().min() > 3e-5  # the true anchor moved on every coordinate
    assert torch.equal(anchor_bf16, start.to(torch.bfloat16))  # the bf16 anchors never moved
    assert torch.equal(anchor_bf16_fp32_math, start.to(torch.bfloat16))
    torch.testing.assert_close(anchor_fp32[0].double(), expected, rtol=1e-6, atol=0)
    actual_shift = anchor_fp32[0].double() - start.double()
    cosine = torch.nn.functional.cosine_similarity(actual_shift, expected_shift, dim=0)
    assert cosine > 0.99  # float32 follows the direction of the drift


# --------------------------------------------------------------------------------------------
# ema_update_ input errors


def test_bad_tau_is_rejected():
    for tau in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="tau="):
            ema_update_(tensors(0), tensors(1), tau)


def test_bf16_anchor_is_rejected():
    anchor = tensors(0)
    anchor[1] = anchor[1].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"anchor\[1\] has dtype torch.bfloat16.*float32"):
        ema_update_(anchor, tensors(1), 0.9)


def test_length_shape_dtype_mismatches_name_the_index():
    with pytest.raises(ValueError, match="anchor has 3 tensors but policy has 2"):
        ema_update_(tensors(0), tensors(1)[:2], 0.9)
    policy = tensors(1)
    policy[2] = torch.zeros(8)
    message = r"policy\[2\] has shape \(8,\) but anchor\[2\] has shape \(2, 2, 2\)"
    with pytest.raises(ValueError, match=message):
        ema_update_(tensors(0), policy, 0.9)
    policy = tensors(1)
    policy[0] = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"policy\[0\] has dtype torch.int64"):
        ema_update_(tensors(0), policy, 0.9)


def test_non_finite_policy_is_rejected_before_touching_the_anchor():
    anchor = tensors(0)
    before = [a.clone() for a in anchor]
    policy = tensors(1)
    policy[1][3] = float("inf")
    with pytest.raises(ValueError, match=r"policy\[1\] contains NaN or infinite"):
        ema_update_(anchor, policy, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(anchor, before))


def test_empty_parameter_lists_are_a_no_op():
    ema_update_([], [], 0.9)


# --------------------------------------------------------------------------------------------
# EmaSchedule


def updates(schedule: EmaSchedule, last_step: int = 40) -> list[int]:
    return [t for t in range(1, last_step + 1) if schedule.should_update(t)]


def test_schedule_period_10_updates_after_steps_10_20_30():
    assert updates(EmaSchedule(tau=0.9, period=10)) == [10, 20, 30, 40]


def test_schedule_period_1_tau_0_updates_every_step():
    assert updates(EmaSchedule(tau=0.0, period=1), last_step=5) == [1, 2, 3, 4, 5]


def test_schedule_first_update_shifts_the_phase():
    assert updates(EmaSchedule(tau=0.9, period=10, first_update=1)) == [1, 11, 21, 31]
    assert updates(EmaSchedule(tau=0.9, period=10, first_update=25)) == [25, 35]
    assert updates(EmaSchedule(tau=0.5, period=1, first_update=3), last_step=6) == [3, 4, 5, 6]


def test_schedule_tau_one_never_updates():
    assert updates(EmaSchedule(tau=1.0, period=1)) == []
    assert updates(EmaSchedule(tau=1.0, period=10, first_update=1)) == []


def test_schedule_statistics_match_ema_pg_numbers():
    s09, s095 = EmaSchedule(tau=0.9, period=10), EmaSchedule(tau=0.95, period=10)
    assert s09.per_step_factor == pytest.approx(0.98952, abs=1e-5)
    assert s095.per_step_factor == pytest.approx(0.99488, abs=1e-5)
    assert s09.half_life == pytest.approx(65.79, abs=0.01)
    assert s095.half_life == pytest.approx(135.1, abs=0.1)
    assert s09.mean_lag == pytest.approx(90.0)
    assert s095.mean_lag == pytest.approx(190.0)
    # half-life: a policy's weight halves after half_life steps of the per-step factor
    assert s09.per_step_factor**s09.half_life == pytest.approx(0.5)
    assert EmaSchedule(tau=1.0, period=10).half_life == math.inf
    assert EmaSchedule(tau=1.0, period=10).mean_lag == math.inf
    assert EmaSchedule(tau=0.0, period=1).half_life == 0.0
    assert EmaSchedule(tau=0.0, period=1).mean_lag == 0.0


def test_schedule_is_frozen():
    schedule = EmaSchedule(tau=0.9, period=10)
    with pytest.raises(AttributeError):
        schedule.tau = 0.5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(tau=1.1, period=10), "EmaSchedule.tau"),
        (dict(tau=-0.5, period=10), "EmaSchedule.tau"),
        (dict(tau=float("nan"), period=10), "EmaSchedule.tau"),
        (dict(tau=0.9, period=0), "EmaSchedule.period"),
        (dict(tau=0.9, period=2.5), "EmaSchedule.period"),
        (dict(tau=0.9, period=10, first_update=0), "EmaSchedule.first_update"),
        (dict(tau=0.9, period=10, first_update=1.0), "EmaSchedule.first_update"),
    ],
)
def test_schedule_bad_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EmaSchedule(**kwargs)


def test_schedule_rejects_step_zero():
    with pytest.raises(ValueError, match="step=0"):
        EmaSchedule(tau=0.9, period=10).should_update(0)
