#!/usr/bin/env python
"""The fused Triton kernels of the update pass against the chunked torch path (GPU; CPU: a check).

    python benchmarks/vocab_kernel.py [--device cuda] [--tokens 16384] [--vocab 151936] [--ids 33]
                                      [--warmup 3] [--repeats 10] [--sweep 4096:8,8192:8,8192:16,16384:16,32768:32]
                                      [--out benchmarks/results/vocab_kernel_gpu.json]

One call of ``parallel.vocab_parallel.vocab_parallel_logprobs`` as the update pass makes it: bf16
logits [T, V] (TP = 1, ``tp_group=None``), M = k + 1 = 33 ids per token (32 random + the target),
the entropy, ``inplace_backward=True``, forward then backward of (log-probs, entropy) with random
upstream gradients; once with ``EMPG_VOCAB_KERNEL=torch`` (the chunked torch path) and once with
``=triton`` (``kernels.vocab_logprob_triton``), each timed with CUDA events (``time.perf_counter``
on CPU) over ``--repeats`` after ``--warmup``, the logits restored from a pristine copy outside the
timed region.

Reported (JSON to ``--out``, a table on stdout):
  - the check: max |triton - torch| of the log-probs, the entropy and the bf16 gradient, and
    whether they are within the tolerances (fp32 values 1e-4 absolute + 1e-5 relative: sums over
    151,936 columns in another order; gradients one bf16 rounding, 2^-7 relative + 1e-6 absolute);
    the exit status is 1 when they are not
  - per path: median / min forward, backward and total ms; achieved bandwidth = the bytes the pass
    must move (forward: one read of the bf16 logits, T V 2 bytes; backward: one read and one write,
    2 T V 2 bytes) over the median time, and its fraction of the device-to-device copy bandwidth
    measured in the same run (one large ``copy_``, bytes read + written); goal for triton: >= 60%
  - a sweep of the kernels' launch configs (BLOCK columns : num_warps), each kernel alone
    (backward out of place), to pick ``launch_config``.

``--device cpu`` runs the same flow at toy sizes under Triton's interpreter (TRITON_INTERPRET=1,
set here before triton is imported): a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BF16_ULP = 2.0**-7
VALUE_TOL = {"atol": 1e-4, "rtol": 1e-5}
GRAD_TOL = {"atol": 1e-6, "rtol": BF16_ULP}
GOAL_FRACTION = 0.6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--ids", type=int, default=33, help="M = k + 1 ids per token")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--sweep",
        default="4096:8,8192:8,8192:16,16384:16,32768:32",
        help="BLOCK:num_warps launch configs timed per kernel ('' for none)",
    )
    p.add_argument("--copy-gb", type=float, default=2.0, help="size of the copy_ measuring the bandwidth")
    p.add_argument("--logit-scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/vocab_kernel_gpu.json"))
    return p.parse_args(argv)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Timer:
    """Intervals between marks: CUDA events on a GPU, perf_counter on a CPU (ms)."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()


def device_info(torch, device) -> dict:
    import triton

    info = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_torch": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name,
            total_memory_bytes=p.total_memory,
            multiprocessors=p.multi_processor_count,
            capability=list(torch.cuda.get_device_capability(device)),
        )
    else:
        info.update(name=f"CPU ({platform.processor() or platform.machine()})", cpu_count=os.cpu_count())
    return info


