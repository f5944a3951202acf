"""``rollout.engine_restarts`` is spent over the run's attempts (``trainer.engines.restart_budget``):
an attempt that starts in the same run directory has only what earlier attempts left."""

from __future__ import annotations

import pytest

from megatron_empg.trainer.engines.restart_budget import RestartBudget
from megatron_empg.trainer.run.watchdog import RestartableError


def test_restarts_spent_in_one_attempt_are_gone_in_the_next(tmp_path):
    lost = RuntimeError("engine 0 lost")
    first = RestartBudget(tmp_path, limit=2)
    first.spend(lost)
    second = RestartBudget(tmp_path, limit=2)  # the launcher's restart: a new process, the same run
    assert second.used == 1
    second.spend(lost)
    with pytest.raises(RestartableError, match=r"rollout.engine_restarts=2 spent over the run's attempts"):
        RestartBudget(tmp_path, limit=2).spend(lost)
    # negative control: another run's directory has its own budget
    fresh = RestartBudget(tmp_path / "other", limit=2)
    fresh.spend(lost)
    assert fresh.used == 1


def test_limit_0_allows_no_restart(tmp_path):
    with pytest.raises(RestartableError):
        RestartBudget(tmp_path, limit=0).spend(RuntimeError("lost"))
    assert RestartBudget(tmp_path, limit=0).used == 0
