"""``algorithm.distill.placement: engine`` against ``trainer`` on one teacher (tiny-qwen2, float32,
CPU): the transformers engine's ``score_topk`` carried by ``Sample.teacher`` into the micro-batches
(``trainer.batching.batch``) gives the teacher fields that the trainer placement's Megatron forward
(``trainer.teacher.TrainerTeacher``) computes on the same micro-batches:

- the teacher's log-prob of each sampled token: equal to 1e-5 (two float32 implementations);
- the top-k ids (k = 5, the head of random tiny weights, no ties) equal, their log-probs to 1e-5;
- per-token distillation losses: k1 and k3 equal (they read the sampled token's log-prob only,
  which the engine gives exactly); forward_kl_topk equal with k = the vocabulary (the engine's
  top-k then has no tail) — with k < V it is the top-k approximation docs/algorithms.md states.

Negative control: an engine teacher of other weights differs by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import ParallelConfig, RolloutConfig, load_model_config
from tests.dist import run_distributed

MODEL, K, TOL = "tiny-qwen2", 5, 1e-5
TEACHER_FIELDS = ("teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs")


def _samples(vocab: int):
    from megatron_empg.trainer.batching.batch import Sample

    g = torch.Generator().manual_seed(5)
    out = []
    for i, (p, r) in enumerate([(3, 6), (5, 2), (1, 9), (4, 4)]):
        prompt, response = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (p, r))
        out.append(Sample(prompt, response, [0.0] * r, "stop", group=i))
    return out


def _engine_micro(model_dir, samples, k: int):
    """The engine placement's micro-batches: ``score_topk`` on each sample, then batching."""
    from megatron_empg.rollout.hf_engine import HfEngine
    from megatron_empg.trainer.batching.batch import MicroBatchPlan, micro_batches

    engine = HfEngine(model_dir, RolloutConfig(dtype="float32"))
    scores = engine.score_topk([s.prompt_ids + s.response_ids for s in samples], k)
    engine.shutdown()
    taught = [dataclasses.replace(s, teacher=t) for s, t in zip(samples, scores)]
    return micro_batches(taught, [1.0] * len(taught), MicroBatchPlan(packing=True, micro_batch_size=2))


def _worker(rank: int, world_size: int, model_dir: str, other_dir: str) -> dict:
    from types import SimpleNamespace

    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import forward_stats
    from megatron_empg.mcore.teacher import FrozenTeacher
    from megatron_empg.trainer.run.start import load_initial_weights
    from megatron_empg.trainer.teacher import TrainerTeacher

    model = load_model_config(MODEL)
    samples = _samples(model.vocab_size)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=1234)
    try:
        config = SimpleNamespace(parallel=parallel)
        frozen = FrozenTeacher.build(
            model,
            parallel,
            params_dtype=torch.float32,
            load=lambda chunks: load_initial_weights(chunks, model_dir, model, config, groups),
        )
        out = {}
        for k in (K, model.vocab_size):
            engine = _engine_micro(model_dir, samples, k)
            trainer = [dataclasses.replace(mb, **dict.fromkeys(TEACHER_FIELDS)) for mb in engine]
            teacher = TrainerTeacher(frozen, vocab_size=model.vocab_size, k=k, chunk_size=None)
            teacher.stats(trainer, lambda models, micro, request: forward_stats(models, micro, request, groups))
            fields = lambda mbs: {
                f: [getattr(mb, f) for mb in mbs] for f in (*TEACHER_FIELDS, "loss_mask", "target_ids")
            }  # noqa: E731
            out[k] = {"engine": fields(engine), "trainer": fields(trainer)}
        out["other"] = [mb.teacher_logprobs for mb in _engine_micro(other_dir, samples, K)]
    finally:
        destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from tools.make_tiny_model import save_tiny_hf_model

    tmp = tmp_path_factory.mktemp("distill_engine")
    model = load_model_config(MODEL)
    model_dir = save_tiny_hf_model(model, tmp / "teacher", seed=0)
    other_dir = save_tiny_hf_model(model, tmp / "other", seed=1)
    return run_distributed(_worker, 1, str(model_dir), str(other_dir), timeout=300)[0]


def _masked(values: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v[m] for v, m in zip(values, masks)])


def _losses(side: dict, loss_name: str) -> torch.Tensor:
    """Per-token losses (loss tokens, flat) of a student of random logits against ``side``'s fields."""
    from megatron_empg.core.distill.losses import DISTILL_LOSSES, distill_values

    g = torch.Generator().manual_seed(11)
    out = []
    for mask, targets, t, ids, t_head in zip(side["loss_mask"], side["target_ids"], *(side[f] for f in TEACHER_FIELDS)):
        student = torch.randn(*targets.shape, load_model_config(MODEL).vocab_size, generator=g).log_softmax(-1)
        values = distill_values(
            DISTILL_LOSSES[loss_name],
            logprobs=student.gather(-1, targets[..., None])[..., 0],
            teacher_logprobs=t,
            head_logprobs=student.gather(-1, ids),
            teacher_head_logprobs=t_head,
        )
        out.append(values[mask])
    return torch.cat(out)


@pytest.mark.dist
@pytest.mark.megatron
def test_the_engine_teacher_gives_the_trainer_teachers_fields(run):
    engine, trainer = run[K]["engine"], run[K]["trainer"]
    masks = engine["loss_mask"]
    assert sum(int(m.sum()) for m in masks) == 6 + 2 + 9 + 4
    target = _masked(engine["teacher_logprobs"], masks)
    assert (target - _masked(trainer["teacher_logprobs"], masks)).abs().max() < TOL
    assert torch.equal(_masked(engine["teacher_topk_ids"], masks), _masked(trainer["teacher_topk_ids"], masks))
    head = _masked(engine["teacher_topk_logprobs"], masks)
    assert (head - _masked(trainer["teacher_topk_logprobs"], masks)).abs().max() < TOL
    assert 0 < head.exp().sum(-1).min() and head.exp().sum(-1).max() < 1  # a real head, not the whole mass
    # negative control: another teacher's engine
    assert (_masked(run["other"], masks) - target).abs().max() > 100 * TOL


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.parametrize(
    ("loss", "k"), [("k1", K), ("k3", K), ("forward_kl_topk", load_model_config(MODEL).vocab_size)]
)
def test_the_per_token_losses_agree(run, loss, k):
    engine, trainer = _losses(run[k]["engine"], loss), _losses(run[k]["trainer"], loss)
    assert engine.abs().max() > 1e-3  # the losses are not trivially zero
    assert (engine - trainer).abs().max() < 2e-5  # measured <= 5e-6 (k3, up to its clamp at 10)
