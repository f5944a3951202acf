"""The whole RL loop on one device: ``empg train`` for a few steps (rollout with the transformers
engine in the trainer's process, sleeping between rollouts; the weight sync and its gate; the old,
anchor and update passes; the optimizer and the EMA; a checkpoint at the end), each phase's time and
device memory peak from the step records, against ``empg plan``'s peak for the same phase.

    python benchmarks/whole_loop.py                      # CPU flow check: the demo model, 2 steps
    python benchmarks/whole_loop.py --model deepseek-r1-distill-qwen-1.5b --steps 3 --dtype bfloat16 \\
        --out benchmarks/results/whole_loop_gpu.json

The model has random weights (``tools/make_tiny_model``: the model config's shapes, a character
tokenizer of its vocabulary) and the demo recipe's task (``recipes/demo_cpu.yaml``: arithmetic
prompts) at ``--prompts`` prompts x ``--samples`` samples of at most ``--max-tokens`` tokens, in
``--dtype``. A random policy writes until ``--max-tokens``, so the lengths are the budget's.

Per phase (``time/<phase>`` and ``memory/peak_gib/<phase>`` of ``trainer.loop``): the median seconds
over the steps after the first (the first compiles and allocates), the largest peak over all steps,
the plan's allocator peak for that phase (``trainer.bind.memory_plan``; its phases: rollout,
weight_sync, old_pass, anchor_pass, update, optimizer) and ``plan_vs_measured`` = planned / measured
- 1 (issue 49's goal: within 5 %). The optimizer's step runs inside ``update`` here: the plan's
``optimizer`` phase is compared with the measured ``update``. The plan's rollout phase is vLLM's
(its KV cache, the sleeping policy); the transformers engine here allocates differently, so that
row is a record, not a check of the plan. On a CPU there are no device peaks: the run checks the
flow only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import commit  # noqa: E402

# measured phase (trainer.loop) -> the plan's phases whose peak it is compared with
PLAN_PHASES = {
    "rollout": ("rollout",),
    "weight_sync": ("weight_sync",),
    "old_pass": ("old_pass",),
    "anchor_pass": ("anchor_pass",),
    "update": ("update", "optimizer"),
}
GOAL = 0.05
PROMPT_TOKENS = 16  # the demo's prompts ("12+34=": 6-7 tokens) and room


def _device() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    return f"CPU ({platform.processor() or 'unknown'}): a flow check, no device peaks"


def run_config(args, work: Path) -> dict:
    """The demo recipe on a random model of ``args.model``'s shapes, the transformers engine."""
    from megatron_empg.config import load_model_config
    from tests.trainer.hf_runs import hf_engine_config
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config(args.model), work / "model", seed=0, std=0.02)
    config = hf_engine_config(work, "run", model_dir, steps=args.steps)
    config["model"] = args.model
    config["train"].update(
        params_dtype=args.dtype,
        prompts_per_step=args.prompts,
        micro_batch_size=args.samples,
        max_seq_len=args.max_tokens + PROMPT_TOKENS,
    )
    sampling = {**config["rollout"]["sampling"], "n": args.samples, "max_tokens": args.max_tokens}
    config["rollout"].update(
        dtype=args.dtype,
        sampling=sampling,
        sleep_while_training=torch.cuda.is_available(),
        max_model_len=max(args.max_tokens + PROMPT_TOKENS, 128),  # 128: room for the gate's probe
    )
    config["algorithm"]["anchor"]["compute_dtype"] = args.dtype
    config["checkpoint"]["interval"] = 0  # one save, at the end
    config["weight_sync"]["gate_tolerance"] = None if args.dtype != "float32" else 1e-3
    return config


def planned(config_path: Path) -> dict[str, int]:
    """The plan's allocator peak (bytes) per phase of ``trainer.bind.memory_plan.PHASES``."""
    from megatron_empg.config import RunConfig, load_config
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_plan import PHASES, plan_memory

    plan = plan_memory(bind(load_config(RunConfig, config_path, []), 1, check_paths=False))
    (rank,) = plan.ranks
    return {phase: rank.allocated(phase) for phase in PHASES}


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo-qwen2")
    p.add_argument("--steps", type=int, default=3 if cuda else 2)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", type=int, default=16 if cuda else 4)
    p.add_argument("--samples", type=int, default=8 if cuda else 4)
    p.add_argument("--max-tokens", type=int, default=1024 if cuda else 32)
    p.add_argument("--work", default=None, help="a directory for the model and the run (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from megatron_empg.trainer.run.metrics_log import read_metrics
    from tests.trainer.demo_runs import run_train

    work = Path(args.work or tempfile.mkdtemp(prefix="whole_loop_"))
    config = run_config(args, work)
    done = run_train(config, work, "run", timeout=args.timeout)
    if done.returncode != 0:
        print(done.stderr[-6000:], file=sys.stderr)
        return 1
    records = [r for r in read_metrics(work / "run" / "metrics.jsonl") if "time/update" in r]
    plan = planned(work / "run.yaml")
    later = records[1:] or records
    phases = {}
    for phase, plan_phases in PLAN_PHASES.items():
        seconds = [r[f"time/{phase}"] for r in later if f"time/{phase}" in r]
        peaks = [r[f"memory/peak_gib/{phase}"] for r in records if f"memory/peak_gib/{phase}" in r]
        measured = max(peaks) * 2**30 if peaks else None
        predicted = max(plan[name] for name in plan_phases)
        phases[phase] = {
            "seconds_median": statistics.median(seconds) if seconds else None,
            "peak_bytes": measured,
            "planned_peak_bytes": predicted,
            "plan_vs_measured": None if not measured else predicted / measured - 1,
        }
    gaps = [abs(x["plan_vs_measured"]) for x in phases.values() if x["plan_vs_measured"] is not None]
    report = {
        "benchmark": "whole_loop",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "device": _device(),
        "command": "whole_loop.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "params": vars(args),
        "config": config,
        "steps_logged": len(records),
        "step_seconds": [r.get("time/step") for r in records],
        "phases": phases,
        "phase_peak_gib": {k: None if v["peak_bytes"] is None else v["peak_bytes"] / 2**30 for k, v in phases.items()},
        "phase_planned_gib": {k: v["planned_peak_bytes"] / 2**30 for k, v in phases.items()},
        "goal": {"plan_within": GOAL, "worst": max(gaps) if gaps else None, "met": bool(gaps) and max(gaps) <= GOAL},
    }
    text = json.dumps(report, indent=1, default=str)
    print(yaml.safe_dump({"phases": phases, "goal": report["goal"]}, sort_keys=False))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
