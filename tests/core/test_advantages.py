"""Advantage estimators against naive per-group float64 loops (the tests loop, the code may not)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from megatron_empg.core.advantages import (
    ADVANTAGE_EPS,
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    dr_grpo,
    grpo,
    register_advantage_estimator,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    rpg_batchmean,
    token_advantages,
)

# --------------------------------------------------------------------------------------------
# Naive references: Python loops over groups in float64, written from the formulas.


def _members(group_ids: list[int]) -> dict[int, list[int]]:
    members = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return members


def reference_grpo(rewards: list[float], group_ids: list[int], normalize_std: bool) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in _members(group_ids).values():
        values = [rewards[i] for i in idx]
        mean = sum(values) / len(values)
        n = len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        for i in idx:
            out[i] = (rewards[i] - mean) / (std + 1e-6) if normalize_std else rewards[i] - mean
    return out


def reference_rloo(rewards: list[float], group_ids: list[int]) -> list[float]:
    out = [0.0] * len(rewards)
    for idx in _members(group_ids).values():
        for i in idx:
            others = [rewards[j] for j in idx if j != i]
            out[i] = rewards[i] - sum(others) / len(others)
    return out


def reference_whiten(values: list[float], weights: list[float]) -> list[float]:
    total = sum(weights)
    mean = sum(w * v for w, v in zip(weights, values)) / total
    var = sum(w * (v - mean) ** 2 for w, v in zip(weights, values)) / (total - 1)
    return [(v - mean) / (math.sqrt(var) + 1e-6) for v in values]


def batch(seed: int = 0, num_groups: int = 6, group_size: int = 5):
    """Rewards [B] float32 and shuffled, non-contiguous group ids [B] int64, plus float64 lists."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([1000, 3, -7, 42, 999_999_937, 17][:num_groups])  # arbitrary, unsorted
    group_ids = ids.repeat_interleave(group_size)
    perm = torch.randperm(len(group_ids), generator=g)
    group_ids = group_ids[perm]  # members scattered through the batch
    rewards = torch.randn(len(group_ids), generator=g)
    return rewards, group_ids, rewards.double().tolist(), group_ids.tolist()


def as_float32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).float()


# --------------------------------------------------------------------------------------------
# Group estimators.


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_naive_loop_with_shuffled_noncontiguous_ids(normalize_std):
    rewards, group_ids, rewards_list, ids_list = batch(seed=1)
    expected = as_float32(reference_grpo(rewards_list, ids_list, normalize_std))
    actual = grpo(rewards, group_ids, normalize_std=normalize_std)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected)


def test_grpo_float64_is_exact_to_float64_tolerance():
    rewards, group_ids, rewards_list, ids_list = batch(seed=2)
    expected = torch.tensor(reference_grpo(rewards_list, ids_list, True), dtype=torch.float64)
    actual = grpo(rewards.double(), group_ids)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_grpo_uneven_groups_and_worked_example():
    # group 5: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735
    # group 2: rewards 3, 1       -> mean 2,   unbiased std sqrt(2)   = 1.41421
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 1.0])
    group_ids = torch.tensor([5, 2, 5, 5, 2, 5])
    s5, s2 = math.sqrt(1 / 3) + ADVANTAGE_EPS, math.sqrt(2) + ADVANTAGE_EPS
    expected = torch.tensor([0.5 / s5, 1 / s2, -0.5 / s5, -0.5 / s5, -1 / s2, 0.5 / s5])
    torch.testing.assert_close(grpo(rewards, group_ids), expected)


def test_grpo_constant_group_gives_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    actual = grpo(rewards, group_ids)
    torch.testing.assert_close(actual[:3], torch.zeros(3))
    assert torch.isfinite(actual).all()


def test_dr_grpo_equals_grpo_without_std_and_sums_to_zero_per_group():
    rewards, group_ids, rewards_list, ids_list = batch(seed=3)
    actual = dr_grpo(rewards, group_ids)
    expected_same = grpo(rewards, group_ids, normalize_std=False)
    torch.testing.assert_close(actual, expected_same, rtol=0, atol=0)
    torch.testing.assert_close(actual, as_float32(reference_grpo(rewards_list, ids_list, False)))
    for g in set(ids_list):
        assert abs(actual[group_ids == g].double().sum().item()) < 1e-5
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS["rpg"](rewards, group_ids), actual, rtol=0, atol=0)


def test_dr_grpo_rejects_a_group_of_one_while_rpg_gives_it_its_reward():
    rewards = torch.tensor([0.7, 1.0, 0.0])
    group_ids = torch.tensor([9, 4, 4])
    with pytest.raises(ValueError, match="group_ids: group 9 has a single sample"):
        dr_grpo(rewards, group_ids)
    # RPG's code: a singleton's baseline is 0, so its advantage is its reward (docs/design/rpg.md property 17).
    actual = ADVANTAGE_ESTIMATORS["rpg"](rewards, group_ids)
    torch.testing.assert_close(actual, torch.tensor([0.7, 0.5, -0.5]))


def test_rloo_matches_leave_one_out_formula():
    rewards, group_ids, rewards_list, ids_list = batch(seed=4)
    expected = as_float32(reference_rloo(rewards_list, ids_list))
    torch.testing.assert_close(rloo(rewards, group_ids), expected)
    # worked example: group (1, 2, 6): 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    actual = rloo(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([8, 8, 8]))
    torch.testing.assert_close(actual, torch.tensor([-3.0, -1.5, 4.5]))


@pytest.mark.parametrize("fn", [grpo, rloo], ids=["grpo", "rloo"])
def test_group_of_size_one_raises_naming_group_ids_and_the_group(fn):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0])
    group_ids = torch.tensor([3, 3, 12345, 7, 7])
    with pytest.raises(ValueError, match=r"group_ids.*group 12345"):
        fn(rewards, group_ids, validate=False)  # checked even without validate


