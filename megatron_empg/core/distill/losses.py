"""Per-token distillation losses against a frozen teacher, registered by name (``DISTILL_LOSSES``).

The names and meanings are verl's (``verl/trainer/distillation/losses.py``). With s = log pi_student(y)
and t = log pi_teacher(y) at the sampled token y ~ pi_student (``logprobs``, ``teacher_logprobs``):

    name              kind       value per token                                    E_y[value]
    k1, kl            estimator  s - t                                              KL(student || teacher)
    abs               estimator  |s - t|                                            -
    k2, mse           estimator  (s - t)^2 / 2                                      -
    k3, low_var_kl    estimator  clamp(e^d - d - 1, +-10), d = clamp(t - s, +-20)   KL(student || teacher)
    forward_kl_topk   topk       max(0, sum_{j in q} e^{t_j} (t_j - s_j))           KL(teacher || student) over q

For ``forward_kl_topk`` q is the teacher's top-k at the position, and s_j, t_j are both first
clamped from below at ``log_prob_min_clamp`` (verl's ``log_prob_min_clamp``; None: no clamp). The
clamp at 0 is verl's: over a top-k subset the sum need not be >= 0.

Every value carries the gradient of s (the student's log-probs at the sampled token, or at q); the
teacher's log-probs are constants. ``distill_values`` returns [*] in float32 (float64 inputs: float64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_empg.core.checks import check_finite, check_same_shape
from megatron_empg.core.kl import sampled_kl


@dataclasses.dataclass(frozen=True)
class DistillLoss:
    """One registered distillation loss.

    Attributes:
        name: the user-facing name (``algorithm.distill.loss``).
        topk: whether it needs the teacher's top-k ids and log-probs (and the student's at them);
            else it reads the sampled token's log-probs only (a single-sample estimator).
        fn: the per-token function: an estimator (s [*], t [*]) -> [*], or the Top-k one
            (s_q [*, K], t_q [*, K], log_prob_min_clamp) -> [*].
        reverse_kl_unbiased: whether E[value] over the student's samples is KL(student || teacher)
            (k1, k3), so that the mean of the values estimates the reverse KL without bias.
    """

    name: str
    topk: bool
    fn: Callable[..., Tensor]
    reverse_kl_unbiased: bool = False


def _k1(s: Tensor, t: Tensor) -> Tensor:
    return sampled_kl(s, t, estimator="k1", validate=False)


def _abs(s: Tensor, t: Tensor) -> Tensor:
    return (s - t.detach()).abs()


def _k2(s: Tensor, t: Tensor) -> Tensor:
    return sampled_kl(s, t, estimator="k2", validate=False)


def _k3(s: Tensor, t: Tensor) -> Tensor:
    return sampled_kl(s, t, estimator="k3", validate=False)


def _at_least_fp32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def forward_kl_topk(head_logprobs: Tensor, teacher_head_logprobs: Tensor, log_prob_min_clamp: float | None) -> Tensor:
    """max(0, sum_j p_t(j) (log p_t(j) - log p_s(j))) over the teacher's top-k q.

    Args:
        head_logprobs: [*, K] float32 log pi_student at q (carries the gradient).
        teacher_head_logprobs: [*, K] float32 log pi_teacher at q (a constant).
        log_prob_min_clamp: lower clamp of both before the sum (< 0), or None.

    Returns:
        [*] float32 (float64 for float64 inputs).
    """
    s, t = _at_least_fp32(head_logprobs), _at_least_fp32(teacher_head_logprobs.detach())
    if log_prob_min_clamp is not None:
        s, t = s.clamp_min(log_prob_min_clamp), t.clamp_min(log_prob_min_clamp)
    return (t.exp() * (t - s)).sum(-1).clamp_min(0.0)


DISTILL_LOSSES: dict[str, DistillLoss] = {
    **{name: DistillLoss(name, False, _k1, True) for name in ("k1", "kl")},
    "abs": DistillLoss("abs", False, _abs),
    **{name: DistillLoss(name, False, _k2) for name in ("k2", "mse")},
    **{name: DistillLoss(name, False, _k3, True) for name in ("k3", "low_var_kl")},
    "forward_kl_topk": DistillLoss("forward_kl_topk", True, forward_kl_topk),
}
# k1's gradient does not depend on the teacher (grad (s - t) = grad s): it is an advantage only.
ADVANTAGE_ONLY = ("k1", "kl")


def distill_values(
    loss: DistillLoss,
    *,
    logprobs: Tensor,
    teacher_logprobs: Tensor | None = None,
    head_logprobs: Tensor | None = None,
    teacher_head_logprobs: Tensor | None = None,
    log_prob_min_clamp: float | None = None,
    loss_max_clamp: float | None = None,
    validate: bool = True,
) -> Tensor:
    """Per-token distillation loss, then verl's ``clamp(value, -loss_max_clamp, loss_max_clamp)``.

    Args:
        loss: a ``DistillLoss`` (a value of ``DISTILL_LOSSES``).
        logprobs: [*] log pi_student at the sampled tokens (an estimator's input; shape reference).
        teacher_logprobs: [*] log pi_teacher at them (estimators).
        head_logprobs, teacher_head_logprobs: [*, K] both at the teacher's top-k (``topk`` losses).
        log_prob_min_clamp: the Top-k loss's lower clamp of the log-probs (< 0) or None.
        loss_max_clamp: > 0, or None (no clamp).
        validate: check the inputs for NaN/inf (one host sync).

    Returns:
        [*] float32, carrying the gradient of the student's log-probs.
    """
    if loss.topk:
        if head_logprobs is None or teacher_head_logprobs is None:
            raise ValueError(f"loss={loss.name!r} needs head_logprobs and teacher_head_logprobs")
        check_same_shape(head_logprobs=head_logprobs, teacher_head_logprobs=teacher_head_logprobs)
        if head_logprobs.shape[:-1] != logprobs.shape:
            raise ValueError(
                f"head_logprobs {tuple(head_logprobs.shape)} do not extend logprobs {tuple(logprobs.shape)}"
            )
        if validate:
            check_finite(head_logprobs=head_logprobs, teacher_head_logprobs=teacher_head_logprobs)
        values = loss.fn(head_logprobs, teacher_head_logprobs, log_prob_min_clamp)
    else:
        if teacher_logprobs is None:
            raise ValueError(f"loss={loss.name!r} needs teacher_logprobs")
        check_same_shape(logprobs=logprobs, teacher_logprobs=teacher_logprobs)
        if validate:
            check_finite(logprobs=logprobs, teacher_logprobs=teacher_logprobs)
        values = loss.fn(_at_least_fp32(logprobs), _at_least_fp32(teacher_logprobs))
    if loss_max_clamp is not None:
        values = values.clamp(-loss_max_clamp, loss_max_clamp)
    return values


def topk_agreement(student_top1: Tensor, teacher_topk_ids: Tensor) -> Tensor:
    """[*] float32 1.0 where the student's top-1 id [*] equals the teacher's ([*, K], descending:
    its first id), else 0.0."""
    return (student_top1 == teacher_topk_ids[..., 0]).to(torch.float32)
