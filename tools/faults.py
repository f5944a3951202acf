"""The fault suite: the CPU demo recipe under the faults a cluster run meets, each resumed run
compared with an uninterrupted one, step by step, in every metric but the timings.

    .venv/bin/python tools/faults.py [--warm-start runs/demo/warm_start] [--steps 12] [--kills 6]
        [--seed 0] [--only NAME ...] [--out benchmarks/results/faults_cpu.json]

One uninterrupted reference run (``--steps`` steps, a checkpoint every 3, ``keep_last`` 2), then the
cases, each in its own directory, each resumed (``--resume``) to ``--steps`` after its fault:

    kill9_uniform_<i>    SIGKILL to the run's process group at a random moment (seeded)
    kill9_tmp_write      SIGKILL once a checkpoint's ``step_N.tmp-*`` directory has files
    kill9_commit         SIGKILL once the completion marker is in the tmp directory (before the rename)
    kill9_retention      SIGKILL once a checkpoint is moved out for deletion (``*.trash-*``)
    group_sigterm        SIGTERM to the process group, after a periodic checkpoint
    group_sigusr1        SIGUSR1 to the process group, after a periodic checkpoint
    torchrun_sigterm     SIGTERM to launchers/torchrun.sh (torchrun: SIGUSR1 to each rank's group)
    second_run           a second ``empg train`` on the same directories while the first runs
    torn_metrics         a torn last line appended to metrics.jsonl before the resume
    truncated_checkpoint the newest checkpoint's largest shard cut in half before the resume
    full_disk            the trainer's file size limit lowered (RLIMIT_FSIZE) after its first
                         checkpoint: the next save fails; the resume runs without the limit

and the cases of a run that restarts itself (``tools/faults_supervised.py``: hangs, lost engines
and ranks, a hanging reward, a NaN step), run to their end by the launcher's restart loop.

A case is ``resumed_identical`` when its final metrics.jsonl has the reference's steps with equal
values (``TIMING`` aside); ``steps_lost`` counts steps logged before the fault that the resume
did not start after (a signal must lose none; SIGKILL redoes the steps since the last checkpoint:
``steps_redone``); ``leftovers`` lists processes of the case, ``*.tmp-*``/``*.trash-*`` directories
and ``/dev/shm`` files left once it ends. Output: JSON with the machine described.
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
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.config import read_yaml  # noqa: E402
from megatron_empg.trainer.run.metrics_log import read_metrics  # noqa: E402
from tools.faults_supervised import FAULT_STEP, HF, HOOK  # noqa: E402
from tools.faults_supervised import cases as supervised_cases  # noqa: E402
from tools.run_processes import processes_with  # noqa: E402

RECIPE = REPO / "recipes" / "demo_cpu.yaml"
LAUNCHER = REPO / "launchers" / "torchrun.sh"
TIMEOUT_S = 600
# prefixes of wall-clock metrics (and of what a background save's timing decides: checkpoint/writing),
# and of the device's allocator peaks
TIMING = ("time/", "perf/", "sync/seconds", "engines/seconds", "engines/slowest", "checkpoint/", "memory/")
INTERVAL, KEEP_LAST = 3, 2


class Suite:
    timing = TIMING

    def __init__(self, work: Path, warm_start: Path, steps: int) -> None:
        self.work, self.warm_start, self.steps = work, warm_start, steps
        self.reference: list[dict] = []
        self.references: dict[str, list[dict]] = {}
        (work / "hook").mkdir(parents=True, exist_ok=True)
        (work / "hook" / "sitecustomize.py").write_text(HOOK)  # inert unless EMPG_FAULT_HOOK is set
        self.sessions: dict[str, set[int]] = {}  # a case's runs, each a session of its own

    # ------------------------------------------------------------------ runs

    def config(self, name: str, steps: int | None = None) -> Path:
        config = read_yaml(RECIPE)
        config["train"]["steps"] = steps or self.steps
        config["logging"] = {"dir": str(self.work / name), "progress": "none"}
        config["checkpoint"].update(
            dir=str(self.work / name / "checkpoints"),
            interval=INTERVAL,
            keep_last=KEEP_LAST,
            init_from=str(self.warm_start),
        )
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(
        self,
        name: str,
        *extra: str,
        launcher: bool = False,
        log_suffix: str = "",
        nproc: int = 1,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """``empg train`` on the case's config in a process group of its own, marked in its
        environment; ``launcher``: through launchers/torchrun.sh on ``nproc`` ranks."""
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "EMPG_FAULT_CASE": name,
            **(env or {}),
            "PYTHONPATH": f"{self.work / 'hook'}:{REPO}",
        }
        command = [sys.executable, "-m", "megatron_empg.trainer.cli", "train", str(self.work / f"{name}.yaml"), *extra]
        if launcher:
            env.update(
                NPROC_PER_NODE=str(nproc), PYTHON=sys.executable, TORCHRUN=str(Path(sys.executable).parent / "torchrun")
            )
            # the reference's in-process engine (the launcher would otherwise add its own CPU defaults)
            command = [
                str(LAUNCHER),
                str(self.work / f"{name}.yaml"),
                "rollout.in_process=true",
                "weight_sync.transport=in_process",
                *extra,
            ]
        log = open(self.work / f"{name}{log_suffix}.log", "a")  # noqa: SIM115 (closed with the process)
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.sessions.setdefault(name, set()).add(proc.pid)
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def metrics(self, name: str) -> list[dict]:
        path = self.work / name / "metrics.jsonl"
        return read_metrics(path) if path.is_file() else []

    def logged(self, name: str) -> int:
        path = self.work / name / "metrics.jsonl"
        return path.read_text().count("\n") if path.is_file() else 0

    def wait_for(self, proc: subprocess.Popen, condition, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + TIMEOUT_S
        while not condition():
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
        return True

    def resume(self, name: str) -> int:
        return self.finish(self.start(name, "--resume"))

    # ------------------------------------------------------------------ checks

    def compare(
        self, name: str, reference: str = "reference", ignore: tuple[str, ...] = (), until_step: int | None = None
    ) -> dict:
        """The case's metrics against ``reference``'s, step by step (``until_step``: up to it),
        every key but the timings and ``ignore``."""
        got = self.metrics(name)
        expected = self.reference if reference == "reference" else self.references[reference]
        if until_step is not None:
            got, expected = [r for r in got if r["step"] <= until_step], expected[:until_step]
        differing = []
        for a, b in zip(got, expected):
            keys = {k for k in (*a, *b) if not k.startswith(TIMING) and k not in ignore}
            differing += [f"step {a['step']}: {k}" for k in sorted(keys) if a.get(k) != b.get(k)]
        same_steps = [r["step"] for r in got] == [r["step"] for r in expected]
        return {
            "resumed_identical": same_steps and not differing,
            "steps": [r["step"] for r in got],
            "differences": differing[:10],
        }

    def leftovers(self, name: str, shm_before: set[str], settle_s: float = 10.0) -> list[str]:
        """What the case left once its last run ended: processes (after ``settle_s`` to exit, as
        multiprocessing's resource tracker takes a moment), temp directories, /dev/shm files."""
        pids = processes_with(f"EMPG_FAULT_CASE={name}", self.sessions.get(name, ()), settle_s)
        found = [f"process {pid}" for pid in pids]
        checkpoints = self.work / name / "checkpoints"
        if checkpoints.is_dir():
            found += [p.name for p in checkpoints.iterdir() if ".tmp-" in p.name or ".trash-" in p.name]
        found += [f"/dev/shm/{n}" for n in sorted(set(os.listdir("/dev/shm")) - shm_before) if "empg" in n.lower()]
        return found


def _stopped_at(log: Path) -> int | None:
    stops = re.findall(r"signal \d+: checkpointed at step (\d+)", log.read_text())
    return int(stops[-1]) if stops else None


def _resumed_from(log: Path) -> int:
    found = re.findall(r"resumed from \S+ at step (\d+)", log.read_text())
    return int(found[-1]) if found else 0


def _tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if ".tmp-" in p.name and p.is_dir()] if root.is_dir() else []


