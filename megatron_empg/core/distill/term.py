"""The distillation term of the update objective, bound once from ``algorithm.distill``.

    term = DistillTerm.bind("k1", topk=128, use_policy_gradient=True, ...)   # ValueError if unknown
    ids = term.gather_ids(batch)                # [*, K] the teacher's top-k (a Top-k loss), or None
    out = term(head, logprobs, batch, ...)      # DistillOut(loss=LossSum, metrics={"distill/kl": ...})

The update pass (``parallel.rl_loss``) gathers the student's log-probs at ``gather_ids`` together
with its own ids and calls the term; the teacher pass (``trainer``) fills ``batch.teacher_*``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_empg.core.aggregation import LossSum, aggregate
from megatron_empg.core.checks import check_choice
from megatron_empg.core.distill.losses import DISTILL_LOSSES, DistillLoss, distill_values, topk_agreement
from megatron_empg.core.distill.objective import distill_objective
from megatron_empg.core.microbatch import MicroBatch


class DistillOut(NamedTuple):
    """``loss``: the distillation term (sum, count), carrying the gradient, before ``coef``;
    ``metrics``: name -> token-mean ``LossSum`` of detached per-token values."""

    loss: LossSum
    metrics: dict[str, LossSum]


@dataclasses.dataclass(frozen=True)
class DistillTerm:
    """A run's distillation term (``bind``); see ``config.distill.DistillConfig`` for the fields.

    ``coef`` is the weight of the term in the objective (1 without task rewards); ``weighted``:
    whether the behaviour-policy weights multiply it (an expectation over the sampled token: the
    policy-gradient form and the single-sample estimators; not a direct Top-k loss, an exact sum
    at the position); ``teacher_k``: the top-k the teacher pass computes: the loss's ``topk`` for
    a Top-k loss, else 1 (the metrics' top-1 and its mass; [tokens, topk] per step would cost the
    micro-batches 12 bytes x topk per token for two metrics).
    """

    loss: DistillLoss
    teacher_k: int
    use_policy_gradient: bool
    use_task_rewards: bool
    coef: float
    loss_max_clamp: float | None
    log_prob_min_clamp: float | None
    clip: dict
    weighted: bool

    @classmethod
    def bind(
        cls,
        name: str,
        *,
        topk: int,
        use_policy_gradient: bool = True,
        use_task_rewards: bool = True,
        coef: float = 1.0,
        loss_max_clamp: float | None = 10.0,
        log_prob_min_clamp: float | None = -10.0,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        clip_c: float | None = 3.0,
    ) -> DistillTerm:
        """The term of loss ``name`` (a key of ``DISTILL_LOSSES``); ValueError naming ``loss``."""
        check_choice("loss", name, DISTILL_LOSSES)
        loss = DISTILL_LOSSES[name]
        return cls(
            loss,
            topk if loss.topk else 1,
            use_policy_gradient,
            use_task_rewards,
            coef if use_task_rewards else 1.0,
            loss_max_clamp,
            log_prob_min_clamp,
            {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high, "clip_c": clip_c},
            use_policy_gradient or not loss.topk,
        )

    def gather_ids(self, batch: MicroBatch) -> Tensor | None:
        """[*, K] int64 ids at which the update pass gathers the student's log-probs (the
        teacher's top-k, for a Top-k loss), or None. Raises ValueError naming what ``batch`` lacks."""
        if batch.teacher_logprobs is None or batch.teacher_topk_ids is None or batch.teacher_topk_logprobs is None:
            raise ValueError("distillation needs batch.teacher_logprobs, teacher_topk_ids and teacher_topk_logprobs")
        return batch.teacher_topk_ids if self.loss.topk else None

    def __call__(
        self,
        head_logprobs: Tensor | None,
        logprobs: Tensor,
        batch: MicroBatch,
        *,
        weights: Tensor | None = None,
        agg_mode: str = "token-mean",
        split: dict | None = None,
        validate: bool = True,
    ) -> DistillOut:
        """The term from the student's log-probs at ``gather_ids`` (``head_logprobs`` [B, S, K] or
        None) and at the targets (``logprobs`` [B, S], both carrying the gradient), and ``batch``'s
        teacher and old log-probs; ``weights`` [B, S] the behaviour weights or None."""
        mask = batch.loss_mask
        raw = distill_values(
            self.loss,
            logprobs=logprobs,
            teacher_logprobs=batch.teacher_logprobs,
            head_logprobs=head_logprobs,
            teacher_head_logprobs=batch.teacher_topk_logprobs,
            log_prob_min_clamp=self.log_prob_min_clamp,
            validate=validate,
        )  # [B, S]
        values = raw if self.loss_max_clamp is None else raw.clamp(-self.loss_max_clamp, self.loss_max_clamp)
        out = distill_objective(
            values,
            mask,
            use_policy_gradient=self.use_policy_gradient,
            logprobs=logprobs,
            old_logprobs=batch.old_logprobs,
            weights=weights if self.weighted else None,
            agg_mode=agg_mode,
            seq_ids=batch.seq_ids,
            validate=validate,
            **self.clip,
            **(split or {}),
        )
        mass = batch.teacher_topk_logprobs.exp().sum(-1)  # [B, S]
        metrics = {
            "distill/kl": aggregate(raw.detach(), mask),
            "distill/loss": LossSum(out.loss_sum.detach(), out.count),
            "distill/teacher_topk_mass": aggregate(mass, mask),
        }
        if batch.student_top1 is not None:
            metrics["distill/top1_agreement"] = aggregate(
                topk_agreement(batch.student_top1, batch.teacher_topk_ids), mask
            )
        return DistillOut(out, metrics)


def zero_like(total: LossSum) -> LossSum:
    """``total``'s count with a zero sum (pure distillation drops the task-reward loss)."""
    return LossSum(torch.zeros_like(total.loss_sum), total.count)
