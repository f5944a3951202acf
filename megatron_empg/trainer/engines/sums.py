"""Per-sample metrics of a step or a validation pass, as sums that add up over batches and
data-parallel replicas (``sample_sums``, ``add_sums``, ``all_reduce_sums``), and their means
(``sample_means``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_empg.parallel.collectives import collective_device
from megatron_empg.trainer.batching.batch import Sample


def sample_sums(samples: list[Sample], reward_metrics: dict[str, float]) -> dict[str, float]:
    """What per-sample means are made of, as sums that add up over batches and replicas: rewards
    and their squares, correct answers, samples, response tokens, truncated responses, the search
    agent's per-episode counts (``rollout/*``) and the reward function's counts and sums
    (``reward_metrics``, ``reward/*``)."""
    sums = {
        "reward_sum": sum(s.reward for s in samples),
        "reward_sq_sum": sum(s.reward * s.reward for s in samples),
        "correct": sum(s.correct for s in samples),
        "samples": len(samples),
        "response_tokens": sum(len(s.response_ids) for s in samples),
        "truncated": sum(s.finish_reason == "length" for s in samples),
    }
    for sample in samples:
        add_sums(sums, {f"rollout/{key}": value for key, value in sample.stats.items()})
    return {**sums, **reward_metrics}


def sample_means(totals: dict[str, float]) -> dict[str, float]:
    """Per-sample means of ``sample_sums``' totals: ``reward/mean``, ``reward/std``,
    ``reward/accuracy``, ``response/length_mean``, ``response/truncated_fraction``, the agent's
    ``rollout/*_mean`` and the reward function's metrics (``reward/f1`` the mean token F1,
    ``reward/malformed`` a fraction)."""
    n = max(totals["samples"], 1)
    mean = totals["reward_sum"] / n
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(totals["reward_sq_sum"] / n - mean * mean, 0.0)),
        "reward/accuracy": totals["correct"] / n,
        "response/length_mean": totals["response_tokens"] / n,
        "response/truncated_fraction": totals["truncated"] / n,
        **{f"{k}_mean": v / n for k, v in totals.items() if k.startswith("rollout/")},
        **{k: v / n for k, v in totals.items() if k.startswith("reward/")},
    }


def add_sums(totals: dict[str, float], values: dict[str, float]) -> None:
    """``totals[key] += value`` for each of ``values`` (missing keys start at 0)."""
    for key, value in values.items():
        totals[key] = totals.get(key, 0.0) + value


def all_reduce_sums(values: dict[str, float], group) -> dict[str, float]:
    """``values`` summed over ``group`` (one float64 all-reduce; every rank of ``group`` calls it)."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=collective_device(group))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))
