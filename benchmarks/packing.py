"""Packed vs padded micro-batches (``trainer.batching.batch``): token slots and compute per real token for
one 1.5B math step, data-parallel balance (``replica_shares``), and the update-pass time of a tiny
model on the CPU. Writes JSON.

    .venv/bin/python benchmarks/packing.py [--quick] [--out benchmarks/results/packing_cpu.json]

Length model (like the math recipes). A sample is a prompt of U{100..400} tokens and a response
of min(C, round(X)) tokens (at least 1), X log-normal with sigma 0.8 and mu = ln C - z sigma,
z = Phi^-1(1 - f), so that a fraction f of the responses is at the cap C = 8192. The two stage points
are those a scale audit of this repository estimated for an 8k run ("8k early: mean 5.1k, 31% at cap";
"8k late: mean 3.5k, 8% at cap", after DeepScaleR's reported 8k phase): early f = 0.30 (z = 0.5244), late f = 0.08 (z = 1.4051), same sigma. (The
audit's own section 2 model is a 25% spike at the cap plus a log-normal of median 3.5k, sigma 0.6.)
Seeded (``random.Random``); the JSON has the realised mean response and at-cap fraction.

1. Token slots per real token (pure Python, no model; every sample trains). One step: 1024
   samples (128 prompts x 8) on DP = 8 replicas of 128 samples (16 whole prompt groups each), each
   replica's samples in 2 mini-batches of 64 (the recipe's ``mini_batches``); ``micro_batches`` is
   called per mini-batch (one Megatron call) and the [b, s] shapes of what it returns are counted:

       step_padded              the old trainer: every sample of a replica right-padded to that
                                replica's longest (rounded up to 8), [128, s] per replica
       padded_mbs1, padded_mbs4 MicroBatchPlan(packing=False, micro_batch_size=1 / 4): [m, s] rows,
                                s = the micro-batch's longest (rounded up to 8); the groups are
                                balanced by tokens, so 4 rows mix long and short samples
       packed_16384, _32768     MicroBatchPlan(packing=True, max_tokens=16384 / 32768): [1, s]
                                rows of several sequences, s = their sum (rounded up to 8)
       packed_16384_fixed_shape the same with fixed_shape=True (PP: every row as long as the call's
                                longest)

   slots_per_real_token = sum(b * s) / sum(sample lengths); the goal for packing is <= 1.05.
   compute_per_real_compute: the same with ``sequence_cost(L, q)`` = L + q L^2 (linear layers plus
   causal attention), q = ``attention_quadratic`` of deepseek-r1-distill-qwen-1.5b (h / params per
   layer = 3.28e-5): a padded row costs sequence_cost(s), a packed row the sum of sequence_cost over
   its ``cu_seqlens`` segments (the sequences, and the padding after them as its own segment);
   the real compute is the sum of sequence_cost(L) over the samples.

2. DP balance. The same step with one engine serving all R = 8 replicas: ``replica_shares(lengths
   [8][128], trains, mini_batches=2, cost=...)`` with cost None (each replica keeps what it sampled)
   and cost = partial(sequence_cost, quadratic=q) (each mini-batch's pool split by estimated
   compute). Per-replica cost = the sum of sequence_cost(L) over its share; reported: max/mean
   (``imbalance``) per mini-batch, and over the step sum_j max_r / sum_j mean_r (the time the
   slowest replica sets, over the ideal); and the median of 3 wall times of ``replica_shares``.

3. Update-pass time on the CPU. tiny-qwen2 (fp32, max_position_embeddings 256; Megatron's local
   spec, one gloo process, TP = PP = DP = 1), the early length model scaled to C = 192 with prompts
   of U{8..40} tokens (random token ids), 32 samples in one mini-batch, loss kl k3 (kl_coef 0.1),
   Adam (lr 1e-6, clip_grad 1.0). Variants: step_padded (MicroBatchPlan(packing=False,
   micro_batch_size=4, fixed_shape=True): 8 micro-batches [4, s], s = the batch's longest), padded
   (micro_batch_size 4, per-micro-batch widths), packed (max_tokens 768). old_logprobs (and
   anchor_logprobs, the same) come from one old pass (``forward_stats``) per variant outside the
   timing; only ``train_step`` (forward + backward + optimizer, all variants on one model) is
   timed: warmup 2 + repeats 7 (``--quick``: 1 + 3), alternated between the variants (A B C A B C
   ...), medians reported with ratios packed/step_padded and packed/padded. torch.set_num_threads(1).
   On the CPU a packed row's attention runs on its sequences gathered into padded batches of
   similar length (``mcore.thd``, ``mcore.attention``), not TE's THD kernel; the JSON has each variant's
   attention_scores_per_head (padded: b * s^2 per micro-batch; packed: the sum of L^2 over its
   ``cu_seqlens`` segments, what a THD kernel computes). CPU time is not GPU time: the ratios are
   not the GPU speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from statistics import NormalDist

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_empg.config import load_model_config  # noqa: E402
from megatron_empg.trainer.batching.balance import attention_quadratic, imbalance, sequence_cost  # noqa: E402
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches, replica_shares  # noqa: E402

SIGMA = 0.8
STAGES = {"early": 0.30, "late": 0.08}  # stage point -> fraction of the responses at the cap
GOAL = 1.05  # packed: at most this many token slots per real token
THREADS = 1
REPLICAS, PER_REPLICA, MINI_BATCHES, RESPONSES_PER_PROMPT = 8, 128, 2, 8
CAP, PROMPTS = 8192, (100, 400)
LAYOUTS = {
    "padded_mbs1": MicroBatchPlan(packing=False, micro_batch_size=1),
    "padded_mbs4": MicroBatchPlan(packing=False, micro_batch_size=4),
    "packed_16384": MicroBatchPlan(packing=True, max_tokens=16384),
    "packed_32768": MicroBatchPlan(packing=True, max_tokens=32768),
    "packed_16384_fixed_shape": MicroBatchPlan(packing=True, max_tokens=16384, fixed_shape=True),
}


def make_samples(count: int, cap: int, at_cap: float, prompts: tuple[int, int], seed: int, vocab: int | None = None):
    """``count`` samples of the length model (module docstring), groups of ``RESPONSES_PER_PROMPT``;
    token ids random in [2, vocab) if ``vocab`` is given, else all 1 (only the lengths matter)."""
    rng, mu = random.Random(seed), _mu(cap, at_cap)
    ids = (lambda n: [rng.randrange(2, vocab) for _ in range(n)]) if vocab else (lambda n: [1] * n)
    out = []
    for i in range(count):
        p = rng.randint(*prompts)
        r = min(cap, max(1, round(rng.lognormvariate(mu, SIGMA))))
        finish = "length" if r == cap else "stop"
        out.append(Sample(ids(p), ids(r), [-0.5] * r, finish, group=i // RESPONSES_PER_PROMPT))
    return out


def _mu(cap: int, at_cap: float) -> float:
    """The log-normal's mu that puts a fraction ``at_cap`` of the mass above ``cap``."""
    return math.log(cap) - NormalDist().inv_cdf(1 - at_cap) * SIGMA


