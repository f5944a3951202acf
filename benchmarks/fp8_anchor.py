"""The FP8 anchor (``algorithm.anchor.fp8``) against the bf16 anchor on the same master: the anchor
pass's time, the anchor's bytes, the per-token log-prob error and the KL term (issue 47).

    python benchmarks/fp8_anchor.py                      # CPU flow check: tiny-qwen2, emulated, toy sizes
    python benchmarks/fp8_anchor.py --model deepseek-r1-distill-qwen-1.5b --tokens 8192 --micro-batches 4 \\
        --fp8 torch --out benchmarks/results/fp8_anchor_gpu.json

One process (TP 1, DP 1): a bf16 policy with random weights, its optimizer's float32 main
parameters, and three anchors built from them (``EmaAnchor``): bf16, float32 (the master's own
values: the reference of the errors) and FP8 (``--fp8``: torch or emulated). The policy's weights
are then moved by ``--drift`` x their RMS (random, per tensor) so that the KL is that of a policy a
few steps away from its anchor. Each micro-batch is one packed row of ``--tokens`` tokens (sequences
of 1k tokens). The old pass gives the policy's log-probs and top-``--k``; each anchor pass gives the
anchor's log-probs at the targets and at the policy's top-k (``mcore.step.forward_stats``), timed
between two device synchronizes, median of ``--repeats`` after ``--warmup``.

The FP8 anchor is run twice: with the output layer in the forward dtype (the default; the headline
fields) and in FP8 too (``algorithm.anchor.fp8_output_layer``: ``output_layer_fp8``).
Records (field names as issue 47 gives them): ``anchor_fp8`` (the storage kind), ``anchor_pass_s``
and ``anchor_pass_s_bf16``, ``anchor_bytes`` and ``anchor_bytes_bf16`` (the compute weights, the
scales included: ``mcore.anchor.storage.storage_params``; ``linear_bytes*`` the decoder's linears
alone), ``logprob_err_{mean,p99,max}`` against the bf16 anchor and ``..._vs_fp32`` against the
master, the same for bf16 against the master; per drift (``by_drift``) the KLs (k3 and the reverse
Top-k KL, batch means) of each anchor and ``kl_rel_err`` (FP8 against bf16; bf16 against the
master beside it); the headline ``kl_rel_err`` is that of the first drift whose bf16 k3 reaches
1e-3 (a typical RL step's KL: the anchor's rounding adds a floor that a tiny KL cannot hide), and the goals (pass >= 1.4x faster, weights <= 0.5x, KL within
1 %), each with whether it was met. Nothing asserts them. On a CPU the numbers check the flow only.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import commit  # noqa: E402

from megatron_empg.config import OptimizerConfig, ParallelConfig, load_model_config  # noqa: E402

CUDA = torch.cuda.is_available()
KLS = ("k3", "topk")
GOALS = {"anchor_pass_speedup": 1.4, "anchor_bytes_ratio": 0.5, "kl_rel_err": 0.01}


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _machine() -> dict:
    out = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    if CUDA:
        p = torch.cuda.get_device_properties(0)
        out["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm{p.major}{p.minor}"
    else:
        out["device"] = f"CPU ({platform.processor() or 'unknown'}), no GPU: a flow check, not a measurement"
    return out


def _micro_batches(args, vocab: int, device) -> list:
    """Packed rows of ``args.tokens`` tokens, sequences of ``args.seq`` tokens each."""
    from megatron_empg.core.microbatch import MicroBatch

    g = torch.Generator().manual_seed(0)
    seqs = max(1, args.tokens // args.seq)
    out = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, vocab, (1, seqs * args.seq), generator=g)
        positions = torch.arange(args.seq).repeat(seqs)[None]
        seq_ids = torch.arange(seqs).repeat_interleave(args.seq)[None]
        cu = torch.arange(0, seqs * args.seq + 1, args.seq, dtype=torch.int32)
        ones = torch.ones(ids.shape)
        mb = MicroBatch(
            ids,
            ids.roll(-1, dims=1),
            torch.ones_like(ids, dtype=torch.bool),
            ones,
            torch.zeros_like(ones),
            position_ids=positions,
            seq_ids=seq_ids,
            cu_seqlens=cu,
            max_seqlen=args.seq,
        )
        out.append(mb.to(device))
    return out


def _timed(fn, args) -> tuple[list, float]:
    for _ in range(args.warmup):
        fn()
    times, result = [], None
    for _ in range(args.repeats):
        _sync()
        start = time.perf_counter()
        result = fn()
        _sync()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def _errors(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs().flatten().double()
    return {"mean": d.mean().item(), "p99": d.quantile(0.99).item() if d.numel() else 0.0, "max": d.max().item()}


def _kls(policy, anchor) -> dict:
    """Batch means of k3 and the reverse Top-k KL (``core.topk_kl``) of the policy to ``anchor``."""
    from megatron_empg.core.topk_kl import topk_kl_from_logprobs

    k3, topk = [], []
    for p, a in zip(policy, anchor, strict=True):
        log_ratio = a.logprobs - p.logprobs
        k3.append(log_ratio.exp() - log_ratio - 1)
        in_head = (p.topk_ids == 0).all(-1) & False  # the targets are random: mark none in the head
        topk.append(
            topk_kl_from_logprobs(
                p.topk_logprobs, a.extra_logprobs, p.logprobs, a.logprobs, in_head, direction="reverse"
            ).values
        )
    return {"k3": torch.cat(k3, dim=1).mean().item(), "topk": torch.cat(topk, dim=1).mean().item()}


def run(args) -> dict:
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.anchor.storage import storage_params
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats

    cfg = load_model_config(args.model, args.model_override)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    device = torch.device("cuda" if CUDA else "cpu")
    try:
        policy = build_gpt_model(cfg, parallel, params_dtype=torch.bfloat16)
        settings = OptimizerConfig(lr=1e-6)
        ddp = wrap_with_ddp(policy, settings)
        optimizer = build_optimizer(ddp, settings)
        kinds = {
            "bf16": dict(compute_dtype=torch.bfloat16),
            "fp32": dict(compute_dtype=torch.float32),
            "fp8": dict(compute_dtype=torch.float8_e4m3fn, fp8=args.fp8, fp8_forward_dtype=torch.bfloat16),
            "fp8_out": dict(
                compute_dtype=torch.float8_e4m3fn, fp8=args.fp8, fp8_forward_dtype=torch.bfloat16, fp8_output_layer=True
            ),
        }
        anchors = {
            k: EmaAnchor.from_configs(cfg, parallel, ddp, optimizer, tau=0.9, period=1, **kw) for k, kw in kinds.items()
        }
        mbs = _micro_batches(args, cfg.vocab_size, device)
        original = [p.detach().clone() for p in ddp[0].module.parameters()]
        request = StatsRequest(vocab_size=cfg.vocab_size, extra_ids_key="topk_ids", with_entropy=False)
        seconds, by_drift = {}, []
        for i, drift in enumerate(args.drift):
            g = torch.Generator(device=device).manual_seed(1)
            with torch.no_grad():  # the policy a few steps from its anchor
                for p, p0 in zip(ddp[0].module.parameters(), original, strict=True):
                    rms = p0.float().pow(2).mean().sqrt()
                    p.copy_(p0 + (torch.randn(p.shape, generator=g, device=device) * rms * drift).to(p.dtype))
            old = forward_stats(ddp, mbs, StatsRequest(vocab_size=cfg.vocab_size, k=args.k, with_entropy=False), groups)
            for mb, o in zip(mbs, old, strict=True):
                mb.topk_ids = o.topk_ids
            stats = {}
            for kind, anchor in anchors.items():
                if i == 0:  # the timing, at the first drift
                    stats[kind], seconds[kind] = _timed(
                        lambda a=anchor: forward_stats(a.models, mbs, request, groups), args
                    )
                else:
                    stats[kind] = forward_stats(anchor.models, mbs, request, groups)
            kl = {k: _kls(old, stats[k]) for k in anchors}
            rel = {f: {e: abs(kl[f][e] - kl["bf16"][e]) / abs(kl["bf16"][e]) for e in KLS} for f in ("fp8", "fp8_out")}
            rel_fp32 = {e: abs(kl["bf16"][e] - kl["fp32"][e]) / abs(kl["fp32"][e]) for e in KLS}
            by_drift.append(
                {
                    "drift": drift,
                    "kl": kl,
                    "kl_rel_err": rel["fp8"],
                    "kl_rel_err_output_layer_fp8": rel["fp8_out"],
                    "kl_rel_err_bf16_vs_fp32": rel_fp32,
                }
            )
            if i == 0:
                lp = {k: torch.cat([s.logprobs for s in v], dim=1) for k, v in stats.items()}
        nbytes = {k: storage_params(a.params) for k, a in anchors.items()}
        linears = {
            k: sum(
                p.param.numel() * p.param.element_size()
                for p in a.params
                if ".decoder." in f".{p.key}" and ".linear_" in p.key and p.key.endswith("weight")
            )
            for k, a in anchors.items()
        }
        nbytes = {
            k: v + (a.storage.scale_inv.numel() * 4 if k.startswith("fp8") else 0)
            for (k, v), a in zip(nbytes.items(), anchors.values(), strict=True)
        }
        record = {
            "anchor_fp8": anchors["fp8"].storage.name,
            "anchor_pass_s": seconds["fp8"],
            "anchor_pass_s_bf16": seconds["bf16"],
            "anchor_pass_speedup": seconds["bf16"] / seconds["fp8"],
            "anchor_bytes": nbytes["fp8"],
            "anchor_bytes_bf16": nbytes["bf16"],
            "anchor_bytes_ratio": nbytes["fp8"] / nbytes["bf16"],
            "linear_bytes": linears["fp8"],
            "linear_bytes_bf16": linears["bf16"],
            "linear_bytes_ratio": linears["fp8"] / linears["bf16"],
            "logprob_err": _errors(lp["fp8"], lp["bf16"]),
            "logprob_err_vs_fp32": _errors(lp["fp8"], lp["fp32"]),
            "logprob_err_bf16_vs_fp32": _errors(lp["bf16"], lp["fp32"]),
            "anchor_pass_s_fp32": seconds["fp32"],
            "by_drift": by_drift,
            "output_layer_fp8": {  # algorithm.anchor.fp8_output_layer: the untied output layer in FP8 too
                "anchor_pass_s": seconds["fp8_out"],
                "anchor_pass_speedup": seconds["bf16"] / seconds["fp8_out"],
                "anchor_bytes": nbytes["fp8_out"],
                "anchor_bytes_ratio": nbytes["fp8_out"] / nbytes["bf16"],
                "logprob_err": _errors(lp["fp8_out"], lp["bf16"]),
            },
        }
        # the headline KL: the first drift whose bf16 k3 reaches a typical RL step's KL (1e-3), else the largest
        headline = next((d for d in by_drift if d["kl"]["bf16"]["k3"] >= 1e-3), by_drift[-1])
        record["kl_rel_err"] = headline["kl_rel_err"]
        record["output_layer_fp8"]["kl_rel_err"] = headline["kl_rel_err_output_layer_fp8"]
        record["kl_headline_drift"] = headline["drift"]
        record["logprob_err_p99"] = record["logprob_err"]["p99"]
        worst_kl = max(record["kl_rel_err"].values())
        record["goals"] = {
            "anchor_pass_speedup": {"goal": GOALS["anchor_pass_speedup"], "met": record["anchor_pass_speedup"] >= 1.4},
            "anchor_bytes_ratio": {
                "goal": GOALS["anchor_bytes_ratio"],
                "met": record["anchor_bytes_ratio"] <= 0.5,
                "linear_bytes_ratio": record["linear_bytes_ratio"],
            },
            "kl_rel_err": {"goal": GOALS["kl_rel_err"], "met": worst_kl <= 0.01},
        }
        return record
    finally:
        destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2")
    p.add_argument("--model-override", action="append", default=[])
    p.add_argument("--fp8", default="torch" if CUDA else "emulated", choices=("torch", "emulated"))
    p.add_argument("--tokens", type=int, default=8192 if CUDA else 256, help="tokens per packed row")
    p.add_argument("--seq", type=int, default=1024 if CUDA else 64, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=4 if CUDA else 2)
    p.add_argument("--k", type=int, default=32 if CUDA else 8)
    p.add_argument(
        "--drift",
        type=float,
        nargs="+",
        default=[0.01, 0.03, 0.1],
        help="the policy's moves from the anchor, x each weight's RMS (the timing and log-prob errors: the first)",
    )
    p.add_argument("--warmup", type=int, default=2 if CUDA else 1)
    p.add_argument("--repeats", type=int, default=5 if CUDA else 2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from tests.dist import run_distributed  # one gloo rank: Megatron's parallel state wants a process group

    record = run_distributed(_entry, 1, vars(args), timeout=3000)[0]
    report = {
        "benchmark": "fp8_anchor",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "device": _machine()["device"],
        "machine": _machine(),
        "command": "fp8_anchor.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "params": vars(args),
        **record,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def _entry(rank: int, world: int, args: dict) -> dict:
    return run(argparse.Namespace(**args))


if __name__ == "__main__":
    sys.exit(main())
