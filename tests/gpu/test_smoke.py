"""The GPU smoke test: two RL steps of a small model through ``empg train`` on one GPU, with the
transformers engine (the lent GPU machine has no vLLM), in float32 and in bf16.

What it exercises that no CPU test can: the micro-batches on the model's device, the NCCL process
group of one, Megatron, the EMA anchor and the checkpoint on CUDA, the engine sleeping (weights off
the GPU) between the rollout and the weight sync, and the consistency gate between the trainer's
and the engine's CUDA kernels. ``benchmarks/gpu_smoke.sh`` runs it; with ``EMPG_GPU_RESULTS_DIR``
set, each run's records and the device go to ``smoke_<dtype>.json`` there. Skipped without CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import run_train
from tests.trainer.hf_runs import hf_engine_config, random_demo_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The gate's tolerance per dtype: float32 kernels of the two stacks agree to ~1e-5 (CPU: 3e-5 over
# the demo's first 300 syncs); bf16 is the recipes' 0.25 (a layout bug gives 0.2 to 2.6, docs/engines.md).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_rl_steps_on_one_gpu(tmp_path, dtype):
    config = hf_engine_config(tmp_path, "run", random_demo_model(tmp_path / "model"), steps=2)
    config["train"]["params_dtype"] = dtype
    config["rollout"].update(dtype=dtype, sleep_while_training=True, sleep_level=2)
    config["algorithm"]["anchor"]["compute_dtype"] = dtype
    config["weight_sync"]["gate_tolerance"] = TOLERANCE[dtype]
    out = run_train(config, tmp_path, "run", timeout=600)
    assert out.returncode == 0, out.stderr[-6000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["actor/lr"] > 0 and record["actor/grad_norm"] > 0 and record["anchor/updates"] >= 0
        assert 0 <= record["sync/gate_max_logprob_diff"] <= TOLERANCE[dtype]
        # the device peak of each phase (trainer.run.device_memory): the update holds the most
        peaks = {k.removeprefix("memory/peak_gib/"): v for k, v in record.items() if k.startswith("memory/peak_gib/")}
        assert {"rollout", "old_pass", "anchor_pass", "update", "weight_sync"} <= peaks.keys(), sorted(peaks)
        assert 0 < peaks["old_pass"] <= peaks["update"], peaks
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
    results = os.environ.get("EMPG_GPU_RESULTS_DIR")
    if results:
        device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
        Path(results, f"smoke_{dtype}.json").write_text(json.dumps({"device": device, "records": records}, indent=1))
