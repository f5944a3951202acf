"""``empg train`` on a few steps of the CPU demo recipe, from the trainer tests: the config, and
the run as a subprocess (one process, or N ranks through ``launchers/torchrun.sh``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_empg.config import read_yaml
from tools.run_processes import processes_with  # noqa: F401 (the tests' import)

REPO = Path(__file__).resolve().parents[2]
DEMO_RECIPE = REPO / "recipes" / "demo_cpu.yaml"
TORCHRUN_LAUNCHER = REPO / "launchers" / "torchrun.sh"
LAUNCH_TIMEOUT_S = 240  # one run of a few steps, on 2 ranks: ~40 s of start-up (vLLM engine, Megatron)
# A training statistic of a run on several ranks vs one process: sums over tokens of fp32 log-prob
# arithmetic whose reduction order depends on the layout (a TP all-reduce/all-gather, a pipeline
# split, a DP all-reduce of gradients). Measured differences up to 7e-7 relative (grad norm) and
# 8e-8 absolute (a Top-k KL of ~1.6e-4, a difference of nearly equal log-probs, so its error is
# absolute). A layout bug (a wrong shard, a replica's batch missing from a reduction) changes these
# by percents or more.
CLOSE_REL, CLOSE_ABS = 1e-5, 1e-6
# Per-step metrics that are functions of the rollouts and the schedule only: equal when the samples are.
EXACT = (
    "reward/mean",
    "reward/std",
    "reward/accuracy",
    "reward/malformed",
    "response/length_mean",
    "response/truncated_fraction",
    "actor/lr",
    "anchor/updates",
    "sync/gbytes",
)
# Sums over tokens of fp32 log-prob arithmetic: to CLOSE_REL, CLOSE_ABS.
CLOSE = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/ratio")
REFERENCE_STEPS = 20  # of the one-process reference run (conftest.py small_demo_reference): a signalled
# Slurm job stops some steps after the signal (steps of 0.4 s, signals through srun in 1.5 s; on a loaded
# 2-core machine 4 or more steps late: 20 leaves room)


def demo_config(tmp: Path, name: str, warm_start: Path | None, steps: int = 3) -> dict:
    """recipes/demo_cpu.yaml for ``steps`` steps, a checkpoint every step, in ``tmp / name``."""
    config = read_yaml(DEMO_RECIPE)
    config["train"]["steps"] = steps
    config["logging"] = {"dir": str(tmp / name), "progress": "none"}
    config["checkpoint"].update(
        dir=str(tmp / name / "checkpoints"),
        interval=1,
        keep_last=5,
        init_from=None if warm_start is None else str(warm_start),
    )
    return config


def small_demo_config(tmp: Path, name: str, warm_start: Path | None, steps: int) -> dict:
    """``demo_config`` with 4 prompts x 4 samples per step, micro-batches of 8: on two data-parallel
    ranks, 8 samples and one micro-batch each."""
    config = demo_config(tmp, name, warm_start, steps=steps)
    config["train"].update(prompts_per_step=4, micro_batch_size=8)
    config["rollout"]["sampling"]["n"] = 4
    return config


def train_command(
    config: dict, tmp: Path, name: str, *extra: str, nproc: int | None = None, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Write ``config`` to ``tmp / name.yaml``; the command (and its environment: this one's, with
    ``env``) that trains on it: ``python -m megatron_empg.trainer.cli train`` in one process
    (``nproc`` None), else ``launchers/torchrun.sh`` on ``nproc`` ranks with this interpreter's
    ``python`` and ``torchrun``. ``extra``: overrides and ``--resume``. Run it from ``REPO``."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if nproc is None:
        return [sys.executable, "-m", "megatron_empg.trainer.cli", "train", str(path), *extra], env
    env.update(NPROC_PER_NODE=str(nproc), PYTHON=sys.executable, TORCHRUN=str(Path(sys.executable).parent / "torchrun"))
    return [str(TORCHRUN_LAUNCHER), str(path), *extra], env


def run_train(
    config: dict,
    tmp: Path,
    name: str,
    *extra: str,
    nproc: int | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``train_command`` run to its end (output captured as text); after ``timeout`` seconds it is
    interrupted (``interrupt``) and ``subprocess.TimeoutExpired`` raised."""
    command, env = train_command(config, tmp, name, *extra, nproc=nproc, env=env)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, cwd=REPO, env=env, **pipes) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            interrupt(proc)
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def interrupt(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stop a run still going: SIGINT (the launcher passes it to torchrun, which passes it to the
    ranks and the engine), then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def unexpected_errors(text: str, *, torchrun: bool = False) -> list[str]:
    """The exception lines of a run's output that are not expected: torchrun re-raises a signal it
    forwarded (``SignalException``), and multiprocessing's resource tracker, shared by the trainer
    and vLLM's spawned engine core, may be told twice that a shared-memory segment is gone
    (``KeyError: '/psm_...'``: CPython 3.11's tracker registers both ends). A rank's error is none."""
    raised = [line for line in text.splitlines() if re.match(r"(\[rank\d+\]: )?[\w.]+(Error|Exception)\b", line)]
    return [
        line
        for line in raised
        if not re.search(r"KeyError: '/psm_", line) and not (torchrun and "SignalException: Process" in line)
    ]


def assert_same_steps(ours: list[dict], reference: list[dict], *, same_tokens: bool) -> None:
    """Each metrics record of ``ours`` against ``reference``'s record of the same step: ``EXACT``
    keys equal, ``CLOSE`` keys to ``CLOSE_REL`` / ``CLOSE_ABS``, and with ``same_tokens`` the same
    ``rollout/digest`` (False where the digest is one engine's share of the samples)."""
    by_step = {m["step"]: m for m in reference}
    for record in ours:
        step = record["step"]
        ref = by_step[step]
        for key in EXACT:
            assert record[key] == ref[key], (step, key, record[key], ref[key])
        for key in CLOSE:
            assert record[key] == pytest.approx(ref[key], rel=CLOSE_REL, abs=CLOSE_ABS), (step, key)
        if same_tokens:
            assert record["rollout/digest"] == ref["rollout/digest"], step