def length_stats(samples: list[Sample], cap: int, at_cap: float) -> dict:
    responses = [len(s.response_ids) for s in samples]
    return {
        "mu": _mu(cap, at_cap),
        "sigma": SIGMA,
        "cap": cap,
        "target_at_cap": at_cap,
        "mean_response": statistics.fmean(responses),
        "at_cap": sum(r == cap for r in responses) / len(responses),
        "mean_sample_length": statistics.fmean(s.length for s in samples),
    }


def slots_and_compute(micro, q: float) -> tuple[int, float]:
    """Token slots (sum of b * s) and their cost of the micro-batches (module docstring)."""
    slots, compute = 0, 0.0
    for mb in micro:
        b, s = mb.shape
        slots += b * s
        if mb.packed:
            compute += sum(sequence_cost(n, q) for n in mb.cu_seqlens.diff().tolist())
        else:
            compute += b * sequence_cost(s, q)
    return slots, compute


def slot_report(samples: list[Sample], q: float) -> dict:
    """Slots and compute per real token of every layout for one step's samples [REPLICAS * PER_REPLICA]."""
    replicas = [samples[r * PER_REPLICA : (r + 1) * PER_REPLICA] for r in range(REPLICAS)]
    real_tokens = sum(s.length for s in samples)
    real_compute = math.fsum(sequence_cost(s.length, q) for s in samples)
    counts = {"step_padded": [0, 0.0, REPLICAS, 0]}  # slots, compute, micro-batches, largest b * s
    for replica in replicas:
        width = -(-max(s.length for s in replica) // 8) * 8
        counts["step_padded"][0] += len(replica) * width
        counts["step_padded"][1] += len(replica) * sequence_cost(width, q)
        counts["step_padded"][3] = max(counts["step_padded"][3], len(replica) * width)
    size = PER_REPLICA // MINI_BATCHES
    for name, plan in LAYOUTS.items():
        c = counts[name] = [0, 0.0, 0, 0]
        for replica in replicas:
            for j in range(MINI_BATCHES):
                micro = micro_batches(replica[j * size : (j + 1) * size], [0.0] * size, plan)
                slots, compute = slots_and_compute(micro, q)
                c[0] += slots
                c[1] += compute
                c[2] += len(micro)
                c[3] = max([c[3], *(b * s for b, s in (mb.shape for mb in micro))])
    layouts = {
        name: {
            "slots_per_real_token": c[0] / real_tokens,
            "compute_per_real_compute": c[1] / real_compute,
            "micro_batches": c[2],
            "largest_micro_batch_slots": c[3],
        }
        for name, c in counts.items()
    }
    packed = {n: v["slots_per_real_token"] <= GOAL for n, v in layouts.items() if n.startswith("packed")}
    return {"real_tokens": real_tokens, "layouts": layouts, "goal_max_slots_per_real_token": GOAL, "goal_met": packed}


def balance_report(samples: list[Sample], q: float) -> dict:
    """Per-replica cost max/mean with and without ``replica_shares`` balancing (module docstring)."""
    lengths = [[s.length for s in samples[r * PER_REPLICA : (r + 1) * PER_REPLICA]] for r in range(REPLICAS)]
    trains = [[True] * PER_REPLICA for _ in range(REPLICAS)]
    cost_fn = partial(sequence_cost, quadratic=q)
    out = {}
    for name, cost in (("sampled", None), ("balanced", cost_fn)):
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            shares = replica_shares(lengths, trains, mini_batches=MINI_BATCHES, cost=cost)
            seconds.append(time.perf_counter() - start)
        per_mini = [
            [math.fsum(cost_fn(lengths[r][i]) for r, i in share[j]) for share in shares] for j in range(MINI_BATCHES)
        ]
        out[name] = {
            "max_over_mean_per_mini_batch": [imbalance(costs) for costs in per_mini],
            "max_over_mean_step": sum(map(max, per_mini)) / sum(statistics.fmean(c) for c in per_mini),
            "replica_shares_seconds_median": statistics.median(seconds),
        }
    return out


def update_pass(repeats: int, warmup: int) -> dict:
    """Median ``train_step`` seconds of tiny-qwen2 on each layout, interleaved (module docstring)."""
    from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.bind.build import bind_loss

    model = load_model_config("tiny-qwen2")
    cap, count = 192, 32
    samples = make_samples(count, cap, STAGES["early"], (8, 40), seed=7, vocab=model.vocab_size)
    advantages = torch.linspace(-1, 1, count).tolist()
    plans = {
        "step_padded": MicroBatchPlan(packing=False, micro_batch_size=4, fixed_shape=True),
        "padded": MicroBatchPlan(packing=False, micro_batch_size=4),
        "packed": MicroBatchPlan(packing=True, max_tokens=768),
    }
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    try:
        settings = OptimizerConfig(lr=1e-6, clip_grad=1.0)
        ddp = wrap_with_ddp(build_gpt_model(model, parallel), settings)
        optimizer, scheduler = (opt := build_optimizer(ddp, settings)), build_scheduler(opt, settings)
        loss_fn, _ = bind_loss(LossConfig(kl="k3", kl_coef=0.1), vocab_size=model.vocab_size, topk=1)
        request = StatsRequest(vocab_size=model.vocab_size, with_entropy=False)
        calls = {}
        for name, plan in plans.items():
            micro = micro_batches(samples, advantages, plan)
            for mb, stats in zip(micro, forward_stats(ddp, micro, request, groups), strict=True):
                mb.old_logprobs = mb.anchor_logprobs = stats.logprobs
            calls[name] = micro
        times: dict[str, list[float]] = {name: [] for name in plans}
        for step in range(warmup + repeats):
            for name, micro in calls.items():
                start = time.perf_counter()
                train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups)
                if step >= warmup:
                    times[name].append(time.perf_counter() - start)
    finally:
        destroy_model_parallel()
    real = sum(s.length for s in samples)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "model": "tiny-qwen2",
        "dtype": "fp32",
        "samples": count,
        "cap": cap,
        "prompts": [8, 40],
        "length_model": length_stats(samples, cap, STAGES["early"]),
        "real_tokens": real,
        "warmup": warmup,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "variants": {
            name: {
                "shapes": [list(mb.shape) for mb in calls[name]],
                "slots_per_real_token": sum(b * s for b, s in (mb.shape for mb in calls[name])) / real,
                "attention_scores_per_head": sum(_attention_scores(mb) for mb in calls[name]),
                "train_step_seconds_median": medians[name],
                "train_step_seconds_all": times[name],
            }
            for name in plans
        },
        "ratio_packed_over_step_padded": medians["packed"] / medians["step_padded"],
        "ratio_packed_over_padded": medians["packed"] / medians["padded"],
    }


