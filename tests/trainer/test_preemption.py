"""Pre-emption signals that reach the whole process group, after a periodic checkpoint: through
``launchers/torchrun.sh`` (SIGTERM to the launcher: torchrun sends SIGUSR1 to each rank's process
group, Megatron's checkpoint writer included) and straight to the process
group of ``empg train`` (``kill -TERM -PGID``). Each run checkpoints at the step it reached and exits;
every step logged before the signals equals the uninterrupted run's (the second run resumed from the
first's checkpoint), and no process is left. The periodic checkpoints are written in the background
(``checkpoint.async_save``): the signal's save commits the one in flight first."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import (
    CLOSE_ABS,
    CLOSE_REL,
    REPO,
    demo_config,
    interrupt,
    processes_with,
    run_train,
    train_command,
    unexpected_errors,
)

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow, pytest.mark.timeout(1200)]

# the engine in the trainer's process (CI time: the engine in a process of its own is pre-empted in
# tests/trainer/test_trainer_multirank.py and tests/launchers/test_slurm.py); the launcher adds nothing
ENGINE = ("rollout.in_process=true", "weight_sync.transport=in_process")
TRAINING = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/grad_norm", "actor/entropy")
TIMEOUT_S = 300


def _config(tmp_path, name, warm_start, steps):
    config = demo_config(tmp_path, name, warm_start, steps=steps)
    config["checkpoint"]["interval"] = 2  # a periodic checkpoint is taken before the signal
    config["checkpoint"]["async_save"] = True  # written in the background; the signal's save blocks
    return config


def _preempt(command, env, log, metrics, lines: int, send, sessions: set[int]) -> int:
    """Start ``command`` in a session of its own (added to ``sessions``); once ``metrics`` has
    ``lines`` records, ``send(process)``; its exit code."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        sessions.add(proc.pid)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not (metrics.exists() and metrics.read_text().count("\n") >= lines):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            send(proc)
            return proc.wait(timeout=TIMEOUT_S)
        finally:
            interrupt(proc)


def _stopped_at(log, *, torchrun: bool = False) -> int:
    text = log.read_text()
    assert not unexpected_errors(text, torchrun=torchrun), text[-4000:]  # no BrokenPipeError, no CheckpointError
    stops = re.findall(r"signal \d+: checkpointed at step (\d+), stopping", text)
    assert len(stops) == 1, text[-4000:]
    return int(stops[0])


def test_group_signals_after_a_periodic_checkpoint_lose_nothing(tmp_path, warm_start):
    marker = f"EMPG_TEST_RUN=preempt-{tmp_path.name}"
    env = dict([marker.split("=")])
    config = _config(tmp_path, "run", warm_start, 1000)
    metrics = tmp_path / "run" / "metrics.jsonl"
    checkpoints = tmp_path / "run" / "checkpoints"
    sessions: set[int] = set()

    # 1. torchrun.sh, SIGTERM to the launcher after step 3 (step 2 was checkpointed)
    command, run_env = train_command(config, tmp_path, "run", *ENGINE, nproc=1, env=env)
    to_launcher = lambda p: p.send_signal(signal.SIGTERM)  # noqa: E731
    _preempt(command, run_env, tmp_path / "a.log", metrics, 3, to_launcher, sessions)
    first = _stopped_at(tmp_path / "a.log", torchrun=True)
    assert first >= 3 and [r["step"] for r in read_metrics(metrics)] == list(range(1, first + 1))
    assert (checkpoints / "step_00000002").is_dir() and (checkpoints / f"step_{first:08d}").is_dir()
    assert processes_with(marker, sessions) == [], "a process outlived the pre-empted run"

    # 2. empg train --resume, SIGTERM to its whole process group two steps later
    command, run_env = train_command(config, tmp_path, "run", *ENGINE, "--resume", env=env)
    to_group = lambda p: os.killpg(p.pid, signal.SIGTERM)  # noqa: E731
    code = _preempt(command, run_env, tmp_path / "b.log", metrics, first + 2, to_group, sessions)
    assert code == 0, (tmp_path / "b.log").read_text()[-4000:]
    second = _stopped_at(tmp_path / "b.log")
    assert f"resumed from {checkpoints / f'step_{first:08d}'} at step {first}" in (tmp_path / "b.log").read_text()
    assert second >= first + 2 and processes_with(marker, sessions) == []
    assert (checkpoints / f"step_{second:08d}" / "empg_checkpoint.json").is_file()  # committed
    assert not [p.name for p in checkpoints.iterdir() if ".tmp-" in p.name]

    # 3. the uninterrupted reference: every step logged before the signals (no step lost) equal
    reference = run_train(
        _config(tmp_path, "reference", warm_start, second), tmp_path, "reference", *ENGINE, timeout=TIMEOUT_S
    )
    assert reference.returncode == 0, reference.stderr[-4000:]
    resumed, expected = read_metrics(metrics), read_metrics(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == list(range(1, second + 1))
    for got, want in zip(resumed, expected):
        assert got["rollout/digest"] == want["rollout/digest"], got["step"]
        assert got["reward/mean"] == want["reward/mean"] and got["anchor/updates"] == want["anchor/updates"]
        for key in TRAINING:
            assert got[key] == pytest.approx(want[key], rel=CLOSE_REL, abs=CLOSE_ABS), (got["step"], key)