# --------------------------------------------------------------------------------------------
# Cases: each returns what it observed; the suite adds the comparison and the leftovers.


def kill9(suite: Suite, name: str, trigger, what: str) -> dict:
    suite.config(name)
    proc = suite.start(name)
    hit = suite.wait_for(proc, trigger, poll_s=0.001)
    logged = suite.logged(name)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    code = suite.resume(name)
    start = _resumed_from(suite.work / f"{name}.log")
    return {
        "fault": f"SIGKILL {what}",
        "aimed_moment_hit": hit,
        "steps_logged_before": logged,
        "resume_exit_code": code,
        "resumed_from": start,
        "steps_redone": max(0, logged - start),
        "steps_lost": 0,
    }


def kill9_uniform(suite: Suite, name: str, rng: random.Random) -> dict:
    at = rng.uniform(1.0, suite.steps - 1.0)  # in units of logged steps: between the first and the last

    def trigger():
        return suite.logged(name) >= int(at) and (time.sleep((at % 1) * 0.5) or True)

    return kill9(suite, name, trigger, f"after {at:.2f} steps")


def kill9_aimed(suite: Suite, name: str, moment: str) -> dict:
    root = suite.work / name / "checkpoints"

    def trigger():
        if moment == "retention":
            return root.is_dir() and any(".trash-" in p.name for p in root.iterdir())
        tmps = _tmp_dirs(root)
        if moment == "commit":
            return any((p / "empg_checkpoint.json").exists() for p in tmps)
        return any(any(p.iterdir()) for p in tmps)

    return kill9(suite, name, trigger, f"at a checkpoint's {moment.replace('_', ' ')}")


