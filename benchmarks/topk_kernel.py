#!/usr/bin/env python
"""The old pass's statistics with the Triton top-k against the chunked torch top-k (GPU; CPU: a check).

    python benchmarks/topk_kernel.py [--device cuda] [--tokens 16384] [--vocab 151936] [--k 32]
                                     [--warmup 3] [--repeats 10] [--torch-repeats 3]
                                     [--sweep 1024:4,2048:8,4096:8,8192:16]
                                     [--out benchmarks/results/topk_kernel_gpu.json]

One call of ``parallel.vocab_parallel.vocab_parallel_token_stats`` as the old pass of a reverse
Top-k KL makes it (``trainer.loop`` -> ``mcore.step._stats_loss``): bf16 logits [T, V] (TP = 1,
``tp_group=None``), the target id [T, 1], k = ``--k``, no entropy, ``validate=False``; timed with
CUDA events (``time.perf_counter`` on CPU) after ``--warmup`` calls, as

    torch_topk    EMPG_VOCAB_KERNEL=torch, k: the chunked torch path (``topk_value_then_id`` on fp32
                  copies of 256 tokens at a time), ``--torch-repeats`` calls after one warm-up
    triton_topk   EMPG_VOCAB_KERNEL=triton, k: ``local_stats`` + ``topk_triton.topk``
    triton_k0     EMPG_VOCAB_KERNEL=triton, k = 0: ``local_stats`` alone (the pass without top-k)

and the top-k kernel alone, at its default launch and per launch config of ``--sweep``
(BLOCK:num_warps), with its bandwidth (one read of the bf16 logits, T V 2 bytes) against a
device-to-device copy's measured in the same run.

Reported (JSON to ``--out``, a table on stdout): median / min ms per variant; the ratios
triton_topk / triton_k0 (what the top-k adds to the pass) and torch_topk / triton_topk; the check:
the two paths' top-k ids identical, max |diff| of the top-k log-probs, log-probs and lse (1e-4
absolute + 1e-5 relative: the lse sums over V in another order), and how many rows have a tie
across the k-th place (random bf16 logits have many: the bf16 grid is ~2^-8 relative), which both
paths must resolve to the lower ids; the exit status is 1 on a mismatch.

``--device cpu`` runs the same flow at toy sizes under Triton's interpreter (TRITON_INTERPRET=1,
set here before triton is imported), written with ``"measurement": false`` (default ``--out``
benchmarks/results/topk_kernel_cpu_flow.json): a check of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

from vocab_kernel import REPO, Timer, _git, _median, copy_bandwidth, device_info, write

VALUE_TOL = {"atol": 1e-4, "rtol": 1e-5}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--torch-repeats", type=int, default=3, help="timed calls of the torch path (~140 ms each)")
    p.add_argument(
        "--sweep",
        default="1024:4,2048:8,4096:8,8192:16",
        help="BLOCK:num_warps launch configs of the top-k kernel alone ('' for none)",
    )
    p.add_argument("--copy-gb", type=float, default=2.0, help="size of the copy_ measuring the bandwidth")
    p.add_argument("--logit-scale", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: benchmarks/results/topk_kernel_{gpu,cpu_flow}.json")
    args = p.parse_args(argv)
    if args.out is None:
        name = "topk_kernel_gpu.json" if args.device == "cuda" else "topk_kernel_cpu_flow.json"
        args.out = str(REPO / "benchmarks/results" / name)
    return args


def make_inputs(torch, args, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(args.seed)
    logits = torch.empty(args.tokens, args.vocab, dtype=torch.bfloat16, device=device)
    for s in range(0, args.tokens, 1024):  # no [T, V] fp32 transient
        e = min(s + 1024, args.tokens)
        logits[s:e] = torch.randn(e - s, args.vocab, generator=gen, device=device).mul_(args.logit_scale)
    return {"logits": logits, "ids": torch.randint(0, args.vocab, (args.tokens, 1), generator=gen, device=device)}


def _timed(timer: Timer, call, warmup: int, repeats: int) -> tuple[dict, object]:
    ms, out = [], None
    for i in range(warmup + repeats):
        timer.sync()
        a = timer.mark()
        out = call()
        b = timer.mark()
        timer.sync()
        if i >= warmup:
            ms.append(timer.ms(a, b))
    return {"median": _median(ms), "min": min(ms), "all": ms}, out


def run_variant(torch, mode: str, k: int, inp: dict, args, timer: Timer, warmup: int, repeats: int):
    """(result, TokenStats of the last call) of the old pass's stats call under EMPG_VOCAB_KERNEL=mode."""
    from megatron_empg.parallel.vocab_parallel import vocab_parallel_token_stats

    os.environ["EMPG_VOCAB_KERNEL"] = mode
    time_ms, stats = _timed(
        timer,
        lambda: vocab_parallel_token_stats(
            inp["logits"],
            inp["ids"],
            k,
            vocab_start=0,
            vocab_size=args.vocab,
            tp_group=None,
            with_entropy=False,
            validate=False,
        ),
        warmup,
        repeats,
    )
    return {"mode": mode, "k": k, "time_ms": time_ms}, stats


