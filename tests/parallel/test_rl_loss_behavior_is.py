"""``parallel.rl_loss`` with ``MicroBatch.behavior_weights`` (``core.behavior_is``), one process.

Weights of 1 give the unweighted loss, metrics and gradient bit for bit. Given weights w, the loss
and its gradient equal a full-vocabulary reference (as in test_rl_loss.py) that multiplies by w
every per-token term whose expectation is over the sampled token (the policy loss, a sampled
KL, an RPG penalty, the corrected GRPO KL, the Top-k KL's tail) and leaves the Top-k head and
the entropy unweighted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.core.aggregation import aggregate
from megatron_empg.core.behavior_is import behavior_weights
from megatron_empg.core.kl import importance_weight, sampled_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.policy_loss import ppo_clip_loss
from megatron_empg.core.rpg import corrected_grpo_kl, rpg_kl_penalty, rpg_reinforce_clip_loss
from megatron_empg.core.topk_kl import topk_kl_from_logprobs
from megatron_empg.parallel.rl_loss import rl_loss

B, S, V, K = 3, 6, 29, 4

CASES = {
    "ppo_k3_entropy": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2},
        kl="k3",
        kl_coef=0.1,
        entropy_coef=0.01,
        agg_mode="token-mean",
    ),
    "dualclip_k1_iw_seqmean": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 3.0},
        kl="k1",
        kl_coef=0.05,
        kl_args={"importance_weight": True},
        agg_mode="seq-mean-token-mean",
    ),
    "topk_reverse_iw_entropy": dict(
        policy_loss="ppo_clip",
        kl="topk",
        kl_coef=0.2,
        entropy_coef=0.02,
        kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
        agg_mode="token-mean",
    ),
    "topk_forward_reference_seqsum": dict(
        policy_loss="ppo_clip",
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "forward", "tail_grad": "reference"},
        agg_mode="seq-mean-token-sum",
    ),
    "rpg_urkl": dict(policy_loss="ppo_clip", kl="rpg_urkl", kl_coef=0.1, agg_mode="token-mean"),
    "grpo_corrected_seqsum": dict(
        policy_loss="ppo_clip",
        kl="grpo_corrected",
        kl_coef=0.2,
        agg_mode="seq-mean-token-sum",
    ),
    "rpg_reinforce_clip_no_kl": dict(
        policy_loss="rpg_reinforce_clip",
        policy_loss_args={"divergence": "ufkl", "beta": 0.1},
        log_entropy=False,
        agg_mode="token-mean",
    ),
}


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, MicroBatch]:
    """(logits [B, S, V] float32, a padded batch without weights)."""
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(B, S, V, generator=g)
    log_p = torch.log_softmax(logits, -1)
    target = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.8
    mask[2, 4:] = False
    old = log_p.gather(-1, target[..., None])[..., 0] + 0.3 * torch.randn(B, S, generator=g)
    anchor_log_p = torch.log_softmax(logits + 0.5 * torch.randn(B, S, V, generator=g), -1)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    topk_ids[0, :3, 0] = target[0, :3]  # some sampled tokens inside the index set: no tail there
    sampler = old + 0.6 * torch.randn(B, S, generator=g)
    batch = MicroBatch(
        input_ids=target,
        target_ids=target,
        loss_mask=mask,
        advantages=torch.randn(B, S, generator=g),
        sampler_logprobs=torch.where(mask, sampler, 0.0),
        old_logprobs=old,
        anchor_logprobs=anchor_log_p.gather(-1, target[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_anchor_logprobs=anchor_log_p.gather(-1, topk_ids),
    )
    return logits, batch


def _weights(batch: MicroBatch) -> torch.Tensor:
    """MIS weights of the batch: some tokens rejected (0), the rest at ratios other than 1."""
    weights = behavior_weights(batch.old_logprobs, batch.sampler_logprobs, batch.loss_mask, "mis", 2.0)
    on_mask = weights[batch.loss_mask]
    assert (on_mask == 0).any() and ((on_mask - 1).abs() > 0.1).sum() >= 4
    return weights


def _ours(logits: torch.Tensor, batch: MicroBatch, case: dict) -> dict:
    leaf = logits.clone().requires_grad_(True)
    out = rl_loss(leaf, batch, vocab_start=0, vocab_size=V, tp_group=None, chunk_size=4, **case)
    (grad,) = torch.autograd.grad(out.loss.loss_sum, leaf)
    metrics = {name: m.loss_sum for name, m in out.metrics.items()}
    return {"loss_sum": out.loss.loss_sum.detach(), "count": out.loss.count, "metrics": metrics, "grad": grad}


def _reference(logits: torch.Tensor, batch: MicroBatch, case: dict, weights: torch.Tensor) -> dict:
    """The objective from the full log-softmax, each sampled-token term multiplied by ``weights``."""
    leaf = logits.clone().requires_grad_(True)
    log_p = torch.log_softmax(leaf, -1)
    logprobs = log_p.gather(-1, batch.target_ids[..., None])[..., 0]
    mask, mode, old = batch.loss_mask, case["agg_mode"], batch.old_logprobs
    loss_fn = {"ppo_clip": ppo_clip_loss, "rpg_reinforce_clip": rpg_reinforce_clip_loss}[case["policy_loss"]]
    pg = loss_fn(logprobs, old, batch.advantages, **case.get("policy_loss_args", {}))
    total = aggregate(pg.values * weights, mask, mode)
    loss_sum, metrics = total.loss_sum, {"policy_loss": total.loss_sum.detach()}
    kl_args = dict(case.get("kl_args", {}))
    use_iw = kl_args.pop("importance_weight", False)
    kl = case.get("kl")
    if kl == "topk":  # head + w * s * tail, from the unweighted pieces
        head = log_p.gather(-1, batch.topk_ids)
        in_head = (batch.topk_ids == batch.target_ids[..., None]).any(-1)
        pieces = topk_kl_from_logprobs(
            head, batch.topk_anchor_logprobs, logprobs, batch.anchor_logprobs, in_head, **kl_args
        )
        iw = importance_weight(logprobs, old) if use_iw else 1.0
        kl_values = pieces.head + weights * iw * pieces.tail
    elif kl == "grpo_corrected":
        kl_values = weights * corrected_grpo_kl(logprobs, old, batch.anchor_logprobs, **kl_args)
    elif kl == "rpg_urkl":
        kl_values = weights * rpg_kl_penalty(logprobs, batch.anchor_logprobs, divergence="urkl", **kl_args)
    elif kl is not None:
        kl_values = weights * sampled_kl(
            logprobs, batch.anchor_logprobs, estimator=kl, old_logprobs=old if use_iw else None, **kl_args
        )
    if kl is not None:
        loss_sum = loss_sum + case["kl_coef"] * aggregate(kl_values, mask, mode).loss_sum
        metrics["kl"] = aggregate(kl_values.detach(), mask).loss_sum
    entropy = -(log_p.exp() * log_p).sum(-1)
    if case.get("entropy_coef", 0) > 0:
        loss_sum = loss_sum - case["entropy_coef"] * aggregate(entropy, mask, mode).loss_sum
    if case.get("log_entropy", True):
        metrics["entropy"] = aggregate(entropy.detach(), mask).loss_sum
    (grad,) = torch.autograd.grad(loss_sum, leaf)
    return {"loss_sum": loss_sum.detach(), "count": total.count, "metrics": metrics, "grad": grad}


@pytest.mark.parametrize("name", list(CASES))
def test_weights_of_one_change_nothing_bit_for_bit(inputs, name):
    logits, batch = inputs
    plain = _ours(logits, batch, CASES[name])
    ones = _ours(logits, dataclasses.replace(batch, behavior_weights=torch.ones(B, S)), CASES[name])
    assert torch.equal(ones["loss_sum"], plain["loss_sum"]) and torch.equal(ones["count"], plain["count"])
    assert torch.equal(ones["grad"], plain["grad"])
    assert ones["metrics"].keys() == plain["metrics"].keys()
    for metric, value in plain["metrics"].items():
        assert torch.equal(ones["metrics"][metric], value), metric


@pytest.mark.parametrize("name", list(CASES))
def test_weights_multiply_the_sampled_token_terms(inputs, name):
    logits, batch = inputs
    weights = _weights(batch)
    ours = _ours(logits, dataclasses.replace(batch, behavior_weights=weights), CASES[name])
    ref = _reference(logits, batch, CASES[name], weights)
    # fp32, the same math in another order (chunked log-probs): a few ulps
    tol = dict(rtol=1e-5, atol=5e-6)
    assert torch.equal(ours["count"], ref["count"])
    torch.testing.assert_close(ours["loss_sum"], ref["loss_sum"], **tol)
    torch.testing.assert_close(ours["grad"], ref["grad"], **tol)
    for metric, value in ref["metrics"].items():
        torch.testing.assert_close(ours["metrics"][metric], value, **tol, msg=lambda m: f"metric {metric}: {m}")
    # the weights matter: the unweighted loss is elsewhere
    plain = _ours(logits, batch, CASES[name])
    assert (ours["loss_sum"] - plain["loss_sum"]).abs() > 1e-3


def test_topk_head_and_entropy_are_not_weighted(inputs):
    """Against the Top-k pieces: the KL is head + w * s * tail, not w * (head + s * tail); the
    entropy metric does not move."""
    logits, batch = inputs
    case = CASES["topk_reverse_iw_entropy"]
    weights = _weights(batch)
    ours = _ours(logits, dataclasses.replace(batch, behavior_weights=weights), case)
    plain = _ours(logits, batch, case)
    assert torch.equal(ours["metrics"]["entropy"], plain["metrics"]["entropy"])
    log_p = torch.log_softmax(logits, -1)
    logprobs = log_p.gather(-1, batch.target_ids[..., None])[..., 0]
    in_head = (batch.topk_ids == batch.target_ids[..., None]).any(-1)
    pieces = topk_kl_from_logprobs(
        log_p.gather(-1, batch.topk_ids),
        batch.topk_anchor_logprobs,
        logprobs,
        batch.anchor_logprobs,
        in_head,
        direction="reverse",
        old_logprobs=batch.old_logprobs,
    )
    s = importance_weight(logprobs, batch.old_logprobs)
    tail_only = aggregate(pieces.head + weights * s * pieces.tail, batch.loss_mask).loss_sum
    whole = aggregate(weights * pieces.values, batch.loss_mask).loss_sum
    torch.testing.assert_close(ours["metrics"]["kl"], tail_only, rtol=1e-5, atol=5e-6)
    assert (whole - tail_only).abs() > 1e-2


def test_topk_tail_weights_multiply_the_tail_only():
    g = torch.Generator().manual_seed(1)
    head = torch.log_softmax(torch.randn(5, 8, generator=g), -1)[:, :3].requires_grad_(True)
    logprobs = torch.log(torch.rand(5, generator=g)).requires_grad_(True)
    anchor, head_anchor = torch.log(torch.rand(5, generator=g)), torch.log(torch.rand(5, 3, generator=g))
    in_head = torch.tensor([True, False, False, True, False])
    weights = torch.tensor([0.5, 0.0, 2.0, 3.0, 1.5])
    for direction in ("reverse", "forward"):
        plain = topk_kl_from_logprobs(head, head_anchor, logprobs, anchor, in_head, direction=direction)
        out = topk_kl_from_logprobs(
            head, head_anchor, logprobs, anchor, in_head, direction=direction, tail_weights=weights
        )
        assert torch.equal(out.head, plain.head) and torch.equal(out.tail, plain.tail)
        assert torch.equal(out.values, plain.head + plain.tail * weights)
    with pytest.raises(ValueError, match="tail_weights has shape"):
        topk_kl_from_logprobs(
            head, head_anchor, logprobs, anchor, in_head, direction="reverse", tail_weights=weights[:4]
        )


def test_weights_of_another_shape_raise(inputs):
    logits, batch = inputs
    with pytest.raises(ValueError, match="behavior_weights has shape"):
        rl_loss(
            logits,
            dataclasses.replace(batch, behavior_weights=torch.ones(B, 1)),
            vocab_start=0,
            vocab_size=V,
            tp_group=None,
        )
