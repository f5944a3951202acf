"""Context parallelism on the CPU: per rank, the seconds of one update pass (forward + backward) on
a long packed row and the bytes autograd keeps for its backward, at CP 1, 2 and 4 (gloo ranks,
one thread each). Writes ``benchmarks/results/context_parallel_cpu.json``.

    .venv/bin/python benchmarks/context_parallel.py [--tokens 4096] [--layers 4] [--repeats 3]

The model is tiny-qwen2 made longer and wider (``--layers``, hidden 256, ffn 512, 8 heads, 2 groups,
fp32) with one row of ``--tokens`` tokens: three sequences of 1/2, 1/4 and 1/4 of it (the
attention's share grows with the row). ``saved_bytes`` is what ``torch.autograd.graph.
saved_tensors_hooks`` sees (distinct storages, the parameters left out): the activations, which
context parallelism divides; the weights, gradients and optimizer state are the same on every CP
rank. ``max_rss_bytes`` is the process's peak resident memory (the whole process, torch included).
CPU seconds are not GPU seconds: the CP attention all-gathers K and V over gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OVERRIDES = [
    "hidden_size=256",
    "ffn_hidden_size=512",
    "num_attention_heads=8",
    "num_query_groups=2",
    "max_position_embeddings=65536",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(tokens: int, vocab: int):
    from megatron_empg.core.microbatch import MicroBatch

    lengths = [tokens // 2, tokens // 4, tokens - tokens // 2 - tokens // 4]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return MicroBatch(ids, ids, position_ids=positions, seq_ids=seq_ids, cu_seqlens=cu, max_seqlen=max(lengths))


def _rank(rank: int, cp: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import _model_forward
    from megatron_empg.parallel.context_parallel import split_microbatch

    model_cfg = load_model_config("tiny-qwen2", [f"num_layers={args.layers}", *OVERRIDES])
    parallel = ParallelConfig(context_parallel_size=cp)
    initialize_model_parallel(parallel, seed=0)
    try:
        (model,) = build_gpt_model(model_cfg, parallel, attention_backend="sdpa")
        batch = split_microbatch(_row(args.tokens, model_cfg.vocab_size), cp, rank)
        seconds, saved = [], 0
        for step in range(1 + args.repeats):
            storages: dict[int, int] = {}

            def pack(t):
                if not isinstance(t, torch.nn.Parameter):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = _model_forward(model, batch)
            logits.float().pow(2).mean().backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step:  # the first is a warm-up
                seconds.append(elapsed)
                saved = sum(storages.values())
        result = {
            "rank": rank,
            "local_tokens": batch.shape[1],
            "seconds": seconds,
            "saved_bytes": saved,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        Path(out, f"{cp}_{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cp", default="1,2,4")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/context_parallel_cpu.json"))
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in (int(c) for c in args.cp.split(",")):
            mp.start_processes(_rank, args=(cp, _free_port(), args, tmp), nprocs=cp, start_method="spawn")
            ranks = [json.loads(Path(tmp, f"{cp}_{r}.json").read_text()) for r in range(cp)]
            results.append(
                {
                    "cp": cp,
                    "local_tokens": ranks[0]["local_tokens"],
                    "seconds_median": statistics.median(s for r in ranks for s in r["seconds"]),
                    "saved_bytes_per_rank_max": max(r["saved_bytes"] for r in ranks),
                    "max_rss_bytes_per_rank_max": max(r["max_rss_bytes"] for r in ranks),
                    "ranks": ranks,
                }
            )
            r = results[-1]
            print(
                f"CP {cp}: {r['local_tokens']} tokens per rank, {r['seconds_median']:.2f} s, saved "
                f"{r['saved_bytes_per_rank_max'] / 2**20:.0f} MiB, peak RSS {r['max_rss_bytes_per_rank_max'] / 2**20:.0f} MiB "
                f"per rank",
                flush=True,
            )
    base = results[0]["saved_bytes_per_rank_max"]
    report = {
        "benchmark": "context_parallel",
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads_per_rank": 1,
        },
        "params": vars(args),
        "model_overrides": [f"num_layers={args.layers}", *OVERRIDES],
        "results": results,
        "saved_fraction_of_cp1": {r["cp"]: r["saved_bytes_per_rank_max"] / base for r in results},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
