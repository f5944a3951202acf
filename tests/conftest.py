"""Fixtures shared by the test packages, built once per session (trainer and launcher tests): the CPU
demo's warm start, and a one-process run of the small demo config that multi-rank runs are checked
against; the order in which the test files run."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def pytest_report_header(config) -> str:
    """The vector width torch's CPU kernels run at (``ATEN_CPU_CAPABILITY`` lowers it): summation
    orders, and so the last bits of every float, depend on it (docs/testing.md)."""
    return f"torch CPU capability: {_cpu_capability()} (ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')})"


def pytest_sessionstart(session) -> None:
    """A capability asked for and not granted (a name torch does not know, or one above the CPU's)
    would run the suite at the native width while claiming another: stop instead."""
    wanted = os.environ.get("ATEN_CPU_CAPABILITY")
    if wanted and _cpu_capability().lower() != wanted.lower():
        pytest.exit(f"ATEN_CPU_CAPABILITY={wanted} but torch runs at {_cpu_capability()}", returncode=2)


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most expensive tests first (each file's tests in their order): ``make
    test`` hands whole files to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``; xdist's own order puts the files with the most tests first, and the
    long multi-rank files, with few tests each, last), so the long ones start early and the short
    ones fill in behind them instead of one worker finishing a long file alone. A slow test weighs
    3, one that starts processes or ranks 1, any other 0."""
    weight = collections.Counter()
    for item in items:
        if item.get_closest_marker("slow"):
            weight[item.path] += 3
        elif any(item.get_closest_marker(m) for m in ("dist", "process", "vllm", "slurm")):
            weight[item.path] += 1
    first_seen = {path: i for i, path in reversed(list(enumerate(item.path for item in items)))}
    items.sort(key=lambda item: (-weight[item.path], first_seen[item.path]))


SLOWEST_FILES = 10


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The files that took longest (setup, call and teardown of their tests summed; with xdist, on
    whichever worker ran them): where the suite's time goes, file by file."""
    seconds: dict[str, float] = collections.defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid") and report.nodeid:
                seconds[report.nodeid.split("::")[0]] += report.duration
    if not seconds:
        return
    terminalreporter.section(f"slowest {min(SLOWEST_FILES, len(seconds))} files")
    for path, total in sorted(seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{total:8.1f}s  {path}")


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory) -> Path:
    """A short version of the demo's warm start (tools/make_demo_model.py, 300 steps instead of
    ~3700, without the restating habit: a few percent of its samples are correct, which the tests'
    few steps of 4 prompts need to see rewards): the model, tokenizer and files ``make demo``
    builds, in about 15 s."""
    from tools.make_demo_model import make_demo_model

    out = tmp_path_factory.mktemp("demo") / "warm_start"
    make_demo_model(out, steps=300, stop_accuracy=0.0, eval_problems=16, restate_fraction=0.0, log=lambda _: None)
    return out


@pytest.fixture(scope="session")
def small_demo_reference(tmp_path_factory, warm_start) -> list[dict]:
    """The per-step metrics of ``small_demo_config`` run in one process (in-process engine) for
    ``REFERENCE_STEPS`` steps: what a run of it on several ranks, or pre-empted and resumed, must
    reproduce (``demo_runs.assert_same_steps``)."""
    pytest.importorskip("vllm")
    from megatron_empg.trainer.run.metrics_log import read_metrics
    from tests.trainer.demo_runs import (
        LAUNCH_TIMEOUT_S,
        REFERENCE_STEPS,
        run_train,
        small_demo_config,
    )

    tmp = tmp_path_factory.mktemp("single")
    done = run_train(
        small_demo_config(tmp, "single", warm_start, REFERENCE_STEPS), tmp, "single", timeout=LAUNCH_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = read_metrics(tmp / "single" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, REFERENCE_STEPS + 1))
    # What is compared is not trivial: some samples are rewarded, the policy moves (lr > 0 from
    # step 2) and is pulled back by a non-zero KL at step 3.
    first = metrics[:3]
    assert any(m["reward/mean"] > 0 for m in first) and any(abs(m["actor/policy_loss"]) > 1e-3 for m in first)
    assert first[-1]["actor/lr"] > 0 and abs(first[-1]["actor/kl"]) > 1e-5
    return metrics
