"""launchers/slurm/train.sbatch without Slurm: its #SBATCH defaults and its refusal to run outside a
job. Its jobs on a real Slurm: tests/launchers/test_slurm.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launchers" / "slurm" / "train.sbatch"


def _directives() -> dict[str, str]:
    """The #SBATCH options sbatch reads: those before the first command."""
    options = {}
    for line in SBATCH.read_text().splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        match = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?$", line)
        if match:
            options[match.group(1)] = match.group(2) or ""
    return options


def test_sbatch_defaults_one_task_per_gpu_requeue_and_the_preemption_warning():
    options = _directives()
    assert options["ntasks-per-node"] == options["gpus-per-node"]  # one task (rank) per GPU
    assert int(options["nodes"]) >= 2 and options["output"].startswith("logs/") and options["open-mode"] == "append"
    assert "requeue" in options and re.fullmatch(r"B:USR1@\d+", options["signal"])  # SIGUSR1 to the script


def test_outside_a_job_it_exits_2():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", str(SBATCH), "recipes/demo_cpu.yaml"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "train.sbatch: error: not inside a Slurm job: submit with sbatch" in done.stderr
