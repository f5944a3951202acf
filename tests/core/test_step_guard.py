"""``core.step_guard.GradNormGuard``: which optimizer steps are refused (a non-finite loss or
gradient norm always; a norm over factor x the median of the last applied steps' once there are
enough of them), the history of applied norms, and its state for a checkpoint."""

from __future__ import annotations

import math

import pytest

from megatron_empg.core.step_guard import HISTORY, MIN_HISTORY, GradNormGuard, SkipReason


def _guard(norms: list[float], factor: float | None = 10.0) -> GradNormGuard:
    guard = GradNormGuard(factor)
    for norm in norms:
        guard.record(norm)
    return guard


@pytest.mark.parametrize("factor", [10.0, None])
def test_non_finite_loss_or_norm_is_always_refused(factor):
    guard = _guard([1.0] * MIN_HISTORY, factor)
    assert guard.decide(math.nan, 1.0) == SkipReason.NON_FINITE_LOSS
    assert guard.decide(math.inf, math.nan) == SkipReason.NON_FINITE_LOSS  # the more severe reason
    assert guard.decide(0.5, math.nan) == SkipReason.NON_FINITE_GRAD_NORM
    assert guard.decide(0.5, math.inf) == SkipReason.NON_FINITE_GRAD_NORM
    assert GradNormGuard(factor).decide(0.5, math.inf) == SkipReason.NON_FINITE_GRAD_NORM  # no history needed
    assert guard.describe(SkipReason.NON_FINITE_LOSS, math.nan, 1.0, None) == "non-finite loss (nan)"
    assert guard.describe(SkipReason.NON_FINITE_GRAD_NORM, 0.5, math.inf, None) == "non-finite gradient norm (inf)"


def test_a_spike_over_factor_times_the_median_is_refused():
    guard = _guard([1.0, 2.0, 3.0, 4.0, 100.0])  # median 3: the threshold is 30, robust to the 100
    assert guard.threshold() == 30.0
    assert guard.decide(0.5, 30.0) == SkipReason.NONE
    assert guard.decide(0.5, 30.001) == SkipReason.GRAD_NORM_SPIKE
    assert guard.describe(SkipReason.GRAD_NORM_SPIKE, 0.5, 31.0, guard.threshold()) == (
        "gradient norm 31 > 30 (train.skip_grad_norm_factor=10 x the median of the last applied steps' norms)"
    )


def test_no_spike_check_before_the_minimum_history():
    guard = _guard([1.0] * (MIN_HISTORY - 1))
    assert guard.threshold() is None and guard.decide(0.5, 1e9) == SkipReason.NONE
    guard.record(1.0)
    assert guard.threshold() == 10.0 and guard.decide(0.5, 1e9) == SkipReason.GRAD_NORM_SPIKE


def test_factor_none_disables_the_spike_check():
    guard = _guard([1.0] * HISTORY, factor=None)
    assert guard.threshold() is None and guard.decide(0.5, 1e30) == SkipReason.NONE


def test_the_history_is_the_last_applied_steps_and_round_trips():
    guard = _guard([float(i) for i in range(1, HISTORY + 6)])  # 1 .. 25: the last 20 are 6 .. 25
    assert guard.history == [float(i) for i in range(6, HISTORY + 6)] and guard.threshold() == 155.0
    restored = GradNormGuard(10.0)
    restored.load_state_dict(guard.state_dict())
    assert restored.history == guard.history and restored.decide(0.5, 155.5) == guard.decide(0.5, 155.5)
    assert guard.decide(0.5, 155.5) == SkipReason.GRAD_NORM_SPIKE


@pytest.mark.parametrize("factor", [1.0, 0.5, math.inf, math.nan])
def test_a_factor_must_be_a_finite_number_over_1(factor):
    with pytest.raises(ValueError, match="factor must be a finite number > 1 or None"):
        GradNormGuard(factor)
