"""benchmarks/weight_sync.py --smoke runs and writes the documented JSON: every measurement moves
exactly the HF model's parameter bytes (no timing assertions: the numbers are the benchmark's).

Without its vLLM engines (CI time: 40 s; the sync into vLLM is tested in tests/weight_sync): run
``python benchmarks/weight_sync.py --smoke --dtypes fp32`` by hand after changing that part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "weight_sync.py"
ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
SUMMARY_KEYS = {"bytes", "repeats", "seconds_all", "seconds_best", "seconds_median", "gbps_best", "gbps_median"}
SYNC_KEYS = SUMMARY_KEYS | {
    "bucket_mb",
    "num_tensors",
    "num_buckets",
    "transport_seconds_best",
    "transport_seconds_median",
    "rest_seconds_best",
    "rest_seconds_median",
    "ratio_to_memcpy_best",
    "ratio_to_memcpy_median",
    "rest_ratio_to_memcpy_best",
}


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "weight_sync.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_common(report: dict, dtypes: list[str]) -> None:
    assert report["benchmark"] == "weight_sync" and report["params"]["smoke"] is True
    machine = report["machine"]
    assert machine["device"].startswith("cpu") and "cpu_model" in machine and "cpu_flags" in machine
    assert "OMP_NUM_THREADS" in machine
    assert report["versions"]["torch"] and "vllm" in report["versions"]
    assert [r["dtype"] for r in report["results"]] == dtypes
    buckets = report["params"]["bucket_mb"]
    assert len(buckets) >= 2
    for result in report["results"]:
        assert result["ok"], result.get("error")
        model = result["model"]
        element = ELEMENT_BYTES[result["dtype"]]
        hf_bytes = model["parameters_hf"] * element
        assert model["parameter_bytes_hf"] == hf_bytes
        # The smoke vocabulary (1000) is padded to 1024 rows in Megatron: more bytes there.
        assert model["parameter_bytes_megatron"] > hf_bytes
        m = result["measurements"]
        assert set(m["memcpy"]) >= SUMMARY_KEYS and m["memcpy"]["bytes"] == hf_bytes
        assert m["param_copy"]["bytes"] == model["parameter_bytes_megatron"]
        for key in ("bridge", "shm_write"):
            assert [e["bucket_mb"] for e in m[key]] == buckets
            for entry in m[key]:
                assert set(entry) >= SYNC_KEYS, (key, set(SYNC_KEYS) - set(entry))
                assert entry["bytes"] == hf_bytes and entry["num_tensors"] == model["num_hf_tensors"]
                assert len(entry["seconds_all"]) == report["params"]["repeats"]
                assert entry["seconds_best"] <= entry["seconds_median"]
        assert m["bridge"][0]["num_buckets"] > m["bridge"][-1]["num_buckets"]  # smaller buckets: more of them
        parts = m["bridge_parts"]
        assert parts["to_hf"]["bytes"] == hf_bytes and parts["to_hf_and_round_trip_check"]["bytes"] == hf_bytes
        diagnosis = parts["diagnosis_round_trip_errors"]
        assert diagnosis["bytes"] == hf_bytes and set(diagnosis["round_trip_error"].values()) == {0.0}
        families = parts["round_trip_by_family"]
        assert {"embedding", "attention.qkv", "mlp.gate_up"} <= set(families)
        assert sum(f["bytes"] for f in families.values()) == model["parameter_bytes_megatron"]
        headline = result["headline"]
        assert headline["bridge_gbps_best"] > 0 and "target_ratio_ge_0.5_met" in headline


def test_smoke_without_vllm_writes_the_json(tmp_path):
    report = _run(tmp_path, "--no-vllm")
    _check_common(report, ["fp32", "bf16"])
    assert report["params"]["vllm"] is False
    assert all("vllm_in_process" not in r["measurements"] for r in report["results"])
