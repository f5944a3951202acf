"""What ``empg train`` prints: ``console.configure_logging`` (run in a subprocess each: logging and
the environment are process-global) and a real run of the CPU demo recipe without a terminal.

The run (2 steps, one process, a checkpoint after each, output captured) prints a line per step
and the summary on stdout (7 lines) and, on stdout and stderr together, 26 lines when measured:
vLLM's, Megatron-Core's and torch's start-up warnings (15), our INFO lines (4). The same recipe
printed 96 lines for 3 steps before this console set-up: 23 lines of vLLM INFO and 17 of vLLM
warnings (one of each after every weight sync), 26 lines of Megatron-Core INFO, 11 Python warnings
of two lines each, 3 Megatron-Core warnings, and of the rich bar only one truncated line at the end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest

from megatron_empg.trainer.run.metrics_log import console_line, read_metrics
from tests.trainer.demo_runs import REPO, demo_config, run_train

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast

# Logs a record at INFO and at WARNING on each logger after configure_logging(third_party_level=
# argv[1], rank=argv[2], world_size=argv[3]), with torch imported before the call and vLLM and
# transformers after it (as empg train does), then warns as Megatron-Core's code and ours would;
# prints the environment variables that a child process inherits.
SCRIPT = r"""
import json, logging, os, sys, warnings
import torch
from megatron_empg.config import LoggingConfig
from megatron_empg.trainer.run.console import configure_logging

level, rank, world, with_vllm, site = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
configure_logging(LoggingConfig(third_party_level=level), rank=rank, world_size=world)
from transformers.utils import logging as transformers_logging
loggers = [logging.getLogger(n) for n in ("megatron.core.optimizer", "torch.distributed", "urllib3.connectionpool",
                                          "megatron_empg.trainer.loop")]
loggers.append(transformers_logging.get_logger("transformers.modeling_utils"))
if with_vllm:
    from vllm.logger import init_logger
    loggers.append(init_logger("vllm.engine.llm_engine"))
for logger in loggers:
    logger.info("info of %s", logger.name)
    logger.warning("warning of %s", logger.name)
megatron_file = os.path.join(site, "megatron", "core", "optimizer", "__init__.py")
warnings.warn_explicit("Apex is not installed", UserWarning, megatron_file, 25)
warnings.warn_explicit("overflow in exp", RuntimeWarning, megatron_file, 26)
warnings.warn_explicit("our own warning", UserWarning, os.path.join("megatron_empg", "trainer", "loop.py"), 1)
names = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY")
print(json.dumps({name: os.environ.get(name) for name in names}))
"""
HAS_VLLM = importlib.util.find_spec("vllm") is not None
THIRD_PARTY = ["megatron.core.optimizer", "torch.distributed", "urllib3.connectionpool", "transformers.modeling_utils"]
THIRD_PARTY += ["vllm.engine.llm_engine"] if HAS_VLLM else []
OURS = "megatron_empg.trainer.loop"


def _configure(level: str = "WARNING", rank: int = 0, world: int = 1, **env: str) -> tuple[dict, str]:
    """The script's environment variables and its stderr (where every record goes)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TRANSFORMERS_", "HF_HUB_", "TORCH_"))}
    args = [level, str(rank), str(world), "1" if HAS_VLLM else "0", sysconfig.get_paths()["purelib"]]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_third_party_info_is_dropped_and_warnings_kept():
    environment, stderr = _configure()
    for name in THIRD_PARTY:
        assert f"info of {name}" not in stderr
        assert f"warning of {name}" in stderr
    assert re.search(rf"^\S+ \S+ INFO {OURS}: info of {OURS}$", stderr, re.MULTILINE)  # no rank prefix in a world of 1
    # Python warnings: a library's note about itself is INFO, a runtime warning and ours stay WARNING
    assert "Apex is not installed" not in stderr
    runtime = r"WARNING megatron: .*optimizer.__init__\.py:26: RuntimeWarning: overflow in exp$"
    assert re.search(runtime, stderr, re.MULTILINE)
    assert re.search(r"WARNING megatron_empg: .*loop\.py:1: UserWarning: our own warning$", stderr, re.MULTILINE)
    assert environment == {
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        "TRANSFORMERS_VERBOSITY": "warning",
        "HF_HUB_VERBOSITY": "warning",
    }


def test_info_restores_third_party_info_and_other_ranks_keep_only_our_warnings():
    environment, stderr = _configure("INFO", rank=1, world=2)
    for name in THIRD_PARTY:
        restored = not name.startswith(("torch", "transformers"))  # quieter by default: they stay at WARNING
        assert (f"info of {name}" in stderr) == restored, name
        assert f"warning of {name}" in stderr
    assert f"info of {OURS}" not in stderr
    assert re.search(rf"^\S+ \S+ \[rank 1\] WARNING {OURS}: warning of {OURS}$", stderr, re.MULTILINE)
    assert re.search(r"INFO megatron: .*: UserWarning: Apex is not installed$", stderr, re.MULTILINE)
    assert environment["VLLM_LOGGING_LEVEL"] == "INFO" and environment["TRANSFORMERS_VERBOSITY"] == "warning"


def test_a_users_own_environment_is_kept():
    environment, stderr = _configure(VLLM_LOGGING_LEVEL="INFO", TRANSFORMERS_VERBOSITY="error")
    assert environment["VLLM_LOGGING_LEVEL"] == "INFO" and environment["TRANSFORMERS_VERBOSITY"] == "error"
    assert "warning of transformers.modeling_utils" not in stderr
    if HAS_VLLM:
        assert "info of vllm.engine.llm_engine" in stderr
    assert "info of megatron.core.optimizer" not in stderr


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
def test_a_run_without_a_terminal_prints_a_line_per_step_and_a_summary(tmp_path, warm_start):
    pytest.importorskip("vllm")
    config = demo_config(tmp_path, "run", warm_start, steps=2)
    config["logging"]["progress"] = "auto"  # the default; demo_config turns the console off
    result = run_train(config, tmp_path, "run")
    assert result.returncode == 0, result.stderr[-5000:]
    out = result.stdout.splitlines()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [line for line in out if line.startswith("step ")] == [
        console_line(r["step"], 2, {k: v for k, v in r.items() if k != "step"}) for r in records
    ]
    assert [r["step"] for r in records] == [1, 2]
    assert re.fullmatch(r"run summary: steps 1\.\.2 of 2, \d+ s", out[2])
    assert out[3].startswith("  reward/mean: best ")
    assert out[4] == f"  metrics:     {tmp_path / 'run' / 'metrics.jsonl'}"
    assert out[6] == f"  checkpoints: {tmp_path / 'run' / 'checkpoints'}"
    assert len(out) == 7
    everything = out + result.stderr.splitlines()
    assert len(everything) <= 40, "\n".join(everything)  # 26 measured
    assert not [line for line in everything if re.match(r"\(\w+ pid=\d+\) INFO ", line)]  # vLLM's INFO format
    infos = [line for line in everything if re.match(r"\S+ \S+ INFO ", line)]
    assert all(" INFO megatron_empg." in line for line in infos), infos
