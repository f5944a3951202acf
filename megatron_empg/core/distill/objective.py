"""The distillation term of the update objective, from per-token values (``losses.distill_values``).

verl's two forms (``use_policy_gradient``), with v the clamped per-token values:

    policy gradient   l = PPO-clip(log pi, log pi_old, A = -sg(v))   (verl's "vanilla": clip 0.2/0.2,
                                                                      dual-clip c = 3), the published
                                                                      recipe with k1 (Thinking Machines)
    direct            l = v                                          (GKD: k3 or forward_kl_topk)

then ``aggregate(l, mask, agg_mode)``: a ``LossSum`` with the policy loss's count, so that the two
add (``parallel.rl_loss``): loss = [rl if use_task_rewards] + coef * distill, coef 1 without task
rewards (verl's ``distillation_loss_coef`` applies only alongside them).
"""

from __future__ import annotations

from torch import Tensor

from megatron_empg.core.aggregation import LossSum, aggregate
from megatron_empg.core.policy_loss import ppo_clip_loss


def distill_objective(
    values: Tensor,
    loss_mask: Tensor,
    *,
    use_policy_gradient: bool,
    logprobs: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_c: float | None = 3.0,
    weights: Tensor | None = None,
    agg_mode: str = "token-mean",
    seq_ids: Tensor | None = None,
    validate: bool = True,
    **split,
) -> LossSum:
    """The distillation term as (sum, count).

    Args:
        values: [B, S] float32 per-token distillation losses (carrying the gradient for the direct form).
        loss_mask: [B, S] bool.
        use_policy_gradient: -sg(values) is the advantage of a PPO-clip loss on ``logprobs``
            (then ``logprobs`` and ``old_logprobs`` [B, S] are required); else ``values`` is the loss.
        clip_eps_low, clip_eps_high, clip_c: the PPO-clip constants (``core.policy_loss``).
        weights: [B, S] behaviour-policy weights of the sampled-token loss (``core.behavior_is``) or None.
        agg_mode, seq_ids, split: as ``core.aggregation.aggregate``.

    Returns:
        ``LossSum``; ``loss_sum`` carries the gradient.
    """
    if use_policy_gradient:
        if logprobs is None or old_logprobs is None:
            raise ValueError("use_policy_gradient needs logprobs and old_logprobs")
        per_token = ppo_clip_loss(
            logprobs,
            old_logprobs,
            -values.detach(),
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            clip_c=clip_c,
            validate=validate,
        ).values
    else:
        per_token = values
    if weights is not None:
        per_token = per_token * weights
    return aggregate(per_token, loss_mask, agg_mode, seq_ids, **split)
