"""What a step's rollout was drawn with (``rollout_metrics``); a step's metrics (``step_metrics``,
from the per-sample sums of ``engines.sums``); stage timers (``timed``)."""

from __future__ import annotations

import array
import contextlib
import statistics
import time
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from megatron_empg.core.behavior_is import behavior_metrics
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.sums import all_reduce_sums, sample_means

if TYPE_CHECKING:
    from megatron_empg.mcore.parallel_state import ParallelGroups
    from megatron_empg.trainer.batching.stage import StepBatch
    from megatron_empg.trainer.engines.collect import StepRollout


def rollout_metrics(rollout: StepRollout, step: int) -> dict[str, float]:
    """Of all the samples this rank holds (its engine's replicas; with one engine, or disaggregated
    engines, the whole batch): how many training steps older than the weights of ``step``
    (0-based) the weights that drew them are (``rollout/staleness_mean``, ``_max``, of each
    sample's first token; 0: on-policy; ``rollout/staleness_token_mean`` over response tokens),
    the share of samples whose tokens span several weight versions (``rollout/partial_fraction``,
    ``rollout.partial``) and the most versions in one sample (``rollout/versions_per_sample_max``),
    and ``rollout/digest``, a CRC32 of their prompt indices and tokens (two runs that drew the same
    samples log the same digest)."""
    samples = [s for replica in rollout.replicas for s in replica]
    lags = [step - s.version for s in samples]
    versions = [s.token_versions or [s.version] * len(s.response_ids) for s in samples]
    token_lags = [step - v for per_token in versions for v in per_token]
    spans = [len(set(per_token)) for per_token in versions]
    digest = 0
    for s in samples:
        digest = zlib.crc32(array.array("q", [s.group, *s.response_ids]).tobytes(), digest)
    return {
        "rollout/staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "rollout/staleness_max": float(max(lags, default=0)),
        "rollout/staleness_token_mean": statistics.fmean(token_lags) if token_lags else 0.0,
        "rollout/partial_fraction": sum(n > 1 for n in spans) / len(spans) if spans else 0.0,
        "rollout/versions_per_sample_max": float(max(spans, default=0)),
        "rollout/digest": float(digest),
    }


@contextlib.contextmanager
def timed(times: dict[str, float], name: str) -> Iterator[None]:
    """``times[name]``: the seconds the block took (a step's ``time/...`` metrics)."""
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start


def step_metrics(
    rollout: StepRollout,
    samples: list[Sample],
    batch: StepBatch,
    *,
    replica: int,
    groups: ParallelGroups,
    dynamic_sampling: bool,
    update: dict[str, float],
    sync: dict[str, float],
    times: dict[str, float],
    behavior: dict[str, float],
) -> dict[str, float]:
    """Per-step metrics: ``sample_means`` of what this replica sampled (``rollout.sums``, all
    generation batches) over data-parallel replicas (one all-reduce), the loss tokens per
    trained sample (``samples``), dynamic sampling's group counts, the micro-batches' padding,
    the mean gap between the old pass's and the engine's log-probs and their importance ratios
    (``behavior``: ``core.behavior_is.behavior_stats``' sums), throughput, and this rank's
    timings (``times``), with the update's and the weight sync's own metrics (``update``, ``sync``).
    ``replica``: this rank's replica of the engine's (``rollout.sums``' index)."""
    local = {
        **rollout.sums[replica],
        "loss_tokens": sum(s.loss_tokens for s in samples),
        "trained": len(samples),
        "no_loss": sum(s.loss_tokens == 0 for s in samples),
        "batch_tokens": batch.tokens,
        "batch_slots": batch.slots,
        "micro_batches": sum(len(mini) for mini in batch.minis),
        "forward_micro_batches": batch.forward_micro_batches,
        "imbalance": batch.imbalance,
    }
    local["sampler_gap"], local["sampler_gap_tokens"] = batch.sampler_gap()
    from_rows = {
        "batch_slots": local["batch_slots"],
        "sampler_gap": local["sampler_gap"],
        "sampler_gap_tokens": local["sampler_gap_tokens"],
        **behavior,
    }
    if groups.cp_size > 1:  # each context-parallel rank holds its share of every row
        from_rows = all_reduce_sums(from_rows, groups.cp_group)
    totals = all_reduce_sums({**local, **from_rows}, groups.dp_group)
    seconds = sum(times.values())
    metrics = {
        **sample_means(totals),
        "response/loss_tokens_mean": totals["loss_tokens"] / max(totals["trained"], 1),
        "response/no_loss_fraction": totals["no_loss"] / max(totals["trained"], 1),
        "batch/padding_fraction": 1.0 - totals["batch_tokens"] / max(totals["batch_slots"], 1),
        "batch/micro_batches_mean": totals["micro_batches"] / groups.dp_size,
        "batch/forward_micro_batches_mean": totals["forward_micro_batches"] / groups.dp_size,
        "batch/replica_imbalance": totals["imbalance"] / groups.dp_size,
        "batch/sampler_logprob_gap": totals["sampler_gap"] / max(totals["sampler_gap_tokens"], 1),
        **behavior_metrics(totals),
        "perf/tokens_per_second": totals["response_tokens"] / seconds if seconds > 0 else 0.0,
        **{f"time/{k}": v for k, v in times.items()},
        **rollout.metrics,
        **update,
        **sync,
    }
    if dynamic_sampling:
        drawn = max(totals["dynamic_sampling/drawn_groups"], 1)
        metrics["dynamic_sampling/informative_fraction"] = totals["dynamic_sampling/informative_groups"] / drawn
        metrics["dynamic_sampling/filled_groups"] = totals["dynamic_sampling/filled_groups"]
    return metrics