def copy_bandwidth(torch, device, nbytes: int, timer: Timer, repeats: int = 20) -> dict:
    """One ``copy_`` of ``nbytes`` of bf16; bytes read + written over the median time."""
    src = torch.randn(nbytes // 2, device=device).bfloat16()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = []
    for _ in range(repeats):
        timer.sync()
        a = timer.mark()
        dst.copy_(src)
        b = timer.mark()
        timer.sync()
        ms.append(timer.ms(a, b))
    ok = bool(torch.equal(dst, src))
    del src, dst
    return {
        "bytes_read_plus_written": 2 * nbytes,
        "median_ms": _median(ms),
        "min_ms": min(ms),
        "bandwidth_GBps": 2 * nbytes / (_median(ms) / 1e3) / 1e9,
        "copy_verified": ok,
    }


def make_inputs(torch, args, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(args.seed)
    t, v, m = args.tokens, args.vocab, args.ids
    logits = torch.empty(t, v, dtype=torch.bfloat16, device=device)
    for s in range(0, t, 1024):  # no [T, V] fp32 transient
        e = min(s + 1024, t)
        logits[s:e] = torch.randn(e - s, v, generator=gen, device=device).mul_(args.logit_scale)
    ids = torch.randint(0, v, (t, m), generator=gen, device=device)
    return {
        "pristine": logits,
        "ids": ids,
        "g_logprobs": torch.randn(t, m, generator=gen, device=device),
        "g_entropy": torch.randn(t, generator=gen, device=device),
    }


def run_path(torch, mode: str, inp: dict, args, timer: Timer) -> tuple[dict, tuple]:
    """Time forward + in-place backward with EMPG_VOCAB_KERNEL=mode; also return the last outputs."""
    from megatron_empg.parallel.vocab_parallel import vocab_parallel_logprobs

    os.environ["EMPG_VOCAB_KERNEL"] = mode
    logits = inp["pristine"].clone().requires_grad_(True)
    fwd, bwd = [], []
    for i in range(args.warmup + args.repeats):
        with torch.no_grad():
            logits.copy_(inp["pristine"])  # the previous backward wrote its gradient here
        timer.sync()
        a = timer.mark()
        logprobs, entropy = vocab_parallel_logprobs(
            logits,
            inp["ids"],
            vocab_start=0,
            vocab_size=args.vocab,
            tp_group=None,
            inplace_backward=True,
            with_entropy=True,
            validate=False,
        )
        b = timer.mark()
        (grad,) = torch.autograd.grad((logprobs, entropy), logits, (inp["g_logprobs"], inp["g_entropy"]))
        c = timer.mark()
        timer.sync()
        if i >= args.warmup:
            fwd.append(timer.ms(a, b))
            bwd.append(timer.ms(b, c))
    tot = [f + b for f, b in zip(fwd, bwd)]
    tv2 = args.tokens * args.vocab * 2
    need = {"forward": tv2, "backward": 2 * tv2, "total": 3 * tv2}
    med = {"forward": _median(fwd), "backward": _median(bwd), "total": _median(tot)}
    result = {
        "mode": mode,
        "grad_aliases_logits": grad.data_ptr() == logits.data_ptr(),
        "time_ms": {
            k: {"median": med[k], "min": min(x), "all": x}
            for k, x in (("forward", fwd), ("backward", bwd), ("total", tot))
        },
        "min_bytes_moved": need,
        "achieved_bandwidth_GBps": {k: need[k] / (med[k] / 1e3) / 1e9 for k in need},
    }
    return result, (logprobs.detach(), entropy.detach(), grad.detach())


def grad_diff(a, b, rows: int = 1024) -> tuple[float, float, float]:
    """(max |a - b|, max |a - b| / (atol + rtol |b|) of GRAD_TOL, max |b|) over row chunks: no
    [T, V] fp32 temporary."""
    worst = ratio = largest = 0.0
    for s in range(0, a.shape[0], rows):
        x, y = a[s : s + rows].float(), b[s : s + rows].float()
        d = (x - y).abs()
        worst = max(worst, d.max().item())
        ratio = max(ratio, (d / (GRAD_TOL["atol"] + GRAD_TOL["rtol"] * y.abs())).max().item())
        largest = max(largest, y.abs().max().item())
    return worst, ratio, largest


def check(ours: tuple, ref: tuple) -> dict:
    out = {"tolerances": {"values": VALUE_TOL, "grad": GRAD_TOL}}
    ok = True
    for name, x, y in (("logprobs", ours[0], ref[0]), ("entropy", ours[1], ref[1])):
        d = (x - y).abs()
        out[f"{name}_max_abs_diff"] = d.max().item()
        ok &= bool((d <= VALUE_TOL["atol"] + VALUE_TOL["rtol"] * y.abs()).all())
    out["grad_max_abs_diff"], out["grad_max_diff_over_tol"], out["grad_max_abs"] = grad_diff(ours[2], ref[2])
    out["ok"] = ok and out["grad_max_diff_over_tol"] <= 1.0
    return out


def sweep(torch, inp: dict, args, timer: Timer, configs: list[tuple[int, int]]) -> list[dict]:
    """Each kernel alone per launch config: forward, and backward out of place into a buffer."""
    from megatron_empg.kernels import vocab_logprob_triton as kernels

    logits, ids = inp["pristine"], inp["ids"]
    cols = ids.contiguous()  # TP = 1: every id is owned, its local column is its id
    lse = torch.logsumexp(logits[:1].float(), -1).expand(args.tokens).contiguous()  # any finite lse
    entropy = torch.full((args.tokens,), 5.0, device=logits.device)
    g_total = inp["g_logprobs"].sum(-1)
    out = torch.empty_like(logits)
    tv2 = args.tokens * args.vocab * 2
    rows = []
    for block, warps in configs:
        row = {"block": block, "num_warps": warps}
        try:
            for name, nbytes, call in (
                (
                    "forward",
                    tv2,
                    lambda: kernels.local_stats(
                        logits, cols, args.vocab, with_entropy=True, block_size=block, num_warps=warps
                    ),
                ),
                (
                    "backward",
                    2 * tv2,
                    lambda: kernels.logsoftmax_backward(
                        logits,
                        out,  # noqa: F821 (deleted after the sweep, its last use)
                        args.vocab,
                        lse,
                        cols,
                        inp["g_logprobs"],
                        g_total,
                        entropy,
                        inp["g_entropy"],
                        block_size=block,
                        num_warps=warps,
                    ),
                ),
            ):
                ms = []
                for i in range(2 + max(3, args.repeats // 2)):
                    timer.sync()
                    a = timer.mark()
                    call()
                    b = timer.mark()
                    timer.sync()
                    if i >= 2:
                        ms.append(timer.ms(a, b))
                row[f"{name}_ms"] = _median(ms)
                row[f"{name}_GBps"] = nbytes / (_median(ms) / 1e3) / 1e9
        except Exception as err:  # noqa: BLE001 - a config that fails to compile or launch is recorded
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    del out
    return rows


def write(result: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    import torch

    from megatron_empg.kernels import vocab_logprob_triton as kernels

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    timer = Timer(torch, device)
    launch = {
        name: dict(zip(("block", "num_warps"), kernels.launch_config(args.vocab, torch.bfloat16, forward=fwd)))
        for name, fwd in (("forward", True), ("backward", False))
    }
    result = {
        "benchmark": "vocab_kernel",
        "schema": 1,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_info(torch, device),
        "git": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": (_git("status", "--porcelain", "--", "megatron_empg") or "").splitlines(),
        },
        "params": {**vars(args), "dtype": "bf16", "tp": 1, "inplace_backward": True, "with_entropy": True},
        "default_launch_config": launch,
        "partial": True,
    }
    status = 0
    try:
        result["copy_bandwidth"] = copy_bandwidth(torch, device, int(args.copy_gb * 2**30), timer)
        copy_bw = result["copy_bandwidth"]["bandwidth_GBps"]
        inp = make_inputs(torch, args, device)
        result["paths"], outputs = {}, {}
        for mode in ("torch", "triton"):
            result["paths"][mode], outputs[mode] = run_path(torch, mode, inp, args, timer)
            r = result["paths"][mode]
            r["fraction_of_copy_bandwidth"] = {k: v / copy_bw for k, v in r["achieved_bandwidth_GBps"].items()}
            if mode == "torch":  # the triton run overwrites the logits buffer: keep a copy
                outputs[mode] = tuple(t.clone() for t in outputs[mode])
            write(result, args.out)
        result["check"] = check(outputs["triton"], outputs["torch"])
        del outputs
        tri, ref = result["paths"]["triton"], result["paths"]["torch"]
        result["speedup_vs_torch"] = {
            k: ref["time_ms"][k]["median"] / tri["time_ms"][k]["median"] for k in tri["time_ms"]
        }
        frac = tri["fraction_of_copy_bandwidth"]["total"]
        result["goal"] = {"fraction_of_copy_bandwidth": GOAL_FRACTION, "achieved": frac, "met": frac >= GOAL_FRACTION}
        write(result, args.out)
        configs = [tuple(int(x) for x in c.split(":")) for c in args.sweep.split(",") if c]
        result["sweep"] = sweep(torch, inp, args, timer, configs)
        status = 0 if result["check"]["ok"] else 1
        result["partial"] = False
    except Exception:  # noqa: BLE001 - record what failed next to what was measured
        result["error"] = traceback.format_exc()[-3000:]
        status = 1
    write(result, args.out)
    report(result)
    return status


def report(r: dict) -> None:
    dev = r["device"]["name"]
    cb = (r.get("copy_bandwidth") or {}).get("bandwidth_GBps")
    p = r["params"]
    print(
        f"\nvocab_kernel: {dev}, T={p['tokens']} V={p['vocab']} M={p['ids']} bf16, entropy, in-place backward; "
        f"copy bandwidth {cb and round(cb)} GB/s; default launch {r['default_launch_config']}"
    )
    print(f"{'path':<8} {'fwd ms':>8} {'bwd ms':>8} {'total ms':>9} {'GB/s':>7} {'%copy':>6}")
    for mode, x in (r.get("paths") or {}).items():
        t = x["time_ms"]
        print(
            f"{mode:<8} {t['forward']['median']:>8.3f} {t['backward']['median']:>8.3f} {t['total']['median']:>9.3f} "
            f"{x['achieved_bandwidth_GBps']['total']:>7.0f} {100 * x['fraction_of_copy_bandwidth']['total']:>6.1f}"
        )
    if "check" in r:
        c = r["check"]
        print(
            f"check vs torch: logprobs {c['logprobs_max_abs_diff']:.2e}, entropy {c['entropy_max_abs_diff']:.2e}, "
            f"grad {c['grad_max_abs_diff']:.2e} (max diff / tol {c['grad_max_diff_over_tol']:.2f}): "
            f"{'OK' if c['ok'] else 'MISMATCH'}"
        )
    if "goal" in r:
        g = r["goal"]
        print(
            f"speedup vs torch x{r['speedup_vs_torch']['total']:.1f}; triton at {100 * g['achieved']:.1f}% of copy "
            f"bandwidth (goal {100 * g['fraction_of_copy_bandwidth']:.0f}%: {'met' if g['met'] else 'NOT met'})"
        )
    for s in r.get("sweep", []):
        if "error" in s:
            print(f"  BLOCK {s['block']:>6} warps {s['num_warps']:>2}: {s['error']}")
        else:
            print(
                f"  BLOCK {s['block']:>6} warps {s['num_warps']:>2}: fwd {s['forward_ms']:.3f} ms "
                f"({s['forward_GBps']:.0f} GB/s), bwd {s['backward_ms']:.3f} ms ({s['backward_GBps']:.0f} GB/s)"
            )
    if "error" in r:
        print(r["error"])


if __name__ == "__main__":
    sys.exit(main())