def kernel_alone(torch, inp: dict, args, timer: Timer, configs: list, copy_bw: float) -> list[dict]:
    """``topk_triton.topk`` alone per (BLOCK, num_warps); None: the default launch."""
    from megatron_empg.kernels import topk_triton

    nbytes = args.tokens * args.vocab * 2
    rows = []
    for block, warps in configs:
        row = {
            "block": block or topk_triton.launch_config(args.vocab)[0],
            "num_warps": warps or topk_triton.launch_config(args.vocab)[1],
            "default": block is None,
        }
        try:
            row["time_ms"], _ = _timed(
                timer,
                lambda: topk_triton.topk(inp["logits"], args.k, args.vocab, block_size=block, num_warps=warps),
                2,
                max(3, args.repeats // 2),
            )
            gbps = nbytes / (row["time_ms"]["median"] / 1e3) / 1e9
            row["achieved_bandwidth_GBps"], row["fraction_of_copy_bandwidth"] = gbps, gbps / copy_bw
        except Exception as err:  # noqa: BLE001 - a config that fails to compile or launch is recorded
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def check(torch, ours, ref, logits, k: int) -> dict:
    out = {
        "tolerances": VALUE_TOL,
        "topk_ids_equal": bool(torch.equal(ours.topk_ids, ref.topk_ids)),
        "rows_with_different_ids": int((ours.topk_ids != ref.topk_ids).any(-1).sum()),
    }
    ok = out["topk_ids_equal"]
    for name in ("topk_logprobs", "logprobs", "lse"):
        x, y = getattr(ours, name), getattr(ref, name)
        out[f"{name}_max_abs_diff"] = (x - y).abs().max().item()
        ok &= bool(((x - y).abs() <= VALUE_TOL["atol"] + VALUE_TOL["rtol"] * y.abs()).all())
    ties = 0
    for s in range(0, logits.shape[0], 1024):  # the (k + 1)-th value equals the k-th
        top = torch.topk(logits[s : s + 1024], k + 1, dim=-1).values
        ties += int((top[:, k - 1] == top[:, k]).sum())
    out["rows_with_tie_across_kth"] = ties
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(REPO))
    import torch

    from megatron_empg.kernels import topk_triton

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    timer = Timer(torch, device)
    block, warps = topk_triton.launch_config(args.vocab)
    result = {
        "benchmark": "topk_kernel",
        "schema": 1,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_info(torch, device),
        "measurement": device.type == "cuda",
        "note": "GPU timings"
        if device.type == "cuda"
        else "CPU under TRITON_INTERPRET=1 at toy sizes: a check of the flow; the times mean nothing",
        "git": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": (_git("status", "--porcelain", "--", "megatron_empg") or "").splitlines(),
        },
        "params": {**vars(args), "dtype": "bf16", "tp": 1, "ids": 1, "with_entropy": False, "max_k": topk_triton.MAX_K},
        "default_launch_config": {"block": block, "num_warps": warps},
        "partial": True,
    }
    status = 0
    try:
        result["copy_bandwidth"] = copy_bandwidth(torch, device, int(args.copy_gb * 2**30), timer)
        copy_bw = result["copy_bandwidth"]["bandwidth_GBps"]
        inp = make_inputs(torch, args, device)
        result["variants"], stats = {}, {}
        for name, mode, k, warmup, repeats in (
            ("triton_k0", "triton", 0, args.warmup, args.repeats),
            ("triton_topk", "triton", args.k, args.warmup, args.repeats),
            ("torch_topk", "torch", args.k, min(args.warmup, 1), args.torch_repeats),
        ):
            result["variants"][name], stats[name] = run_variant(torch, mode, k, inp, args, timer, warmup, repeats)
            write(result, args.out)
        med = {name: v["time_ms"]["median"] for name, v in result["variants"].items()}
        result["ratios"] = {
            "triton_topk_over_triton_k0": med["triton_topk"] / med["triton_k0"],
            "torch_topk_over_triton_topk": med["torch_topk"] / med["triton_topk"],
        }
        result["check"] = check(torch, stats["triton_topk"], stats["torch_topk"], inp["logits"], args.k)
        del stats
        write(result, args.out)
        configs = [(None, None)] + [tuple(int(x) for x in c.split(":")) for c in args.sweep.split(",") if c]
        result["kernel_alone"] = kernel_alone(torch, inp, args, timer, configs, copy_bw)
        status = 0 if result["check"]["ok"] else 1
        result["partial"] = False
    except Exception:  # noqa: BLE001 - record what failed next to what was measured
        result["error"] = traceback.format_exc()[-3000:]
        status = 1
    write(result, args.out)
    report(result)
    return status


