"""benchmarks/async_overlap.py at its smallest (3 steps of 4 prompts x 4 samples, the transformers
engine, one round, a 4 MB link payload): the JSON holds every run, the paper model and the link
measurements, with positive, finite numbers (no timing assertions: the numbers are the benchmark's)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "async_overlap.py"
RUNS = {"disaggregated_sync": 3, "disaggregated_one_step_off": 3}  # the colocated reference skipped: CI time
STAGES = {"time/update", "time/old_pass", "time/weight_sync", "sync/seconds", "gate", "stage_sum", "training_stages"}


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smallest_run_writes_the_json(tmp_path, warm_start):
    out = tmp_path / "async_overlap.json"
    args = ["--engine", "hf", "--steps", "3", "--warmup", "0", "--rounds", "1", "--prompts-per-step", "4",
            "--n", "4", "--micro-batch-size", "8", "--link-mb", "4", "--bucket-mb", "1", "--link-repeats", "1",
            "--link-rounds", "1", "--warm-start", str(warm_start), "--runs-dir", str(tmp_path / "runs"),
            "--no-colocated", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=570)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["benchmark"] == "async_overlap" and record["params"]["engine"] == "hf"
    assert record["machine"]["cpu_count"] >= 1 and record["versions"]["torch"]

    assert set(record["runs"]) == set(RUNS)
    for name, processes in RUNS.items():
        run = record["runs"][name]
        assert run["timed_steps"] == 1 and len(run["rounds"]) == 1, name  # step 2 of 3 (1: start-up, 3: last)
        assert run["rounds"][0]["processes"] == processes and run["rounds"][0]["timed_steps"] == [2]
        assert len(run["rounds"][0]["per_step"]) == 3
        assert _positive(run["step_seconds_mean"]) and _positive(run["startup_seconds_mean"]), name
        assert set(run["means"]) >= STAGES, (name, STAGES - set(run["means"]))
        assert all(math.isfinite(v) and v >= 0 for k, v in run["means"].items() if k != "gate"), name
        assert _positive(run["sync_gbytes"])
    off, sync = record["runs"]["disaggregated_one_step_off"], record["runs"]["disaggregated_sync"]
    assert _positive(sync["means"]["time/engine_rollout"]) and _positive(off["means"]["time/engine_rollout"])
    assert "time/rollout_wait" in off["means"] and "time/rollout_wait" not in sync["means"]
    # one step off trains on the samples of the weights before: a staleness of 1 after the first step
    assert off["means"]["staleness_mean"] == 1.0 and sync["means"]["staleness_mean"] == 0.0
    assert all(_positive(v) for v in record["comparison"].values() if not isinstance(v, list))

    model = record["paper_model"]
    assert all(_positive(model["inputs"][k]) for k in ("G_engine_seconds", "Tr_device_seconds", "S_d_seconds"))
    for table in ("with_straggler_floor", "without_straggler_floor"):
        assert set(model[table]) == {"8", "32"}
        for n, row in model[table].items():
            assert all(_positive(v) for v in row.values()), (table, n, row)
            assert 1 <= row["one_step_off_best_k"] < int(n) and 1 <= row["disaggregated_sync_best_k"] < int(n)
            # overlap never loses in the model: max(a, b) <= a + b at every k
            assert row["one_step_off_seconds"] <= row["disaggregated_sync_seconds"] + 1e-12

    link = record["link"]
    assert link["bytes"] == 4 * 2**20 and link["num_buckets"] == 4
    for key in ("link_transport", "pack_bucket_only", "broadcast_prealloc", "broadcast_fresh"):
        assert len(link[key]["seconds_all"]) == 1 and _positive(link[key]["gbps_best"]), key
    assert _positive(link["link_over_broadcast_prealloc_gbps_best"])
