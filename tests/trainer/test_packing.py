"""Packed rows (``train.packing``) train exactly like padded rows: Megatron on gloo ranks in
float32, the same samples laid out both ways (``trainer.batching.batch.micro_batches``), through the old pass
and 3 optimizer steps (``mcore.step``), at TP1, TP2, PP2, PP2 x VPP2 and DP2, in every aggregation
mode, with a sampled (K3) and a reverse Top-k KL.

Compared: the per-token log-probs of the old pass at every loss token (read per sample, since the
layouts put them at different places), each step's loss, policy loss, KL and entropy, the
gradient norms (to 1e-5), the first step's gradients (tightly) and the parameters after the 3
steps (within Adam's bound for the two runs' gradients: ``tests.adam_bound``). The packed micro-batches are also
grouped differently (a token budget, so fewer and longer rows): the (sum, count) losses make the
gradient independent of the grouping.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.aggregation import AGG_MODES
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches
from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound
from tests.dist import run_distributed

MODEL = "tiny-qwen2"
STEPS = 3
ADAM_EPS = 1e-6  # any eps works: the parameter bound follows from it (tests.adam_bound)


def _samples(rank: int, count: int = 6, vocab: int = 250) -> list[Sample]:
    """``count`` samples of this DP rank: prompts of 3..8 tokens, responses of 2..40 (skewed, one
    long), one with an observation run (``response_mask``)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(count):
        prompt = torch.randint(2, vocab, (3 + (5 * i) % 6,), generator=g).tolist()
        length = 40 if i == 1 else 2 + (7 * i + 3 * rank) % 13
        response = torch.randint(2, vocab, (length,), generator=g).tolist()
        mask = [not (i == 2 and 1 <= j < 4) for j in range(length)]
        logprobs = (-torch.rand(length, generator=g)).tolist()
        out.append(Sample(prompt, response, logprobs, "stop", group=i // 2, response_mask=mask))
    return out


def _old_logprobs_per_sample(micro, samples_in_order) -> list[list[float]]:
    """Each sample's old-pass log-probs at its loss tokens, in the order micro-batches hold them."""
    out = []
    for mb in micro:
        logprobs, mask = mb.old_logprobs, mb.loss_mask
        if mb.packed:
            ids = mb.seq_ids[0]
            for seq in range(len(mb.cu_seqlens) - 1):
                where = (ids == seq) & mask[0]
                if where.any():
                    out.append(logprobs[0][where].tolist())
        else:
            out.extend(logprobs[row][mask[row]].tolist() for row in range(mask.shape[0]) if mask[row].any())
    return out


def _train(rank: int, world_size: int, parallel: ParallelConfig, agg_modes: list[str], kl: str) -> dict:
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, share_stats, train_step
    from megatron_empg.trainer.bind.build import bind_loss
    from tests.adam_bound import applied_grads

    model = load_model_config(MODEL)
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    multiple = pp if vpp else 1  # the interleaved schedule runs micro-batches in groups of PP
    plans = {
        "padded": MicroBatchPlan(packing=False, micro_batch_size=2, fixed_shape=pp > 1, count_multiple=multiple),
        "packed": MicroBatchPlan(packing=True, max_tokens=96, fixed_shape=pp > 1, count_multiple=multiple),
    }
    k = 4 if kl == "topk" else 0
    results = {}
    for agg_mode in agg_modes:
        loss = LossConfig(
            kl=kl,
            kl_coef=0.1,
            agg_mode=agg_mode,
            entropy_coef=0.01,
            kl_args={"direction": "reverse"} if kl == "topk" else {},
        )
        loss_fn, _ = bind_loss(loss, vocab_size=model.vocab_size, topk=k or 1)
        for name, plan in plans.items():
            groups = initialize_model_parallel(parallel, seed=5)  # the same initial weights each time
            samples = _samples(groups.dp_rank)
            advantages = torch.linspace(-1, 1.5, len(samples)).tolist()
            try:
                settings = OptimizerConfig(lr=1e-3, clip_grad=0.0, adam_eps=ADAM_EPS)
                ddp = wrap_with_ddp(build_gpt_model(model, parallel), settings)
                optimizer, scheduler = (opt := build_optimizer(ddp, settings)), build_scheduler(opt, settings)
                micro = micro_batches(samples, advantages, plan)
                request = StatsRequest(vocab_size=model.vocab_size, k=k, with_entropy=False)
                stats = share_stats(forward_stats(ddp, micro, request, groups), micro, request, groups)
                for mb, out in zip(micro, stats):
                    mb.old_logprobs = out.logprobs + 0.05 * mb.advantages  # a ratio != 1
                    mb.anchor_logprobs = out.logprobs - 0.1 * mb.loss_mask
                    if k:  # a reverse Top-k KL: the old policy's top-k, the anchor below it
                        mb.topk_ids, mb.topk_anchor_logprobs = out.topk_ids, out.topk_logprobs - 0.1
                old = _old_logprobs_per_sample(
                    [type(mb)(**{**mb.__dict__, "old_logprobs": out.logprobs}) for mb, out in zip(micro, stats)],
                    samples,
                )
                steps, grads = [], []
                for _ in range(STEPS):
                    steps.append(train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups))
                    by_id = applied_grads(ddp, optimizer)
                    grads.append({n: by_id[id(p)] for n, p in ddp[0].module.named_parameters()})
                results[agg_mode, name] = {
                    "micro_batches": len(micro),
                    "shapes": [mb.shape for mb in micro],
                    "old": old,
                    "metrics": [s.metrics for s in steps],
                    "grad_norms": [s.grad_norm for s in steps],
                    "lrs": [s.lr for s in steps],
                    "grads": grads,
                    "params": {n: p.detach().clone() for n, p in ddp[0].module.named_parameters()},
                }
            finally:
                destroy_model_parallel()
    return results


def _sorted_old(old: list[list[float]]) -> list[list[float]]:
    return sorted(old, key=lambda values: (len(values), values[0]))


CASES = {  # world size, layout, aggregation modes, KL
    "tp1": (1, ParallelConfig(), list(AGG_MODES), "k3"),
    "tp2": (2, ParallelConfig(tensor_model_parallel_size=2), ["seq-mean-token-mean"], "topk"),
    "pp2": (2, ParallelConfig(pipeline_model_parallel_size=2), ["token-mean"], "k3"),
    "pp2vpp2": (
        2,
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ["seq-mean-token-mean"],
        "topk",
    ),
    "dp2": (2, ParallelConfig(), ["seq-mean-token-sum"], "k3"),
}


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.layout
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_rows_train_like_padded_rows(case):
    world_size, parallel, modes, kl = CASES[case]
    per_rank = run_distributed(_train, world_size, parallel, modes, kl, timeout=360)
    for rank, results in enumerate(per_rank):
        for mode in modes:
            padded, packed = results[mode, "padded"], results[mode, "packed"]
            # fewer, longer rows: the budget fills a row; one [b, s] per call under PP
            assert packed["micro_batches"] < padded["micro_batches"]
            assert all(b == 1 for b, _ in packed["shapes"])
            if parallel.pipeline_model_parallel_size > 1:
                assert len(set(packed["shapes"])) == 1 and len(set(padded["shapes"])) == 1
            if parallel.virtual_pipeline_model_parallel_size:
                assert packed["micro_batches"] % 2 == 0 and padded["micro_batches"] % 2 == 0
            old_padded, old_packed = _sorted_old(padded["old"]), _sorted_old(packed["old"])
            assert [len(v) for v in old_padded] == [len(v) for v in old_packed]
            for a, b in zip(old_padded, old_packed):
                torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=1e-5)
            for step in range(STEPS):
                for key in ("loss", "policy_loss", "kl", "entropy"):
                    assert packed["metrics"][step][key] == pytest.approx(
                        padded["metrics"][step][key], rel=1e-5, abs=1e-6
                    ), (rank, mode, step, key)
                assert packed["grad_norms"][step] == pytest.approx(padded["grad_norms"][step], rel=1e-5)
            assert padded["grad_norms"][0] > 0
            # Adam divides by sqrt(v) + eps: a weight whose gradient is near 0 moves by up to ~lr on
            # rounding-level differences, more on one CPU than another; the bound follows from the
            # two runs' gradients instead
            for name, param in padded["params"].items():
                grads = [step[name] for step in packed["grads"]]
                ref_grads = [step[name] for step in padded["grads"]]
                what = f"{case} rank {rank} {mode} {name}"
                assert_grads_close(grads[0], ref_grads[0], f"{what} step 1 gradient")
                assert_params_within_adam_bound(
                    packed["params"][name], param, grads, ref_grads, padded["lrs"], eps=ADAM_EPS, what=what
                )