def signalled(suite: Suite, name: str, how: str) -> dict:
    suite.config(name)
    proc = suite.start(name, launcher=how == "torchrun")
    suite.wait_for(proc, lambda: suite.logged(name) >= INTERVAL + 1)  # after the first periodic checkpoint
    if how == "torchrun":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM if how == "sigterm" else signal.SIGUSR1)
    code = suite.finish(proc)
    logged = suite.logged(name)
    stopped = _stopped_at(suite.work / f"{name}.log")
    resumed = suite.resume(name)
    start = _resumed_from(suite.work / f"{name}.log")
    return {
        "fault": {"torchrun": "SIGTERM to launchers/torchrun.sh"}.get(how, f"{how.upper()} to the process group"),
        "exit_code": code,
        "checkpointed_at": stopped,
        "steps_logged_before": logged,
        "resume_exit_code": resumed,
        "resumed_from": start,
        "steps_lost": max(0, logged - start),
    }


def second_run(suite: Suite, name: str) -> dict:
    suite.config(name)
    first = suite.start(name)
    suite.wait_for(first, lambda: suite.logged(name) >= 1)
    began = time.monotonic()
    second = suite.start(name, log_suffix="-second")
    code = suite.finish(second, timeout=60)
    refused_s = time.monotonic() - began
    text = (suite.work / f"{name}-second.log").read_text()
    first_code = suite.finish(first)
    return {
        "fault": "a second empg train on the same directories",
        "second_exit_code": code,
        "second_refused_after_s": round(refused_s, 3),
        "names_the_holder": f"pid {first.pid} on host" in text,
        "first_exit_code": first_code,
        "steps_lost": 0,
    }


def stopped_then(suite: Suite, name: str, damage, what: str) -> dict:
    """Run to a signal after step 7 (checkpoints 3, 6 and 7), ``damage`` the run, resume."""
    suite.config(name)
    proc = suite.start(name)
    suite.wait_for(proc, lambda: suite.logged(name) >= 2 * INTERVAL + 1)
    os.killpg(proc.pid, signal.SIGTERM)
    suite.finish(proc)
    logged = suite.logged(name)
    detail = damage(suite.work / name)
    code = suite.resume(name)
    start = _resumed_from(suite.work / f"{name}.log")
    text = (suite.work / f"{name}.log").read_text()
    return {
        "fault": what,
        "damage": detail,
        "steps_logged_before": logged,
        "resume_exit_code": code,
        "resumed_from": start,
        "steps_redone": max(0, logged - start),
        "steps_lost": 0,
        "warned": [
            line.split("WARNING ", 1)[1][:300]
            for line in text.splitlines()
            if "WARNING megatron_empg" in line and ("damaged" in line or "torn" in line or "skip" in line)
        ],
    }


def tear_metrics(run: Path) -> str:
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 99, "reward/me')
    return "metrics.jsonl: a torn last line appended"


