"""launchers/torchrun.sh without training: a stand-in ``torchrun`` prints the command line it gets
(and the signals torchrun is told to forward), a stand-in ``nvidia-smi`` lists GPUs or fails. The
real launch, on 2 gloo ranks, is tested in tests/trainer/test_trainer_multirank.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "launchers" / "torchrun.sh"
RECIPE = "recipes/demo_cpu.yaml"  # 16 prompts x 8 samples, micro-batches of 64
CPU_DEFAULTS = ["rollout.in_process=false", "weight_sync.transport=shm_file"]
TORCHRUN_PREFIX = ["--standalone", "--nproc-per-node"]
MODULE = ["-m", "megatron_empg.trainer.cli", "train", RECIPE]


def _launch(tmp_path: Path, *args: str, gpus: int | None = None, nproc: int | None = None):
    """Run the launcher with stand-ins on PATH; ``gpus`` None: nvidia-smi fails (no driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake_torchrun = bin_dir / "torchrun"
    fake_torchrun.write_text('#!/bin/sh\necho "signals=$PET_SIGNALS_TO_HANDLE"\necho "$@"\n')
    smi = bin_dir / "nvidia-smi"
    if gpus is None:
        smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    else:
        smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus)))
    for tool in (fake_torchrun, smi):
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "TORCHRUN", "PET_SIGNALS_TO_HANDLE")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=sys.executable)
    if nproc is not None:
        env["NPROC_PER_NODE"] = str(nproc)
    return subprocess.run([str(LAUNCHER), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def _torchrun_args(done: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    assert done.returncode == 0, done.stderr
    signals, args = done.stdout.splitlines()
    return signals, args.split()


def test_cpu_defaults_two_processes_and_resume_pass_through(tmp_path):
    signals, args = _torchrun_args(_launch(tmp_path, RECIPE, "train.micro_batch_size=8", "--resume"))
    assert args == [*TORCHRUN_PREFIX, "2", *MODULE, "train.micro_batch_size=8", *CPU_DEFAULTS, "--resume"]
    assert signals == "signals=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def test_the_users_engine_settings_win(tmp_path):
    _, args = _torchrun_args(_launch(tmp_path, RECIPE, "rollout.in_process=true", nproc=1))
    assert args == [*TORCHRUN_PREFIX, "1", *MODULE, "rollout.in_process=true", "weight_sync.transport=shm_file"]


def test_gpus_set_the_process_count_and_no_cpu_defaults(tmp_path):
    own = ["train.micro_batch_size=8", *CPU_DEFAULTS]  # 4 replicas of 4 prompts x 8 samples
    _, args = _torchrun_args(_launch(tmp_path, RECIPE, *own, gpus=4))
    assert args == [*TORCHRUN_PREFIX, "4", *MODULE, *own]
    # without them, 4 ranks and an in-process engine: refused before torchrun starts
    done = _launch(tmp_path, RECIPE, "train.micro_batch_size=8", gpus=4)
    assert done.returncode == 2 and done.stdout == ""
    assert "rollout.in_process: true needs a world of one process" in done.stderr
    assert "(checked for NPROC_PER_NODE=4)" in done.stderr


@pytest.mark.parametrize(
    "args, nproc, message",
    [
        (
            ["parallel.tensor_model_parallel_size=2"],
            3,
            "parallel.tensor_model_parallel_size: the world of 3 processes is not divisible by "
            "parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = 2 x 1",
        ),
        (["parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=2"], 2, "= 2 x 2"),
        ([], 4, "train.micro_batch_size: must divide each data-parallel replica's samples"),  # 64 > 16 / 4 x 8
        (
            ["train.prompts_per_step=3", "train.micro_batch_size=4"],
            2,
            "train.prompts_per_step: must be divisible by the data-parallel size 2",
        ),
        (["train.stepz=3"], 2, "train.stepz"),
        (["--steps=3"], 2, "unknown option --steps=3"),
    ],
)
def test_bad_layouts_and_arguments_exit_2_naming_the_field(tmp_path, args, nproc, message):
    done = _launch(tmp_path, RECIPE, *args, nproc=nproc)
    assert done.returncode == 2 and done.stdout == "", done
    assert message in done.stderr


def test_more_processes_than_gpus_exit_2(tmp_path):
    done = _launch(tmp_path, RECIPE, "train.micro_batch_size=8", *CPU_DEFAULTS, gpus=2, nproc=4)
    assert done.returncode == 2 and done.stdout == ""
    message = "tasks per node: 4 exceeds the 2 GPUs per node (one rank per GPU) (checked for NPROC_PER_NODE=4)"
    assert message in done.stderr


def test_bad_process_count_and_no_config_exit_2(tmp_path):
    done = _launch(tmp_path, RECIPE, nproc=0)
    assert done.returncode == 2 and "NPROC_PER_NODE must be a positive integer, got '0'" in done.stderr
    done = _launch(tmp_path)
    assert done.returncode == 2 and "launchers/torchrun.sh CONFIG.yaml" in done.stderr
    done = _launch(tmp_path, "recipes/missing.yaml")
    assert done.returncode == 2 and "missing.yaml" in done.stderr
