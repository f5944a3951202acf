"""DAPO dynamic sampling (``trainer.engines.dynamic_sampling``): which groups a step keeps, over how many
generation batches, on one rank and on two gloo ranks that must agree on the batch count."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_empg.config import ConfigError, DynamicSamplingConfig
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.dynamic_sampling import DynamicSampler, informative, split_groups
from tests.dist import run_distributed


def _group(tag: str, group: int, correct: list[bool], rewards: list[float] | None = None) -> list[Sample]:
    rewards = rewards or [1.0 if c else -1.0 for c in correct]
    return [
        Sample([1], [2, 3], [0.0, 0.0], "stop", group=group, example=(tag, i), reward=r, correct=c)
        for i, (c, r) in enumerate(zip(correct, rewards))
    ]


def _scored(samples: list[Sample]) -> dict[str, float]:
    # the groups come scored; the sums a reward function would return
    return {"reward/malformed": 0.0}


MIXED, ALL_RIGHT, ALL_WRONG = [True, False], [True, True], [False, False]


def test_informative_by_accuracy_or_by_reward():
    assert informative(_group("a", 0, MIXED), "acc")
    assert not informative(_group("a", 0, ALL_RIGHT), "acc") and not informative(_group("a", 0, ALL_WRONG), "acc")
    # both correct, one with an overlong penalty: the rewards differ, the accuracies do not
    penalised = _group("a", 0, ALL_RIGHT, rewards=[1.0, 0.6])
    assert informative(penalised, "reward") and not informative(penalised, "acc")
    assert not informative(_group("a", 0, [True]), "acc")


def test_split_groups_keeps_consecutive_runs_in_order():
    samples = _group("a", 0, MIXED) + _group("b", 1, ALL_RIGHT) + _group("c", 2, [True])
    assert [[s.example for s in g] for g in split_groups(samples)] == [
        [("a", 0), ("a", 1)],
        [("b", 0), ("b", 1)],
        [("c", 0)],
    ]


def _batches(*rounds: list[list[bool]]):
    """draw(k) for one replica: round k's groups, tagged (round, position)."""

    def draw(k: int) -> list[list[Sample]]:
        return [[s for g, correct in enumerate(rounds[k]) for s in _group(f"{k}.{g}", g, correct)]]

    return draw


def _tags(samples: list[Sample]) -> list[str]:
    return [g[0].example[0] for g in split_groups(samples)]


def test_draws_until_the_quota_of_informative_groups_and_keeps_them_in_order():
    draw = _batches([MIXED, ALL_RIGHT, ALL_WRONG, MIXED], [ALL_WRONG, MIXED, MIXED, MIXED], [MIXED] * 4)
    sampler = DynamicSampler(DynamicSamplingConfig(max_num_gen_batches=5), quota=4, replicas=1)
    out = sampler.collect(draw, _scored)
    assert out.gen_batches == 2  # 2 informative groups in batch 0, 3 in batch 1: enough
    assert _tags(out.replicas[0]) == ["0.0", "0.3", "1.1", "1.2"]
    # renumbered 0..3 as a step's prompt indices, two samples each
    assert [s.group for s in out.replicas[0]] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {k: v for k, v in out.sums[0].items() if k.startswith("dynamic_sampling/")} == {
        "dynamic_sampling/informative_groups": 5.0,
        "dynamic_sampling/drawn_groups": 8.0,
        "dynamic_sampling/filled_groups": 0.0,
    }
    assert out.sums[0]["samples"] == 16 and out.sums[0]["correct"] == 7  # every drawn sample: the policy's accuracy


def test_a_batch_that_is_all_informative_draws_once():
    sampler = DynamicSampler(DynamicSamplingConfig(), quota=2, replicas=1)
    out = sampler.collect(_batches([MIXED, MIXED]), _scored)
    assert out.gen_batches == 1 and _tags(out.replicas[0]) == ["0.0", "0.1"]


def test_after_max_num_gen_batches_dropped_groups_fill_the_batch(caplog):
    draw = _batches([ALL_RIGHT, MIXED, ALL_WRONG], [ALL_WRONG, ALL_RIGHT, ALL_RIGHT], [MIXED] * 3)
    sampler = DynamicSampler(DynamicSamplingConfig(max_num_gen_batches=2), quota=3, replicas=1)
    out = sampler.collect(draw, _scored)
    assert out.gen_batches == 2  # the third batch is never drawn
    assert _tags(out.replicas[0]) == ["0.1", "0.0", "0.2"]  # the informative one, then the first dropped
    assert out.sums[0]["dynamic_sampling/filled_groups"] == 2.0
    assert "short of 3 informative groups" in caplog.text


def test_every_replica_of_the_engine_fills_its_own_quota():
    def draw(k: int) -> list[list[Sample]]:
        rounds = {0: ([MIXED, MIXED], [ALL_WRONG, MIXED]), 1: ([MIXED, ALL_RIGHT], [MIXED, ALL_WRONG])}[k]
        return [
            [s for g, c in enumerate(groups) for s in _group(f"{r}:{k}.{g}", g, c)] for r, groups in enumerate(rounds)
        ]

    out = DynamicSampler(DynamicSamplingConfig(), quota=2, replicas=2).collect(draw, _scored)
    assert out.gen_batches == 2  # replica 1 needed a second batch, so replica 0 drew it too
    assert [_tags(r) for r in out.replicas] == [["0:0.0", "0:0.1"], ["1:0.1", "1:1.0"]]
    assert [sums["samples"] for sums in out.sums] == [8, 8]  # each replica's own draws
    assert [sums["dynamic_sampling/informative_groups"] for sums in out.sums] == [3.0, 2.0]


def test_config_checks():
    with pytest.raises(ConfigError, match="max_num_gen_batches"):
        DynamicSamplingConfig(max_num_gen_batches=0).validate()
    with pytest.raises(ConfigError, match="prompts_per_gen_batch"):
        DynamicSamplingConfig(prompts_per_gen_batch=0).validate()
    assert dataclasses.asdict(DynamicSamplingConfig()) == {
        "metric": "acc",
        "prompts_per_gen_batch": None,
        "max_num_gen_batches": 20,
    }


# ------------------------------------------------------------------ two ranks


def _two_ranks(rank: int, world_size: int) -> tuple[list[int], list[str]]:
    # rank 0's replica is full after one batch, rank 1's after three
    rounds = {0: [[MIXED, MIXED]] * 4, 1: [[ALL_RIGHT, MIXED], [ALL_WRONG, ALL_WRONG], [MIXED, ALL_RIGHT], [MIXED] * 2]}
    draws = []

    def draw(k):
        draws.append(k)
        return [[s for g, c in enumerate(rounds[rank][k]) for s in _group(f"{k}.{g}", g, c)]]

    out = DynamicSampler(DynamicSamplingConfig(), quota=2, replicas=1).collect(draw, _scored)
    return draws, _tags(out.replicas[0])


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_draw_the_same_number_of_batches():
    results = run_distributed(_two_ranks, 2, timeout=90)
    # every rank's engine samples every batch (the engines' collectives stay in step)
    assert results[0] == ([0, 1, 2], ["0.0", "0.1"])
    assert results[1] == ([0, 1, 2], ["0.1", "2.0"])
