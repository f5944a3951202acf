"""Three RL steps (old pass, update with PPO + Top-k KL + entropy, Adam, warmup) give the same losses,
grad norms and parameters at every parallel layout as at TP1, and do not depend on the number of
micro-batches.

The reference runs TP1/PP1/DP1 in a one-rank process and returns its initial full state dict.
Each layout loads its slice of it (``mcore.weights.load_full_state_dict``), splits the global batch
over its DP ranks and micro-batches, and runs the same three steps: the old pass
(``forward_stats``: log pi_old at the targets and the top-k of pi_old), a synthetic anchor (the old
log-probs plus fixed noise, so that the KL has a gradient), and ``train_step``. The parent compares
each rank's first-step gradients with the same slice of the reference's (fp32, tightly), and its
parameters after the three steps within what Adam allows for the two runs' gradients
(``tests.adam_bound``: a bound, not a machine's observation).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.microbatch import MicroBatch
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.layout]

MODEL = "tiny-qwen2"
N, S, K, STEPS = 8, 16, 4, 3  # sequences per global batch, sequence length, top-k, optimizer steps
SETTINGS = LossConfig(
    policy_loss="ppo_clip",
    policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
    kl="topk",
    kl_coef=0.1,
    kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
    entropy_coef=0.01,
    chunk_size=8,
)


def loss_fn(vocab_size: int):
    """``SETTINGS`` bound as the trainer binds it (``trainer.bind.build.bind_loss``)."""
    from megatron_empg.trainer.bind.build import bind_loss

    return bind_loss(SETTINGS, vocab_size=vocab_size, topk=K)[0]


OPTIM = dict(
    lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine", min_lr=1e-4, clip_grad=1.0, adam_eps=1e-8
)
ADAM_EPS = OPTIM["adam_eps"]
# fp32: layouts regroup matmuls and all-reduces; observed differences are ~1e-7. Losses and norms
# after a step also see the parameters Adam moved apart (below), but only where an element's
# gradient nearly cancels, so the loss moves by (gradient x difference) ~ 0.
TOL = dict(rtol=1e-5, atol=1e-5)
# The parameters after 3 Adam steps: no fixed atol (Adam divides by sqrt(v), so where an element's
# gradient nearly cancels a 1e-12 difference in it can move the parameter by up to ~lr, more on one
# CPU than another), but Adam's bound for the recorded gradients (tests.adam_bound): ~1e-8 where
# the gradient is well above its rounding, while a layout bug moves parameters by ~lr.

# (name, world size, TP, PP, distributed optimizer)
LAYOUTS_2 = [("tp2", 2, 2, 1, False), ("pp2", 2, 1, 2, False), ("dp2_distopt", 2, 1, 1, True)]
LAYOUTS_4 = [("tp2xpp2", 4, 2, 2, False), ("tp2xdp2_distopt", 4, 2, 1, True)]


def _global_batches(vocab_size: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, vocab_size, (N, S + 1), generator=g)
        loss_mask = torch.zeros(N, S, dtype=torch.bool)
        for i in range(N):  # prompt of 4..7 tokens, response to a random end (right padding after)
            start, end = 4 + i % 4, S - (i % 3)
            loss_mask[i, start:end] = True
        batches.append(
            {
                "input_ids": tokens[:, :S],
                "target_ids": tokens[:, 1:],
                "loss_mask": loss_mask,
                "advantages": torch.randn(N, 1, generator=g).expand(N, S).clone(),
                "anchor_noise": 0.3 * torch.randn(N, S, generator=g),
                "topk_anchor_noise": 0.3 * torch.randn(N, S, K, generator=g),
            }
        )
    return batches


def _split(batch: dict, dp_rank: int, dp_size: int, num_microbatches: int) -> list[dict]:
    rows = N // dp_size
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    size = rows // num_microbatches
    return [{k: v[i * size : (i + 1) * size] for k, v in mine.items()} for i in range(num_microbatches)]


def _train(
    tp: int,
    pp: int,
    distopt: bool,
    full_state_dict: dict | None,
    num_microbatches: int,
    *,
    model: str = MODEL,
    model_overrides: tuple[str, ...] = (),
    inspect=None,
    **parallel_fields,
) -> dict:
    """Build the layout, load the weights, run STEPS RL steps; returns metrics and parameter shards.

    ``model_overrides``: dotted overrides of the model config (``moe_experts=sequential``);
    ``parallel_fields``: more ``ParallelConfig`` fields (the expert grid); ``inspect(ddp=,
    optimizer=, groups=, model_cfg=, parallel=)``, if given, runs after the steps and its result is
    returned as ``inspected``."""
    from megatron_empg.mcore import model as mcore_model
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.parallel.rl_loss import loss_units
    from tests.adam_bound import named_applied_grads

    model_cfg = load_model_config(model, model_overrides)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **parallel_fields)
    groups = initialize_model_parallel(parallel, seed=1234)
    try:
        chunks = mcore_model.build_gpt_model(model_cfg, parallel)
        initial = None
        if full_state_dict is None:  # the reference: its own random init is everybody's
            initial = {k: v.clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}
        else:
            mcore_weights.load_full_state_dict(chunks, full_state_dict)
        settings = OptimizerConfig(**OPTIM, use_distributed_optimizer=distopt)
        ddp = wrap_with_ddp(chunks, settings)
        optimizer = build_optimizer(ddp, settings)
        scheduler = build_scheduler(optimizer, settings)
        history, grads = [], []
        for batch in _global_batches(model_cfg.vocab_size):
            parts = _split(batch, groups.dp_rank, groups.dp_size, num_microbatches)
            mbs = [MicroBatch(p["input_ids"], p["target_ids"], p["loss_mask"], p["advantages"]) for p in parts]
            old = forward_stats(ddp, mbs, StatsRequest(vocab_size=model_cfg.vocab_size, k=K), groups)
            if old is not None:  # last stage: the loss inputs
                for mb, part, stats in zip(mbs, parts, old, strict=True):
                    mb.old_logprobs = stats.logprobs
                    mb.topk_ids = stats.topk_ids
                    mb.anchor_logprobs = stats.logprobs + part["anchor_noise"]
                    mb.topk_anchor_logprobs = stats.topk_logprobs + part["topk_anchor_noise"]
            result = train_step(
                ddp,
                optimizer,
                scheduler,
                mbs,
                loss_fn(model_cfg.vocab_size),
                groups=groups,
                loss_units=partial(loss_units, agg_mode=SETTINGS.agg_mode),
            )
            history.append({"metrics": result.metrics, "grad_norm": result.grad_norm, "lr": result.lr})
            grads.append(named_applied_grads(chunks, ddp, optimizer))
        params = {}  # by global name, a stacked expert weight row by row (per-expert names)
        for name, p, partition in mcore_weights.named_weight_shards(chunks):
            params[name] = (p.detach().clone(), partition)
        inspected = None
        if inspect is not None:
            inspected = inspect(ddp=ddp, optimizer=optimizer, groups=groups, model_cfg=model_cfg, parallel=parallel)
        return {
            "initial": initial,
            "history": history,
            "params": params,
            "grads": grads,
            "tp_rank": groups.tp_rank,
            "tp": tp,
            "etp_rank": groups.etp_rank,
            "etp": groups.etp_size,
            "inspected": inspected,
        }
    finally:
        destroy_model_parallel()


def _reference_worker(rank: int, world_size: int) -> dict:
    out = _train(1, 1, False, None, num_microbatches=2)
    full = out["initial"]
    again = _train(1, 1, False, full, num_microbatches=4)  # micro-batch count invariance
    eight = _train(1, 1, False, full, num_microbatches=8)
    return {"main": out, "mb4": again, "mb8": eight}


def _layouts_worker(rank: int, world_size: int, layouts: list, full_state_dict: dict) -> dict:
    results = {}
    for name, _, tp, pp, distopt in layouts:
        results[name] = _train(tp, pp, distopt, full_state_dict, num_microbatches=2)
    return results


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_reference_worker, 1, timeout=240)[0]


@pytest.fixture(scope="module")
def layouts(reference) -> dict:
    full = reference["main"]["initial"]
    per_rank = run_distributed(_layouts_worker, 2, LAYOUTS_2, full, timeout=300)
    per_rank_4 = run_distributed(_layouts_worker, 4, LAYOUTS_4, full, timeout=300)
    out = {}
    for layouts, ranks in ((LAYOUTS_2, per_rank), (LAYOUTS_4, per_rank_4)):
        for layout in layouts:
            out[layout[0]] = [r[layout[0]] for r in ranks]
    return out


def _assert_same_history(actual: list, expected: list, what: str) -> None:
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(
            a["grad_norm"], e["grad_norm"], **TOL, msg=lambda m: f"{what} step {step} grad norm: {m}"
        )
        assert a["lr"] == pytest.approx(e["lr"], rel=1e-12)
        assert a["metrics"].keys() == e["metrics"].keys()
        for key, value in e["metrics"].items():
            torch.testing.assert_close(a["metrics"][key], value, **TOL, msg=lambda m: f"{what} step {step} {key}: {m}")


def _assert_same_params(rank_result: dict, reference: dict, what: str) -> None:
    """This rank's first-step gradients tightly, and its parameters within Adam's bound for the
    two runs' gradients, against the same slice of the reference run's (``tests.adam_bound``)."""
    from megatron_empg.mcore.moe.layout import is_expert_parameter
    from megatron_empg.mcore.weights import tp_slice
    from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound

    lrs = [h["lr"] for h in reference["history"]]
    for name, (shard, partition) in rank_result["params"].items():
        split = ("etp_rank", "etp") if is_expert_parameter(name) else ("tp_rank", "tp")  # experts: over ETP
        mine = partial(tp_slice, partition=partition, tp_rank=rank_result[split[0]], tp_size=rank_result[split[1]])
        ref_grads = [mine(step[name]) for step in reference["grads"]]
        grads = [step[name] for step in rank_result["grads"]]
        assert_grads_close(grads[0], ref_grads[0], f"{what} {name} step 1 gradient")
        assert_params_within_adam_bound(
            shard, mine(reference["params"][name][0]), grads, ref_grads, lrs, eps=ADAM_EPS, what=f"{what} {name}"
        )


def test_reference_trains_and_reports(reference):
    history = reference["main"]["history"]
    # linear warmup over 2 updates: the k-th update runs at lr * k / 2, the first one never at 0
    assert [h["lr"] for h in history][:2] == pytest.approx([5e-4, 1e-3])
    # every step's norm exceeds clip_grad: the layouts below also agree on the clipped update
    assert all(h["grad_norm"] > OPTIM["clip_grad"] for h in history)
    assert {"loss", "policy_loss", "kl", "entropy", "ratio", "clipped_high", "clipped_low"} <= history[0][
        "metrics"
    ].keys()
    initial = reference["main"]["initial"]
    moved = [n for n, (p, _) in reference["main"]["params"].items() if not torch.equal(p, initial[n])]
    assert moved, "three optimizer steps changed no parameter"


def test_recorded_gradients_are_the_ones_adam_applied(reference):
    """The layouts' parameter bound rests on the recorded gradients: replayed through torch's AdamW
    (Megatron's optimizer on CPU; no weight decay on biases and norms, as Megatron) from the initial
    weights at the run's LRs, they give the reference's parameters to the last bit."""
    run = reference["main"]
    for name, (final, _) in run["params"].items():
        param = torch.nn.Parameter(run["initial"][name].clone())
        decay = 0.0 if param.dim() == 1 or name.endswith(".bias") else OptimizerConfig().weight_decay
        adam = torch.optim.AdamW([param], eps=ADAM_EPS, weight_decay=decay)
        for step, grads in zip(run["history"], run["grads"], strict=True):
            adam.param_groups[0]["lr"] = step["lr"]
            param.grad = grads[name].clone()
            adam.step()
        torch.testing.assert_close(param.detach(), final, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("count", ["mb4", "mb8"])
def test_microbatch_count_does_not_change_the_result(reference, count):
    _assert_same_history(reference[count]["history"], reference["main"]["history"], count)
    _assert_same_params(reference[count], reference["main"], count)


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS_2 + LAYOUTS_4])
def test_layout_equals_tp1(reference, layouts, name):
    ref = reference["main"]
    for rank, result in enumerate(layouts[name]):
        _assert_same_history(result["history"], ref["history"], f"{name} rank {rank}")
        _assert_same_params(result, ref, f"{name} rank {rank}")


def _update_logits_vs_forward(rank: int, world_size: int, num_microbatches: int) -> list[float]:
    """Per micro-batch: max |log p(target)| difference between the update pass (``train_step``,
    the interleaved 1F1B schedule) and the forward-only pass, on the same weights, at PP2 x VPP2."""
    from megatron_empg.core.aggregation import LossSum
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, share_stats, train_step
    from megatron_empg.parallel.rl_loss import RLLoss

    parallel = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    model_cfg = load_model_config(MODEL)
    groups = initialize_model_parallel(parallel, seed=5)
    try:
        ddp = wrap_with_ddp(build_gpt_model(model_cfg, parallel), OptimizerConfig(**OPTIM))
        optimizer = build_optimizer(ddp, OptimizerConfig(**OPTIM))
        scheduler = build_scheduler(optimizer, OptimizerConfig(**OPTIM))
        g = torch.Generator().manual_seed(0)
        micro = [
            MicroBatch(ids, ids)
            for ids in (torch.randint(2, 200, (2, 16), generator=g) for _ in range(num_microbatches))
        ]
        request = StatsRequest(vocab_size=model_cfg.vocab_size, with_entropy=False)
        forward = share_stats(forward_stats(ddp, micro, request, groups), micro, request, groups)
        seen = {}

        def loss_fn(logits, batch, *, vocab_start, tp_group):
            logprobs = torch.log_softmax(logits.float()[..., : model_cfg.vocab_size], -1)
            logprobs = logprobs.gather(-1, batch.target_ids[..., None])[..., 0]
            i = next(j for j, mb in enumerate(micro) if mb is batch)
            seen[i] = (logprobs.detach() - forward[i].logprobs).abs().max().item()
            total = LossSum(logprobs.sum(), torch.tensor(logprobs.numel()))
            return RLLoss(total, {"loss": LossSum(total.loss_sum.detach(), total.count)})

        train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups)
        return [seen[i] for i in sorted(seen)]
    finally:
        destroy_model_parallel()


@pytest.mark.dist
@pytest.mark.megatron
def test_interleaved_update_sees_each_micro_batch_activations_at_pp2():
    """4 micro-batches on 2 stages x 2 chunks: the steady state sends activations and gradients to
    the one neighbour in the same call. Batched p2p paired them crossed (micro-batches 2 and 3 got
    another's activations, log-probs off by ~0.1)."""
    last = run_distributed(_update_logits_vs_forward, 2, 4)[1]
    assert len(last) == 4 and max(last) < 1e-5, last
