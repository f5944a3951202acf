"""benchmarks/anchor_sweep.py on two short runs (the tests' warm start): the JSON holds each run's
measurements, the exact KL to the initial policy is 0 only where the policy did not move, and a
second call reuses the finished runs instead of training again."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.anchor_sweep import main

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast


@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_two_short_runs_then_resume(tmp_path, warm_start):
    args = [
        "--anchors",
        "fixed_topk",
        "reset_topk",
        "--kl-coefs",
        "0.2",
        "--seeds",
        "0",
        "--steps",
        "2",
        "--window",
        "1",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--out",
        str(tmp_path / "sweep.json"),
        "--warm-start",
        str(warm_start),
    ]
    assert main(args) == 0
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0
    runs = {anchor: record["results"][anchor]["0.2"]["per_seed"]["0"] for anchor in ("fixed_topk", "reset_topk")}
    for anchor, run in runs.items():
        assert set(run) >= {"train_accuracy_last", "kl_to_anchor_last", "kl_to_initial", "entropy", "heldout_accuracy"}
        # two updates moved the policy a little: a small, positive KL to where it started
        assert 0 < run["kl_to_initial"] < 0.1 and math.isfinite(run["entropy"]) and run["entropy"] > 0, anchor
        assert 0 <= run["heldout_accuracy"] <= 1
        assert len(record["curves"][anchor]["0.2"]["0"]["reward/accuracy"]) == 2
    # the reset anchor is pi_old: its KL at each step's single update is 0; the fixed one has moved away
    assert runs["reset_topk"]["kl_to_anchor_last"] == pytest.approx(0.0, abs=1e-6)
    assert runs["fixed_topk"]["kl_to_anchor_last"] > 1e-7
    logs = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/train.log")}
    assert len(logs) == 2 and main(args) == 0  # finished runs are read back, not run again
    assert {p: p.stat().st_mtime_ns for p in logs} == logs
