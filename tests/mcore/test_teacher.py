"""``mcore.teacher.FrozenTeacher``: a frozen model loaded from a full state dict gives, at TP 2 (gloo),
the same log-probs and top-k as at TP 1; it takes no gradient, runs in eval mode, and building it
leaves the random streams where they were (a run with a teacher samples and initializes as one
without)."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import ParallelConfig, load_model_config
from megatron_empg.core.microbatch import MicroBatch
from tests.dist import run_distributed

MODEL, N, S, K = "tiny-qwen2", 2, 9, 5


def _probe(vocab: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (N, S + 1), generator=g)
    return [MicroBatch(input_ids=tokens[:, :S], target_ids=tokens[:, 1:], loss_mask=torch.ones(N, S, dtype=torch.bool))]


def _worker(rank: int, world_size: int) -> dict:

    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats
    from megatron_empg.mcore.teacher import FrozenTeacher

    model = load_model_config(MODEL)
    initialize_model_parallel(ParallelConfig(), seed=1234)  # the same random TP1 weights on both ranks
    try:
        full = {
            k: v.clone()
            for k, v in build_gpt_model(model, ParallelConfig())[0].state_dict().items()
            if torch.is_tensor(v)
        }
    finally:
        destroy_model_parallel()
    out = {}
    other = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in full.items()}
    for name, tp, weights in (("tp1", 1, full), ("tp1_other", 1, other), ("tp2", 2, full)):
        parallel = ParallelConfig(tensor_model_parallel_size=tp)
        groups = initialize_model_parallel(parallel, seed=1234)
        try:
            torch.manual_seed(7)
            before = _streams()
            teacher = FrozenTeacher.build(model, parallel, params_dtype=torch.float32, load=_drawing_load(weights))
            kept = _same(before, _streams())
            if name == "tp1":  # negative control: the same load outside the teacher moves the streams
                _drawing_load(weights)(teacher.models)
                out["control_moved"] = not _same(before, _streams())
            with teacher.forward_models() as models:
                stats = forward_stats(
                    models, _probe(model.vocab_size), StatsRequest(vocab_size=model.vocab_size, k=K), groups
                )[0]
            out[name] = {
                "logprobs": stats.logprobs,
                "topk_ids": stats.topk_ids,
                "topk_logprobs": stats.topk_logprobs,
                "frozen": all(not p.requires_grad for c in teacher.models for p in c.parameters()),
                "eval": all(not c.training for c in teacher.models),
                "rng_kept": kept,
            }
        finally:
            destroy_model_parallel()
    return out


def _drawing_load(weights: dict):
    """A load that also draws from the CPU stream and Megatron's tracker (as a random init would)."""
    from megatron.core import tensor_parallel

    from megatron_empg.mcore.weights import load_full_state_dict

    def load(chunks):
        torch.randn(3)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            torch.randn(3)
        load_full_state_dict(chunks, weights)

    return load


def _streams():
    from megatron.core import tensor_parallel

    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    return torch.get_rng_state(), {k: v.clone() for k, v in states.items()}


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_worker, 2, timeout=300)


@pytest.mark.dist
@pytest.mark.megatron
def test_tp2_teacher_equals_tp1(runs):
    for result in runs:
        tp1, tp2 = result["tp1"], result["tp2"]
        torch.testing.assert_close(tp2["logprobs"], tp1["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tp2["topk_logprobs"], tp1["topk_logprobs"], rtol=1e-5, atol=1e-5)
        assert torch.equal(tp2["topk_ids"], tp1["topk_ids"])
        # negative control: other weights give other log-probs
        assert (result["tp1_other"]["logprobs"] - tp1["logprobs"]).abs().max() > 1e-3


@pytest.mark.dist
@pytest.mark.megatron
def test_the_teacher_is_frozen_in_eval_and_leaves_the_random_streams(runs):
    for result in runs:
        assert result["control_moved"]
        for name in ("tp1", "tp2"):
            assert result[name]["frozen"] and result[name]["eval"] and result[name]["rng_kept"], name