def report(r: dict) -> None:
    p = r["params"]
    cb = (r.get("copy_bandwidth") or {}).get("bandwidth_GBps")
    print(
        f"\ntopk_kernel: {r['device']['name']}, T={p['tokens']} V={p['vocab']} k={p['k']} bf16, old pass "
        f"(1 id, no entropy); copy bandwidth {cb and round(cb)} GB/s"
        f"{'' if r['measurement'] else ' -- ' + r['note']}"
    )
    for name, v in (r.get("variants") or {}).items():
        print(f"{name:<12} {v['time_ms']['median']:>10.3f} ms (min {v['time_ms']['min']:.3f})")
    if "ratios" in r:
        x = r["ratios"]
        print(
            f"triton_topk / triton_k0 = {x['triton_topk_over_triton_k0']:.2f}; "
            f"torch_topk / triton_topk = {x['torch_topk_over_triton_topk']:.1f}"
        )
    if "check" in r:
        c = r["check"]
        print(
            f"check vs torch: ids {'identical' if c['topk_ids_equal'] else 'DIFFER'} "
            f"({c['rows_with_tie_across_kth']} rows tied across the k-th place), max |diff| top-k log-probs "
            f"{c['topk_logprobs_max_abs_diff']:.1e}, lse {c['lse_max_abs_diff']:.1e}: "
            f"{'OK' if c['ok'] else 'MISMATCH'}"
        )
    for s in r.get("kernel_alone", []):
        what = f"  topk kernel BLOCK {s['block']:>5} warps {s['num_warps']:>2}{' (default)' if s['default'] else ''}"
        if "error" in s:
            print(f"{what}: {s['error']}")
        else:
            print(
                f"{what}: {s['time_ms']['median']:.3f} ms, {s['achieved_bandwidth_GBps']:.0f} GB/s "
                f"({100 * s['fraction_of_copy_bandwidth']:.1f}% of copy)"
            )
    if "error" in r:
        print(r["error"])


if __name__ == "__main__":
    sys.exit(main())