def truncate_checkpoint(run: Path) -> str:
    root = run / "checkpoints"
    newest = root / (root / "latest").read_text().strip()
    shard = max((p for p in newest.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    return f"{shard.relative_to(run)}: {size} -> {size // 2} bytes"


def full_disk(suite: Suite, name: str) -> dict:
    suite.config(name)
    proc = suite.start(name)
    root = suite.work / name / "checkpoints"
    suite.wait_for(proc, lambda: (root / "latest").is_file())  # the first checkpoint is committed
    shard = max(root.rglob("*.distcp"), key=lambda p: p.stat().st_size).stat().st_size
    limit = shard // 4
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))  # the trainer's process only
    code = suite.finish(proc)
    text = (suite.work / f"{name}.log").read_text()
    said = [line for line in text.splitlines() if "empg: error" in line or "CheckpointError" in line][-2:]
    logged = suite.logged(name)
    resumed = suite.resume(name)
    start = _resumed_from(suite.work / f"{name}.log")
    return {
        "fault": f"RLIMIT_FSIZE {limit} bytes after the first checkpoint",
        "exit_code": code,
        "message": [line[:1000] for line in said],
        "traceback": "Traceback" in text,
        "steps_logged_before": logged,
        "resume_exit_code": resumed,
        "resumed_from": start,
        "steps_redone": max(0, logged - start),
        "steps_lost": 0,
    }


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start", default=str(REPO / "runs" / "demo" / "warm_start"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="run only these cases")
    parser.add_argument("--work", default=None, help="where the runs go (default: a new directory in /tmp)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "faults_cpu.json"))
    args = parser.parse_args(argv)
    warm = Path(args.warm_start)
    if not (warm / "config.json").is_file():
        parser.error(f"--warm-start {warm}: no model there (make demo writes runs/demo/warm_start)")
    work = Path(args.work or f"/tmp/empg-faults-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    suite = Suite(work, warm, args.steps)
    rng = random.Random(args.seed)
    cases = {f"kill9_uniform_{i}": (lambda n: kill9_uniform(suite, n, rng)) for i in range(args.kills)}
    cases.update(
        {
            "kill9_tmp_write": lambda n: kill9_aimed(suite, n, "tmp_write"),
            "kill9_commit": lambda n: kill9_aimed(suite, n, "commit"),
            "kill9_retention": lambda n: kill9_aimed(suite, n, "retention"),
            "group_sigterm": lambda n: signalled(suite, n, "sigterm"),
            "group_sigusr1": lambda n: signalled(suite, n, "sigusr1"),
            "torchrun_sigterm": lambda n: signalled(suite, n, "torchrun"),
            "second_run": lambda n: second_run(suite, n),
            "torn_metrics": lambda n: stopped_then(suite, n, tear_metrics, "a torn metrics.jsonl line"),
            "truncated_checkpoint": lambda n: stopped_then(
                suite, n, truncate_checkpoint, "the newest checkpoint truncated"
            ),
            "full_disk": lambda n: full_disk(suite, n),
            **supervised_cases(suite),
        }
    )
    began = time.monotonic()
    suite.config("reference")
    code = suite.finish(suite.start("reference"))
    suite.reference = suite.metrics("reference")
    if code != 0 or len(suite.reference) != args.steps:
        print(f"the reference run failed (exit {code}): see {work / 'reference.log'}", file=sys.stderr)
        return 1
    if any(n in ("rank_sigstop", "rank_lost") for n in args.only or cases):  # 2 ranks, the transformers engine
        suite.config("reference_2ranks")
        code = suite.finish(suite.start("reference_2ranks", *HF, launcher=True, nproc=2))
        suite.references["reference_2ranks"] = suite.metrics("reference_2ranks")
        if code != 0 or len(suite.references["reference_2ranks"]) != args.steps:
            print(
                f"the 2-rank reference run failed (exit {code}): see {work / 'reference_2ranks.log'}", file=sys.stderr
            )
            return 1
    results = []
    for name, case in cases.items():
        if args.only and name not in args.only:
            continue
        shm_before = set(os.listdir("/dev/shm"))
        t0 = time.monotonic()
        try:
            result = {"case": name, **case(name)}
        except Exception as error:  # noqa: BLE001 (recorded: the suite goes on)
            result = {"case": name, "error": f"{type(error).__name__}: {error}"}
        until = FAULT_STEP - 1 if name == "nan_step" else None  # later steps differ by design (a refused update)
        result.update(
            suite.compare(name, result.get("compare_with", "reference"), tuple(result.get("ignore", ())), until),
            leftovers=suite.leftovers(name, shm_before),
            seconds=round(time.monotonic() - t0, 1),
        )
        results.append(result)
        print(
            f"{name:<22} identical={result['resumed_identical']} lost={result.get('steps_lost')} "
            f"redone={result.get('steps_redone', 0)} leftovers={result['leftovers']} {result['seconds']} s",
            flush=True,
        )
    report = {
        "benchmark": "faults",
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "recipe": str(RECIPE.relative_to(REPO)),
        "steps": args.steps,
        "checkpoint_interval": INTERVAL,
        "keep_last": KEEP_LAST,
        "timing_metrics_excluded": list(TIMING),
        "summary": {
            "cases": len(results),
            "resumed_identical": sum(r["resumed_identical"] for r in results),
            "steps_lost": sum(r.get("steps_lost") or 0 for r in results),
            "with_leftovers": sum(bool(r["leftovers"]) for r in results),
            "errors": sum("error" in r for r in results),
        },
        "cases": results,
        "total_wall_s": round(time.monotonic() - began, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"]))
    ok = report["summary"]["resumed_identical"] == len(results) and not report["summary"]["steps_lost"]
    return 0 if ok and not report["summary"]["with_leftovers"] else 1


if __name__ == "__main__":
    sys.exit(main())
