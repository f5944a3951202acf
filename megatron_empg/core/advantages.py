"""Outcome-reward advantages: one scalar reward per sequence -> one advantage per sequence.

Every estimator takes ``rewards`` [B] (float) and ``group_ids`` [B] (integer): sequences sampled
from the same prompt share an id. Ids are arbitrary (not contiguous, not sorted, any order in the
batch); groups are found with ``torch.unique`` and reduced with ``index_add_``, never with a
Python loop. With ``R_i`` the reward of sequence i, ``g(i)`` its group, ``n_g`` the group size,
``mean_g`` the group mean and ``std_g`` the unbiased group standard deviation:

    grpo:                  (R_i - mean_g) / (std_g + eps)           GRPO (arXiv:2402.03300), verl
    dr_grpo (= rpg):       R_i - mean_g                             Dr.GRPO (arXiv:2503.20783);
                                                                    RPG's ``adv_estimator=rpg``
    rloo:                  R_i - (sum_g R - R_i) / (n_g - 1)        RLOO (arXiv:2402.14740)
                           = n_g / (n_g - 1) * (R_i - mean_g)
    rpg_batchmean:         R_i - mean_batch                         RPG's ``rpg_batchmean``
    reinforce_pp:          (R_i - mean_batch) / (std_batch + eps)   REINFORCE++ (arXiv:2501.03262)
    reinforce_pp_baseline: x_i = R_i - mean_g, then (x_i - mean_batch(x)) / (std_batch(x) + eps)

The batch-level estimators (``reinforce_pp*``, ``rpg_batchmean``) must see the global batch (all
data-parallel ranks' rewards); the group estimators need every group whole. Rewards are tiny
([B] scalars), so the trainer computes advantages once on the gathered rewards.

Host syncs: ``torch.unique`` has a data-dependent output size, so every group estimator syncs once
on GPU. ``grpo`` (with ``normalize_std=True``) and ``rloo`` need at least 2 samples per group and
always check it (one more sync): a group of one has no standard deviation and no leave-one-out
baseline, and silently substituting one (verl uses mean 0 and std 1) would train on the raw
reward. ``validate=True`` adds the finiteness check of ``rewards`` (one sync).

Differences from verl's ``core_algos.py`` (all ``with torch.no_grad()`` Python loops there):
    * a group of one gets mean_g = R_i (advantage 0 for dr_grpo / reinforce_pp_baseline); verl
      sets mean 0 (advantage R_i) and, for grpo/rloo, we raise instead (see above);
    * REINFORCE++ whitening: verl applies ``masked_whiten`` over *tokens* (each sequence weighted
      by its response length, unbiased variance, ``(x - mean) * rsqrt(var + 1e-8)``); OpenRLHF
      does the same with the biased variance and ``rsqrt(clamp(var, 1e-8))``. We normalise per
      sequence by default; pass ``token_counts`` to weight sequences by their response length,
      which reproduces verl's statistics exactly (only the ``eps`` placement differs, O(eps)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_empg.core.checks import check_finite, check_same_shape

ADVANTAGE_EPS = 1e-6
"""Added to the standard deviation before dividing (verl's ``epsilon``; keeps a group whose
samples all got the same reward at advantage 0 instead of 0/0)."""

AdvantageEstimator = Callable[..., Tensor]
"""``fn(rewards [B], group_ids [B] | None, *, validate: bool = True) -> advantages [B]``."""

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
"""Registry: estimator name -> function. Bind extra keyword arguments with ``functools.partial``."""


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding ``fn`` to ``ADVANTAGE_ESTIMATORS`` under ``name``.

    Registering a different function under a taken name raises ValueError.
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if ADVANTAGE_ESTIMATORS.get(name, fn) is not fn:
            raise ValueError(f"advantage estimator name {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ValueError listing the valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


# --------------------------------------------------------------------------------------------
# Group helpers (vectorised: unique + index_add_, no loop over groups, no .item()).


def _work_dtype(rewards: Tensor) -> torch.dtype:
    """float32 at least: bf16/fp16 rewards would round the group statistics."""
    return torch.promote_types(rewards.dtype, torch.float32)


def _check_inputs(rewards: Tensor, group_ids: Tensor | None, validate: bool, eps: float = ADVANTAGE_EPS) -> None:
    if not rewards.is_floating_point() or rewards.dim() != 1:
        raise ValueError(
            f"rewards must be a 1-D float tensor [B], got shape {tuple(rewards.shape)} and dtype {rewards.dtype}"
        )
    if group_ids is not None:
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor [B], got dtype {group_ids.dtype}")
        check_same_shape(rewards=rewards, group_ids=group_ids)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")
    if validate:
        check_finite(rewards=rewards)


def _check_token_counts(token_counts: Tensor, rewards: Tensor, validate: bool) -> None:
    if token_counts.is_floating_point() or token_counts.dtype == torch.bool:
        raise ValueError(f"token_counts must be an integer tensor [B], got dtype {token_counts.dtype}")
    check_same_shape(rewards=rewards, token_counts=token_counts)
    if validate:
        ok = torch.stack([(token_counts >= 0).all(), token_counts.sum() >= 2]).tolist()  # one sync
        if not all(ok):
            raise ValueError("token_counts must be >= 0 and sum to at least 2")


def _groups(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(unique_ids [N], inverse [B] in [0, N), counts [N] int64)`` for N groups; syncs on GPU."""
    unique_ids, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return unique_ids, inverse, counts


