"""One run per directory (an OS lock, released when its holder dies) and the start rules: no fresh
start over an earlier run's checkpoints or metrics without ``--overwrite``; ``--resume`` with nothing
to resume starts at step 0 unless the metrics there belong to another checkpoint directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_empg.config import RunConfig, from_dict
from megatron_empg.mcore.checkpoint import DIST_CKPT_FILES, INFO_FILE, LATEST_FILE, checkpoint_info
from megatron_empg.trainer.run.run_dir import LOCK_FILE, RunDirectoryError, check_start, hold_run_directories

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, checkpoints: str = "run/checkpoints", logs: str = "run") -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": "tiny-qwen2",
            "tokenizer": "unused",
            "logging": {"dir": str(tmp_path / logs)},
            "checkpoint": {"dir": str(tmp_path / checkpoints)},
        },
    )


def _checkpoint(root: Path, step: int) -> None:
    """A committed checkpoint as ``find_latest_checkpoint`` sees one (marker and dist_checkpointing's files)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    for name in DIST_CKPT_FILES:
        (path / name).write_text("{}")
    info = checkpoint_info(step=step, model_name=None, layout={}, model_chunks=1, parts={})
    (path / INFO_FILE).write_text(json.dumps(info))
    (root / LATEST_FILE).write_text(path.name + "\n")


def _metrics(config: RunConfig, steps) -> Path:
    path = Path(config.logging.dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps))
    return path


HOLDER = """
import sys, time
from megatron_empg.config import RunConfig, from_dict
from megatron_empg.trainer.run.run_dir import hold_run_directories
config = from_dict(RunConfig, {"model": "tiny-qwen2", "tokenizer": "unused", "logging": {"dir": sys.argv[1]},
                               "checkpoint": {"dir": sys.argv[2]}})
held = hold_run_directories(config)
held.claim()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.process
def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_blocks_nothing(tmp_path):
    config = _config(tmp_path, "elsewhere/checkpoints")  # two directories, two locks
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, config.logging.dir, config.checkpoint.dir],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for field, directory in (("logging.dir", config.logging.dir), ("checkpoint.dir", config.checkpoint.dir)):
            # the same logging.dir; then only the same checkpoint.dir
            alone = _config(tmp_path) if field == "logging.dir" else _config(tmp_path, directory, "other")
            with pytest.raises(RunDirectoryError) as refused:
                hold_run_directories(alone)
            message = str(refused.value)
            assert f"{field}={Path(directory).resolve()} is in use by another run: pid {holder.pid} on host " in message
            assert f"{Path(directory).resolve() / LOCK_FILE}" in message and "started 20" in message
        hold_run_directories(_config(tmp_path / "x")).release()  # other directories are free
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding both
        holder.wait(timeout=30)
    held = hold_run_directories(config)  # the OS released the dead holder's locks
    assert held.previous["pid"] == holder.pid  # who held logging.dir last, and where its checkpoints went
    assert held.previous["checkpoint_dir"] == str(Path(config.checkpoint.dir).resolve())
    with pytest.raises(RunDirectoryError):  # the same process, a second time: refused as well
        hold_run_directories(config)
    held.release()
    hold_run_directories(config).release()


def test_fresh_start_refuses_an_earlier_runs_checkpoints_or_metrics_unless_overwrite(tmp_path):
    config = _config(tmp_path)
    check_start(config, resume=False, overwrite=False, previous=None)  # empty: fine
    _checkpoint(Path(config.checkpoint.dir), 4)
    with pytest.raises(
        RunDirectoryError,
        match=r"an earlier run left checkpoints \(newest: step_00000004\) in "
        r"checkpoint.dir=.*pass --resume to continue it, --overwrite",
    ):
        check_start(config, resume=False, overwrite=False, previous=None)
    other = _config(tmp_path / "b")
    metrics = _metrics(other, [1, 2, 3])
    with pytest.raises(RunDirectoryError, match=r"metrics \(3 records, steps 1-3\) in logging.dir="):
        check_start(other, resume=False, overwrite=False, previous=None)
    assert metrics.read_text().count("\n") == 3  # nothing touched

    _metrics(config, [1, 2, 3, 4, 5])
    check_start(config, resume=False, overwrite=True, previous=None)
    assert not (Path(config.logging.dir) / "metrics.jsonl").exists()
    assert sorted(p.name for p in Path(config.checkpoint.dir).iterdir()) == []
    check_start(config, resume=False, overwrite=False, previous=None)  # now a fresh directory


def test_resume_with_nothing_to_resume_starts_at_step_0_unless_the_metrics_are_another_runs(tmp_path, caplog):
    config = _config(tmp_path)
    check_start(config, resume=True, overwrite=False, previous=None)  # a requeue script's first attempt
    assert "--resume: no checkpoint in" in caplog.text and "starting at step 0" in caplog.text
    _checkpoint(Path(config.checkpoint.dir), 2)
    caplog.clear()
    check_start(config, resume=True, overwrite=False, previous=None)  # resumes: nothing said here
    assert caplog.text == ""

    typo = _config(tmp_path, "run/checkpionts")  # the metrics are of the run whose checkpoints are in run/checkpoints
    _metrics(typo, [1, 2, 3])
    previous = {"checkpoint_dir": str(Path(config.checkpoint.dir).resolve())}
    with pytest.raises(RunDirectoryError) as refused:
        check_start(typo, resume=True, overwrite=False, previous=previous)
    assert "checkpoint.dir=" in str(refused.value) and "checkpionts holds no checkpoint" in str(refused.value)
    assert (
        f"(3 records, steps 1-3; its checkpoints in {previous['checkpoint_dir']}). Is checkpoint.dir mistyped?"
        in str(refused.value)
    )
    with pytest.raises(RunDirectoryError, match="its checkpoints elsewhere"):  # no lock file: not this run's either
        check_start(typo, resume=True, overwrite=False, previous=None)
    # the same run, stopped before its first checkpoint: its records are redone
    caplog.clear()
    check_start(
        typo, resume=True, overwrite=False, previous={"checkpoint_dir": str(Path(typo.checkpoint.dir).resolve())}
    )
    assert "stopped before its first checkpoint: 3 records, steps 1-3 are redone" in caplog.text


@pytest.mark.process
def test_empg_train_refuses_a_second_run_before_building_anything(tmp_path, warm_start):
    """Through the command line: the second ``empg train`` on a held directory exits 2 at once; the
    first one's checkpoints and metrics are untouched."""
    from tests.trainer.demo_runs import demo_config, train_command

    config = demo_config(tmp_path, "run", warm_start, steps=2)
    command, env = train_command(config, tmp_path, "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, config["logging"]["dir"], config["checkpoint"]["dir"]],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"is in use by another run: pid {holder.pid} on host" in done.stderr
    assert "Traceback" not in done.stderr and "engine" not in done.stderr.lower()
    print(f"refused after {seconds:.2f} s")  # (the fault suite records it; no timing assertion here)
    assert sorted(os.listdir(config["logging"]["dir"])) == [LOCK_FILE, "checkpoints"]
    assert os.listdir(config["checkpoint"]["dir"]) == [LOCK_FILE]