def test_rpg_batchmean_subtracts_the_batch_mean():
    rewards, group_ids, rewards_list, _ = batch(seed=5)
    mean = sum(rewards_list) / len(rewards_list)
    expected = as_float32([r - mean for r in rewards_list])
    torch.testing.assert_close(rpg_batchmean(rewards, group_ids), expected)
    torch.testing.assert_close(rpg_batchmean(rewards), expected)
    assert abs(rpg_batchmean(rewards).double().sum().item()) < 1e-5


# --------------------------------------------------------------------------------------------
# REINFORCE++.


def test_reinforce_pp_uses_batch_statistics():
    rewards, _, rewards_list, _ = batch(seed=6)
    expected = as_float32(reference_whiten(rewards_list, [1.0] * len(rewards_list)))
    actual = reinforce_pp(rewards)
    torch.testing.assert_close(actual, expected)
    # whitened: mean 0, unbiased std 1 (up to eps)
    assert abs(actual.double().mean().item()) < 1e-6
    assert abs(actual.double().std().item() - 1) < 1e-5


def test_reinforce_pp_token_counts_reproduce_token_level_whitening():
    # verl's masked_whiten over tokens: each sequence's reward repeated over its response tokens
    rewards, _, rewards_list, _ = batch(seed=7, num_groups=2, group_size=4)
    token_counts = torch.tensor([3, 1, 7, 2, 5, 0, 4, 6])
    tokens = [r for r, n in zip(rewards_list, token_counts.tolist()) for _ in range(n)]
    total = len(tokens)
    mean = sum(tokens) / total
    std = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (total - 1))  # unbiased over tokens
    expected = as_float32([(r - mean) / (std + 1e-6) for r in rewards_list])
    torch.testing.assert_close(reinforce_pp(rewards, token_counts=token_counts), expected)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens_over_batch():
    rewards, group_ids, rewards_list, ids_list = batch(seed=8)
    centered = reference_grpo(rewards_list, ids_list, normalize_std=False)
    expected = as_float32(reference_whiten(centered, [1.0] * len(centered)))
    torch.testing.assert_close(reinforce_pp_baseline(rewards, group_ids), expected)
    torch.testing.assert_close(reinforce_pp(rewards, group_ids, baseline=True), expected)
    # with token weights the (non-zero) weighted batch mean of the centered rewards is removed too
    token_counts = torch.arange(1, len(rewards_list) + 1)
    expected_weighted = as_float32(reference_whiten(centered, [float(n) for n in token_counts]))
    actual_weighted = reinforce_pp_baseline(rewards, group_ids, token_counts=token_counts)
    torch.testing.assert_close(actual_weighted, expected_weighted)


def test_reinforce_pp_bad_inputs():
    rewards = torch.tensor([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="group_ids is required"):
        reinforce_pp(rewards, baseline=True)
    with pytest.raises(ValueError, match="rewards has 1 element"):
        reinforce_pp(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="token_counts must be an integer"):
        reinforce_pp(rewards, token_counts=torch.ones(3))
    with pytest.raises(ValueError, match="token_counts has shape"):
        reinforce_pp(rewards, token_counts=torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="token_counts must be >= 0"):
        reinforce_pp(rewards, token_counts=torch.tensor([1, 0, 0]))


# --------------------------------------------------------------------------------------------
# Order invariance, input checks, registry, token broadcast.


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_is_equivariant_under_shuffling(name):
    rewards, group_ids, _, _ = batch(seed=9)
    fn = advantage_estimator(name)
    expected = fn(rewards, group_ids)
    perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(10))
    actual = fn(rewards[perm], group_ids[perm])
    torch.testing.assert_close(actual, expected[perm])


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_names_bad_arguments(name):
    fn = advantage_estimator(name)
    group_ids = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="rewards must be a 1-D float"):
        fn(torch.tensor([1, 0, 1, 0]), group_ids)
    with pytest.raises(ValueError, match="rewards must be a 1-D float"):
        fn(torch.zeros(2, 2), group_ids)
    with pytest.raises(ValueError, match="group_ids must be an integer"):
        fn(torch.zeros(4), group_ids.float())
    with pytest.raises(ValueError, match="group_ids has shape"):
        fn(torch.zeros(4), group_ids[:3])
    with pytest.raises(ValueError, match="rewards contains NaN"):
        fn(torch.tensor([1.0, float("nan"), 0.0, 1.0]), group_ids)


def test_bf16_rewards_are_computed_in_float32():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.25, 0.75], dtype=torch.bfloat16)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    actual = grpo(rewards, group_ids)
    assert actual.dtype == torch.float32
    expected = grpo(rewards.float(), group_ids)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_registry_lookup_and_duplicate_registration():
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo",
        "dr_grpo",
        "rpg",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "rpg_batchmean",
    }
    assert advantage_estimator("grpo") is grpo
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'dr_grpo'"):
        advantage_estimator("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda rewards, group_ids, **kw: rewards)
    register_advantage_estimator("grpo")(grpo)  # same function again: allowed
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo


def test_token_advantages_broadcasts_and_masks():
    advantages = torch.tensor([0.5, -2.0, 3.0])
    loss_mask = torch.tensor([[True, True, False], [False, True, True], [False, False, False]])
    expected = torch.tensor([[0.5, 0.5, 0.0], [0.0, -2.0, -2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(token_advantages(advantages, loss_mask), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="loss_mask must be a"):
        token_advantages(advantages, loss_mask.float())
    with pytest.raises(ValueError, match="advantages must be"):
        token_advantages(advantages[:2], loss_mask)
