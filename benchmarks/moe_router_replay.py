#!/usr/bin/env python
"""What router replay (``algorithm.router_replay: rollout``) does to the trainer/engine log-prob gap
on the tiny Qwen3-MoE (model_configs/tiny-qwen3-moe.yaml, random weights), on the CPU.

    python benchmarks/moe_router_replay.py [--out benchmarks/results/moe_router_replay_cpu.json]

For each weight seed and engine dtype: the transformers engine (``HfEngine``, ``routed_experts=True``)
samples ``PROMPTS`` random prompts x ``N`` responses (temperature 1, no top-k/top-p, so the sampler's
log-probs are the model's own); the trainer's old pass (``mcore.step.forward_stats`` on a float32
Megatron model of the same float32 weights, packed micro-batches built by ``trainer.batching.batch``) runs
twice, with the engine's routing replayed and without. Reported per run:

  sampler_logprob_gap   mean |log pi_old - the engine's log-prob| over the loss tokens: the
                        trainer's ``batch/sampler_logprob_gap`` (``StepBatch.sampler_gap``)
  max_gap               the largest of those
  routing_mismatch      the share of (loss token, layer) pairs whose expert set the trainer's
                        router chose differently from the engine's (0 with replay: what the
                        hooked routers dispatched)
  gap_routed_alike / gap_routed_apart   the gap without replay over the loss tokens whose own
                        sequence was routed alike in every layer up to and including that token,
                        and over the others

The engine in bfloat16 against the trainer in float32 is the setting where routing differs (the
router logits of bf16 hidden states move the near-ties); the float32 engine is the control (the
same numerics up to GEMM shapes: the routing agrees and both gaps are rounding). Nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.config import ParallelConfig, RolloutConfig, SamplingConfig, load_model_config  # noqa: E402

MODEL = "tiny-qwen3-moe"
PROMPTS, N, MAX_TOKENS = 16, 4, 32
WEIGHT_SEEDS = (0, 1)
ENGINE_DTYPES = ("bfloat16", "float32")
THREADS = 2


def _machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "note": "no GPU: the transformers engine (vLLM returns "
        "routed experts on a GPU only); the figures do not depend on the machine's speed",
    }


def _samples(engine, seed: int, vocab: int) -> list:
    from megatron_empg.rollout.trajectory import Trajectory
    from megatron_empg.trainer.batching.batch import Sample

    g = torch.Generator().manual_seed(1000 + seed)
    prompts = [
        torch.randint(1, vocab, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist()
        for _ in range(PROMPTS)
    ]
    sampling = SamplingConfig(n=N, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)
    groups = engine.generate(prompts, sampling)
    return [
        Sample.from_trajectory(SimpleNamespace(prompt_ids=p), i, Trajectory.from_completion(c))
        for i, (p, group) in enumerate(zip(prompts, groups))
        for c in group
    ]


def _run(chunk, micro, groups, model, replay: bool) -> dict:
    import dataclasses

    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_empg.mcore.moe.replay import token_routing
    from megatron_empg.mcore.step import StatsRequest, forward_stats

    seen: list[tuple[int, torch.Tensor]] = []
    hooks = [
        r.register_forward_hook(lambda m, i, out: seen.append((m.layer_number - 1, out[1].clone())))
        for r in chunk.modules()
        if isinstance(r, TopKRouter)
    ]
    batches = micro if replay else [dataclasses.replace(mb, routed_experts=None) for mb in micro]
    stats = forward_stats([chunk], batches, StatsRequest(vocab_size=model.vocab_size, with_entropy=False), groups)
    for hook in hooks:
        hook.remove()
    gaps, alike, mismatched, routed = [], [], 0, 0
    for j, (mb, out) in enumerate(zip(micro, stats)):
        engine_ids = token_routing(mb)  # [tokens, layers, k], this row's tokens in order
        loss = mb.loss_mask[0]  # the tokens p - 1 .. p + r - 2 of each sample: all routed by the engine
        differs = torch.zeros(mb.shape[1], dtype=torch.bool)
        for layer in range(model.num_layers):
            own = [m for i, m in seen if i == layer][j]
            apart = (own != torch.zeros_like(own).scatter_(1, engine_ids[:, layer], True)).any(-1)
            differs |= apart
            mismatched += int((apart & loss).sum())
            routed += int(loss.sum())
        # alike up to a token: no token at or before it in its sequence routed apart (a sequence's
        # last token and the padding segment hold filler routing, which reaches no loss token)
        earlier = torch.zeros_like(differs)
        for seq in mb.seq_ids[0].unique():
            span = mb.seq_ids[0] == seq
            earlier[span] = differs[span].cumsum(0) > 0
        gaps.append((out.logprobs - mb.sampler_logprobs)[0].abs()[loss])
        alike.append(~earlier[loss])
    gaps, alike = torch.cat(gaps), torch.cat(alike)
    return {
        "sampler_logprob_gap": float(gaps.mean()),
        "max_gap": float(gaps.max()),
        "loss_tokens": int(gaps.numel()),
        "routing_mismatch": mismatched / max(routed, 1),
        "routed_token_layers": routed,
        "gap_routed_alike": float(gaps[alike].mean()) if alike.any() else None,
        "gap_routed_apart": float(gaps[~alike].mean()) if (~alike).any() else None,
        "tokens_routed_apart": int((~alike).sum()),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/moe_router_replay_cpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    from safetensors.torch import load_file

    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.rollout.hf_engine import HfEngine
    from megatron_empg.trainer.batching.batch import MicroBatchPlan, micro_batches
    from megatron_empg.weight_sync import mapping
    from tools.make_tiny_model import save_tiny_hf_model

    model = load_model_config(MODEL)
    parallel = ParallelConfig(moe_token_dispatcher_type="allgather")
    plan = MicroBatchPlan(packing=True, max_tokens=512, routing=(model.num_layers, model.moe_router_topk))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    report: dict = {
        "benchmark": "moe_router_replay",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "params": {
            "model": MODEL,
            "prompts": PROMPTS,
            "n": N,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "prompt_tokens": "8..24 random ids",
            "trainer_dtype": "float32",
            "engine": "hf",
            "dispatcher": "allgather",
            "weights": "tools/make_tiny_model.py random (std 0.08), float32",
        },
        "runs": [],
    }
    try:
        groups = parallel_state.initialize_model_parallel(parallel, 0)
        (chunk,) = build_gpt_model(model, parallel, routing_replay=True)
        for seed in WEIGHT_SEEDS:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir = save_tiny_hf_model(model, tmp, seed=seed)
                state = load_file(f"{model_dir}/model.safetensors")
                load_full_state_dict(
                    [chunk], mapping.to_megatron_state_dict(state, model, parallel.padded_vocab_size(model.vocab_size))
                )
                for dtype in ENGINE_DTYPES:
                    engine = HfEngine(model_dir, RolloutConfig(dtype=dtype), routed_experts=True)
                    samples = _samples(engine, seed, model.vocab_size)
                    engine.shutdown()
                    micro = micro_batches(samples, [1.0] * len(samples), plan)
                    run = {
                        "weight_seed": seed,
                        "engine_dtype": dtype,
                        "without_replay": _run(chunk, micro, groups, model, replay=False),
                        "with_replay": _run(chunk, micro, groups, model, replay=True),
                    }
                    report["runs"].append(run)
                    off, on = run["without_replay"], run["with_replay"]
                    print(
                        f"seed {seed} engine {dtype}: gap {off['sampler_logprob_gap']:.3e} -> "
                        f"{on['sampler_logprob_gap']:.3e} with replay; routing mismatch "
                        f"{off['routing_mismatch']:.4f} -> {on['routing_mismatch']:.4f}",
                        flush=True,
                    )
    finally:
        dist.destroy_process_group()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
