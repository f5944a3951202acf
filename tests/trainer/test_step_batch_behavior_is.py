"""``StepBatch.behavior_is``: after the old pass it sets every micro-batch's weights of the mode
(none: leaves them None) and returns the stats summed over all of this replica's micro-batches."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.trainer.batching.stage import StepBatch


def _micro(ratios: list[list[float]], mask: list[list[bool]]) -> MicroBatch:
    """A micro-batch after the old pass whose loss tokens have pi_old / mu = ``ratios``."""
    sampler = -torch.rand(len(ratios), len(ratios[0]), generator=torch.Generator().manual_seed(len(ratios)))
    ids = torch.zeros(sampler.shape, dtype=torch.int64)
    mask_t = torch.tensor(mask)
    return MicroBatch(
        ids,
        ids,
        loss_mask=mask_t,
        sampler_logprobs=torch.where(mask_t, sampler, 0.0),
        old_logprobs=sampler + torch.tensor(ratios).log(),
    )


def _step_batch() -> StepBatch:
    # two mini-batches, the first of two micro-batches; ratios off the mask (9, 5) carry no weight
    first = _micro([[0.5, 3.0, 9.0]], [[True, True, False]])
    second = _micro([[1.0, 2.5], [0.25, 5.0]], [[True, True], [True, False]])
    third = _micro([[1.5]], [[True]])
    return StepBatch([[first, second], [third]], tokens=8, slots=9, imbalance=1.0, forward_micro_batches=3)


def test_tis_sets_each_micro_batch_and_sums_the_stats():
    batch = _step_batch()
    totals = batch.behavior_is("tis", 2.0)
    (first, second), (third,) = batch.minis
    torch.testing.assert_close(first.behavior_weights, torch.tensor([[0.5, 2.0, 1.0]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(second.behavior_weights, torch.tensor([[1.0, 2.0], [0.25, 1.0]]), rtol=1e-6, atol=0)
    torch.testing.assert_close(third.behavior_weights, torch.tensor([[1.5]]), rtol=1e-6, atol=0)
    # loss-token ratios 0.5, 3, 1, 2.5, 0.25, 1.5: two above the cap; K3 = ratio - 1 - log(ratio)
    ratios = [0.5, 3.0, 1.0, 2.5, 0.25, 1.5]
    expected = {
        "behavior/ratio": 8.75,
        "behavior/clipped": 2.0,
        "behavior/k3": sum(r - 1 - math.log(r) for r in ratios),
        "behavior/tokens": 6.0,
    }
    assert totals == pytest.approx(expected, rel=1e-6)


def test_none_leaves_the_weights_none_and_still_sums_the_stats():
    batch = _step_batch()
    tis_totals = _step_batch().behavior_is("tis", 2.0)
    assert batch.behavior_is("none", 2.0) == tis_totals
    assert all(mb.behavior_weights is None for mini in batch.minis for mb in mini)


def test_a_replica_without_micro_batches_sums_zeros():
    empty = StepBatch([], tokens=0, slots=0, imbalance=1.0, forward_micro_batches=0)
    assert empty.behavior_is("mis", 2.0) == {
        "behavior/ratio": 0.0,
        "behavior/clipped": 0.0,
        "behavior/k3": 0.0,
        "behavior/tokens": 0.0,
    }
