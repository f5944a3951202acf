"""``parallel.rl_loss`` against a full-vocabulary single-process reference, at TP = 1 and 2.

The reference takes the whole real vocabulary's ``torch.log_softmax`` of the float32 logits,
gathers log pi at the targets (and at the Top-k index set), and feeds the ``core`` losses
directly: ppo_clip / RPG, the sampled KL or ``topk_kl_from_logprobs``, the entropy, each
aggregated with ``core.aggregation.aggregate``. Each TP rank gets its vocab shard (vocab 37 in
2 x 19 columns: one padded column holding garbage) and must return the same (sum, count), the
same metrics and its columns of the reference gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_empg.core.aggregation import aggregate
from megatron_empg.core.kl import sampled_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.policy_loss import ppo_clip_loss
from megatron_empg.core.rpg import corrected_grpo_kl, rpg_kl_penalty, rpg_reinforce_clip_loss
from megatron_empg.core.topk_kl import topk_kl_from_logprobs
from megatron_empg.parallel.rl_loss import rl_loss
from tests.dist import run_distributed

B, S, V, K = 3, 5, 37, 4
TP, WIDTH = 2, 19  # V_pad = 38

CASES = {
    "grpo_k3_entropy": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2},
        kl="k3",
        kl_coef=0.1,
        entropy_coef=0.01,
        agg_mode="token-mean",
    ),
    "dapo_dualclip_k1_iw_seqmean": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 3.0},
        kl="k1",
        kl_coef=0.05,
        kl_args={"importance_weight": True},
        agg_mode="seq-mean-token-mean",
    ),
    "topk_reverse_iw": dict(
        policy_loss="ppo_clip",
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
        agg_mode="token-mean",
    ),
    "topk_forward_reference_seqsum": dict(
        policy_loss="ppo_clip",
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "forward", "tail_grad": "reference"},
        entropy_coef=0.02,
        agg_mode="seq-mean-token-sum",
    ),
    "dualclip_rpg_urkl_seqmean": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 10.0},
        kl="rpg_urkl",
        kl_coef=0.1,
        agg_mode="seq-mean-token-mean",
    ),
    "rpg_fkl_unclamped_entropy": dict(
        policy_loss="ppo_clip",
        kl="rpg_fkl",
        kl_coef=0.3,
        kl_args={"max_abs_value": None},
        entropy_coef=0.01,
        agg_mode="token-mean",
    ),
    "grpo_corrected_seqsum": dict(
        policy_loss="ppo_clip",
        kl="grpo_corrected",
        kl_coef=0.2,
        agg_mode="seq-mean-token-sum",
    ),
    "rpg_clip_no_kl": dict(
        policy_loss="rpg_reinforce_clip",
        policy_loss_args={"divergence": "ufkl", "beta": 0.1},
        log_entropy=False,
        agg_mode="token-mean",
    ),
}


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, S, TP * WIDTH, generator=g)
    logits[..., V:] = 1e4  # padding: would dominate everything if not masked
    log_p = torch.log_softmax(logits[..., :V], -1)
    target = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[2] = False  # a sequence without loss tokens
    old = log_p.gather(-1, target[..., None])[..., 0] + 0.3 * torch.randn(B, S, generator=g)
    anchor_log_p = torch.log_softmax(logits[..., :V] + 0.5 * torch.randn(B, S, V, generator=g), -1)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    return {
        "logits": logits,
        "batch": MicroBatch(
            input_ids=target,
            target_ids=target,
            loss_mask=mask,
            advantages=torch.randn(B, S, generator=g),
            old_logprobs=old,
            anchor_logprobs=anchor_log_p.gather(-1, target[..., None])[..., 0],
            topk_ids=topk_ids,
            topk_anchor_logprobs=anchor_log_p.gather(-1, topk_ids),
        ),
    }


def _reference(logits: torch.Tensor, batch: MicroBatch, case: dict) -> dict:
    leaf = logits[..., :V].clone().requires_grad_(True)
    log_p = torch.log_softmax(leaf, -1)
    logprobs = log_p.gather(-1, batch.target_ids[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss_fn = {"ppo_clip": ppo_clip_loss, "rpg_reinforce_clip": rpg_reinforce_clip_loss}[case["policy_loss"]]
    pg = loss_fn(logprobs, batch.old_logprobs, batch.advantages, **case.get("policy_loss_args", {}))
    mode = case["agg_mode"]
    total = aggregate(pg.values, batch.loss_mask, mode)
    loss_sum, metrics = total.loss_sum, {"policy_loss": total.loss_sum.item()}
    kl_args = dict(case.get("kl_args", {}))
    old = batch.old_logprobs if kl_args.pop("importance_weight", False) else None
    if case.get("kl") == "topk":
        head = log_p.gather(-1, batch.topk_ids)
        in_head = (batch.topk_ids == batch.target_ids[..., None]).any(-1)
        kl = topk_kl_from_logprobs(
            head, batch.topk_anchor_logprobs, logprobs, batch.anchor_logprobs, in_head, old_logprobs=old, **kl_args
        ).values
    elif case.get("kl") == "grpo_corrected":
        kl = corrected_grpo_kl(logprobs, batch.old_logprobs, batch.anchor_logprobs, **kl_args)
    elif str(case.get("kl")).startswith("rpg_"):
        kl = rpg_kl_penalty(logprobs, batch.anchor_logprobs, divergence=case["kl"].removeprefix("rpg_"), **kl_args)
    elif case.get("kl"):
        kl = sampled_kl(logprobs, batch.anchor_logprobs, estimator=case["kl"], old_logprobs=old, **kl_args)
    if case.get("kl"):
        loss_sum = loss_sum + case["kl_coef"] * aggregate(kl, batch.loss_mask, mode).loss_sum
        metrics["kl"] = aggregate(kl.detach(), batch.loss_mask).loss_sum.item()
    if case.get("entropy_coef", 0) > 0:
        loss_sum = loss_sum - case["entropy_coef"] * aggregate(entropy, batch.loss_mask, mode).loss_sum
    if case.get("log_entropy", True):
        metrics["entropy"] = aggregate(entropy.detach(), batch.loss_mask).loss_sum.item()
    (grad,) = torch.autograd.grad(loss_sum, leaf)
    grad = torch.cat([grad, torch.zeros(B, S, TP * WIDTH - V)], -1)
    return {"loss_sum": loss_sum.item(), "count": total.count.item(), "metrics": metrics, "grad": grad}


def _ours(logits, batch, case, *, start: int, width: int, group) -> dict:
    """rl_loss on the columns [start, start + width) of the padded logits."""
    shard = logits[..., start : start + width].clone().requires_grad_(True)
    out = rl_loss(shard, batch, vocab_start=start, vocab_size=V, tp_group=group, chunk_size=4, **case)
    (grad,) = torch.autograd.grad(out.loss.loss_sum, shard)
    metrics = {name: m.loss_sum.item() for name, m in out.metrics.items()}
    return {"loss_sum": out.loss.loss_sum.item(), "count": out.loss.count.item(), "metrics": metrics, "grad": grad}


def _tp_worker(rank: int, world_size: int, inputs: dict) -> dict:
    return {
        name: _ours(inputs["logits"], inputs["batch"], case, start=rank * WIDTH, width=WIDTH, group=dist.group.WORLD)
        for name, case in CASES.items()
    }


def _compare(ours: dict, ref: dict, start: int) -> None:
    # fp32, the same math in another order (per-rank logsumexp, chunks): a few ulps of values up
    # to ~5 (seq-mean-token-sum sums a sequence's tokens); 1.1e-6 seen on a gradient.
    tol = dict(rtol=1e-5, atol=5e-6)
    assert ours["count"] == ref["count"]
    torch.testing.assert_close(ours["loss_sum"], ref["loss_sum"], **tol)
    assert ours["metrics"].keys() >= ref["metrics"].keys()
    for name, value in ref["metrics"].items():
        torch.testing.assert_close(ours["metrics"][name], value, **tol, msg=lambda m: f"metric {name}: {m}")
    expected = ref["grad"][..., start : start + ours["grad"].shape[-1]]
    torch.testing.assert_close(ours["grad"], expected, **tol)
    assert ref["grad"].abs().sum() > 0


@pytest.fixture(scope="module")
def inputs() -> dict:
    return _inputs()


@pytest.fixture(scope="module")
def tp2_results(inputs) -> list[dict]:
    return run_distributed(_tp_worker, TP, inputs, timeout=120)


@pytest.mark.parametrize("name", list(CASES))
def test_rl_loss_tp1_equals_full_vocab_reference(inputs, name):
    ours = _ours(inputs["logits"], inputs["batch"], CASES[name], start=0, width=TP * WIDTH, group=None)
    _compare(ours, _reference(inputs["logits"], inputs["batch"], CASES[name]), start=0)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_rl_loss_tp2_equals_full_vocab_reference(inputs, tp2_results, name):
    ref = _reference(inputs["logits"], inputs["batch"], CASES[name])
    for tp_rank, result in enumerate(tp2_results):
        _compare(result[name], ref, start=tp_rank * WIDTH)


def test_rl_loss_bad_options_raise_naming_the_option(inputs):
    kw = dict(vocab_start=0, vocab_size=V, tp_group=None)
    logits = inputs["logits"][..., : TP * WIDTH]
    with pytest.raises(ValueError, match="^policy_loss="):
        rl_loss(logits, inputs["batch"], policy_loss="ppo", **kw)
    with pytest.raises(ValueError, match="^kl="):
        rl_loss(logits, inputs["batch"], kl="k7", kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="^kl_coef=0.1 needs a kl estimator"):
        rl_loss(logits, inputs["batch"], kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="kl='topk' needs batch.topk_ids"):
        rl_loss(logits, dataclasses.replace(inputs["batch"], topk_ids=None), kl="topk", kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="^entropy_coef="):
        rl_loss(logits, inputs["batch"], entropy_coef=-1.0, **kw)
