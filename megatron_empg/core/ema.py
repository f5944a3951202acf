"""EMA anchor math: the in-place update and the schedule deciding when it runs.

EMA-PG (arXiv:2602.04417) replaces the fixed KL reference by an exponential moving average of the
policy, updated every ``period`` optimizer steps::

    anchor <- tau * anchor + (1 - tau) * policy

``tau = 1`` keeps the initial policy (GRPO with a fixed reference); ``tau = 0`` with ``period = 1``
resets the anchor to the policy after every step (RPG's iterative reference, arXiv:2505.17508).

The anchor is kept in float32. In bf16 (as ema-pg's ``search/`` code does) an update moves a
coordinate only if ``(1 - tau) * |policy - anchor|`` exceeds about half a bf16 ulp (2^-9 relative),
so the lr ~1e-6 drifts of RL fine-tuning are rounded away and the anchor stalls. The forward pass
may still run on a bf16 copy of the anchor; only the accumulator must be float32.

This module is local math: in a sharded model each rank updates its own shards (no communication);
which tensors form the anchor, and checkpointing, live in ``mcore/anchor.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_empg.core.checks import check_finite


def _check_tau(name: str, tau: float) -> None:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 <= tau <= 1.0:
        raise ValueError(f"{name}={tau!r} must be a number in [0, 1] (1 keeps a fixed reference, 0 copies the policy)")


def ema_update_(
    anchor: Iterable[Tensor],
    policy: Iterable[Tensor],
    tau: float,
    *,
    validate: bool = True,
) -> None:
    """In place: ``anchor[i] <- tau * anchor[i] + (1 - tau) * policy[i]`` for every i.

    Computed as ``lerp(anchor, policy, 1 - tau)`` (``torch._foreach_lerp_``, one rounding per
    element; ema-pg's ``mul_(tau).add_(policy, alpha=1 - tau)`` rounds twice). The limits are
    exact: ``tau = 1`` leaves every anchor bit unchanged (no kernel runs), ``tau = 0`` copies the
    policy (cast to float32) bit for bit. Runs under ``torch.no_grad()``, so anchors may be
    ``nn.Parameter``s.

    Args:
        anchor: float32 tensors, updated in place.
        policy: tensors of any float dtype, paired with ``anchor`` by position, same shapes and
            devices. Non-float32 ones are cast one tensor at a time (one temporary at a time); pass
            the optimizer's float32 main parameters to avoid the casts and the bf16 rounding.
        tau: decay in [0, 1].
        validate: check that every policy tensor is finite (one host sync), since a NaN would
            poison the anchor permanently.

    Raises:
        ValueError: naming ``tau``, or the index of a mismatched pair (count, dtype, shape,
            device), or a non-finite ``policy[i]``.
    """
    _check_tau("tau", tau)
    anchors, policies = list(anchor), list(policy)
    _check_pairs(anchors, policies)
    if validate and policies:
        check_finite(**{f"policy[{i}]": p for i, p in enumerate(policies)})
    if tau == 1:
        return
    with torch.no_grad():
        if tau == 0:
            for a, p in zip(anchors, policies):
                a.copy_(p)  # exact: a float32 copy of p
            return
        weight = 1.0 - tau
        same = [i for i, p in enumerate(policies) if p.dtype == torch.float32]
        if same:
            torch._foreach_lerp_([anchors[i] for i in same], [policies[i] for i in same], weight)
        for a, p in zip(anchors, policies):
            if p.dtype != torch.float32:
                a.lerp_(p.to(torch.float32), weight)


def _check_pairs(anchors: list[Tensor], policies: list[Tensor]) -> None:
    if len(anchors) != len(policies):
        raise ValueError(
            f"anchor has {len(anchors)} tensors but policy has {len(policies)}; they pair up by "
            "position and must have the same length"
        )
    for i, (a, p) in enumerate(zip(anchors, policies)):
        if a.dtype != torch.float32:
            raise ValueError(
                f"anchor[{i}] has dtype {a.dtype}; the EMA anchor must be float32 (a bf16 EMA "
                "rounds away updates smaller than half a bf16 ulp and stalls)"
            )
        if not p.is_floating_point():
            raise ValueError(f"policy[{i}] has dtype {p.dtype}; it must be a floating-point tensor")
        if p.shape != a.shape:
            raise ValueError(
                f"policy[{i}] has shape {tuple(p.shape)} but anchor[{i}] has shape {tuple(a.shape)}; they must match"
            )
        if p.device != a.device:
            raise ValueError(f"policy[{i}] is on {p.device} but anchor[{i}] is on {a.device}")


@dataclass(frozen=True)
class EmaSchedule:
    """When the anchor is updated, and by how much (ema-pg's driver logic).

    Steps count optimizer steps (global steps) from 1. The update runs *after* the optimizer step
    of step ``t`` when ``should_update(t)``: by default when ``t % period == 0`` (first update at
    ``t = period``, as ema-pg), or, with ``first_update = f``, when ``t >= f`` and
    ``(t - f) % period == 0``. ``tau = 1`` never updates (the anchor stays the initial policy).
    The anchor used by step ``t`` is then the state after the last update before ``t``.

    One update every ``period`` steps with decay ``tau`` behaves like a per-step EMA with:
        per-step factor   tau ** (1 / period)
        half-life         period * ln(1/2) / ln(tau) steps  (weight of old policies halves)
        mean lag          period * tau / (1 - tau) steps    (weights (1 - tau) tau^j on the policy
                                                             j updates back), plus up to
                                                             period - 1 steps of staleness.
    E.g. tau 0.9, period 10: factor 0.98952, half-life 65.8, mean lag 90 steps; tau 0.95,
    period 10: 0.99488, 135, 190.

    Args:
        tau: decay in [0, 1].
        period: optimizer steps between updates, >= 1.
        first_update: step of the first update (>= 1), or None for ``period``.
    """

    tau: float
    period: int
    first_update: int | None = None

    def __post_init__(self) -> None:
        _check_tau("EmaSchedule.tau", self.tau)
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"EmaSchedule.period={self.period!r} must be an integer >= 1")
        first = self.first_update
        bad_first = isinstance(first, bool) or not isinstance(first, int) or first < 1
        if first is not None and bad_first:
            raise ValueError(
                f"EmaSchedule.first_update={first!r} must be None (first update at step = period) "
                "or an integer >= 1 (steps count from 1)"
            )

    def should_update(self, step: int) -> bool:
        """Whether to update the anchor after the optimizer step numbered ``step`` (>= 1)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step={step!r} must be an integer >= 1 (steps count from 1)")
        if self.tau == 1:
            return False
        first = self.period if self.first_update is None else self.first_update
        return step >= first and (step - first) % self.period == 0

    @property
    def per_step_factor(self) -> float:
        """``tau ** (1 / period)``: the decay of a per-step EMA with the same long-run memory."""
        return self.tau ** (1.0 / self.period)

    @property
    def half_life(self) -> float:
        """Steps after which a policy's weight in the anchor has halved (inf for tau = 1)."""
        if self.tau == 1:
            return math.inf
        if self.tau == 0:
            return 0.0
        return self.period * math.log(0.5) / math.log(self.tau)

    @property
    def mean_lag(self) -> float:
        """Mean age, in steps, of the policies averaged into the anchor (inf for tau = 1)."""
        if self.tau == 1:
            return math.inf
        return self.period * self.tau / (1.0 - self.tau)


class ScheduledEma:
    """What every EMA anchor does with its schedule: ``schedule`` (``EmaSchedule``), ``tau``,
    ``num_updates`` (the updates made, restored from checkpoints), and ``maybe_update(step)`` calling
    the subclass's ``update()`` when the schedule says so."""

    def __init__(self, schedule: EmaSchedule) -> None:
        self.schedule = schedule
        self.num_updates = 0

    @property
    def tau(self) -> float:
        return self.schedule.tau

    def maybe_update(self, step: int) -> bool:
        """``update()`` if the schedule says so after the optimizer step numbered ``step`` (from 1)."""
        if not self.schedule.should_update(step):
            return False
        self.update()
        return True

    def update(self) -> None:
        raise NotImplementedError
