#!/usr/bin/env python
"""Peak memory and time of the update pass's output layer + loss, fused or not (CPU; or one GPU).

    python benchmarks/fused_output.py [--tokens 4096,16384] [--vocab 151936] [--hidden 1536]
                                      [--chunk-size 256] [--threads 2] [--device cpu|cuda]
                                      [--out benchmarks/results/fused_output_cpu.json]

One micro-batch of T tokens (one packed row [1, T]) of R1-Distill-Qwen-1.5B's output layer
(V = 151,936, H = 1536, untied, bf16) and the 16k recipe's loss (``RECIPE``'s ``algorithm.loss``
bound by ``trainer.bind.build.bind_loss``: dual-clip PPO, the K3 KL, seq-mean-token-mean, the entropy
logged), forward + backward, TP 1:

  unfused   what ``train.fused_output_loss: false`` runs: logits = hidden @ weight.T [1, T, V] bf16
            (autograd's matmul, as ColumnParallelLinear), ``rl_loss`` on them with the recipe's
            ``inplace_backward`` (the logits' gradient written into them), backward; then Megatron
            DDP's hook adds weight.grad (bf16 [V, H]) into the float32 ``main_grad``
  fused     ``train.fused_output_loss: true``: ``rl_loss`` on ``OutputLayerInput(hidden, weight)``
            (``parallel.fused_output``), the weight gradient summed into ``main_grad`` directly

The inputs (not counted): hidden [1, T, H] bf16 (a leaf standing for the decoder's output), the
weight [V, H] bf16 with a float32 ``main_grad`` (zeroed, its pages touched) and the batch.

CPU: each (variant, tokens) runs in a FRESH subprocess: a warm-up pass on the first 256 tokens,
both under the profiler (its one-time memory then precedes the measurement), then ONE measured
forward + backward (a full-size pass takes minutes on two cores) under
torch.profiler(profile_memory=True), giving
  * tracked_peak_extra: the peak of the running sum of the CPU allocations and frees (allocator-
    exact: it counts an allocation whose pages are never touched, e.g. the fused path's dummy
    weight gradient, which RSS does not),
  * peak_rss_extra: VmHWM (reset to the RSS through /proc/self/clear_refs right before) minus that
    RSS; glibc is told to mmap every block of 1 MiB or more, so that freed ones leave the RSS,
  * time: wall-clock (perf_counter) of forward and backward (the profiler's overhead included).
An address-space limit (RLIMIT_AS = the current size + MemAvailable - 1 GiB) turns a point that does
not fit into a recorded MemoryError instead of the OOM killer.
CUDA (``--device cuda``, default output ``..._gpu.json``): the same points in one process, one
warm-up and ``--repeats`` timed passes each (CUDA synchronize around perf_counter, median), the
peak extra memory from ``max_memory_allocated`` after ``reset_peak_memory_stats``.
The results of both variants (loss, norms of the hidden and weight gradients) are recorded to
compare them at this size. No assertion.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/r1_distill_qwen_1.5b_math_ema_pg_16k.yaml"
VARIANTS = ("unfused", "fused")


def _proc_status(field: str) -> int | None:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s*kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else None


def _mem_available() -> int | None:
    with open("/proc/meminfo") as f:
        m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else None


def _reset_hwm() -> bool:
    """VmHWM := the current RSS; False when the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict:
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    with open("/proc/meminfo") as f:
        total = int(re.search(r"^MemTotal:\s+(\d+)\s*kB", f.read(), re.M).group(1)) * 1024
    return {
        "cpu_model": model.group(1).strip() if model else None,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "bf16_isa": sorted(flags & {"avx512_bf16", "amx_bf16"}),
        "ram_total_bytes": total,
        "ram_available_bytes_at_start": _mem_available(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------- child (one point)


def _inputs(spec: dict, device):
    import torch

    from megatron_empg.core.microbatch import MicroBatch

    T, V, H = spec["tokens"], spec["vocab"], spec["hidden"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, T, H, generator=g).bfloat16().to(device).requires_grad_(True)
    # logits ~ N(0, 2.5^2)
    weight = torch.nn.Parameter((2.5 / H**0.5 * torch.randn(V, H, generator=g)).bfloat16().to(device))
    weight.main_grad = torch.empty(V, H, device=device).fill_(0.0)  # Megatron DDP's buffer, pages touched
    weight.grad_added_to_main_grad = False
    target = torch.randint(0, V, (1, T), generator=g)
    old = -2.0 + 0.5 * torch.randn(1, T, generator=g)
    seq_ids = torch.arange(T)[None] * 4 // T  # four sequences of T / 4 tokens
    batch = MicroBatch(
        input_ids=target,
        target_ids=target,
        loss_mask=torch.ones(1, T, dtype=torch.bool),
        advantages=torch.randn(1, T, generator=g),
        seq_ids=seq_ids,
        old_logprobs=old,
        anchor_logprobs=old - 0.1 * torch.rand(1, T, generator=g),
    ).to(device)
    return hidden, weight, batch


def _head(hidden, batch, tokens: int):
    """The first ``tokens`` tokens: a leaf and a batch (the warm-up pass)."""
    import dataclasses

    import torch

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    head = {k: v[:, :tokens] for k, v in fields.items() if isinstance(v, torch.Tensor)}
    return hidden[:, :tokens].detach().requires_grad_(True), dataclasses.replace(batch, **head)


def _loss_fn(spec: dict):
    from megatron_empg.config import LossConfig, load_config, read_yaml
    from megatron_empg.trainer.bind.build import bind_loss

    section = dict(read_yaml(REPO / RECIPE)["algorithm"]["loss"])
    if spec["chunk_size"]:
        section["chunk_size"] = spec["chunk_size"]
    return bind_loss(load_config(LossConfig, section), vocab_size=spec["vocab"], topk=1)[0]


def _step(spec: dict, loss_fn, hidden, weight, batch, sync) -> tuple[float, float, float]:
    """One forward + backward and DDP's hook; (forward s, backward s, loss)."""
    import torch

    from megatron_empg.parallel.fused_output import OutputLayerInput

    hidden.grad = None
    sync()
    ta = time.perf_counter()
    if spec["variant"] == "fused":
        source = OutputLayerInput(hidden, weight)
    else:
        source = torch.matmul(hidden, weight.t())  # [1, T, V], held by the graph only
    loss = loss_fn(source, batch, vocab_start=0, tp_group=None).loss.loss_sum
    del source
    sync()
    tb = time.perf_counter()
    loss.backward()
    if weight.grad is not None and not weight.grad_added_to_main_grad:  # DDP's hook
        weight.main_grad.add_(weight.grad)
    weight.grad = None
    weight.grad_added_to_main_grad = False  # as zero_grad_buffer
    sync()
    return tb - ta, time.perf_counter() - tb, float(loss)


def _results(hidden, weight, loss: float) -> dict:
    return {
        "loss": loss,
        "grad_hidden_norm": float(hidden.grad.float().norm()),
        "grad_weight_norm": float(weight.main_grad.norm()),
    }


def child_cpu(spec: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(spec["threads"])
    hidden, weight, batch = _inputs(spec, "cpu")
    loss_fn = _loss_fn(spec)
    out = {"variant": spec["variant"], "tokens": spec["tokens"], "threads": torch.get_num_threads()}
    head_hidden, head_batch = _head(hidden, batch, 256)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):  # warm-up, the profiler's too
        _step(spec, loss_fn, head_hidden, weight, head_batch, lambda: None)
    del head_hidden, head_batch
    weight.main_grad.zero_()
    gc.collect()
    out["rss_before_bytes"] = rss0 = _proc_status("VmRSS")
    budget = _mem_available() - (1 << 30)
    limit = _proc_status("VmSize") + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out["address_space_limit_extra_bytes"] = budget
    try:
        out["hwm_reset"] = _reset_hwm()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fwd, bwd, loss = _step(spec, loss_fn, hidden, weight, batch, lambda: None)
        out["peak_rss_extra_bytes"] = _proc_status("VmHWM") - rss0 if out["hwm_reset"] else None
        mem = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        current = peak = 0
        for _, nbytes in mem:
            current += nbytes
            peak = max(peak, current)
        out["tracked_peak_extra_bytes"] = peak
        out.update(time_fwd_s=round(fwd, 3), time_bwd_s=round(bwd, 3), time_total_s=round(fwd + bwd, 3))
        out.update(_results(hidden, weight, loss), ok=True)
    except (RuntimeError, MemoryError) as err:
        out.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
    return out


def run_cuda(spec: dict, repeats: int) -> dict:
    import statistics

    import torch

    hidden, weight, batch = _inputs(spec, "cuda")
    loss_fn = _loss_fn(spec)
    out = {"variant": spec["variant"], "tokens": spec["tokens"], "device": torch.cuda.get_device_name()}
    try:
        _step(spec, loss_fn, hidden, weight, batch, torch.cuda.synchronize)  # warm-up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            weight.main_grad.zero_()
            fwd, bwd, loss = _step(spec, loss_fn, hidden, weight, batch, torch.cuda.synchronize)
            times.append((fwd, bwd))
        out["cuda_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        out["time_fwd_s"] = round(statistics.median(f for f, _ in times), 4)
        out["time_bwd_s"] = round(statistics.median(b for _, b in times), 4)
        out["time_total_s"] = round(statistics.median(f + b for f, b in times), 4)
        out.update(_results(hidden, weight, loss), ok=True)
    except RuntimeError as err:  # OutOfMemoryError among them: recorded, the next point still runs
        out.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
    del hidden, weight, batch
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- parent


def run_point_cpu(spec: dict, timeout: float) -> dict:
    # glibc: blocks of 1 MiB and more come from mmap and go back to the OS when freed, so that the
    # timed pass's VmHWM is its own and not memory the tracked pass left in malloc's arenas
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "PYTHONPATH": str(REPO),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    }
    cmd = [sys.executable, __file__, "--_child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**spec, "ok": False, "error": f"timeout after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**spec, "ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: each path's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per CPU point")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per CUDA point")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/fused_output_<cpu|gpu>.json")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(child_cpu(json.loads(args._child))), flush=True)
        return
    out_path = Path(args.out or f"benchmarks/results/fused_output_{'gpu' if args.device == 'cuda' else 'cpu'}.json")
    points = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for variant in VARIANTS:
            spec = dict(
                variant=variant,
                tokens=tokens,
                vocab=args.vocab,
                hidden=args.hidden,
                chunk_size=args.chunk_size,
                threads=args.threads,
            )
            result = run_cuda(spec, args.repeats) if args.device == "cuda" else run_point_cpu(spec, args.timeout)
            print(json.dumps(result), flush=True)
            points.append(result)
    comparison = []
    for tokens in sorted({p["tokens"] for p in points}):
        row = {p["variant"]: p for p in points if p["tokens"] == tokens}
        fused, unfused = row.get("fused", {}), row.get("unfused", {})
        entry = {"tokens": tokens, "logits_bytes_bf16": tokens * args.vocab * 2}
        if fused.get("ok") and unfused.get("ok"):
            for key in ("peak_rss_extra_bytes", "tracked_peak_extra_bytes", "cuda_peak_extra_bytes", "time_total_s"):
                if key in fused:
                    entry[f"{key}_fused_over_unfused"] = round(fused[key] / unfused[key], 3)
            entry["loss_rel_diff"] = abs(fused["loss"] - unfused["loss"]) / abs(unfused["loss"])
            for key in ("grad_hidden_norm", "grad_weight_norm"):
                entry[f"{key}_rel_diff"] = abs(fused[key] - unfused[key]) / unfused[key]
        comparison.append(entry)
    import torch

    report = {
        "benchmark": "benchmarks/fused_output.py",
        "params": {
            "vocab": args.vocab,
            "hidden": args.hidden,
            "dtype": "bfloat16",
            "tp": 1,
            "recipe": RECIPE,
            "chunk_size": args.chunk_size or "each path's default: unfused 256, fused 1024",
            "device": args.device,
            "threads": args.threads if args.device == "cpu" else None,
            "repeats": args.repeats if args.device == "cuda" else 1,
        },
        "machine": {
            **machine_info(),
            **(
                {"note": "shared machine: other processes ran beside this benchmark (see loadavg)"}
                if args.device == "cpu"
                else {}
            ),
        },
        "torch": torch.__version__,
        "vocab_kernel_env": os.environ.get("EMPG_VOCAB_KERNEL", "auto"),
        "git_commit": _git_commit(),
        "points": points,
        "comparison": comparison,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(comparison, indent=2))


if __name__ == "__main__":
    main()
