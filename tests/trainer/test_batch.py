"""``trainer.batching.batch``: samples -> micro-batches. The packed row holds each sample's tokens, targets,
loss mask, advantages and sampler log-probs exactly where its padded row has them (shifted), with
per-sequence positions and ``cu_seqlens``; a token budget bounds every row and names its field when
a sample cannot fit; pipeline calls get one shape; ``replica_shares`` drops samples without loss
and balances the rest between replicas without changing their union; dropping loss-free samples
leaves the optimizer step unchanged (Megatron, one rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.trainer.batching.balance import imbalance, micro_batch_bins
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches, replica_shares
from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound
from tests.dist import run_distributed

MODEL = "tiny-qwen2"
ADAM_EPS = 1e-6  # any eps works: the parameter bound follows from it (tests.adam_bound)


def _samples(no_loss: set[int], count: int = 8, vocab: int = 50) -> list[Sample]:
    """``count`` samples of prompts 3..6 tokens and responses 2..9 tokens; those in ``no_loss``
    have only observation tokens (``response_mask`` all False): no loss, as a masked truncation."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = torch.randint(2, vocab, (3 + i % 4,), generator=g).tolist()
        response = torch.randint(2, vocab, (2 + (7 * i) % 8,), generator=g).tolist()
        mask = [i not in no_loss] * len(response)
        logprobs = (-torch.rand(len(response), generator=g)).tolist()
        out.append(Sample(prompt, response, logprobs, "stop", group=i // 2, response_mask=mask))
    return out


def test_a_packed_row_holds_each_sample_as_its_padded_row_does():
    samples = _samples(no_loss={2})
    samples[5].response_mask[1] = False  # an observation token inside a response
    samples[6].trains = False  # masked truncation: tokens present, no loss
    advantages = [float(i) - 3.5 for i in range(8)]
    (padded,) = micro_batches(samples, advantages, MicroBatchPlan(packing=False, micro_batch_size=8, pad_id=1))
    (packed,) = micro_batches(samples, advantages, MicroBatchPlan(packing=True, micro_batch_size=8, pad_id=1))
    lengths = [s.length for s in samples]
    total = sum(lengths)
    assert padded.shape == (8, -(-max(lengths) // 8) * 8) and not padded.packed
    assert packed.shape == (1, -(-total // 8) * 8) and packed.packed
    # the samples back to back in their order, then one padding segment
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    assert packed.cu_seqlens.tolist() == bounds + ([packed.shape[1]] if total % 8 else [])
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == max(max(lengths), packed.shape[1] - total)
    for row, (first, n) in enumerate(zip(bounds, lengths)):
        span = slice(first, first + n)
        assert packed.position_ids[0, span].tolist() == list(range(n))
        assert packed.seq_ids[0, span].tolist() == [row] * n
        assert packed.input_ids[0, span].tolist() == padded.input_ids[row, :n].tolist()
        # the last position of a sequence predicts nothing (the pad id), as in its padded row
        assert packed.target_ids[0, span].tolist() == padded.target_ids[row, :n].tolist()
        assert packed.target_ids[0, first + n - 1] == 1
        for name in ("loss_mask", "advantages", "sampler_logprobs"):
            assert getattr(packed, name)[0, span].tolist() == getattr(padded, name)[row, :n].tolist(), name
            assert not getattr(padded, name)[row, n:].any(), name
    assert not packed.loss_mask[0, total:].any() and packed.position_ids[0, total:].tolist() == list(
        range(packed.shape[1] - total)
    )
    loss_tokens = sum(len(s.response_ids) for i, s in enumerate(samples) if i not in (2, 6)) - 1
    assert (
        int(padded.loss_mask.sum()) == int(packed.loss_mask.sum()) == sum(s.loss_tokens for s in samples) == loss_tokens
    )
    assert not padded.loss_mask[2].any() and not padded.loss_mask[6].any()
    expected = torch.tensor(advantages)[:, None].expand_as(padded.advantages)
    torch.testing.assert_close(padded.advantages, torch.where(padded.loss_mask, expected, 0.0), rtol=0, atol=0)
    assert padded.sampler_logprobs[padded.loss_mask].lt(0).all()


def test_a_token_budget_bounds_every_row_and_names_its_field():
    samples = _samples(no_loss=set(), count=8)
    lengths = [s.length for s in samples]
    budget = 24
    micro = micro_batches(samples, [1.0] * 8, MicroBatchPlan(max_tokens=budget))
    held = [int((mb.input_ids != 0).sum()) for mb in micro]  # sample tokens are >= 2, the pad id 0
    assert all(h <= budget for h in held) and sum(held) == sum(lengths) == 80
    assert len(micro) == 4  # ceil(80 / 24): as few as the tokens need (they fit here)
    assert all(mb.shape[1] == -(-h // 8) * 8 for mb, h in zip(micro, held))
    with pytest.raises(ValueError, match=r"train\.max_tokens_per_microbatch=10"):
        micro_batches(samples, [1.0] * 8, MicroBatchPlan(max_tokens=10))
    with pytest.raises(ValueError, match="needs the packed layout"):
        MicroBatchPlan(packing=False, max_tokens=64)


@pytest.mark.parametrize("packing", [False, True])
def test_a_pipeline_call_has_one_shape_and_a_multiple_of_micro_batches(packing):
    samples = _samples(no_loss=set(), count=7)
    plan = MicroBatchPlan(packing=packing, micro_batch_size=2, fixed_shape=True, count_multiple=3)
    micro = micro_batches(samples, [1.0] * 7, plan)
    assert len(micro) == 6 and len({mb.shape for mb in micro}) == 1  # ceil(7 / 2) = 4 -> 6
    assert sum(int(mb.loss_mask.sum()) for mb in micro) == sum(s.loss_tokens for s in samples)
    # no samples: padding-only micro-batches, still a multiple of the pipeline's group
    empty = micro_batches([], [], plan)
    assert len(empty) == 3 and not any(mb.loss_mask.any() for mb in empty)


def test_replica_share_drops_loss_free_samples_and_balances_without_changing_the_union():
    g = torch.Generator().manual_seed(3)
    replicas, per_replica, mini_batches = 4, 8, 2
    # skewed: replica 0 sampled the long responses
    lengths = [
        [int(x) for x in (torch.rand(per_replica, generator=g) * 300 + (4000 if r == 0 else 200))]
        for r in range(replicas)
    ]
    trains = [[(r + i) % 5 != 0 for i in range(per_replica)] for r in range(replicas)]
    own = replica_shares(lengths, trains, mini_batches=mini_batches, cost=None)
    balanced = replica_shares(lengths, trains, mini_batches=mini_batches, cost=float)  # cost: the tokens
    for j in range(mini_batches):
        members = range(j * 4, (j + 1) * 4)
        want = sorted((r, i) for r in range(replicas) for i in members if trains[r][i])
        assert sorted(own[r][j] == [(r, i) for i in members if trains[r][i]] for r in range(replicas)) == [True] * 4
        assert sorted(pair for r in range(replicas) for pair in balanced[r][j]) == want  # the same union
        tokens = [[sum(lengths[r][i] for r, i in share[j]) for share in shares] for shares in (own, balanced)]
        assert imbalance(tokens[1]) < imbalance(tokens[0]) - 0.5  # 4k-token samples spread over replicas


def _step(rank: int, world_size: int, agg_mode: str) -> dict:
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.bind.build import bind_loss
    from tests.adam_bound import applied_grads

    model = load_model_config(MODEL)
    loss = LossConfig(kl="k3", kl_coef=0.1, agg_mode=agg_mode, policy_loss_args={"clip_eps_low": 0.2})
    loss_fn, _ = bind_loss(loss, vocab_size=model.vocab_size, topk=1)
    samples = _samples(no_loss={1, 2, 5}, vocab=model.vocab_size)
    advantages = torch.linspace(-1, 1, 8).tolist()
    plan = MicroBatchPlan(packing=False, micro_batch_size=2)
    results = {}
    for name in ("all", "dropped"):
        groups = initialize_model_parallel(ParallelConfig(), seed=5)  # the same initial weights each time
        try:
            settings = OptimizerConfig(lr=1e-3, clip_grad=0.0, adam_eps=ADAM_EPS)
            ddp = wrap_with_ddp(build_gpt_model(model, ParallelConfig()), settings)
            optimizer, scheduler = (opt := build_optimizer(ddp, settings)), build_scheduler(opt, settings)
            if name == "all":
                micro = micro_batches(samples, advantages, plan)
            else:
                ((micro_items,),) = replica_shares(
                    [[s.length for s in samples]], [[s.loss_tokens > 0 for s in samples]], mini_batches=1, cost=None
                )
                micro = micro_batches(
                    [samples[i] for _, i in micro_items], [advantages[i] for _, i in micro_items], plan
                )
            stats = forward_stats(ddp, micro, StatsRequest(vocab_size=model.vocab_size, with_entropy=False), groups)
            for mb, out in zip(micro, stats):
                mb.old_logprobs = out.logprobs + 0.05 * mb.advantages  # a ratio != 1
                mb.anchor_logprobs = out.logprobs - 0.1
            result = train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups)
            by_id = applied_grads(ddp, optimizer)
            results[name] = {
                "micro_batches": len(micro),
                "metrics": result.metrics,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "grads": {n: by_id[id(p)] for n, p in ddp[0].module.named_parameters()},
                "params": {n: p.detach().clone() for n, p in ddp[0].module.named_parameters()},
            }
        finally:
            destroy_model_parallel()
    return results


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.layout
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_dropping_loss_free_samples_leaves_the_update_unchanged(agg_mode):
    (results,) = run_distributed(_step, 1, agg_mode)
    full, dropped = results["all"], results["dropped"]
    assert (full["micro_batches"], dropped["micro_batches"]) == (4, 3)  # 8 samples; 5 with a loss
    for key in ("loss", "policy_loss", "kl", "entropy"):
        assert dropped["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5, abs=1e-7), key
    assert dropped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert full["grad_norm"] > 0
    # fp32, the two differ only by matmul shapes and grouping: the gradients tightly; Adam's first
    # update is about lr * g / (|g| + eps), so a rounding-level gradient near 0 may move its weight
    # by up to 2 lr: the parameters within Adam's bound for the two gradients (tests.adam_bound)
    for name, param in full["params"].items():
        grad, ref_grad = dropped["grads"][name], full["grads"][name]
        assert_grads_close(grad, ref_grad, f"{name} gradient")
        assert_params_within_adam_bound(
            dropped["params"][name], param, [grad], [ref_grad], [full["lr"]], eps=ADAM_EPS, what=name
        )


def test_one_shape_per_call_takes_a_few_more_rows_when_that_computes_fewer_slots():
    g = torch.Generator().manual_seed(9)
    lengths = [int(x) for x in torch.randint(20, 90, (24,), generator=g)] + [150] * 6  # some at the "cap"
    samples = [Sample([1] * 4, [2] * (n - 4), [-1.0] * (n - 4), "stop", group=0) for n in lengths]
    budget = 200
    plan = MicroBatchPlan(max_tokens=budget, fixed_shape=True)
    micro = micro_batches(samples, [0.0] * len(samples), plan)
    fewest = micro_batch_bins(lengths, budget)  # the fewest rows within the budget
    widest = -(-max(sum(lengths[i] for i in b) for b in fewest) // 8) * 8
    assert len({mb.shape for mb in micro}) == 1 and micro[0].shape[1] <= budget
    # measured: 15 rows of 152 (2280 slots) instead of 12 of 200 (2400)
    assert len(micro) > len(fewest) and len(micro) * micro[0].shape[1] < len(fewest) * widest
    assert sum(int((mb.input_ids != 0).sum()) for mb in micro) == sum(lengths)  # every sample, once


def test_a_micro_batch_moves_every_tensor_to_the_device():
    (packed,) = micro_batches(_samples(no_loss=set(), count=3), [1.0, 0.0, -1.0], MicroBatchPlan(micro_batch_size=3))
    packed.old_logprobs = torch.zeros(packed.shape)
    moved = packed.to(torch.device("meta"))  # any device other than the host's
    tensors = {name: value for name, value in vars(moved).items() if isinstance(value, torch.Tensor)}
    assert {"input_ids", "cu_seqlens", "seq_ids", "old_logprobs"} <= set(tensors)
    assert {t.device.type for t in tensors.values()} == {"meta"} and moved.max_seqlen == packed.max_seqlen
    assert packed.input_ids.device.type == "cpu"  # a copy


@pytest.mark.parametrize("packing", [True, False])
def test_teacher_scores_land_at_the_positions_predicting_each_token(packing):
    """``Sample.teacher`` (a teacher engine's ``TopkScores``) at ``offset .. offset + L - 2`` of its
    sequence, where ``target_ids`` hold its tokens 1 .. L-1; every sample of a micro-batch or none."""
    from megatron_empg.rollout.engine import TopkScores

    samples = [Sample([1, 2], [3, 4, 5], [0.0] * 3, "stop", group=0), Sample([6], [7, 8], [0.0] * 2, "stop", group=1)]
    for i, s in enumerate(samples):  # position t of sample i: target 100 i + t, ids (t, t + 1), log-probs -(t, t + 1)
        t = torch.arange(s.length - 1)
        ids = torch.stack([t, t + 1], -1)
        s.teacher = TopkScores(ids, -ids.float(), 100.0 * i + t.float())
    (mb,) = micro_batches(samples, [1.0, 1.0], MicroBatchPlan(packing=packing, micro_batch_size=2, pad_multiple=1))
    rows = [(0, 0), (0, 5)] if packing else [(0, 0), (1, 0)]  # (row, offset) of each sample
    for i, ((row, offset), s) in enumerate(zip(rows, samples)):
        span = slice(offset, offset + s.length - 1)
        assert mb.target_ids[row, span].tolist() == (s.prompt_ids + s.response_ids)[1:]
        assert mb.teacher_logprobs[row, span].tolist() == [100.0 * i + t for t in range(s.length - 1)]
        assert mb.teacher_topk_ids[row, span, 1].tolist() == list(range(1, s.length))
        assert mb.teacher_topk_logprobs[row, span, 0].tolist() == [-float(t) for t in range(s.length - 1)]
    assert mb.teacher_logprobs.shape == mb.input_ids.shape and mb.teacher_topk_ids.shape[-1] == 2
    samples[1].teacher = None  # negative control: a micro-batch of taught and untaught samples
    with pytest.raises(ValueError, match="have no teacher scores"):
        micro_batches(samples, [1.0, 1.0], MicroBatchPlan(packing=packing, micro_batch_size=2))
    samples[0].teacher = None
    assert micro_batches(samples, [1.0, 1.0], MicroBatchPlan(packing=packing))[0].teacher_logprobs is None
