"""The tolerance of the layout tests (tests/adam_bound.py) against torch's AdamW itself, in float64:
two runs from the same weights with gradients a little apart never move further apart than
``adam_drift_bound``, the bound is within 2x of the worst case, and it catches an update that went
wrong (a skipped step) where a fixed ``atol`` of 1e-5 would not.
"""

from __future__ import annotations

import pytest
import torch

from tests.adam_bound import (
    adam_drift_bound,
    adam_step_bound,
    assert_grads_close,
    assert_params_within_adam_bound,
)

BETAS = (0.9, 0.999)


def _adamw(p0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float], eps: float, wd: float, skip=None):
    """torch's AdamW over ``grads`` from ``p0``, the LR set per step; ``skip``: a step not applied."""
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([param], lr=lrs[0], betas=BETAS, eps=eps, weight_decay=wd)
    for step, (grad, lr) in enumerate(zip(grads, lrs)):
        if step == skip:
            continue
        opt.param_groups[0]["lr"] = lr
        param.grad = grad.clone()
        opt.step()
    return param.detach()


def _histories(seed: int, steps: int, size: int, noise: float):
    """Gradient histories whose elements span 1e-12..1 in size, exact zeros and sign flips among
    them, and the same histories perturbed by up to ``noise`` of each element (plus ``noise`` x 1e-9
    absolute, as a reordered sum leaves on a cancelling element)."""
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** (-12 * torch.rand(size, generator=g, dtype=torch.float64))
    ref = [torch.randn(size, generator=g, dtype=torch.float64) * scale for _ in range(steps)]
    ref[0][: size // 10] = 0.0
    ours = [r * (1 + noise * torch.randn(size, generator=g, dtype=torch.float64)) for r in ref]
    ours = [o + noise * 1e-9 * torch.randn(size, generator=g, dtype=torch.float64) for o in ours]
    return ours, ref


@pytest.mark.parametrize("eps", [1e-8, 1e-6])
@pytest.mark.parametrize("noise", [1e-7, 1e-3, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_two_adam_runs_stay_within_the_bound(seed, noise, eps):
    steps, size = 5, 4000
    ours, ref = _histories(seed, steps, size, noise)
    lrs = [1e-3 * (k + 1) / steps for k in range(steps)]  # a warmup
    p0 = torch.randn(size, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    diff = (_adamw(p0, ours, lrs, eps, 0.1) - _adamw(p0, ref, lrs, eps, 0.1)).abs()
    bound = adam_drift_bound(ours, ref, lrs, beta1=BETAS[0], beta2=BETAS[1], eps=eps)
    assert bool((diff <= bound * (1 + 1e-9) + 1e-15).all()), float((diff - bound).max())
    # not vacuous: some elements come close to it, and most of it is far below the saturated 2 lr R_t
    assert float((diff / bound.clamp(min=1e-300)).max()) > 0.05
    saturated = 2 * sum(adam_step_bound(lr, t + 1) for t, lr in enumerate(lrs))
    if noise < 1e-3:
        assert float(bound.median()) < 1e-3 * saturated


def test_the_bound_is_within_two_of_the_worst_case():
    """One step, a zero gradient against a gradient delta << eps: Adam moves the second by
    lr delta / (delta + eps), the first not at all; the bound says 2 lr delta / eps, within
    2 (1 + delta / eps) of it."""
    eps, lr = 1e-8, 1e-3
    deltas = torch.tensor([1e-14, 1e-12, 1e-10], dtype=torch.float64)
    moved = _adamw(torch.zeros(3, dtype=torch.float64), [deltas], [lr], eps, 0.0).abs()
    bound = adam_drift_bound([deltas], [torch.zeros(3, dtype=torch.float64)], [lr], beta1=0.9, beta2=0.999, eps=eps)
    assert torch.all(moved <= bound) and torch.all(bound <= 2 * (1 + deltas / eps) * moved * (1 + 1e-9)), (moved, bound)


def test_a_skipped_update_breaks_the_bound_where_a_fixed_atol_would_not_notice():
    """The negative control: the same gradients, one step not applied (a stale shard). The bound is
    ~0 there; the parameters move a few lr apart, and at lr 2e-6 (a warmup's first steps) all of
    them pass an atol of 1e-5."""
    steps, size, lr = 3, 1000, 2e-6
    _, ref = _histories(3, steps, size, 0.0)
    ref = [r + 1e-3 * torch.sign(r) for r in ref]  # well above eps: Adam's ordinary regime
    lrs = [lr] * steps
    p0 = torch.zeros(size, dtype=torch.float64)
    stale = _adamw(p0, ref, lrs, 1e-8, 0.01, skip=1)
    good = _adamw(p0, ref, lrs, 1e-8, 0.01)
    assert float((stale - good).abs().max()) <= 1e-5  # what the old atol let through
    with pytest.raises(AssertionError, match="past Adam's bound"):
        assert_params_within_adam_bound(stale, good, ref, ref, lrs, eps=1e-8, what="stale")
    assert_params_within_adam_bound(good, good, ref, ref, lrs, eps=1e-8, what="same")


def test_first_step_gradients_are_compared_to_their_scale():
    ref = torch.tensor([1.0, -0.5, 1e-9])
    assert_grads_close(ref + 5e-6, ref, "rounding")
    with pytest.raises(AssertionError, match="wrong"):
        assert_grads_close(ref * 1.001, ref, "wrong")
    assert_grads_close(torch.zeros(3), torch.zeros(3), "zero")
    with pytest.raises(AssertionError):
        assert_grads_close(torch.full((3,), 1e-30), torch.zeros(3), "zero")
