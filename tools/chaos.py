"""The randomized fault campaign: one long run of the CPU demo through ``launchers/torchrun.sh``'s
restart loop, with one-step-off engines (2 training ranks, 1 engine rank, ``rollout.max_staleness``
1, the transformers engine), under seeded faults at random moments, injected from this process;
then compared with the same run uninterrupted.

    .venv/bin/python tools/chaos.py [--steps 24] [--faults 8] [--seed 0] [--warm-start DIR]
        [--kinds KIND ...] [--out benchmarks/results/chaos_cpu_<commit>.json]

The faults (``FAULTS``), each at a random moment of a seeded step, one after the other, the kinds a
seeded shuffle of ``--kinds`` repeated (so ``--faults`` >= the kinds has each at least once):

    kill_rank      SIGKILL to training rank 1 (its peer's collective fails: restartable)
    stop_rank      SIGSTOP to training rank 1 (rank 0's learned phase limit: a hang)
    kill_engine    SIGKILL to the engine rank
    stop_engine    SIGSTOP to the engine rank (the training ranks wait in the rollout: a hang)
    corrupt_shard  the newest checkpoint's largest shard cut in half, then SIGKILL to rank 1: the
                   restart resumes from the checkpoint before it (with one checkpoint: no cut)
    full_disk      the training ranks' file size limit (RLIMIT_FSIZE, prlimit from here) lowered
                   below a checkpoint shard: their next save fails (EFBIG), the run exits
                   restartable and the launcher's restart (new processes, no limit: the space came
                   back) resumes from the last checkpoint
    hang_reward    the reward hangs in the process that next calls it, for ever (the engine rank
                   scores; its ``draw`` phase, or the trainers' ``rollout``, passes its learned limit)
    nan_step       the next update's loss is NaN: the step guard refuses it, no restart

The last two are flag files read by ``tools/chaos_hook.py`` in the run's processes (a test hook);
the others act on the processes and files as a cluster's faults do. A fault that acts later than it
is injected (a full disk at the next save, the flags when taken) is timed from then.

It reports the faults injected and survived (the run restarted for the fault, for the expected
cause where there is one, ``EXPECTED_CAUSE``; a NaN step without a restart; and a step was logged
after it), steps lost (steps of the reference missing at the end), steps trained twice (rank 0's
log of each step it logged, ``chaos_hook``), the seconds from each fault (the signal; the reward's
hang; the failed save) to its detection and to the next step logged (p50, max), and whether the
final metrics equal the uninterrupted run's in every key but the timings and ``NOT_COMPARED`` (resume is
exact at k = 1). The reference runs after the campaign, with the steps the campaign's NaN faults
poisoned poisoned alike (a poisoned step redone after a restart is poisoned again, as a NaN from the
data would be): a refused step changes every later step, so it is compared with a run that refused
the same steps. The hang detection uses the learned limits with ``supervisor.learned_floor_s``
lowered to ``FLOOR_S`` (the default 60 s would make the campaign 4x longer; the default is measured
by tests/launchers/test_restart_loop.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.trainer.run.restarts import read_history  # noqa: E402
from megatron_empg.trainer.run.watchdog import fresh_request  # noqa: E402
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
# At max_staleness >= 1 the gate checks the engines' probes that have arrived when it runs (after a
# load, asynchronously: trainer.engines.placements), so which versions a step's value covers depends
# on timing; an uninterrupted run's differs too. A failed gate would stop the run instead.
NOT_COMPARED = ("sync/gate_max_logprob_diff",)
NOT_COMPARED_WHY = (
    "at rollout.max_staleness 1 a step's gate value is the largest difference of the engine probes that "
    "arrived before it (asynchronous loads), so it depends on timing; a gate that failed would stop the run"
)


def _signal_rank(run: Path, rank: int, sig: int) -> str:
    pid = _beat(run, rank).get("pid")
    if pid is None:
        return f"no heartbeat of rank {rank}"
    os.kill(pid, sig)
    return f"{signal.Signals(sig).name} to rank {rank} (pid {pid})"


def _corrupt_then_kill(run: Path, flags: Path) -> str:
    """With two committed checkpoints, the newest's largest shard cut in half (the resume skips it
    for the one before); with one, nothing cut: a run whose every checkpoint is damaged is refused
    by design (a resume must not start again from scratch unasked); then rank 1 killed."""
    committed = [d for d in (run / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", d.name)]
    what = truncate_checkpoint(run) if len(committed) >= 2 else f"not cut: {len(committed)} committed checkpoint(s)"
    return f"{what}; {_signal_rank(run, TRAINING_RANK, signal.SIGKILL)}"


def _full_disk(run: Path, flags: Path) -> str:
    """Both training ranks' RLIMIT_FSIZE lowered to half the smallest shard of the committed
    checkpoints (not a save in progress: its shards are still growing), 1 MiB before the first:
    above the log and metrics files the ranks append to (a write past the limit fails there too)."""
    committed = [d for d in (run / "checkpoints").glob("step_*") if re.fullmatch(r"step_\d+", d.name)]
    shards = [_size(p) for d in committed for p in d.glob("*.distcp")]
    limit = min((n for n in shards if n), default=2 << 20) // 2
    done = []
    for rank in (0, 1):
        pid = _beat(run, rank).get("pid")
        if pid is not None:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, limit))
            done.append(f"rank {rank} (pid {pid})")
    return f"RLIMIT_FSIZE {limit} bytes for {', '.join(done) or 'no rank'}"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # retention removed its checkpoint meanwhile
        return 0


def _flag(name: str):
    def raise_flag(run: Path, flags: Path) -> str:
        (flags / name).touch()
        return f"flag {name} raised"

    return raise_flag


FAULTS = {
    "kill_rank": lambda run, flags: _signal_rank(run, TRAINING_RANK, signal.SIGKILL),
    "stop_rank": lambda run, flags: _signal_rank(run, TRAINING_RANK, signal.SIGSTOP),
    "kill_engine": lambda run, flags: _signal_rank(run, ENGINE_RANK, signal.SIGKILL),
    "stop_engine": lambda run, flags: _signal_rank(run, ENGINE_RANK, signal.SIGSTOP),
    "corrupt_shard": _corrupt_then_kill,
    "full_disk": _full_disk,
    "hang_reward": _flag("hang_reward"),
    "nan_step": _flag("nan_step"),
}


# What each restarting fault's restart must be for (its cause in restarts.jsonl); the other kinds
# restart for a lost or hung rank or engine, whichever a peer finds first.
EXPECTED_CAUSE = {"full_disk": "restartable: checkpoint save failed", "hang_reward": "hang: "}


def _act(suite: Suite, proc, kind: str, run: Path, flags: Path, t_inject: float) -> dict | None:
    """Wait for the fault of ``kind`` to act: a NaN step once its flag is taken; the others once the
    launcher restarted the run for it. When it began (epoch seconds: the signal; the hanging reward
    taken; the save that failed, by its restart request), when it was detected, and the cause."""
    if kind in ("hang_reward", "nan_step") and not suite.wait_for(proc, lambda: not (flags / kind).exists()):
        return None
    began = None if kind == "full_disk" else time.time() if kind in ("hang_reward", "nan_step") else t_inject
    if kind == "nan_step":
        return {"began": began, "detected": None, "cause": None}
    restarts, seen = len(read_history(run)), {}

    def restarted() -> bool:
        request = fresh_request(run, t_inject)  # on disk until the next attempt begins
        if request is not None:
            seen.setdefault("request", request)
        return len(read_history(run)) > restarts

    if not suite.wait_for(proc, restarted):
        return None
    record = read_history(run)[restarts]
    detected = seen["request"]["time"] if "request" in seen else record["time"]
    return {"began": began or detected, "detected": detected, "cause": record["cause"]}


def steps_trained(flags: Path) -> list[int]:
    """Each step rank 0 logged, in order, across the attempts (``chaos_hook``)."""
    return [int(float(step)) for step, _ in _lines(flags / "trained")]


def step_seconds(flags: Path) -> float:
    """The median time between two steps logged in a row (a restart's gap aside)."""
    times = [float(t) for _, t in _lines(flags / "trained")]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return gaps[len(gaps) // 2] if gaps else 1.0


def _lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


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


def schedule(kinds: list[str], faults: int, steps: int, rng: random.Random) -> list[tuple[str, int]]:
    """(kind, step) pairs in order: distinct steps in [2, steps - 2] (the limits learn from the
    first steps; a rank stopped once its peers ended is watched by no one: see the docs), the kinds
    each round a shuffle of ``kinds``."""
    at = sorted(rng.sample(range(2, steps - 1), faults))
    rounds = [k for _ in range(-(-faults // len(kinds))) for k in rng.sample(kinds, len(kinds))]
    return list(zip(rounds, at))


def campaign(suite: Suite, name: str, faults: list[tuple[str, int]], rng: random.Random) -> dict:
    """The run under ``faults`` ((kind, at step), in order); what each did."""
    run, flags = suite.work / name, suite.work / f"{name}-flags"
    flags.mkdir(parents=True, exist_ok=True)
    suite.config(name)
    env = {"EMPG_FAULT_HOOK": "chaos", "EMPG_CHAOS_FLAGS": str(flags)}
    proc = suite.start(name, *ONE_STEP_OFF, *SUPERVISED, launcher=True, nproc=3, env=env)
    injected = []
    for kind, at in faults:
        # the step the run is at: the last one logged (a restart's redone steps included)
        if not suite.wait_for(proc, lambda: steps_trained(flags)[-1:] >= [at]):
            break
        time.sleep(rng.uniform(0.0, step_seconds(flags)))  # a random moment of the next step
        newest = steps_trained(flags)[-1]
        if newest >= suite.steps - 1:  # its last step: the fault could outlive every watchdog
            injected.append({"kind": kind, "at_step": newest, "what": "not injected: the run's last step"})
            continue
        restarts, t_inject = len(read_history(run)), time.time()
        what = FAULTS[kind](run, flags)
        acted = _act(suite, proc, kind, run, flags, t_inject)
        trained = len(steps_trained(flags))  # (a restart's old attempt has ended: its steps are in)
        nxt = acted is not None and suite.wait_for(proc, lambda: len(steps_trained(flags)) > trained)
        cause = acted["cause"] if acted else None
        detected = None if acted is None or acted["detected"] is None else acted["detected"] - acted["began"]
        injected.append(
            {
                "kind": kind,
                "at_step": newest,
                "what": what,
                "survived": nxt and (cause or "").startswith(EXPECTED_CAUSE.get(kind, "")),
                "restart_cause": cause,
                "seconds_to_detection": None if detected is None else round(detected, 1),
                "seconds_to_next_step": round(time.time() - acted["began"], 1) if nxt else None,
                "restarts": len(read_history(run)) - restarts,
            }
        )
    code = suite.finish(proc)
    return {"exit_code": code, "faults": injected, "flags": flags}


def reference(suite: Suite, flags: Path) -> int:
    """The uninterrupted run, poisoning the steps the campaign's NaN faults poisoned (``flags``)."""
    mine = suite.work / "reference-flags"
    mine.mkdir(parents=True, exist_ok=True)
    if (flags / "nan_steps").is_file():
        (mine / "nan_steps").write_text((flags / "nan_steps").read_text())
    suite.config("reference")
    env = {"EMPG_FAULT_HOOK": "chaos", "EMPG_CHAOS_FLAGS": str(mine)}
    code = suite.finish(suite.start("reference", *ONE_STEP_OFF, *SUPERVISED, launcher=True, nproc=3, env=env))
    suite.reference = suite.metrics("reference")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start", default=str(REPO / "runs" / "demo" / "warm_start"))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--work", default=None, help="where the runs go (default: a new directory in /tmp)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/chaos_cpu_<commit>.json")
    parser.add_argument("--note", default="shared 2-core VM (other jobs ran beside it); local disk")
    args = parser.parse_args(argv)
    if not args.kinds:
        parser.error("--kinds: give at least one kind")
    if not 1 <= args.faults <= args.steps - 3:
        parser.error(f"--faults {args.faults}: 1 to --steps - 3 ({args.steps - 3}), each at its own step")
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
    faults = schedule(args.kinds, args.faults, args.steps, rng)
    began, shm_before = time.monotonic(), set(os.listdir("/dev/shm"))
    result = campaign(suite, "chaos", faults, rng)
    campaign_s = time.monotonic() - began
    code = reference(suite, result["flags"])
    if code != 0 or len(suite.reference) != args.steps:
        print(f"the reference run failed (exit {code}): see {work / 'reference.log'}", file=sys.stderr)
        return 1
    compared = suite.compare("chaos", ignore=NOT_COMPARED)
    steps, trained = _steps_logged(work / "chaos"), steps_trained(result["flags"])
    nan_steps = sorted({int(line[0]) for line in _lines(result["flags"] / "nan_steps")})
    seconds = [f["seconds_to_next_step"] for f in result["faults"] if f.get("seconds_to_next_step") is not None]
    report = {
        "benchmark": "chaos",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit.stdout.strip(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "note": args.note,
        },
        "setup": {
            "steps": args.steps,
            "processes": "2 training ranks + 1 engine rank (launchers/torchrun.sh, gloo)",
            "overrides": [*ONE_STEP_OFF, *SUPERVISED],
            "checkpoint_interval": 3,
            "seed": args.seed,
            "schedule": faults,
        },
        "summary": {
            "faults_injected": sum("survived" in f for f in result["faults"]),
            "faults_survived": sum(f.get("survived", False) for f in result["faults"]),
            "faults_not_injected": sum("survived" not in f for f in result["faults"]),
            "kinds_survived": sorted({f["kind"] for f in result["faults"] if f.get("survived")}),
            "steps_lost": len(set(range(1, args.steps + 1)) - set(steps)),
            "steps_trained_twice": len(trained) - len(set(trained)),
            "seconds_to_next_step_p50": statistics.median(seconds) if seconds else None,
            "seconds_to_next_step_max": max(seconds, default=None),
            "final_metrics_equal_uninterrupted": compared["resumed_identical"],
            "exit_code": result["exit_code"],
        },
        "nan_steps": {
            "poisoned": nan_steps,
            "skipped_steps": {
                r["step"]: r.get("train/skipped_steps") for r in suite.metrics("chaos") if r["step"] in nan_steps
            },
            "note": "the reference run poisoned the same steps: a refused step changes every later one, so the "
            "comparison is with a run that refused them too (each poisoned again when redone after a restart)",
        },
        "faults": result["faults"],
        "comparison": compared,
        "restarts": read_history(work / "chaos"),
        "leftovers": suite.leftovers("chaos", shm_before),
        "timing_metrics_excluded": list(TIMING),
        "not_compared": {"keys": list(NOT_COMPARED), "why": NOT_COMPARED_WHY},
        "campaign_wall_s": round(campaign_s, 1),
        "total_wall_s": round(time.monotonic() - began, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"]))
    summary = report["summary"]
    ok = summary["faults_survived"] == summary["faults_injected"] and not summary["steps_lost"]
    return 0 if ok and summary["final_metrics_equal_uninterrupted"] and summary["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
