"""PPO clip, DAPO clip-higher and dual-clip (``core/policy_loss.py``): worked examples, the gradient
per region against its closed form, and the input contract."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from megatron_empg.core.policy_loss import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    PolicyLoss,
    ppo_clip_loss,
)

DTYPE = torch.float64
TIGHT = dict(atol=1e-12, rtol=0.0)  # float64 arithmetic on O(1) numbers: rounding only


def tokens_with_ratios(ratios: list[float], advantages: list[float]) -> dict[str, Tensor]:
    """old_logprobs = -1.3 everywhere and logprobs = old + log w, so exp(l - l_old) = w."""
    ratio = torch.tensor(ratios, dtype=DTYPE)
    old_logprobs = torch.full_like(ratio, -1.3)
    return {
        "logprobs": old_logprobs + ratio.log(),
        "old_logprobs": old_logprobs,
        "advantages": torch.tensor(advantages, dtype=DTYPE),
    }


def values_and_dl(**kwargs) -> tuple[PolicyLoss, Tensor]:
    """The loss and d sum(values) / d logprobs (the per-token gradient coefficient)."""
    logprobs = kwargs.pop("logprobs").detach().clone().requires_grad_(True)
    out = ppo_clip_loss(logprobs, **kwargs)
    (dl,) = torch.autograd.grad(out.values.sum(), logprobs)
    return out, dl


def test_worked_example_dapo_dual_clip():
    # eps_low = 0.2, eps_high = 0.28, c = 3: ratio range [0.8, 1.28].
    #   A    w     -A w   -A clip(w)   max     dual: min(., -A c)   loss   d/dl = -A w or 0
    #   +1  1.1   -1.1   -1.1         -1.1    -                    -1.1   -1.1
    #   +1  1.5   -1.5   -1.28        -1.28   -                    -1.28   0   (clipped_high)
    #   +1  0.5   -0.5   -0.8         -0.5    -                    -0.5   -0.5 (no low clip, A>0)
    #   -1  0.5    0.5    0.8          0.8    min(0.8, 3) = 0.8     0.8    0   (clipped_low)
    #   -1  1.5    1.5    1.28         1.5    min(1.5, 3) = 1.5     1.5    1.5
    #   -1  4.0    4.0    1.28         4.0    min(4, 3) = 3         3.0    0   (dual_clipped)
    #   -2  0.9    1.8    1.8          1.8    min(1.8, 6) = 1.8     1.8    1.8
    #    0  2.0    0      0            0      -                    0      0
    tokens = tokens_with_ratios([1.1, 1.5, 0.5, 0.5, 1.5, 4.0, 0.9, 2.0], [1, 1, 1, -1, -1, -1, -2, 0])
    actual, actual_dl = values_and_dl(**tokens, clip_eps_low=0.2, clip_eps_high=0.28, clip_c=3.0)
    expected_values = torch.tensor([-1.1, -1.28, -0.5, 0.8, 1.5, 3.0, 1.8, 0.0], dtype=DTYPE)
    expected_dl = torch.tensor([-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 1.8, 0.0], dtype=DTYPE)
    assert_close(actual.values, expected_values, **TIGHT)
    assert_close(actual_dl, expected_dl, **TIGHT)
    expected_metrics = {
        "clipped_low": [0, 0, 0, 1, 0, 0, 0, 0],
        "clipped_high": [0, 1, 0, 0, 0, 0, 0, 0],
        "dual_clipped": [0, 0, 0, 0, 0, 1, 0, 0],
        "ratio": [1.1, 1.5, 0.5, 0.5, 1.5, 4.0, 0.9, 2.0],
    }
    for name, expected in expected_metrics.items():
        assert_close(actual.metrics[name], torch.tensor(expected, dtype=DTYPE), **TIGHT, msg=name)


def test_worked_example_symmetric_default_vs_clip_higher():
    # A = +1, w = 1.25. Symmetric eps = 0.2 (clip_eps_high=None): clip at 1.2 -> loss -1.2, no
    # gradient. DAPO eps_high = 0.28: 1.25 < 1.28 -> loss -1.25, d/dl = -1.25.
    # A = -1, w = 0.75: both clip at 0.8 from below -> loss max(0.75, 0.8) = 0.8, no gradient.
    tokens = tokens_with_ratios([1.25, 0.75], [1.0, -1.0])
    symmetric, symmetric_dl = values_and_dl(**tokens)
    assert_close(symmetric.values, torch.tensor([-1.2, 0.8], dtype=DTYPE), **TIGHT)
    assert_close(symmetric_dl, torch.zeros(2, dtype=DTYPE), **TIGHT)
    dapo, dapo_dl = values_and_dl(**tokens, clip_eps_high=0.28)
    assert_close(dapo.values, torch.tensor([-1.25, 0.8], dtype=DTYPE), **TIGHT)
    assert_close(dapo_dl, torch.tensor([-1.25, 0.0], dtype=DTYPE), **TIGHT)


def test_worked_example_without_dual_clip():
    # A = -1, w = 4: without dual-clip the loss is max(4, 1.2) = 4 and d/dl = -A w = 4 (PPO's
    # unbounded loss for negative advantages, which dual-clip caps at -A c).
    tokens = tokens_with_ratios([4.0], [-1.0])
    actual, actual_dl = values_and_dl(**tokens)
    assert_close(actual.values, torch.tensor([4.0], dtype=DTYPE), **TIGHT)
    assert_close(actual_dl, torch.tensor([4.0], dtype=DTYPE), **TIGHT)
    assert_close(actual.metrics["dual_clipped"], torch.zeros(1, dtype=DTYPE), **TIGHT)


# Bands of w away from the boundaries of (0.2, 0.28, c = 3): below, inside, above, above c.
REGION_BANDS = ((0.5, 0.78), (0.82, 1.26), (1.3, 2.9), (3.1, 6.0))


@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_gradient_matches_closed_form_per_region(clip_c):
    g = torch.Generator().manual_seed(0)
    per_region = 64
    ratio = torch.cat([lo + (hi - lo) * torch.rand(per_region, generator=g, dtype=DTYPE) for lo, hi in REGION_BANDS])
    advantages = torch.randn(ratio.shape, generator=g, dtype=DTYPE)
    old_logprobs = -0.1 - 3 * torch.rand(ratio.shape, generator=g, dtype=DTYPE)
    actual, actual_dl = values_and_dl(
        logprobs=old_logprobs + ratio.log(),
        old_logprobs=old_logprobs,
        advantages=advantages,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        clip_c=clip_c,
    )
    c = math.inf if clip_c is None else clip_c
    flows = ((advantages > 0) & (ratio < 1.28)) | ((advantages < 0) & (ratio > 0.8) & (ratio < c))
    expected_dl = torch.where(flows, -advantages * ratio, torch.zeros_like(ratio))
    assert_close(actual_dl, expected_dl, **TIGHT)
    expected_values = torch.where(
        advantages > 0,
        -advantages * ratio.clamp(max=1.28),
        -advantages * ratio.clamp(min=0.8, max=c),
    )
    assert_close(actual.values, expected_values, **TIGHT)
    # Each zero-gradient token is counted by exactly one indicator.
    indicators = sum(actual.metrics[k] for k in ("clipped_low", "clipped_high", "dual_clipped"))
    assert_close(indicators, (~flows).to(DTYPE), **TIGHT)
    assert 0.1 < indicators.mean() < 0.9


def test_log_ratio_clamp_keeps_ratio_finite():
    # log w = 30 > LOG_RATIO_CLAMP: the ratio is exp(20) (finite), the token is clipped and gets
    # exactly zero gradient; so does log w = -30 with a negative advantage.
    old_logprobs = torch.tensor([-35.0, -1.0], dtype=torch.float32)
    logprobs = old_logprobs + torch.tensor([30.0, -30.0])
    actual, actual_dl = values_and_dl(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=torch.tensor([1.0, -1.0])
    )
    expected_ratio = torch.tensor([math.exp(LOG_RATIO_CLAMP), math.exp(-LOG_RATIO_CLAMP)])
    assert_close(actual.metrics["ratio"], expected_ratio, rtol=1e-6, atol=0.0)
    assert torch.isfinite(actual.values).all()
    assert torch.equal(actual_dl, torch.zeros(2))


def test_contract_shapes_dtypes_no_grad_metrics():
    g = torch.Generator().manual_seed(1)
    logprobs = (-torch.rand(2, 5, generator=g)).requires_grad_(True)
    old_logprobs = logprobs.detach() + 0.1 * torch.randn(2, 5, generator=g)
    out = POLICY_LOSSES["ppo_clip"](logprobs, old_logprobs, torch.randn(2, 5, generator=g))
    assert isinstance(out, PolicyLoss)
    assert out.values.shape == (2, 5) and out.values.dtype == torch.float32
    assert out.values.requires_grad
    assert set(out.metrics) == {"clipped_low", "clipped_high", "dual_clipped", "ratio"}
    for metric in out.metrics.values():
        assert metric.shape == (2, 5) and metric.dtype == torch.float32
        assert not metric.requires_grad


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(old_logprobs=torch.zeros(4, 1)), "old_logprobs"),
        (dict(logprobs=torch.tensor([0.0, math.nan, 0.0, 0.0])), "logprobs"),
        (dict(advantages=torch.tensor([0.0, math.inf, 0.0, 0.0])), "advantages"),
        (dict(clip_c=1.0), "clip_c"),
        (dict(clip_c=0.5), "clip_c"),
        (dict(clip_eps_low=1.0), "clip_eps_low"),
        (dict(clip_eps_low=-0.1), "clip_eps_low"),
        (dict(clip_eps_high=-0.1), "clip_eps_high"),
    ],
)
def test_bad_input_raises_naming_argument(overrides, match):
    kwargs = dict(logprobs=torch.zeros(4), old_logprobs=torch.zeros(4), advantages=torch.ones(4))
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(**kwargs)


def test_validate_false_skips_the_finiteness_check():
    logprobs = torch.tensor([0.0, math.nan])
    out = ppo_clip_loss(logprobs, torch.zeros(2), torch.ones(2), validate=False)
    assert torch.isnan(out.values[1]) and out.values[0] == -1.0
