"""Phase limits learned from the run's own history (``trainer.run.phase_limits``): the default until a
phase was seen ``learn_after`` times, then the safety factor x the slowest time (at least the
floor), scaled by the token bound; explicit values win; the history is kept across attempts in the
run directory; a hang is declared at the learned limit."""

from __future__ import annotations

import time

import pytest

from megatron_empg.config import RunConfig, load_config
from megatron_empg.trainer.run.phase_limits import Learning, PhaseLimits, Seen, phase_timeouts, read_seen
from megatron_empg.trainer.run.watchdog import RESTARTABLE_EXIT, Watchdog
from tests.trainer.test_watchdog import REPO, run_script

DEMO = str(REPO / "recipes/demo_cpu.yaml")


def demo(tmp_path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, DEMO, [f"logging.dir={tmp_path}", *overrides])


def test_a_limit_is_the_default_until_learned_then_the_factor_times_the_slowest(tmp_path):
    config = demo(tmp_path)
    limits = PhaseLimits.for_run(config, tmp_path)
    default = phase_timeouts(config)["update"]
    for seconds in (2.0, 30.0):  # fewer than learn_after (3): still the default
        limits.observe("update", seconds)
        assert limits.limit("update") == default
    limits.observe("update", 4.0)
    assert limits.limit("update") == 5 * 30.0  # safety_factor x the slowest, above the 60 s floor
    for _ in range(3):
        limits.observe("advantages", 0.01)
    assert limits.limit("advantages") == 60.0  # the floor
    assert limits.limit("old_pass") == phase_timeouts(config)["old_pass"]  # never seen: the default
    assert "learned" in limits.explain("update")[1]


def test_explicit_values_win_and_learn_after_0_learns_nothing(tmp_path):
    set_update = PhaseLimits.for_run(demo(tmp_path, "supervisor.phase_timeout_s.update=7"), tmp_path)
    never = PhaseLimits.for_run(demo(tmp_path, "supervisor.learn_after=0"), tmp_path)
    for limits in (set_update, never):
        for _ in range(5):
            limits.observe("update", 1.0)
    assert set_update.explain("update") == (7, "supervisor.phase_timeout_s.update")
    assert never.limit("update") == phase_timeouts(demo(tmp_path))["update"]


def test_the_history_is_kept_across_attempts_and_merged_over_ranks(tmp_path):
    config = demo(tmp_path)
    rank0, rank1 = PhaseLimits.for_run(config, tmp_path), PhaseLimits.for_run(config, tmp_path)
    for seconds in (1.0, 2.0, 3.0):
        rank0.observe("update", seconds)
    rank1.observe("update", 20.0)  # once: the slowest, not enough times on its own
    rank0.save(tmp_path, 0)
    rank1.save(tmp_path, 1)
    next_attempt = PhaseLimits.for_run(config, tmp_path)
    assert next_attempt.seen["update"] == Seen(count=3, slowest=20.0, tokens=next_attempt.tokens)
    assert next_attempt.limit("update") == 100.0
    # negative control: another run directory has no history
    assert PhaseLimits.for_run(config, tmp_path / "other").limit("update") == phase_timeouts(config)["update"]


def test_a_learned_time_follows_the_token_bound(tmp_path):
    small = demo(tmp_path)
    limits = PhaseLimits.for_run(small, tmp_path)
    for _ in range(3):
        limits.observe("rollout", 40.0)
        limits.observe("checkpoint", 40.0)
    limits.save(tmp_path, 0)
    doubled = demo(tmp_path, f"train.prompts_per_step={2 * small.train.prompts_per_step}")
    seen = read_seen(tmp_path, PhaseLimits.for_run(doubled, tmp_path).tokens)
    assert seen["rollout"].slowest == pytest.approx(80.0)  # its work grows with the bound
    assert seen["checkpoint"].slowest == 40.0  # not a per-token phase


def test_an_outer_phase_counts_only_its_time_outside_the_inner_ones(tmp_path):
    limits = PhaseLimits({"step": 600.0, "update": 600.0})
    watchdog = Watchdog(tmp_path, 0, 1, limits, interval_s=60)
    try:
        with watchdog.phase("step", 1), watchdog.phase("update", 1):
            time.sleep(0.3)
    finally:
        watchdog.close()
    # without the nesting rule the step would have lasted longer than its update
    assert limits.seen["step"].slowest < limits.seen["update"].slowest
    assert limits.seen["update"].slowest >= 0.3


@pytest.mark.parametrize("learn_after", [2, 0])
def test_a_hang_is_declared_at_the_learned_limit(tmp_path, learn_after):
    """Two updates of 0.05 s teach a limit of max(0.5 s, 2 x 0.05 s): the third, stuck, is a hang;
    with ``learn_after`` 0 the default (600 s) lets it finish its 3 s."""
    learning = Learning(learn_after=learn_after, safety_factor=2.0, floor_s=0.5)
    done = run_script(
        f"""
        from megatron_empg.trainer.run.phase_limits import Learning
        limits = PhaseLimits({{"update": 600.0}}, learning=Learning{tuple(vars(learning).values())!r})
        w = watchdog.Watchdog(RUN_DIR, 0, 1, limits, 0.1)
        for _ in range(2):
            with w.phase("update", 1):
                time.sleep(0.05)
        with w.phase("update", 3):
            time.sleep(3)
        w.close()
    """,
        tmp_path,
    )
    if learn_after:
        assert done.returncode == RESTARTABLE_EXIT, done.stderr
        assert "phase update of step 3" in done.stderr and "learned: max(0.5 s, 2 x the slowest" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert not list(tmp_path.glob("hang-*"))
    assert read_seen(tmp_path, 0)["update"].count == 2 + (not learn_after)  # saved by the thread