def _group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Per-group sums of ``values`` [B] -> [N]."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, inverse, values)


def _require_group_size(unique_ids: Tensor, counts: Tensor, estimator: str) -> None:
    """ValueError naming ``group_ids`` and the first group with fewer than 2 samples (one sync)."""
    too_small = counts < 2  # [N]
    if bool(too_small.any()):  # host sync; the error needs the offending id anyway
        bad_id = unique_ids[too_small][0].tolist()
        raise ValueError(
            f"group_ids: group {bad_id} has a single sample, but {estimator} needs at least 2 "
            "samples per group (sample several responses per prompt, or use rpg_batchmean / "
            "reinforce_pp, which need no groups)"
        )


def _centered_by_group(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(R - mean_g [B], inverse [B], counts [N], unique_ids [N])`` in the working dtype."""
    rewards = rewards.to(_work_dtype(rewards))
    unique_ids, inverse, counts = _groups(group_ids)
    group_mean = _group_sum(rewards, inverse, len(counts)) / counts.to(rewards.dtype)  # [N]
    return rewards - group_mean[inverse], inverse, counts, unique_ids  # [B]


def _whiten(values: Tensor, token_counts: Tensor | None, eps: float) -> Tensor:
    """``(x - mean_w) / (std_w + eps)`` over the batch, weights ``w`` = token_counts or 1 [B].

    ``std_w`` is unbiased in the number of weighted units: ``sum w (x - mean_w)^2 / (sum w - 1)``,
    i.e. the unbiased std over tokens when ``w`` counts response tokens (verl's masked_whiten).
    """
    if token_counts is None:
        weights = torch.ones_like(values)
    else:
        weights = token_counts.to(values.dtype)  # [B]
    total = weights.sum()
    mean = (weights * values).sum() / total
    centered = values - mean  # [B]
    var = (weights * centered.square()).sum() / (total - 1)
    return centered / (var.sqrt() + eps)


# --------------------------------------------------------------------------------------------
# Estimators.


@register_advantage_estimator("grpo")
def grpo(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = ADVANTAGE_EPS,
    validate: bool = True,
) -> Tensor:
    """GRPO advantages ``(R_i - mean_g) / (std_g + eps)`` (arXiv:2402.03300; verl ``grpo``).

    ``std_g`` is the unbiased (n_g - 1) standard deviation, as ``torch.std`` in verl and ema-pg.
    With ``normalize_std=False`` this is ``R_i - mean_g``: Dr.GRPO (arXiv:2503.20783) and RPG's
    ``rpg`` estimator (arXiv:2505.17508).

    Args:
        rewards: [B] one reward per sequence (any float dtype; computed in float32 at least).
        group_ids: [B] integer, equal for samples of the same prompt; arbitrary values and order.
        normalize_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std before dividing.
        validate: check that ``rewards`` is finite (one host sync).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).

    Raises:
        ValueError: naming ``group_ids`` and a group of size 1, whose advantage would be
            identically 0 (always checked: one host sync).
    """
    _check_inputs(rewards, group_ids, validate, eps)
    centered, inverse, counts, unique_ids = _centered_by_group(rewards, group_ids)
    _require_group_size(unique_ids, counts, "grpo" if normalize_std else "dr_grpo")
    if not normalize_std:
        return centered
    var = _group_sum(centered.square(), inverse, len(counts)) / (counts - 1).to(centered.dtype)
    return centered / (var.sqrt()[inverse] + eps)  # [B]


@register_advantage_estimator("dr_grpo")
def dr_grpo(rewards: Tensor, group_ids: Tensor, *, validate: bool = True) -> Tensor:
    """Dr.GRPO advantages ``R_i - mean_g`` (arXiv:2503.20783): ``grpo(normalize_std=False)``.

    Sums to 0 over each group; a group of size 1 raises (see ``grpo``).

    Args:
        rewards: [B] one reward per sequence.
        group_ids: [B] integer group ids (see ``grpo``).
        validate: check that ``rewards`` is finite (one host sync).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).
    """
    return grpo(rewards, group_ids, normalize_std=False, validate=validate)


@register_advantage_estimator("rpg")
def rpg_group_mean(rewards: Tensor, group_ids: Tensor, *, validate: bool = True) -> Tensor:
    """RPG's ``adv_estimator=rpg`` (arXiv:2505.17508, docs/design/rpg.md section 6): ``R_i - mean_g``.

    Equal to ``dr_grpo`` except that, as in the RPG code, a group of size 1 is not an error: its
    baseline is 0, so its advantage is its reward.

    Args:
        rewards: [B] one reward per sequence.
        group_ids: [B] integer group ids (see ``grpo``).
        validate: check that ``rewards`` is finite (one host sync).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).
    """
    _check_inputs(rewards, group_ids, validate)
    centered, inverse, counts, _ = _centered_by_group(rewards, group_ids)
    singleton = (counts == 1)[inverse]  # [B]
    return torch.where(singleton, rewards.to(centered.dtype), centered)


@register_advantage_estimator("rloo")
def rloo(rewards: Tensor, group_ids: Tensor, *, validate: bool = True) -> Tensor:
    """RLOO advantages ``R_i - (sum_g R - R_i) / (n_g - 1)`` (arXiv:2402.14740; verl ``rloo``).

    Computed as the equal ``n_g / (n_g - 1) * (R_i - mean_g)``.

    Args:
        rewards: [B] one reward per sequence.
        group_ids: [B] integer group ids (see ``grpo``).
        validate: check that ``rewards`` is finite (one host sync).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).

    Raises:
        ValueError: naming ``group_ids`` and a group of size 1 (always checked: one host sync).
    """
    _check_inputs(rewards, group_ids, validate)
    centered, inverse, counts, unique_ids = _centered_by_group(rewards, group_ids)
    _require_group_size(unique_ids, counts, "rloo")
    n = counts.to(centered.dtype)  # [N]
    return centered * (n / (n - 1))[inverse]  # [B]


@register_advantage_estimator("rpg_batchmean")
def rpg_batchmean(rewards: Tensor, group_ids: Tensor | None = None, *, validate: bool = True) -> Tensor:
    """``R_i - mean_batch R`` (RPG's ``rpg_batchmean``, arXiv:2505.17508). Sums to 0 over the batch.

    Args:
        rewards: [B] one reward per sequence, the global batch.
        group_ids: [B] integer or None; unused (kept for the registry's common signature).
        validate: check that ``rewards`` is finite (one host sync).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).
    """
    _check_inputs(rewards, group_ids, validate)
    rewards = rewards.to(_work_dtype(rewards))
    return rewards - rewards.mean()


@register_advantage_estimator("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    baseline: bool = False,
    token_counts: Tensor | None = None,
    eps: float = ADVANTAGE_EPS,
    validate: bool = True,
) -> Tensor:
    """REINFORCE++ advantages: batch whitening of the reward (arXiv:2501.03262).

    ``baseline=False`` (verl ``reinforce_plus_plus``, OpenRLHF ``reinforce``; outcome reward,
    gamma = 1, so every token's return is R_i)::

        A_i = (R_i - mean_batch R) / (std_batch R + eps)

    ``baseline=True`` (verl ``reinforce_plus_plus_baseline``, OpenRLHF ``reinforce_baseline``):
    subtract the group mean first, then whiten over the batch::

        x_i = R_i - mean_g;   A_i = (x_i - mean_batch x) / (std_batch x + eps)

    (with unweighted statistics ``mean_batch x`` is exactly 0; with ``token_counts`` it is not,
    and verl subtracts it too). ``std_batch`` is unbiased. The mean and std are over sequences, or,
    with ``token_counts``, over tokens (sequence i counted ``token_counts[i]`` times) as verl's
    ``masked_whiten`` does.

    Args:
        rewards: [B] one reward per sequence, the global batch.
        group_ids: [B] integer group ids; required with ``baseline=True``, otherwise unused.
        baseline: subtract the group mean before whitening.
        token_counts: [B] integer response lengths (>= 0, summing to >= 2), or None for
            per-sequence statistics.
        eps: added to the std before dividing.
        validate: check that ``rewards`` is finite and ``token_counts`` valid (host syncs).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).
    """
    if baseline and group_ids is None:
        raise ValueError("group_ids is required with baseline=True (the group mean is subtracted)")
    _check_inputs(rewards, group_ids, validate, eps)
    if token_counts is None:
        if rewards.numel() < 2:
            raise ValueError(f"rewards has {rewards.numel()} element(s); a batch std needs >= 2")
    else:
        _check_token_counts(token_counts, rewards, validate)
    if baseline:
        values = _centered_by_group(rewards, group_ids)[0]
    else:
        values = rewards.to(_work_dtype(rewards))
    return _whiten(values, token_counts, eps)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    token_counts: Tensor | None = None,
    eps: float = ADVANTAGE_EPS,
    validate: bool = True,
) -> Tensor:
    """REINFORCE++-baseline: group mean subtracted, then batch whitening (``reinforce_pp``).

    Args:
        rewards: [B] one reward per sequence, the global batch.
        group_ids: [B] integer group ids (see ``grpo``).
        token_counts: [B] integer response lengths, or None (see ``reinforce_pp``).
        eps: added to the std before dividing.
        validate: check that ``rewards`` is finite and ``token_counts`` valid (host syncs).

    Returns:
        [B] advantages, float32 (float64 for float64 rewards).
    """
    return reinforce_pp(rewards, group_ids, baseline=True, token_counts=token_counts, eps=eps, validate=validate)


# --------------------------------------------------------------------------------------------
# Sequence -> token broadcast.


def token_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Broadcast per-sequence advantages over the sequence's tokens, 0 where masked.

    Args:
        advantages: [B] one advantage per sequence.
        loss_mask: [B, S] bool, True on response tokens that train.

    Returns:
        [B, S] ``advantages[b]`` where ``loss_mask[b, s]``, else 0 (dtype of ``advantages``).
    """
    if loss_mask.dtype != torch.bool or loss_mask.dim() != 2:
        raise ValueError(
            f"loss_mask must be a [B, S] bool tensor, got shape {tuple(loss_mask.shape)} and dtype {loss_mask.dtype}"
        )
    if advantages.dim() != 1 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"advantages must be [B] with B = loss_mask.shape[0] = {loss_mask.shape[0]}, "
            f"got shape {tuple(advantages.shape)}"
        )
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(loss_mask, advantages[:, None], zero)  # [B, S]
