"""``parallel.rl_loss`` with a distillation term, against a full-vocabulary reference, at TP 1 and 2.

The reference takes ``torch.log_softmax`` of the whole real vocabulary of the student's and the
teacher's logits, the teacher's top-k by ``torch.topk``, and writes each loss kind's per-token
value out by its formula (verl's), then the objective: [policy loss] + kl_coef KL + coef distill.
A teacher equal to the student gives zero distillation KL and exactly plain RL's loss and gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_empg.core.aggregation import aggregate
from megatron_empg.core.distill.term import DistillTerm
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.policy_loss import ppo_clip_loss
from megatron_empg.parallel.rl_loss import rl_loss
from tests.dist import run_distributed

B, S, V, K = 3, 5, 37, 4
TP, WIDTH = 2, 19  # V_pad = 38
RL = dict(policy_loss="ppo_clip", policy_loss_args={"clip_eps_low": 0.2})
CASES = {
    "k1_policy_gradient_with_rl": (dict(loss="k1", coef=0.5), dict(agg_mode="token-mean")),
    "k3_direct_alone": (
        dict(loss="k3", use_policy_gradient=False, use_task_rewards=False),
        dict(agg_mode="token-mean"),
    ),
    "forward_kl_topk_direct_seqmean": (
        dict(loss="forward_kl_topk", use_policy_gradient=False, coef=0.3, log_prob_min_clamp=-4.0, loss_max_clamp=2.0),
        dict(agg_mode="seq-mean-token-mean"),
    ),
}


def _term(args: dict) -> DistillTerm:
    args = dict(args)
    return DistillTerm.bind(args.pop("loss"), topk=K, **args)


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, S, TP * WIDTH, generator=g)
    logits[..., V:] = 1e4  # padding: would dominate everything if not masked
    log_p = torch.log_softmax(logits[..., :V], -1)
    teacher = torch.log_softmax(logits[..., :V] + 1.5 * torch.randn(B, S, V, generator=g), -1)
    target = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[2] = False
    top = torch.topk(teacher, K, dim=-1)
    batch = MicroBatch(
        input_ids=target,
        target_ids=target,
        loss_mask=mask,
        advantages=torch.randn(B, S, generator=g),
        old_logprobs=log_p.gather(-1, target[..., None])[..., 0] + 0.2 * torch.randn(B, S, generator=g),
        teacher_logprobs=teacher.gather(-1, target[..., None])[..., 0],
        teacher_topk_ids=top.indices,
        teacher_topk_logprobs=top.values,
        student_top1=log_p.argmax(-1),
    )
    return {"logits": logits, "batch": batch, "teacher": teacher}


def _reference(logits, batch, teacher, args, agg_mode) -> dict:
    leaf = logits[..., :V].clone().requires_grad_(True)
    log_p = torch.log_softmax(leaf, -1)
    s = log_p.gather(-1, batch.target_ids[..., None])[..., 0]
    t = batch.teacher_logprobs
    if args["loss"] == "k1":
        v = s - t
    elif args["loss"] == "k3":
        d = (t - s).clamp(-20, 20)
        v = (d.exp() - d - 1).clamp(-10, 10)
    else:
        floor = args["log_prob_min_clamp"]
        ids = torch.topk(teacher, K, dim=-1).indices
        sq, tq = log_p.gather(-1, ids).clamp_min(floor), teacher.gather(-1, ids).clamp_min(floor)
        v = (tq.exp() * (tq - sq)).sum(-1).clamp_min(0)
    kl = v.detach()
    cap = args.get("loss_max_clamp", 10.0)
    v = v.clamp(-cap, cap)
    mask = batch.loss_mask
    if args.get("use_policy_gradient", True):
        v = ppo_clip_loss(s, batch.old_logprobs, -v.detach(), clip_eps_low=0.2, clip_eps_high=0.2, clip_c=3.0).values
    distill = aggregate(v, mask, agg_mode)
    pg = aggregate(ppo_clip_loss(s, batch.old_logprobs, batch.advantages, clip_eps_low=0.2).values, mask, agg_mode)
    task = args.get("use_task_rewards", True)
    loss_sum = (pg.loss_sum if task else 0.0) + (args.get("coef", 1.0) if task else 1.0) * distill.loss_sum
    (grad,) = torch.autograd.grad(loss_sum, leaf)
    agreement = (log_p.argmax(-1) == teacher.argmax(-1)).float()
    metrics = {
        "distill/kl": aggregate(kl, mask).loss_sum.item(),
        "distill/teacher_topk_mass": aggregate(batch.teacher_topk_logprobs.exp().sum(-1), mask).loss_sum.item(),
        "distill/top1_agreement": aggregate(agreement, mask).loss_sum.item(),
    }
    grad = torch.cat([grad, torch.zeros(B, S, TP * WIDTH - V)], -1)
    return {"loss_sum": loss_sum.item(), "count": pg.count.item(), "metrics": metrics, "grad": grad}


def _ours(logits, batch, args, agg_mode, *, start, width, group, distill=True) -> dict:
    shard = logits[..., start : start + width].clone().requires_grad_(True)
    term = _term(args) if distill else None
    out = rl_loss(
        shard,
        batch,
        vocab_start=start,
        vocab_size=V,
        tp_group=group,
        chunk_size=4,
        agg_mode=agg_mode,
        distill=term,
        **RL,
    )
    (grad,) = torch.autograd.grad(out.loss.loss_sum, shard)
    metrics = {name: m.loss_sum.item() for name, m in out.metrics.items()}
    return {"loss_sum": out.loss.loss_sum.item(), "count": out.loss.count.item(), "metrics": metrics, "grad": grad}


def _compare(ours, ref, start) -> None:
    tol = dict(rtol=1e-5, atol=5e-6)
    assert ours["count"] == ref["count"]
    torch.testing.assert_close(ours["loss_sum"], ref["loss_sum"], **tol)
    for name, value in ref["metrics"].items():
        torch.testing.assert_close(ours["metrics"][name], value, **tol, msg=lambda m: f"metric {name}: {m}")
    torch.testing.assert_close(ours["grad"], ref["grad"][..., start : start + ours["grad"].shape[-1]], **tol)
    assert ref["grad"].abs().sum() > 0


@pytest.fixture(scope="module")
def inputs() -> dict:
    return _inputs()


@pytest.mark.parametrize("name", list(CASES))
def test_distill_tp1_equals_full_vocab_reference(inputs, name):
    args, agg = CASES[name]
    ours = _ours(inputs["logits"], inputs["batch"], args, agg["agg_mode"], start=0, width=TP * WIDTH, group=None)
    _compare(ours, _reference(inputs["logits"], inputs["batch"], inputs["teacher"], args, agg["agg_mode"]), 0)


def _tp_worker(rank: int, world_size: int, inputs: dict) -> dict:
    return {
        name: _ours(
            inputs["logits"], inputs["batch"], a, g["agg_mode"], start=rank * WIDTH, width=WIDTH, group=dist.group.WORLD
        )
        for name, (a, g) in CASES.items()
    }


def test_distill_tp2_equals_full_vocab_reference(inputs):
    results = run_distributed(_tp_worker, TP, inputs, timeout=120)
    for name, (args, agg) in CASES.items():
        ref = _reference(inputs["logits"], inputs["batch"], inputs["teacher"], args, agg["agg_mode"])
        for rank, result in enumerate(results):
            _compare(result[name], ref, rank * WIDTH)


@pytest.mark.parametrize("loss", ["k1", "k3", "forward_kl_topk"])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_plain_rl(inputs, loss):
    """For ``forward_kl_topk`` with k = V and no log-prob floor only: over k < V ids (or with
    floored ids) sum_q p (t - s) is 0 at the teacher but its gradient -sum_q p grad s is not (it
    raises the student's mass on q), as in verl."""
    logits, batch = inputs["logits"], inputs["batch"]
    log_p = torch.log_softmax(logits[..., :V], -1)
    top = torch.topk(log_p, V if loss == "forward_kl_topk" else K, dim=-1)
    on_policy = log_p.gather(-1, batch.target_ids[..., None])[..., 0]
    same = dataclasses.replace(
        batch,
        old_logprobs=on_policy,
        teacher_logprobs=on_policy,
        teacher_topk_ids=top.indices,
        teacher_topk_logprobs=top.values,
    )
    args = {"loss": loss, "use_policy_gradient": loss == "k1", "coef": 0.7, "log_prob_min_clamp": None}
    kw = dict(start=0, width=TP * WIDTH, group=None)
    ours = _ours(logits, same, args, "token-mean", **kw)
    plain = _ours(logits, same, args, "token-mean", distill=False, **kw)
    tokens = int(same.loss_mask.sum())
    assert abs(ours["metrics"]["distill/kl"]) < 1e-5 and ours["metrics"]["distill/top1_agreement"] == tokens
    torch.testing.assert_close(ours["loss_sum"], plain["loss_sum"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["grad"], plain["grad"], rtol=1e-6, atol=1e-7)
    # negative control: the inputs' own teacher (another distribution) moves the gradient
    other = _ours(logits, dataclasses.replace(batch, old_logprobs=on_policy), args, "token-mean", **kw)
    assert (other["grad"] - plain["grad"]).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CASES))
def test_distill_through_the_fused_output_layer_equals_whole_logits(inputs, name):
    """``train.fused_output_loss``: the teacher's top-k ids are gathered chunk by chunk from the
    output layer's input and weight, as the other ids are."""
    from megatron_empg.parallel.fused_output import OutputLayerInput

    args, agg = CASES[name]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, S, 8, generator=g, requires_grad=True)
    weight = torch.randn(V, 8, generator=g, requires_grad=True)
    results = []
    for fused in (True, False):
        source = OutputLayerInput(hidden, weight) if fused else hidden @ weight.T
        out = rl_loss(
            source,
            inputs["batch"],
            vocab_start=0,
            vocab_size=V,
            tp_group=None,
            chunk_size=4,
            agg_mode=agg["agg_mode"],
            distill=_term(args),
            **RL,
        )
        results.append((out.loss.loss_sum, *torch.autograd.grad(out.loss.loss_sum, (hidden, weight))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert results[0][2].abs().sum() > 0
