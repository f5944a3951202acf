"""``core.behavior_is``: the weights of each mode and the stats on a small batch whose expected
values are written out by hand, the masking, the clamp of extreme log-ratios, the argument errors,
and ``algorithm.behavior_is_cap``'s config error."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_empg.config import AlgorithmConfig, ConfigError, RunConfig, from_dict
from megatron_empg.core.behavior_is import BEHAVIOR_IS, behavior_metrics, behavior_stats, behavior_weights

CAP = 2.0
# pi_old / mu on the loss tokens, row by row; 7.0 and 1e3 sit off the mask (weight 1 whatever they are)
RATIOS = [[0.4, 1.0, 3.0, 7.0], [0.6, 1e3, 1.9, 100.0]]
MASK = torch.tensor([[True, True, True, False], [True, False, True, True]])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(old, sampler) [2, 4] float32 log-probs with exp(old - sampler) = RATIOS."""
    sampler = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-3.0, -1.0, -0.7, -5.0]])
    return sampler + torch.tensor(RATIOS).log(), sampler


def test_tis_truncates_the_ratio_at_the_cap():
    old, sampler = _batch()
    weights = behavior_weights(old, sampler, MASK, "tis", CAP)
    # min(ratio, 2) on the mask, 1 off it
    expected = torch.tensor([[0.4, 1.0, 2.0, 1.0], [0.6, 1.0, 1.9, 2.0]])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)
    assert weights.dtype == torch.float32


def test_mis_keeps_the_ratio_inside_one_over_cap_to_cap_and_zeroes_the_rest():
    old, sampler = _batch()
    weights = behavior_weights(old, sampler, MASK, "mis", CAP)
    # 0.4 < 1/2 and 3, 100 > 2 are rejected (0); 0.6, 1 and 1.9 keep their ratio; 1 off the mask
    expected = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.6, 1.0, 1.9, 0.0]])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=0)


def test_none_gives_no_weights_and_every_mode_is_in_the_registry():
    old, sampler = _batch()
    assert behavior_weights(old, sampler, MASK, "none", CAP) is None
    assert sorted(BEHAVIOR_IS) == ["mis", "none", "tis"]


def test_weights_are_detached_float32_and_finite_for_extreme_log_ratios():
    old = torch.tensor([[0.0, -1e4, 0.0, -30.0]], requires_grad=True)
    sampler = torch.tensor([[-1e30, 0.0, -float("inf"), 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for mode in ("tis", "mis"):
        weights = behavior_weights(old.bfloat16(), sampler, mask, mode, CAP)
        assert not weights.requires_grad and weights.dtype == torch.float32
        assert torch.isfinite(weights).all()
    stats = behavior_stats(old, sampler, mask, CAP)
    assert all(math.isfinite(v) for v in stats.values())
    # the log-ratio is clamped to +-20 before exp: ratios e^20, e^-20, e^20, e^-20
    assert stats["behavior/ratio"] == pytest.approx(2 * math.exp(20) + 2 * math.exp(-20), rel=1e-6)


def test_stats_are_sums_over_the_loss_tokens_and_metrics_their_means():
    old, sampler = _batch()
    stats = behavior_stats(old, sampler, MASK, CAP)
    # loss-token ratios 0.4, 1, 3, 0.6, 1.9, 100; K3 = ratio - 1 - log(ratio) of each:
    # 0.316291 + 0 + 0.901388 + 0.110826 + 0.258146 + 94.394830
    expected = {"behavior/ratio": 106.9, "behavior/clipped": 2.0, "behavior/k3": 95.981480, "behavior/tokens": 6.0}
    assert stats.keys() == expected.keys()
    for name, value in expected.items():
        assert stats[name] == pytest.approx(value, rel=1e-6), name
    metrics = behavior_metrics(stats)
    assert metrics == pytest.approx(
        {"rollout/is_ratio_mean": 106.9 / 6, "rollout/is_clipped_fraction": 2 / 6, "rollout/sampler_k3": 95.981480 / 6},
        rel=1e-6,
    )


def test_on_policy_samples_get_weight_one_and_zero_k3():
    sampler = torch.tensor([[-0.3, -2.0, -0.9]])
    mask = torch.tensor([[True, True, False]])
    for mode in ("tis", "mis"):
        assert torch.equal(behavior_weights(sampler.clone(), sampler, mask, mode, CAP), torch.ones(1, 3))
    stats = behavior_stats(sampler.clone(), sampler, mask, CAP)
    assert stats == {"behavior/ratio": 2.0, "behavior/clipped": 0.0, "behavior/k3": 0.0, "behavior/tokens": 2.0}


def test_metrics_of_no_tokens_are_zero():
    zeros = {"behavior/ratio": 0.0, "behavior/clipped": 0.0, "behavior/k3": 0.0, "behavior/tokens": 0.0}
    assert behavior_metrics(zeros) == {
        "rollout/is_ratio_mean": 0.0,
        "rollout/is_clipped_fraction": 0.0,
        "rollout/sampler_k3": 0.0,
    }


def test_bad_arguments_raise_naming_the_argument():
    old, sampler = _batch()
    with pytest.raises(ValueError, match=r"^mode='ais' is not one of \['mis', 'none', 'tis'\]"):
        behavior_weights(old, sampler, MASK, "ais", CAP)
    with pytest.raises(ValueError, match="^cap=0.5 must be >= 1"):
        behavior_weights(old, sampler, MASK, "tis", 0.5)
    with pytest.raises(ValueError, match="^cap=0.5 must be >= 1"):
        behavior_stats(old, sampler, MASK, 0.5)
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        behavior_weights(old, sampler[:, :3], MASK, "tis", CAP)
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        behavior_stats(old, sampler, MASK.float(), CAP)


def test_config_defaults_and_cap_error_name_the_field():
    algorithm = from_dict(AlgorithmConfig, {})
    assert (algorithm.behavior_is, algorithm.behavior_is_cap) == ("none", 2.0)
    assert from_dict(AlgorithmConfig, {"behavior_is": "tis", "behavior_is_cap": 1.0}).behavior_is_cap == 1.0
    for cap, words in ((0.99, "must be >= 1"), (float("nan"), "expected a finite number")):
        with pytest.raises(ConfigError) as e:
            from_dict(AlgorithmConfig, {"behavior_is_cap": cap})
        assert e.value.field == "behavior_is_cap" and words in e.value.reason
    base = {"model": "tiny-qwen2", "tokenizer": "/tmp/tokenizer"}
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, {**base, "algorithm": {"behavior_is_cap": 0.5}})
    assert e.value.field == "algorithm.behavior_is_cap"
