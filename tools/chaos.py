"""The randomized fault campaign: one long run of the CPU demo through ``launchers/torchrun.sh``'s
restart loop, with one-step-off engines (2 training ranks, 1 engine rank, ``rollout.max_staleness``
1, the transformers engine), under seeded faults at random moments; then compared with the same run
uninterrupted.

    .venv/bin/python tools/chaos.py [--steps 24] [--faults 8] [--seed 0] [--warm-start DIR]
        [--kinds KIND ...] [--out benchmarks/results/chaos_cpu_<commit>.json]

The faults (``FAULTS``), each at a random step (a random moment inside it), one after the other:

    kill_rank      SIGKILL to training rank 1 (its peer's collective fails: restartable)
    stop_rank      SIGSTOP to training rank 1 (rank 0's learned phase limit: a hang)
    kill_engine    SIGKILL to the engine rank
    stop_engine    SIGSTOP to the engine rank (the training ranks wait in the rollout: a hang)
    corrupt_shard  the newest checkpoint's largest shard cut in half, then SIGKILL to rank 1: the
                   restart resumes from the checkpoint before it

It reports the faults injected and survived (the run went on to a new step after it), steps lost
(steps of the reference missing at the end), steps done twice (trained again after a restart), the
seconds from each fault to the next new step (p50, max), and whether the final metrics equal the
uninterrupted run's in every key but the timings (resume is exact at k = 1). The hang detection
uses the learned limits with ``supervisor.learned_floor_s`` lowered to ``FLOOR_S`` (the default
60 s would make the campaign 4x longer; the default is measured by tests/launchers/test_restart_loop.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.faults import TIMING, Suite, truncate_checkpoint  # noqa: E402
from tools.faults_supervised import HF, _beat  # noqa: E402

ONE_STEP_OFF = (
    "rollout.placement=disaggregated",
    "rollout.engine_ranks=1",
    "rollout.max_staleness=1",
    "algorithm.behavior_is=tis",
    *HF,
)
FLOOR_S = 10.0
SUPERVISED = (
    "supervisor.heartbeat_interval_s=1",
    f"supervisor.learned_floor_s={FLOOR_S}",
    "supervisor.max_restarts=100",
    "train.prompts_per_step=4",
    "rollout.sampling.n=4",
    "train.micro_batch_size=8",
)
ENGINE_RANK, TRAINING_RANK = 2, 1


def _signal_rank(run: Path, rank: int, sig: int) -> str:
    pid = _beat(run, rank).get("pid")
    if pid is None:
        return f"no heartbeat of rank {rank}"
    os.kill(pid, sig)
    return f"{signal.Signals(sig).name} to rank {rank} (pid {pid})"


def _corrupt_then_kill(run: Path) -> str:
    what = truncate_checkpoint(run) if (run / "checkpoints" / "latest").is_file() else "no checkpoint yet"
    return f"{what}; {_signal_rank(run, TRAINING_RANK, signal.SIGKILL)}"


FAULTS = {
    "kill_rank": lambda run: _signal_rank(run, TRAINING_RANK, signal.SIGKILL),
    "stop_rank": lambda run: _signal_rank(run, TRAINING_RANK, signal.SIGSTOP),
    "kill_engine": lambda run: _signal_rank(run, ENGINE_RANK, signal.SIGKILL),
    "stop_engine": lambda run: _signal_rank(run, ENGINE_RANK, signal.SIGSTOP),
    "corrupt_shard": _corrupt_then_kill,
}


def steps_done_twice(log: Path, faults: list[dict]) -> int:
    """Steps trained again: per restart, the newest step logged before its fault minus the step
    its resume started from (metrics.jsonl keeps one record per step, so it cannot tell)."""
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log.read_text(errors="replace"))]
    return sum(max(0, f["at_step"] - r) for f, r in zip([f for f in faults if f["survived"]], resumed))


def _steps_logged(run: Path) -> list[int]:
    """The step records of metrics.jsonl."""
    path = run / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return steps


def campaign(suite: Suite, name: str, faults: list[tuple[str, float]], rng: random.Random) -> dict:
    """The run under ``faults`` ((kind, at step), in order); what each did."""
    run = suite.work / name
    suite.config(name)
    proc = suite.start(name, *ONE_STEP_OFF, *SUPERVISED, launcher=True, nproc=3)
    injected = []
    for kind, at in faults:
        if not suite.wait_for(proc, lambda: max(_steps_logged(run), default=0) >= at):
            break
        time.sleep(rng.uniform(0.0, 1.0))  # a random moment of the next step
        records, newest = len(_steps_logged(run)), max(_steps_logged(run), default=0)
        t_fault = time.monotonic()
        what = FAULTS[kind](run)
        nxt = suite.wait_for(proc, lambda: len(_steps_logged(run)) > records)  # a step trained (again) after it
        injected.append(
            {
                "kind": kind,
                "at_step": newest,
                "what": what,
                "survived": nxt,
                "seconds_to_next_step": round(time.monotonic() - t_fault, 1) if nxt else None,
            }
        )
    code = suite.finish(proc)
    return {"exit_code": code, "faults": injected}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start", default=str(REPO / "runs" / "demo" / "warm_start"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--work", default=None, help="where the runs go (default: a new directory in /tmp)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/chaos_cpu_<commit>.json")
    args = parser.parse_args(argv)
    warm = Path(args.warm_start)
    work = Path(args.work or f"/tmp/empg-chaos-{os.getpid()}")
    if not (warm / "config.json").is_file():  # the tests' short warm start (tests/conftest.py), ~15 s
        from tools.make_demo_model import make_demo_model

        warm = work / "warm_start"
        make_demo_model(warm, steps=300, stop_accuracy=0.0, eval_problems=16, restate_fraction=0.0, log=print)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"chaos_cpu_{commit.stdout.strip()}.json")
    suite = Suite(work, warm, args.steps)
    rng = random.Random(args.seed)
    # faults spread over the run, at seeded steps: past step 2 (the limits learn from the first steps)
    # and before the last (a rank stopped once its peers ended is watched by no one: see the docs)
    at = sorted(rng.randint(2, args.steps - 2) for _ in range(args.faults))
    faults = [(rng.choice(args.kinds), a) for a in at]
    began, shm_before = time.monotonic(), set(os.listdir("/dev/shm"))
    suite.config("reference")
    code = suite.finish(suite.start("reference", *ONE_STEP_OFF, *SUPERVISED, launcher=True, nproc=3))
    suite.reference = suite.metrics("reference")
    if code != 0 or len(suite.reference) != args.steps:
        print(f"the reference run failed (exit {code}): see {work / 'reference.log'}", file=sys.stderr)
        return 1
    reference_s = time.monotonic() - began
    result = campaign(suite, "chaos", faults, rng)
    compared = suite.compare("chaos")
    steps = _steps_logged(work / "chaos")
    seconds = [f["seconds_to_next_step"] for f in result["faults"] if f["seconds_to_next_step"] is not None]
    report = {
        "benchmark": "chaos",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit.stdout.strip(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "note": "shared 2-core VM (another job ran beside it); local disk",
        },
        "setup": {
            "steps": args.steps,
            "processes": "2 training ranks + 1 engine rank (launchers/torchrun.sh, gloo)",
            "overrides": [*ONE_STEP_OFF, *SUPERVISED],
            "checkpoint_interval": 3,
            "seed": args.seed,
        },
        "summary": {
            "faults_injected": len(result["faults"]),
            "faults_survived": sum(f["survived"] for f in result["faults"]),
            "steps_lost": len(set(range(1, args.steps + 1)) - set(steps)),
            "steps_done_twice": steps_done_twice(work / "chaos.log", result["faults"]),
            "seconds_to_next_step_p50": statistics.median(seconds) if seconds else None,
            "seconds_to_next_step_max": max(seconds, default=None),
            "final_metrics_equal_uninterrupted": compared["resumed_identical"],
            "exit_code": result["exit_code"],
        },
        "faults": result["faults"],
        "comparison": compared,
        "restarts": [json.loads(line) for line in (work / "chaos" / "restarts.jsonl").read_text().splitlines()]
        if (work / "chaos" / "restarts.jsonl").is_file()
        else [],
        "leftovers": suite.leftovers("chaos", shm_before),
        "timing_metrics_excluded": list(TIMING),
        "reference_wall_s": round(reference_s, 1),
        "total_wall_s": round(time.monotonic() - began, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"]))
    summary = report["summary"]
    ok = summary["faults_survived"] == summary["faults_injected"] and not summary["steps_lost"]
    return 0 if ok and summary["final_metrics_equal_uninterrupted"] else 1


if __name__ == "__main__":
    sys.exit(main())
