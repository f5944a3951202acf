#!/usr/bin/env python
"""What the KL anchor does, on the CPU demo task: a fixed reference (tau 1), the EMA anchor (tau
0.95 every 2 steps) and RPG's per-step reset (tau 0), each with the reverse Top-k KL, plus the
fixed reference with K3 (GRPO as usually run), over KL coefficients and seeds, from the demo's
warm start. Writes JSON and a PNG.

    OMP_NUM_THREADS=2 python benchmarks/anchor_sweep.py            # the whole sweep (resumable)
    python benchmarks/anchor_sweep.py --anchors ema_topk --kl-coefs 0.2 --seeds 0 --steps 20 --out /tmp/s.json

Every run is ``empg train recipes/demo_cpu.yaml`` in a subprocess with the transformers engine
(``rollout.engine=hf``: no vLLM start-up per run; the same sampling, 0.3 s per step instead of
0.5), ``data.seed`` / ``rollout.sampling.seed`` = seed and ``train.seed`` = 1234 + seed. A run that
finished has ``summary.json`` in its directory and is not run again; an unfinished one is started
over, so the sweep resumes after an interruption. After each run its last checkpoint is converted
to HF and measured against the warm start on ``EVAL_PROMPTS`` held-out problems (responses sampled
at T 1 from the trained policy): the exact KL(policy || initial policy) over the whole vocabulary,
mean per response token; the policy's exact entropy per token; the accuracy of those samples.
From ``metrics.jsonl``: the accuracy of the training samples (the last ``--window`` steps) and the
trainer's estimate of the KL to the anchor (``actor/kl``: a Top-k KL or a K3 estimate, so the two
KL kinds are not comparable with each other). Per (anchor, coefficient): mean, min and max over seeds.
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

RECIPE = REPO / "recipes" / "demo_cpu.yaml"
WARM_START = REPO / "runs" / "demo" / "warm_start"
ANCHORS = {  # name -> overrides of the demo recipe (whose anchor is the EMA one, reverse Top-k KL)
    "fixed_topk": ["algorithm.anchor.tau=1.0"],
    "ema_topk": ["algorithm.anchor.tau=0.95", "algorithm.anchor.period=2"],
    "reset_topk": ["algorithm.anchor.tau=0.0", "algorithm.anchor.period=1"],
    "fixed_k3": ["algorithm.anchor.tau=1.0", "algorithm.loss.kl=k3", "algorithm.loss.kl_args={}"],
}
LABELS = {
    "fixed_topk": "fixed reference, Top-k KL",
    "ema_topk": "EMA anchor (0.95 / 2 steps), Top-k KL",
    "reset_topk": "reset every step (RPG), Top-k KL",
    "fixed_k3": "fixed reference, K3 (GRPO)",
}
COLORS = {"fixed_topk": "tab:orange", "ema_topk": "tab:blue", "reset_topk": "tab:green", "fixed_k3": "tab:red"}
EVAL_PROMPTS, EVAL_SAMPLES, EVAL_SEED, EVAL_MAX_TOKENS = 256, 4, 99, 12
ACCURACY = "reward/accuracy"


def run_dir(runs: Path, anchor: str, kl_coef: float, seed: int) -> Path:
    return runs / f"{anchor}_kl{kl_coef:g}_seed{seed}"


def train(
    directory: Path, anchor: str, kl_coef: float, seed: int, steps: int, lr: float | None, warm_start: Path
) -> float:
    """One training run into ``directory`` (started over); its wall-clock seconds."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    overrides = [
        f"logging.dir={directory}",
        f"checkpoint.dir={directory / 'checkpoints'}",
        "logging.progress=none",
        "checkpoint.interval=0",
        "checkpoint.keep_last=1",
        "rollout.engine=hf",
        f"train.steps={steps}",
        f"algorithm.loss.kl_coef={kl_coef}",
        f"data.seed={seed}",
        f"rollout.sampling.seed={seed}",
        f"train.seed={1234 + seed}",
        f"checkpoint.init_from={warm_start}",
        *ANCHORS[anchor],
        *([f"optimizer.lr={lr}"] if lr is not None else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    with (directory / "train.log").open("w") as log:
        subprocess.run(
            [sys.executable, "-m", "megatron_empg.trainer.cli", "train", str(RECIPE), *overrides],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return time.perf_counter() - start


def measure(directory: Path, warm_start: Path) -> dict[str, float]:
    """The trained policy (last checkpoint, converted to HF) against the warm start on held-out
    problems: exact KL(policy || initial) and entropy per response token, sampled accuracy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools.convert_megatron_to_hf import main as convert
    from tools.make_demo_model import evaluation_examples, hf_generate, score

    hf_dir = directory / "final_hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    if convert([str(directory / "checkpoints"), str(hf_dir)]) != 0:
        raise RuntimeError(f"converting {directory / 'checkpoints'} failed")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    policy = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    initial = AutoModelForCausalLM.from_pretrained(warm_start, torch_dtype=torch.float32).eval()
    settings = json.loads((warm_start / "demo_model.json").read_text())["settings"]
    examples = evaluation_examples(settings["digits"], settings["ops"], tokenizer, count=EVAL_PROMPTS)
    repeated = [e for e in examples for _ in range(EVAL_SAMPLES)]
    generator = torch.Generator().manual_seed(EVAL_SEED)
    responses = hf_generate(
        policy,
        [e.prompt_ids for e in repeated],
        eos_id=tokenizer.eos_token_id,
        max_tokens=EVAL_MAX_TOKENS,
        temperature=1.0,
        generator=generator,
    )
    kl_sum = entropy_sum = 0.0
    tokens = 0
    with torch.no_grad():
        for example, response in zip(repeated, responses):
            ids = torch.tensor([list(example.prompt_ids) + response])
            start = len(example.prompt_ids) - 1  # the position that predicts the first response token
            log_p = torch.log_softmax(policy(input_ids=ids).logits[0, start:-1].double(), -1)  # [R, V]
            log_q = torch.log_softmax(initial(input_ids=ids).logits[0, start:-1].double(), -1)
            p = log_p.exp()
            kl_sum += float((p * (log_p - log_q)).sum())
            entropy_sum += float(-(p * log_p).sum())
            tokens += len(response)
    shutil.rmtree(hf_dir)
    correct = score(tokenizer, responses, repeated)
    return {
        "kl_to_initial": kl_sum / tokens,
        "entropy": entropy_sum / tokens,
        "heldout_accuracy": sum(correct) / len(correct),
    }


def summarize(rows: list[dict], window: int) -> dict[str, float]:
    last = rows[-window:]
    return {
        "train_accuracy_first": statistics.fmean(float(r[ACCURACY]) for r in rows[:window]),
        "train_accuracy_last": statistics.fmean(float(r[ACCURACY]) for r in last),
        "kl_to_anchor_last": statistics.fmean(float(r.get("actor/kl") or 0.0) for r in last),
        "entropy_last": statistics.fmean(float(r.get("actor/entropy") or 0.0) for r in last),
    }


def moving_average(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(curves: dict, kl_coefs: list[float], window: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(kl_coefs), figsize=(4.2 * len(kl_coefs), 6.4), dpi=110, squeeze=False)
    for col, coef in enumerate(kl_coefs):
        for anchor in ANCHORS:
            runs = curves.get(anchor, {}).get(f"{coef:g}", {})
            for row, key in enumerate((ACCURACY, "actor/kl")):
                series = [moving_average(run[key], window) for run in runs.values()]
                if not series:
                    continue
                length = min(map(len, series))
                mean = [statistics.fmean(s[i] for s in series) for i in range(length)]
                low = [min(s[i] for s in series) for i in range(length)]
                high = [max(s[i] for s in series) for i in range(length)]
                ax = axes[row][col]
                ax.plot(
                    range(1, length + 1),
                    mean,
                    color=COLORS[anchor],
                    lw=1.4,
                    label=f"{LABELS[anchor]} ({len(series)} seeds)",
                )
                ax.fill_between(range(1, length + 1), low, high, color=COLORS[anchor], alpha=0.15, lw=0)
        axes[0][col].set_title(f"kl_coef {coef:g}", fontsize=10)
        axes[0][col].set_ylabel(f"training accuracy ({window}-step mean)")
        axes[1][col].set_ylabel("KL to the anchor (trainer's estimate)")
        axes[1][col].set_xlabel("RL step (16 prompts x 8 samples)")
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchors", nargs="+", choices=list(ANCHORS), default=list(ANCHORS))
    parser.add_argument("--kl-coefs", type=float, nargs="+", default=[0.001, 0.05, 0.2, 1.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=None, help="override optimizer.lr (default: the recipe's)")
    parser.add_argument("--window", type=int, default=25, help="steps per average (default 25)")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "anchor_sweep")
    parser.add_argument(
        "--warm-start", type=Path, default=WARM_START, help="(built with tools/make_demo_model.py if missing)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "anchor_sweep_cpu.json")
    args = parser.parse_args(argv)
    warm_start = args.warm_start.resolve()
    if not (warm_start / "demo_model.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_demo_model.py"), str(warm_start)], check=True)
    per_run: dict[str, dict[str, dict[str, dict]]] = {}
    curves: dict[str, dict[str, dict[str, dict]]] = {}
    for seed in args.seeds:  # a seed of every setting first: an interrupted sweep still covers the grid
        for coef in args.kl_coefs:
            for anchor in args.anchors:
                directory = run_dir(args.runs_dir, anchor, coef, seed)
                done = directory / "summary.json"
                if not done.is_file():
                    print(f"{directory.name} ...", flush=True)
                    seconds = train(directory, anchor, coef, seed, args.steps, args.lr, warm_start)
                    rows = read_metrics(directory / "metrics.jsonl")
                    summary = {
                        "seconds": round(seconds, 1),
                        **summarize(rows, args.window),
                        **measure(directory, warm_start),
                    }
                    shutil.rmtree(directory / "checkpoints")
                    done.write_text(json.dumps(summary, indent=1) + "\n")
                summary = json.loads(done.read_text())
                rows = read_metrics(directory / "metrics.jsonl")
                print(f"{directory.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items()), flush=True)
                per_run.setdefault(anchor, {}).setdefault(f"{coef:g}", {})[str(seed)] = summary
                curves.setdefault(anchor, {}).setdefault(f"{coef:g}", {})[str(seed)] = {
                    ACCURACY: [float(r[ACCURACY]) for r in rows],
                    "actor/kl": [float(r.get("actor/kl") or 0.0) for r in rows],
                }
    results = {}
    for anchor, by_coef in per_run.items():
        for coef, seeds in by_coef.items():
            keys = [k for k in next(iter(seeds.values())) if k != "seconds"]
            results.setdefault(anchor, {})[coef] = {
                "seeds": sorted(seeds, key=int),
                "mean": {k: statistics.fmean(s[k] for s in seeds.values()) for k in keys},
                "min": {k: min(s[k] for s in seeds.values()) for k in keys},
                "max": {k: max(s[k] for s in seeds.values()) for k in keys},
                "per_seed": seeds,
            }
    png = args.out.with_suffix(".png")
    meta = json.loads((warm_start / "demo_model.json").read_text())
    title = (
        f"CPU demo task ({meta['settings']['digits']}-digit {' '.join(meta['settings']['ops'])}), demo warm start, "
        f"{args.steps} steps; mean and range over seeds"
    )
    plot(curves, args.kl_coefs, args.window, png, title)
    record = {
        "benchmark": "anchor_sweep",
        "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')})",
        "recipe": str(RECIPE.relative_to(REPO)),
        "engine": "hf",
        "steps": args.steps,
        "lr": args.lr,
        "window": args.window,
        "seeds": args.seeds,
        "kl_coefs": args.kl_coefs,
        "anchors": {name: ANCHORS[name] for name in args.anchors},
        "evaluation": {"prompts": EVAL_PROMPTS, "samples_per_prompt": EVAL_SAMPLES, "temperature": 1.0},
        "warm_start": meta.get("evaluation"),
        "results": results,
        "curves": curves,
        "png": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
