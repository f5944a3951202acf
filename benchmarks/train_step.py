"""Per-stage times of one RL step on the Megatron policy: old pass, anchor pass, update, EMA update,
checkpoint; tokens/s and achieved model FLOP/s, with and without Top-k KL. Writes JSON.

    python benchmarks/train_step.py                       # CPU, tiny-qwen2, one process (gloo)
    python benchmarks/train_step.py --model deepseek-r1-distill-qwen-1.5b --dtype bf16 \
        --seqs 16 --seq-len 1024 --peak-tflops 989     # one GPU (NCCL), random weights

One process, TP = PP = DP = 1. Each variant builds the policy (``mcore.model.build_gpt_model``),
Megatron DDP + Adam, the EMA anchor (bf16 compute weights on GPU, the policy's dtype on CPU) and
runs ``--warmup`` + ``--repeats`` RL steps on random tokens; every stage is timed with
``perf_counter`` after a device synchronize, and the medians are reported.

    old pass      forward_stats on the policy: log pi_old at the targets (+ top-k ids and log-probs)
    anchor pass   forward_stats on the anchor: log pi_ref at the targets (+ at the policy's top-k)
    update        train_step: forward + backward (PPO clip + beta KL) + optimizer step
    ema update    EmaAnchor.update(): master = tau master + (1 - tau) main params, then the cast
    checkpoint    save_checkpoint (policy, optimizer, anchor master, RNG) into a temporary directory

Model FLOPs per token: 2 N (forward) and 6 N (update), N = non-embedding parameters + the output
layer, plus attention 4 L s h per token forward (x3 for forward + backward), the convention of
Megatron-LM's ``num_floating_point_operations`` without the causal halving. MFU = achieved /
``--peak-tflops`` (only reported when a peak is given: CPUs have no meaningful one here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.config import ParallelConfig, load_model_config  # noqa: E402

STAGES = ("old_pass", "anchor_pass", "update", "ema_update", "checkpoint")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def model_flops_per_token(model_cfg, seq_len: int) -> dict:
    """Forward and update (forward + backward) FLOPs per token (module docstring)."""
    n_embedding = model_cfg.vocab_size * model_cfg.hidden_size
    # The embedding lookup is no matmul; the output layer is one, tied or not.
    n = model_cfg.num_parameters() - n_embedding + (n_embedding if model_cfg.tie_word_embeddings else 0)
    attention = 4 * model_cfg.num_layers * seq_len * model_cfg.num_attention_heads * model_cfg.kv_channels
    forward = 2 * n + attention
    return {"forward": forward, "update": 3 * forward, "matmul_params": n}


def _batch(vocab_size: int, seqs: int, seq_len: int, micro_batch: int, device) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (seqs, seq_len + 1), generator=g)
    mask = torch.zeros(seqs, seq_len, dtype=torch.bool)
    mask[:, seq_len // 4 :] = True  # a quarter prompt, the rest response
    full = {
        "input_ids": tokens[:, :-1],
        "target_ids": tokens[:, 1:],
        "loss_mask": mask,
        "advantages": torch.randn(seqs, 1, generator=g).expand(seqs, seq_len).clone(),
    }
    full = {k: v.to(device) for k, v in full.items()}
    return [{k: v[i : i + micro_batch] for k, v in full.items()} for i in range(0, seqs, micro_batch)]


def run_variant(args, kl: str, ckpt_root: Path) -> dict:
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.checkpoint import save_checkpoint
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.config import OptimizerConfig
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.config import LossConfig
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step

    model_cfg = load_model_config(args.model)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        policy = build_gpt_model(model_cfg, parallel, params_dtype=dtype)
        settings = OptimizerConfig(lr=1e-6, clip_grad=1.0)
        ddp = wrap_with_ddp(policy, settings)
        optimizer = build_optimizer(ddp, settings)
        scheduler = build_scheduler(optimizer, settings)
        anchor = EmaAnchor.from_configs(model_cfg, parallel, ddp, optimizer, tau=0.99, period=1, compute_dtype=dtype)
        k = args.k if kl == "topk" else 0
        loss = LossConfig(
            kl=kl, kl_coef=0.05, chunk_size=args.chunk_size,
            kl_args={"direction": "reverse", "importance_weight": True} if kl == "topk" else {},
        )  # fmt: skip
        vocab = model_cfg.vocab_size
        times = {stage: [] for stage in STAGES}
        for step in range(args.warmup + args.repeats):
            mbs = _batch(vocab, args.seqs, args.seq_len, args.micro_batch, device)
            old, t_old = _timed(lambda: forward_stats(ddp, mbs, StatsRequest(vocab_size=vocab, k=k), groups))
            for mb, stats in zip(mbs, old, strict=True):
                mb["old_logprobs"] = stats["logprobs"]
                if k:
                    mb["topk_ids"] = stats["topk_ids"]
            request = StatsRequest(vocab_size=vocab, extra_ids_key="topk_ids" if k else None, with_entropy=False)
            ref, t_anchor = _timed(lambda: forward_stats(anchor.models, mbs, request, groups))
            for mb, stats in zip(mbs, ref, strict=True):
                mb["anchor_logprobs"] = stats["logprobs"]
                if k:
                    mb["topk_anchor_logprobs"] = stats["extra_logprobs"]
            _, t_update = _timed(
                lambda: train_step(ddp, optimizer, scheduler, mbs, loss, vocab_size=vocab, groups=groups)
            )
            _, t_ema = _timed(anchor.update)
            _, t_ckpt = _timed(
                lambda: save_checkpoint(
                    ckpt_root / kl, step, models=ddp, optimizer=optimizer, scheduler=scheduler, anchor=anchor,
                    groups=groups, keep_last=1,
                )
            )
            if step >= args.warmup:
                for stage, t in zip(STAGES, (t_old, t_anchor, t_update, t_ema, t_ckpt)):
                    times[stage].append(t)
    finally:
        destroy_model_parallel()
    medians = {stage: statistics.median(ts) for stage, ts in times.items()}
    step_s = sum(medians[s] for s in ("old_pass", "anchor_pass", "update", "ema_update"))
    tokens = args.seqs * args.seq_len
    flops = model_flops_per_token(model_cfg, args.seq_len)
    step_flops = tokens * (2 * flops["forward"] + flops["update"])  # two forward-only passes + update
    result = {
        "kl": kl,
        "k": k,
        "tokens_per_step": tokens,
        "stage_seconds_median": medians,
        "stage_seconds_all": times,
        "step_seconds_without_checkpoint": step_s,
        "tokens_per_second": tokens / step_s,
        "ema_update_share_of_step": medians["ema_update"] / step_s,
        "achieved_model_tflops": step_flops / step_s / 1e12,
        "model_flops_per_token": flops,
    }
    if args.peak_tflops:
        result["mfu"] = result["achieved_model_tflops"] / args.peak_tflops
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (H100 SXM bf16 dense: 989)")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/train_step_cpu.json"))
    args = p.parse_args(argv)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="train_step_bench_") as tmp:
            variants = [run_variant(args, kl, Path(tmp)) for kl in ("topk", "k3")]
    finally:
        dist.destroy_process_group()
    report = {
        "benchmark": "train_step",
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch_threads": torch.get_num_threads(),
        },
        "params": vars(args),
        "variants": variants,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for v in variants:
        stages = ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in v["stage_seconds_median"].items())
        print(f"kl={v['kl']:<5} {v['tokens_per_second']:.0f} tokens/s, EMA {100 * v['ema_update_share_of_step']:.2f}% | {stages}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
