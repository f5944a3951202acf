"""Per-stage times of one RL step on the Megatron policy: old pass, anchor pass, update, EMA update,
checkpoint; tokens/s and achieved model FLOP/s, with and without Top-k KL. Writes JSON.

    python benchmarks/train_step.py                       # CPU, tiny-qwen2, one process (gloo)
    python benchmarks/train_step.py --model deepseek-r1-distill-qwen-1.5b --dtype bf16 \
        --seqs 16 --seq-len 2048 --micro-batch 1 --peak-tflops 989 --checkpoint once \
        --out benchmarks/results/train_step_gpu.json   # one GPU (NCCL world of one), random weights

One process, TP = PP = DP = 1. Each variant (``--kl``: topk, k3) builds the policy
(``mcore.model.build_gpt_model``: the Transformer Engine layer spec when TE is importable, else
Megatron's local spec, picked automatically; on a CUDA machine the model is moved to the GPU),
Megatron DDP (fp32 grad buffers) + Adam (fp32 main params for bf16), the EMA anchor (compute weights
in ``--dtype``, fp32 master on the same device) and runs ``--warmup`` + ``--repeats`` RL steps on
random tokens (the micro-batches are moved to the device before the old pass, outside the timing);
every stage is timed with ``perf_counter`` between two device synchronizes
(``torch.cuda.synchronize`` on CUDA), and the medians are reported. ``--checkpoint`` saves every
step (default), once (the last step of the first variant: a 1.5B-parameter checkpoint with its
optimizer and anchor is ~30 GB) or never. On CUDA the JSON also has the CUDA allocator's peaks: over
the variant, per stage (max over steps) and the memory held after building and after the steps; an
out-of-memory variant is recorded as such (``ok: false, oom: true``) and the next one still runs.
The JSON is rewritten after each variant.

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
import gc
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
from megatron_empg.core.microbatch import MicroBatch  # noqa: E402

STAGES = ("old_pass", "anchor_pass", "update", "ema_update", "checkpoint")
CUDA = torch.cuda.is_available()


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _timed(fn, peaks: dict | None = None, stage: str | None = None):
    """Run fn between two device synchronizes; the seconds, and on CUDA the allocator's peak during
    fn kept as the max over calls in peaks[stage]."""
    if CUDA and peaks is not None:
        torch.cuda.reset_peak_memory_stats()
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    elapsed = time.perf_counter() - start
    if CUDA and peaks is not None:
        peaks[stage] = max(peaks.get(stage, 0), torch.cuda.max_memory_allocated())
    return out, elapsed


def model_flops_per_token(model_cfg, seq_len: int) -> dict:
    """Forward and update (forward + backward) FLOPs per token (module docstring)."""
    n_embedding = model_cfg.vocab_size * model_cfg.hidden_size
    # The embedding lookup is no matmul; the output layer is one, tied or not.
    n = model_cfg.num_parameters() - n_embedding + (n_embedding if model_cfg.tie_word_embeddings else 0)
    attention = 4 * model_cfg.num_layers * seq_len * model_cfg.num_attention_heads * model_cfg.kv_channels
    forward = 2 * n + attention
    return {"forward": forward, "update": 3 * forward, "matmul_params": n}


def _batch(vocab_size: int, seqs: int, seq_len: int, micro_batch: int, device) -> list[MicroBatch]:
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
    return [MicroBatch(**{k: v[i : i + micro_batch] for k, v in full.items()}) for i in range(0, seqs, micro_batch)]


def run_variant(args, kl: str, ckpt_root: Path, progress: dict, checkpoint_steps: set[int]) -> dict:
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.checkpoint import save_checkpoint
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.config import OptimizerConfig
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.config import LossConfig
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.build import bind_loss

    model_cfg = load_model_config(args.model)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda") if CUDA else torch.device("cpu")  # "cuda": the current device
    peaks: dict[str, int] = {}
    memory: dict[str, int] = {}
    checkpoint_errors: list[str] = []
    progress.update(kl=kl, stage="build", step=None)
    try:
        policy = build_gpt_model(model_cfg, parallel, params_dtype=dtype)
        settings = OptimizerConfig(lr=1e-6, clip_grad=1.0)
        ddp = wrap_with_ddp(policy, settings)
        optimizer = build_optimizer(ddp, settings)
        scheduler = build_scheduler(optimizer, settings)
        anchor = EmaAnchor.from_configs(model_cfg, parallel, ddp, optimizer, tau=0.99, period=1, compute_dtype=dtype)
        k = args.k if kl == "topk" else 0
        vocab = model_cfg.vocab_size
        loss, _ = bind_loss(LossConfig(
            kl=kl, kl_coef=0.05, chunk_size=args.chunk_size,
            kl_args={"direction": "reverse", "importance_weight": True} if kl == "topk" else {},
        ), vocab_size=vocab, topk=args.k)  # fmt: skip
        times = {stage: [] for stage in STAGES}
        if CUDA:
            _sync()
            memory["allocated_after_build_bytes"] = torch.cuda.memory_allocated()
            memory["peak_during_build_bytes"] = torch.cuda.max_memory_allocated()
        for step in range(args.warmup + args.repeats):
            progress.update(step=step, stage="batch")
            mbs = _batch(vocab, args.seqs, args.seq_len, args.micro_batch, device)
            progress["stage"] = "old_pass"
            old, t_old = _timed(
                lambda: forward_stats(ddp, mbs, StatsRequest(vocab_size=vocab, k=k), groups), peaks, "old_pass"
            )
            for mb, stats in zip(mbs, old, strict=True):
                mb.old_logprobs = stats["logprobs"]
                if k:
                    mb.topk_ids = stats["topk_ids"]
            request = StatsRequest(vocab_size=vocab, extra_ids_key="topk_ids" if k else None, with_entropy=False)
            progress["stage"] = "anchor_pass"
            ref, t_anchor = _timed(lambda: forward_stats(anchor.models, mbs, request, groups), peaks, "anchor_pass")
            for mb, stats in zip(mbs, ref, strict=True):
                mb.anchor_logprobs = stats["logprobs"]
                if k:
                    mb.topk_anchor_logprobs = stats["extra_logprobs"]
            progress["stage"] = "update"
            _, t_update = _timed(
                lambda: train_step(ddp, optimizer, scheduler, mbs, loss, groups=groups), peaks, "update"
            )
            progress["stage"] = "ema_update"
            _, t_ema = _timed(anchor.update, peaks, "ema_update")
            t_ckpt = None
            if step in checkpoint_steps:
                progress["stage"] = "checkpoint"
                try:
                    _, t_ckpt = _timed(
                        lambda: save_checkpoint(
                            ckpt_root / kl, step, models=ddp, optimizer=optimizer, scheduler=scheduler, anchor=anchor,
                            groups=groups, keep_last=1,
                        ),
                        peaks, "checkpoint",
                    )  # fmt: skip
                except Exception as err:  # noqa: BLE001 - e.g. a full disk: recorded, the timing goes on
                    checkpoint_errors.append(f"step {step}: {type(err).__name__}: {err}"[:500])
            if step >= args.warmup:
                for stage, t in zip(STAGES, (t_old, t_anchor, t_update, t_ema, t_ckpt)):
                    if t is not None:
                        times[stage].append(t)
        if CUDA:
            memory["allocated_after_steps_bytes"] = torch.cuda.memory_allocated()
            memory["reserved_after_steps_bytes"] = torch.cuda.memory_reserved()
    finally:
        destroy_model_parallel()
    medians = {stage: (statistics.median(ts) if ts else None) for stage, ts in times.items()}
    step_s = sum(medians[s] for s in ("old_pass", "anchor_pass", "update", "ema_update"))
    tokens = args.seqs * args.seq_len
    flops = model_flops_per_token(model_cfg, args.seq_len)
    step_flops = tokens * (2 * flops["forward"] + flops["update"])  # two forward-only passes + update
    result = {
        "kl": kl,
        "ok": True,
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
    if checkpoint_errors:
        result["checkpoint_errors"] = checkpoint_errors
    if CUDA:
        result["cuda_memory"] = {
            **memory,
            "peak_allocated_bytes": max([memory.get("peak_during_build_bytes", 0), *peaks.values()]),
            "peak_allocated_by_stage_bytes": peaks,
            "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "device_total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        }
    return result


def _failure(kl: str, err: BaseException, progress: dict) -> dict:
    out = {
        "kl": kl,
        "ok": False,
        "oom": isinstance(err, torch.cuda.OutOfMemoryError),
        "failed_at": {"stage": progress.get("stage"), "step": progress.get("step")},
        "error": f"{type(err).__name__}: {err}"[:1500],
    }
    if CUDA:
        out["cuda_memory"] = {
            "allocated_at_failure_bytes": torch.cuda.memory_allocated(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "device_total_bytes": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        }
    return out


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f} GiB"


def _summary(v: dict) -> str:
    if not v.get("ok"):
        mem = v.get("cuda_memory", {})
        what = "OUT OF MEMORY" if v.get("oom") else "FAILED"
        return (f"kl={v['kl']:<5} {what} at {v['failed_at']['stage']} (step {v['failed_at']['step']}), "
                f"peak {_gib(mem.get('peak_allocated_bytes'))}: {v['error'][:300]}")
    stages = ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in v["stage_seconds_median"].items() if t is not None)
    line = f"kl={v['kl']:<5} {v['tokens_per_second']:.0f} tokens/s, EMA {100 * v['ema_update_share_of_step']:.2f}%"
    if "mfu" in v:
        line += f", {v['achieved_model_tflops']:.0f} TFLOP/s, MFU {100 * v['mfu']:.1f}%"
    if "cuda_memory" in v:
        line += f", peak {_gib(v['cuda_memory']['peak_allocated_bytes'])}"
    return line + f" | {stages}"


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
    p.add_argument("--kl", default="topk,k3", help="comma list of the variants' KL estimators (topk, k3, ...)")
    p.add_argument("--checkpoint", choices=("every", "once", "none"), default="every",
                   help="save a checkpoint every step, once (last step of the first variant) or never")
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/train_step_cpu.json (train_step_gpu.json on a CUDA machine)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(REPO / f"benchmarks/results/train_step_{'gpu' if CUDA else 'cpu'}.json")
    kls = [x for x in args.kl.split(",") if x]
    n_steps = args.warmup + args.repeats

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    variants: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="train_step_bench_") as tmp:
            for i, kl in enumerate(kls):
                steps = {"every": set(range(n_steps)), "once": {n_steps - 1} if i == 0 else set(), "none": set()}
                progress: dict = {}
                if CUDA:
                    torch.cuda.reset_peak_memory_stats()
                try:
                    variants.append(run_variant(args, kl, Path(tmp), progress, steps[args.checkpoint]))
                except torch.cuda.OutOfMemoryError as err:
                    variants.append(_failure(kl, err, progress))
                if CUDA:
                    gc.collect()
                    torch.cuda.empty_cache()
                print(_summary(variants[-1]), flush=True)
                _write_report(args, variants)
    finally:
        dist.destroy_process_group()
    print(f"wrote {args.out}")
    if not all(v.get("ok") for v in variants):
        sys.exit(1)


def _machine() -> dict:
    from megatron_empg.mcore.model import te_available

    info = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "torch_threads": torch.get_num_threads(),
        "transformer_engine": te_available(),
    }
    try:
        import megatron.core

        info["megatron_core"] = getattr(megatron.core, "__version__", None)
    except ImportError:
        pass
    if CUDA:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(torch_cuda=torch.version.cuda, device_total_memory_bytes=props.total_memory,
                    multiprocessors=props.multi_processor_count)  # fmt: skip
    return info


def _write_report(args, variants: list[dict]) -> None:
    report = {
        "benchmark": "train_step",
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "params": vars(args),
        "variants": variants,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