def _attention_scores(mb) -> int:
    """Attention scores per head of one micro-batch: b * s^2 padded, sum of L^2 over segments packed."""
    if mb.packed:
        return int(((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long() ** 2).sum())
    b, s = mb.shape
    return b * s * s


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
        "note": "CPU time is not GPU time; on the CPU a packed row's attention runs on its sequences "
        "gathered into length buckets (mcore.thd), not Transformer Engine's THD kernel. "
        "The slot, compute and balance figures do not depend on the machine.",
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/packing_cpu.json"))
    p.add_argument("--quick", action="store_true", help="update pass: warmup 1 + repeats 3 (default 2 + 7)")
    args = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    big = load_model_config("deepseek-r1-distill-qwen-1.5b")
    q = attention_quadratic(big.hidden_size, big.parameters_per_layer())
    report: dict = {
        "benchmark": "packing",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "params": {
            "quick": args.quick,
            "cap": CAP,
            "prompts": list(PROMPTS),
            "replicas": REPLICAS,
            "samples_per_replica": PER_REPLICA,
            "mini_batches": MINI_BATCHES,
            "cost_model": "deepseek-r1-distill-qwen-1.5b",
            "quadratic": q,
        },
        "stages": {},
    }
    for seed, (stage, at_cap) in enumerate(STAGES.items()):
        samples = make_samples(REPLICAS * PER_REPLICA, CAP, at_cap, PROMPTS, seed=seed)
        report["stages"][stage] = {
            "length_model": length_stats(samples, CAP, at_cap),
            "slots": slot_report(samples, q),
            "balance": balance_report(samples, q),
        }
        lay = report["stages"][stage]["slots"]["layouts"]
        print(f"{stage}: " + ", ".join(f"{n} {v['slots_per_real_token']:.3f}" for n, v in lay.items()), flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        report["update_pass"] = update_pass(*((3, 1) if args.quick else (7, 2)))
    finally:
        dist.destroy_process_group()
    u = report["update_pass"]
    print(
        f"update pass: packed/step_padded {u['ratio_packed_over_step_padded']:.3f}, "
        f"packed/padded {u['ratio_packed_over_padded']:.3f}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
