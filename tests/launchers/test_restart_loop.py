"""``launchers/torchrun.sh`` restarts a hung run by itself: rank 1 of 2 stops (SIGSTOP) inside a
collective of step 4's update; rank 0's watchdog finds the update past the limit it learned from
steps 1-3 (no supervisor setting given), writes its stacks and a diagnosis naming rank 1, kills the
stopped rank and exits restartable; the launcher restarts the run with ``--resume`` from step 3's
checkpoint, and it ends with every step logged once and equal to an uninterrupted run's, no process
of either attempt left (the transformers engine, 2 ranks)."""

from __future__ import annotations

import json

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from megatron_empg.trainer.run.restarts import read_history
from tests.trainer.demo_runs import (
    LAUNCH_TIMEOUT_S,
    REPO,
    assert_same_steps,
    processes_with,
    run_train,
    small_demo_config,
)

STEPS = 6
HF = ("rollout.engine=hf", "rollout.in_process=true", "weight_sync.transport=in_process")
# Issue 46: a stopped rank of the CPU demo found within 3 minutes with no setting given. The learned
# limit is the 60 s floor (updates of about a second); a 5 s heartbeat adds at most 5 s. The bound is
# the requirement itself, with 2 minutes to spare for a loaded machine.
DETECTED_WITHIN_S = 180

STOP_RANK_1 = """
import os
import signal
from pathlib import Path

MARK = Path(os.environ["EMPG_TEST_MARK"])
if os.environ.get("RANK") == "1":  # once: stopped in step 4's update (rank 0 waits in its gradient all-reduce)
    import megatron_empg.trainer.loop as loop

    _update = loop.Trainer.update

    def update(self, minis):
        if self.step_index + 1 == 4 and not MARK.exists():
            MARK.touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        return _update(self, minis)

    loop.Trainer.update = update
"""


def _config(tmp_path, warm_start, name: str) -> dict:
    config = small_demo_config(tmp_path, name, warm_start, STEPS)
    config["checkpoint"]["interval"] = 3
    return config


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_a_stopped_rank_is_found_and_the_run_restarts_itself(tmp_path, warm_start):
    reference = run_train(
        _config(tmp_path, warm_start, "full"), tmp_path, "full", *HF, nproc=2, timeout=LAUNCH_TIMEOUT_S
    )
    assert reference.returncode == 0, reference.stderr[-4000:]

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_RANK_1)
    env = {"PYTHONPATH": f"{hook}:{REPO}", "EMPG_TEST_MARK": str(tmp_path / "stopped"), "EMPG_TEST_RUN": tmp_path.name}
    done = run_train(
        _config(tmp_path, warm_start, "hung"),
        tmp_path,
        "hung",
        *HF,
        nproc=2,
        timeout=2 * LAUNCH_TIMEOUT_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "stopped").exists()  # the fault happened
    assert processes_with(f"EMPG_TEST_RUN={tmp_path.name}") == []

    run = tmp_path / "hung"
    (attempt,) = read_history(run)
    assert attempt["restart"] and attempt["cause"].startswith("hang: phase update of step 4 outlasted 60 s")
    (hang,) = run.glob("hang-*")
    detected_s = (hang / "summary-rank0.txt").stat().st_mtime - (tmp_path / "stopped").stat().st_mtime
    print(f"a stopped rank detected {detected_s:.1f} s after it stopped")
    assert detected_s < DETECTED_WITHIN_S
    summary = (hang / "summary-rank0.txt").read_text()
    assert "rank 1 on " in summary and "did not arrive (no heartbeat for" in summary and "killed (SIGKILL)" in summary
    assert "last step logged: 3" in summary
    assert "File " in (hang / "rank0.txt").read_text()  # rank 0's stacks (rank 1 was stopped: none)
    assert "hang: rank 0 spent" in done.stderr and "restarting after attempt 0" in done.stderr
    assert "learned: max(60 s, 5 x the slowest" in done.stderr

    ours, full = read_metrics(run / "metrics.jsonl"), read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))  # step 4 redone once, nothing lost
    assert_same_steps(ours, full, same_tokens=True)
    beats = {p.name: json.loads(p.read_text())["state"] for p in (run / "heartbeats").glob("rank*.json")}
    assert beats == {"rank0.json": "done", "rank1.json": "done"}  # the second attempt ended cleanly
