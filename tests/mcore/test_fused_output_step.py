"""One RL step with ``train_step(..., fused_output=True)`` (``train.fused_output_loss``) equals the
step through whole logits: the same metrics, grad norm and updated parameters (fp32), at TP 1 and
TP 2, with separate and with tied input / output embeddings (the tied weight's gradient is the
embedding's plus the output layer's, in one ``main_grad``), on padded rows and on a packed row.

Each case builds the tiny model twice from the same weights, runs the old pass (log pi_old and
its top-k), then one ``train_step`` of PPO clip + reverse Top-k KL + entropy bonus over two
micro-batches, once with each setting; the fused one must never call the output layer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.microbatch import MicroBatch
from tests.adam_bound import assert_params_within_adam_bound
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.layout]

MODEL = "tiny-qwen2"
K = 4
SETTINGS = LossConfig(
    policy_loss="ppo_clip",
    policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
    kl="topk",
    kl_coef=0.1,
    kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
    entropy_coef=0.01,
    chunk_size=8,  # 32 tokens per micro-batch: four chunks
)
OPTIM = OptimizerConfig(lr=1e-3, clip_grad=1.0, adam_eps=1e-8)
# fp32: the output layer's GEMMs are split into chunks and its weight gradient summed in main_grad
# directly; the gradients differ by float32 rounding (~1e-7 of the largest).
TOL = dict(rtol=1e-5, atol=1e-6)
# Adam's first update is lr * g / (|g| + eps): for a gradient element near eps that rounding moves
# the update by up to ~lr, more on one CPU than another: the parameters are compared within Adam's
# bound for the two runs' applied gradients (tests.adam_bound), as tests/mcore/test_train_step.py.


def _microbatches(vocab_size: int, packed: bool) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, vocab_size, (2, 17), generator=g)
        mask = torch.zeros(2, 16, dtype=torch.bool)
        mask[0, 5:15], mask[1, 7:16] = True, True
        mb = MicroBatch(tokens[:, :16], tokens[:, 1:], mask, torch.randn(2, 1, generator=g).expand(2, 16).clone())
        if packed:  # one row: sequences of 9 and 14 tokens, then 9 of padding
            lengths = (9, 14, 9)
            seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
            mb = MicroBatch(
                mb.input_ids.reshape(1, 32),
                mb.target_ids.reshape(1, 32),
                mb.loss_mask.reshape(1, 32) & (seq_ids < 2),
                mb.advantages.reshape(1, 32),
                position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                seq_ids=seq_ids,
                cu_seqlens=torch.tensor([0, 9, 23, 32], dtype=torch.int32),
                max_seqlen=14,
            )
        out.append(mb)
    return out


def _one_step(tp: int, tied: bool, packed: bool) -> dict:
    """{fused: {"metrics", "grad_norm", "grads", "params", "output_layer_calls"}} for fused False and True."""
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.bind.build import bind_loss
    from tests.adam_bound import applied_grads

    model_cfg = dataclasses.replace(load_model_config(MODEL), tie_word_embeddings=tied)
    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    groups = initialize_model_parallel(parallel, seed=1234)
    loss_fn = bind_loss(SETTINGS, vocab_size=model_cfg.vocab_size, topk=K)[0]
    try:
        results, initial = {}, None
        for fused in (False, True):
            chunks = build_gpt_model(model_cfg, parallel)
            if initial is None:
                initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in chunks[0].state_dict().items()}
            else:
                chunks[0].load_state_dict(initial)
            ddp = wrap_with_ddp(chunks, OPTIM)
            optimizer = build_optimizer(ddp, OPTIM)
            scheduler = build_scheduler(optimizer, OPTIM)
            micro = _microbatches(model_cfg.vocab_size, packed)
            old = forward_stats(ddp, micro, StatsRequest(vocab_size=model_cfg.vocab_size, k=K), groups)
            g = torch.Generator().manual_seed(5)
            for mb, stats in zip(micro, old, strict=True):  # a synthetic anchor near pi_old
                mb.old_logprobs, mb.topk_ids = stats.logprobs, stats.topk_ids
                mb.anchor_logprobs = stats.logprobs + 0.3 * torch.randn(mb.shape, generator=g)
                mb.topk_anchor_logprobs = stats.topk_logprobs + 0.3 * torch.randn(*mb.shape, K, generator=g)
            calls, grads = [], {}
            chunks[0].output_layer.register_forward_hook(lambda *_: calls.append(1))
            step = optimizer.step

            def step_after_reading_grads(step=step, grads=grads, chunk=chunks[0]):
                grads.update({n: p.main_grad.clone() for n, p in chunk.named_parameters()})  # final: DDP is done
                return step()

            optimizer.step = step_after_reading_grads
            result = train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups, fused_output=fused)
            applied = applied_grads(ddp, optimizer)
            results[fused] = {
                "metrics": result.metrics,
                "grad_norm": result.grad_norm,
                "lr": result.lr,
                "grads": grads,
                "applied": {n: applied[id(p)] for n, p in chunks[0].named_parameters()},
                "params": {n: p.detach().clone() for n, p in chunks[0].named_parameters()},
                "output_layer_calls": len(calls),
            }
        return results
    finally:
        destroy_model_parallel()


CASES_TP1 = [(1, False, False), (1, True, False), (1, False, True)]
CASES_TP2 = [(2, False, False), (2, True, False)]


def _worker(rank: int, world_size: int, cases: list) -> dict:
    return {case: _one_step(*case) for case in cases}


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_distributed(_worker, 1, CASES_TP1, timeout=240)[0]
    for rank_results in run_distributed(_worker, 2, CASES_TP2, timeout=240):
        for case, value in rank_results.items():
            out.setdefault(case, []).append(value)
    return out


@pytest.mark.parametrize(
    "case", CASES_TP1 + CASES_TP2, ids=lambda c: f"tp{c[0]}{'-tied' if c[1] else ''}{'-packed' if c[2] else ''}"
)
def test_fused_output_step_equals_logits_step(results, case):
    for per_rank in results[case] if isinstance(results[case], list) else [results[case]]:
        unfused, fused = per_rank[False], per_rank[True]
        assert unfused["output_layer_calls"] > 0 and fused["output_layer_calls"] == 0
        torch.testing.assert_close(fused["grad_norm"], unfused["grad_norm"], **TOL)
        assert fused["grad_norm"] > 0
        assert fused["metrics"].keys() == unfused["metrics"].keys()
        for name, value in unfused["metrics"].items():
            torch.testing.assert_close(fused["metrics"][name], value, **TOL, msg=lambda m: f"{name}: {m}")
        assert fused["grads"].keys() == unfused["grads"].keys()
        for name, value in unfused["grads"].items():
            assert value.abs().max() > 0, name
            torch.testing.assert_close(fused["grads"][name], value, **TOL, msg=lambda m: f"grad of {name}: {m}")
        for name, value in unfused["params"].items():
            applied, ref_applied = [fused["applied"][name]], [unfused["applied"][name]]
            assert_params_within_adam_bound(
                fused["params"][name], value, applied, ref_applied, [unfused["lr"]], eps=OPTIM.adam_eps, what=name
            )
