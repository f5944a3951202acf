"""Context parallelism trains exactly like one rank: Megatron on gloo ranks in float32, the same
samples in the same packed rows (every sequence padded to a multiple of 2 x CP, ``MicroBatchPlan.
segment_multiple``), each CP rank with its share of every row (``parallel.context_parallel.
split_microbatch``), through the old pass and 3 optimizer steps (``mcore.step``), against the
one-process run on the whole rows: the old pass's per-token log-probs (each rank's share gathered
back into the rows), each step's loss, policy loss, KL and entropy, the gradient norms and the
parameters after the 3 steps (the first step's gradients tightly, the parameters within Adam's
bound for the two runs' gradients: ``tests.adam_bound``). In every aggregation mode (the seq-mean modes divide each sequence
by its tokens over the CP ranks), with K3, a reverse and a forward Top-k KL and an RPG penalty; at
CP 2, CP 2 x TP 2 and CP 2 x PP 2. The samples have odd lengths, so the padding to 2 x CP falls
inside the sequences' last chunks.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.aggregation import AGG_MODES
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches
from tests.dist import run_distributed

MODEL = "tiny-qwen2"
STEPS = 3
CP = 2
BUDGET = 96  # tokens per CP rank: a full row holds CP x as many
ADAM_EPS = 1e-6  # any eps works: the parameter bound follows from it (tests.adam_bound)


def _samples(count: int = 8, vocab: int = 250) -> list[Sample]:
    """Prompts of 3..8 tokens, responses of 2..40 (odd total lengths among them)."""
    g = torch.Generator().manual_seed(17)
    out = []
    for i in range(count):
        prompt = torch.randint(2, vocab, (3 + (5 * i) % 6,), generator=g).tolist()
        response = torch.randint(2, vocab, (40 if i == 1 else 2 + (7 * i) % 13,), generator=g).tolist()
        out.append(Sample(prompt, response, (-torch.rand(len(response), generator=g)).tolist(), "stop", group=i // 2))
    return out


def _loss(kl: str, agg_mode: str) -> LossConfig:
    args = {"topk_reverse": {"direction": "reverse"}, "topk_forward": {"direction": "forward"}}.get(kl, {})
    name = "topk" if kl.startswith("topk") else kl
    return LossConfig(kl=name, kl_coef=0.1, agg_mode=agg_mode, entropy_coef=0.01, kl_args=args)


def _train(
    rank: int,
    world_size: int,
    parallel: ParallelConfig,
    cases: list[tuple[str, str]],
    initial: dict | None = None,
    model_overrides: tuple[str, ...] = (),
) -> dict:
    """Per (aggregation mode, KL): the full rows' old log-probs, the steps' metrics and grad norms,
    and the trained parameters (a LoRA policy's: its adapters), under ``parallel``, from the
    reference's ``initial`` weights (None: the reference itself, whose initial weights are returned
    under "initial"); ``model_overrides`` of the model config."""
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, share_stats, train_step
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.parallel.context_parallel import CpChunks, split_microbatch
    from megatron_empg.trainer.bind.build import bind_loss
    from tests.adam_bound import applied_grads

    model = load_model_config(MODEL, model_overrides)
    cp = parallel.context_parallel_size
    pp = parallel.pipeline_model_parallel_size
    plan = MicroBatchPlan(packing=True, max_tokens=BUDGET * CP, fixed_shape=pp > 1, segment_multiple=2 * CP)
    samples = _samples()
    advantages = torch.linspace(-1, 1.5, len(samples)).tolist()
    results = {}
    for agg_mode, kl in cases:
        loss, plan_stats = bind_loss(_loss(kl, agg_mode), vocab_size=model.vocab_size, topk=4)
        groups = initialize_model_parallel(parallel, seed=5)  # the same initial weights each time
        try:
            settings = OptimizerConfig(lr=1e-3, clip_grad=0.0, adam_eps=ADAM_EPS)
            chunks = build_gpt_model(model, parallel)
            if initial is None:  # the reference: its own random initialization is everybody's
                results["initial"] = {k: v.clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}
            else:  # (Megatron seeds each pipeline stage apart: another layout draws other weights)
                load_full_state_dict(chunks, initial)
            ddp = wrap_with_ddp(chunks, settings)
            optimizer, scheduler = (opt := build_optimizer(ddp, settings)), build_scheduler(opt, settings)
            full = micro_batches(samples, advantages, plan)
            micro = [split_microbatch(mb, cp, groups.cp_rank) for mb in full]
            request = StatsRequest(
                vocab_size=model.vocab_size, k=plan_stats.old_topk or plan_stats.anchor_topk, with_entropy=False
            )
            stats = share_stats(forward_stats(ddp, micro, request, groups), micro, request, groups)
            rows = []
            for mb, out in zip(micro, stats):
                mb.old_logprobs = out.logprobs + 0.05 * mb.advantages  # a ratio != 1
                mb.anchor_logprobs = out.logprobs - 0.1 * mb.loss_mask
                if request.k:  # the Top-k set and the anchor below it
                    mb.topk_ids, mb.topk_anchor_logprobs = out.topk_ids, out.topk_logprobs - 0.1
                share = out.logprobs
                if cp > 1:  # every rank's share, back in the row's order
                    parts = [torch.empty_like(share) for _ in range(cp)]
                    torch.distributed.all_gather(parts, share, group=groups.cp_group)
                    order = CpChunks.from_cu_seqlens(mb.cu_seqlens, cp, groups.cp_rank).full_order()
                    share = torch.cat(parts, dim=1)[:, order]
                rows.append(share)
            steps, grads = [], []
            for _ in range(STEPS):
                steps.append(train_step(ddp, optimizer, scheduler, micro, loss, groups=groups))
                by_id = applied_grads(ddp, optimizer)
                grads.append({n: by_id[id(p)] for n, p in ddp[0].module.named_parameters() if p.requires_grad})
            results[agg_mode, kl] = {
                "old": rows,
                "masks": [mb.loss_mask for mb in full],
                "metrics": [s.metrics for s in steps],
                "grad_norms": [s.grad_norm for s in steps],
                "lrs": [s.lr for s in steps],
                "grads": grads,
                "tp_rank": groups.tp_rank,
                "params": {n: p.detach().clone() for n, p in ddp[0].module.named_parameters() if p.requires_grad},
                "pp_rank": groups.pp_rank,
                "local_tokens": [mb.shape[1] for mb in micro],
            }
        finally:
            destroy_model_parallel()
    return results


def _cases(modes, kls) -> list[tuple[str, str]]:
    return [(m, k) for m in modes for k in kls]


CASES = {  # world size, layout, (aggregation mode, KL) pairs
    "cp2": (
        2,
        ParallelConfig(context_parallel_size=CP),
        _cases(AGG_MODES, ["k3"]) + _cases(["seq-mean-token-mean"], ["topk_reverse", "topk_forward", "rpg_urkl"]),
    ),
    "cp2tp2": (
        4,
        ParallelConfig(context_parallel_size=CP, tensor_model_parallel_size=2),
        _cases(["seq-mean-token-sum"], ["topk_reverse"]),
    ),
    "cp2pp2": (
        4,
        ParallelConfig(context_parallel_size=CP, pipeline_model_parallel_size=2),
        _cases(["token-mean"], ["k3"]),
    ),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    every = sorted({case for _, _, cases in CASES.values() for case in cases})
    return run_distributed(_train, 1, ParallelConfig(), every, timeout=600)[0]


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.layout
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_trains_like_one_rank(case, reference):
    world_size, parallel, cases = CASES[case]
    per_rank = run_distributed(_train, world_size, parallel, cases, reference["initial"], timeout=540)
    tp = parallel.tensor_model_parallel_size
    for rank, results in enumerate(per_rank):
        for key in cases:
            ours, ref = results[key], reference[key]
            # each CP rank held 1 / CP of every row
            assert [n * CP for n in ours["local_tokens"]] == [m.shape[1] for m in ref["masks"]]
            if ours["pp_rank"] == parallel.pipeline_model_parallel_size - 1:
                for got, want, mask in zip(ours["old"], ref["old"], ref["masks"]):
                    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5, msg=f"{case} {key} old")
            for step in range(STEPS):
                for name in ("loss", "policy_loss", "kl", "entropy"):
                    assert ours["metrics"][step][name] == pytest.approx(
                        ref["metrics"][step][name], rel=1e-5, abs=1e-6
                    ), (case, rank, key, step, name)
                assert ours["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], rel=1e-5), (case, key, step)
            assert ref["grad_norms"][0] > 0
            _assert_params(ours, ref, tp, parallel.pipeline_model_parallel_size, f"{case} rank {rank} {key}")


def _assert_params(ours: dict, ref: dict, tp: int, pp: int, what: str) -> None:
    """This rank's first-step gradients tightly, and its parameter shards within Adam's bound for
    the two runs' gradients, against the same slice of the one-process run's (``tests.adam_bound``)."""
    from megatron_empg.config import load_model_config as load
    from megatron_empg.mcore.weights import global_name
    from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound

    layers = load(MODEL).num_layers // pp
    for name, shard in ours["params"].items():
        full_name = global_name(name, ours["pp_rank"] * layers)
        full = ref["params"][full_name]

        def mine(full: torch.Tensor) -> torch.Tensor:
            if shard.shape == full.shape:
                return full
            # a TP shard: rows (column-parallel) or columns (row-parallel)
            dim = next(d for d in range(full.dim()) if shard.shape[d] != full.shape[d])
            stride = 2 if "linear_fc1" in name else 1  # fc1 stacks [gate; up]
            pieces = torch.split(full, full.shape[dim] // (tp * stride), dim=dim)
            return torch.cat(pieces[ours["tp_rank"] :: tp], dim=dim)

        grads = [step[name] for step in ours["grads"]]
        ref_grads = [mine(step[full_name]) for step in ref["grads"]]
        assert_grads_close(grads[0], ref_grads[0], f"{what} {name} step 1 gradient")
        assert_params_within_adam_bound(
            shard, mine(full), grads, ref_grads, ref["lrs"], eps=ADAM_EPS, what=f"{what} {name}"
        )


# ---------------------------------------------------------------------------- the layout, unit


def test_rows_pad_every_sequence_to_a_multiple_of_two_cp():
    samples = _samples()
    plan = MicroBatchPlan(packing=True, max_tokens=BUDGET * CP, segment_multiple=2 * CP)
    rows = micro_batches(samples, torch.zeros(len(samples)).tolist(), plan)
    assert sum(len(mb.cu_seqlens) - 1 for mb in rows) >= len(samples)
    for mb in rows:
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        assert all(n % (2 * CP) == 0 for n in lengths), lengths  # the padding segment too
        assert mb.shape[1] <= BUDGET * CP and mb.shape[1] % plan.row_multiple == 0
    # each sequence keeps its tokens and loss tokens; what pads it to 2 x CP carries no loss
    loss = sum(int(mb.loss_mask.sum()) for mb in rows)
    assert loss == sum(s.loss_tokens for s in samples)


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["train.packing=false", "train.max_tokens_per_microbatch=null"], "parallel.context_parallel_size", "packing"),
        (["model_overrides=[attention_backend=unfused]"], "parallel.context_parallel_size", "sdpa or te"),
        (["train.max_tokens_per_microbatch=8"], "train.max_tokens_per_microbatch", "set it to at least 16"),
        (
            ["parallel.context_parallel_size=3"],
            "parallel.tensor_model_parallel_size",
            "x parallel.context_parallel_size",
        ),
    ],
)
def test_bind_refuses_what_context_parallelism_cannot_split(overrides, field, words):
    from megatron_empg.config import ConfigError, RunConfig, load_config
    from megatron_empg.trainer.bind.build import bind

    base = [
        "parallel.context_parallel_size=2",
        "train.max_tokens_per_microbatch=64",
        "rollout.in_process=false",
        "weight_sync.transport=shm_file",
    ]
    config = load_config(RunConfig, "recipes/demo_cpu.yaml", base + overrides)
    with pytest.raises(ConfigError) as error:
        bind(config, 2, check_paths=False)
    assert error.value.field == field and words in error.value.reason, error.value
    bind(load_config(RunConfig, "recipes/demo_cpu.yaml", base), 2, check_paths=False)  # the base binds
