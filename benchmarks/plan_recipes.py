"""Every shipped GPU recipe's memory plan at its world size (8 ranks, 16 for the 32k Qwen3-8B one,
32 for Qwen3-30B-A3B; one H100 80GB each): the
planned peak per rank and its phase, the terms behind it, and, where it does not fit, the changes
that would. Writes ``benchmarks/results/plan_recipes.json`` and prints the table of docs/planning.md.

    .venv/bin/python benchmarks/plan_recipes.py [--gpu-memory-gib 79.2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CPU_RECIPES = ("demo_cpu.yaml", "demo_cpu_grpo.yaml")
WORLD_SIZES = {
    "qwen3_8b_dapo_math_rpg_urkl_32k_cp4.yaml": 16,
    "qwen3_30b_a3b_dapo_math_ema_pg.yaml": 32,
}  # the rest: one node of 8 (their comments)


def main(argv=None) -> int:
    from megatron_empg.config import RunConfig, load_config
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_fixes import cheapest_fixes
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="default: an H100 80GB (79.2 GiB)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/plan_recipes.json"))
    args = p.parse_args(argv)
    device = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * 2**30)
    rows = []
    print("| recipe | ranks | peak per GPU (phase) | update pass | weights + optimizer | anchor | activations | fits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        if path.name in CPU_RECIPES:
            continue
        world = WORLD_SIZES.get(path.name, 8)
        components = bind(load_config(RunConfig, path), world, check_paths=False)
        plan = plan_memory(components, device_bytes=device)
        fixes = [] if plan.fits else cheapest_fixes(components, world, plan.device_bytes, bind=bind)
        record = {
            **plan.to_json()["ranks"][0],
            "recipe": path.name,
            "world_size": world,
            "device_bytes": plan.device_bytes,
            "fits": plan.fits,
            "fixes": [{"label": f.label, "overrides": list(f.overrides), "peak_bytes": f.peak_bytes} for f in fixes],
        }
        rows.append(record)
        gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
        rank = plan.ranks[0]
        fits = "yes" if plan.fits else "no: " + "; ".join(" ".join(f["overrides"]) for f in record["fixes"])
        print(
            f"| `{path.stem}` | {world} | {gib(rank.peak_bytes)} GiB ({rank.peak_phase}) | "
            f"{gib(rank.total('update'))} GiB | {gib(record['weights_and_optimizer_bytes'])} GiB | "
            f"{gib(record['anchor_bytes'])} GiB | {gib(record['activation_bytes'])} GiB | {fits} |"
        )
    Path(args.out).write_text(json.dumps({"device_bytes": plan.device_bytes, "recipes": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
