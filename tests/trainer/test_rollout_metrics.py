"""The rollout's version metrics: staleness per sample (its first token) and per token, and how
many samples span several weight versions (``rollout.partial``)."""

from __future__ import annotations

import types

import pytest

from megatron_empg.rollout.trajectory import Trajectory
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.collect import StepRollout
from megatron_empg.trainer.engines.metrics import rollout_metrics

EXAMPLE = types.SimpleNamespace(prompt_ids=[1, 2])


def sample(versions: list[str] | None, drawn_with: int, length: int = 4) -> Sample:
    trajectory = Trajectory(list(range(length)), [-1.0] * length, "stop", versions=versions)
    return Sample.from_trajectory(EXAMPLE, 0, trajectory, version=drawn_with)


def test_a_response_spanning_versions_counts_from_its_first_token():
    partial = sample(["step-3", "step-3", "step-4", "step-4"], drawn_with=3)
    assert partial.version == 3 and partial.token_versions == [3, 3, 4, 4]
    whole = sample(None, drawn_with=4)
    assert whole.version == 4 and whole.token_versions is None
    metrics = rollout_metrics(StepRollout([[partial, whole]], [{}], {}), step=5)
    assert metrics["rollout/staleness_mean"] == pytest.approx((2 + 1) / 2)
    assert metrics["rollout/staleness_max"] == 2.0
    assert metrics["rollout/staleness_token_mean"] == pytest.approx((2 + 2 + 1 + 1 + 1 * 4) / 8)
    assert metrics["rollout/partial_fraction"] == 0.5
    assert metrics["rollout/versions_per_sample_max"] == 2.0


def test_without_partial_rollouts_every_token_has_its_sample_version():
    samples = [sample(None, drawn_with=v) for v in (2, 3, 3)]
    metrics = rollout_metrics(StepRollout([samples[:1], samples[1:]], [{}, {}], {}), step=3)
    assert metrics["rollout/staleness_token_mean"] == metrics["rollout/staleness_mean"] == pytest.approx(1 / 3)
    assert metrics["rollout/partial_fraction"] == 0.0 and metrics["rollout/versions_per_sample_max"] == 1.0
