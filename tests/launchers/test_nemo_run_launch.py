"""launchers/nemo_run_launch.py without a cluster: ``--dry-run`` output (the sbatch script nemo-run
generates, the script each task runs, the local torchrun command) and the errors given before
anything is submitted. Jobs on a real Slurm: tests/launchers/test_slurm.py."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launchers" / "nemo_run_launch.py"
RECIPE = "recipes/demo_cpu.yaml"  # 16 prompts x 8 samples per step, micro-batches of 64
MATH = "recipes/r1_distill_qwen_1.5b_math_ema_pg.yaml"  # 128 prompts x 8 samples, micro-batches of 8
IMAGE = "nvcr.io/nvidia/pytorch:25.12-py3"


def _launch(python: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The launcher with its experiments under ``tmp_path / "home"`` (NEMORUN_HOME)."""
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "COLUMNS": "1000"}  # COLUMNS: rich does not wrap
    return subprocess.run(
        [python, str(LAUNCH), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def _experiments(tmp_path: Path) -> list[Path]:
    """What is left of experiments in NEMORUN_HOME (a dry run removes its own)."""
    return sorted((tmp_path / "home" / "experiments").glob("*/*"))


def test_slurm_dry_run_prints_the_sbatch_script_with_container_and_srun(nemo_run_python, tmp_path):
    done = _launch(
        nemo_run_python,
        tmp_path,
        "slurm",
        "--account",
        "acct",
        "--partition",
        "batch",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--container-image",
        IMAGE,
        "--container-mounts",
        "/data:/data,/ckpt:/ckpt",
        "--time",
        "01:00:00",
        "--dry-run",
        MATH,
        "rollout.in_process=false",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    for flag in (
        "--account=acct",
        "--partition=batch",
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--time=01:00:00",
        "--signal=USR1@300",
        "--open-mode=append",
    ):
        assert f"#SBATCH {flag}\n" in out, flag
    assert "Run with: sbatch --requeue --parsable" in out and "export TORCHX_MAX_RETRIES=3\n" in out
    assert "export MASTER_ADDR=$head_node\n" in out and "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))\n" in out
    srun = [line for line in out.splitlines() if line.startswith("srun --output")]
    assert len(srun) == 1, out
    mounts = re.search(r"--container-mounts (\S+)", srun[0]).group(1).split(",")
    assert f"--container-image {IMAGE} " in srun[0] and mounts[:2] == ["/data:/data", "/ckpt:/ckpt"]
    assert mounts[2].endswith("/train:/nemo_run") and "--container-workdir /nemo_run/code" in srun[0]
    assert srun[0].endswith("--kill-on-bad-exit=1 bash /nemo_run/scripts/train.sh")
    # the task script: one rank, resumed when requeued, exit 75 after a pre-emption signal
    task = out.split("# ---- each task runs ")[1]
    assert f"python -m megatron_empg.trainer.cli train {MATH} rollout.in_process=false $resume\n" in task
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=--resume; fi' in task
    assert "trap 'stopped=1' USR1" in task
    assert 'if [ "$status" -eq 0 ] && [ "$stopped" -eq 1 ]; then exit 75; fi' in task
    assert _experiments(tmp_path) == []


def test_slurm_dry_run_cpu_adds_the_cpu_defaults_and_no_gpus(nemo_run_python, tmp_path):
    done = _launch(
        nemo_run_python,
        tmp_path,
        "slurm",
        "--account",
        "acct",
        "--gpus-per-node",
        "0",
        "--ntasks-per-node",
        "2",
        "--python",
        "/venv/bin/python",
        "--packager",
        "none",
        "--dry-run",
        RECIPE,
        "train.micro_batch_size=16",
        "--resume",
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "#SBATCH --gpus-per-node" not in done.stdout and "#SBATCH --ntasks-per-node=2\n" in done.stdout
    assert "--container-image" not in done.stdout
    task = done.stdout.split("# ---- each task runs ")[1]
    assert f"cd {REPO}\n" in task  # --packager none: this checkout, in place
    assert (
        f"/venv/bin/python -m megatron_empg.trainer.cli train {RECIPE} train.micro_batch_size=16 "
        "rollout.in_process=false weight_sync.transport=shm_file --resume $resume\n"
    ) in task


def test_local_dry_run_is_torchrun_with_the_cpu_defaults(nemo_run_python, tmp_path):
    done = _launch(
        nemo_run_python, tmp_path, "local", "--nproc-per-node", "2", "--dry-run", RECIPE, "train.micro_batch_size=16"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    args = re.findall(r"'([^']*)'", done.stdout.split("'args': [", 1)[1].split("]", 1)[0])
    assert args[0] == "torchrun" and args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("-m") :] == [
        "-m",
        "megatron_empg.trainer.cli",
        "train",
        RECIPE,
        "train.micro_batch_size=16",
        "rollout.in_process=false",
        "weight_sync.transport=shm_file",
    ]
    assert _experiments(tmp_path) == []


SLURM_GPU = ["slurm", "--account", "acct", "--nodes", "2", "--gpus-per-node", "8"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [*SLURM_GPU, MATH, "parallel.tensor_model_parallel_size=16", "rollout.in_process=false"],
            "parallel.tensor_model_parallel_size: 16 does not divide the 8 tasks (GPUs) per node: a tensor-parallel group "
            "must sit within one node (checked for 2 nodes x 8 tasks, 8 GPUs per node)",
        ),
        (
            [*SLURM_GPU, MATH, "parallel.tensor_model_parallel_size=3", "rollout.in_process=false"],
            "parallel.tensor_model_parallel_size: 3 does not divide the 8 tasks (GPUs) per node",
        ),
        (
            [*SLURM_GPU, MATH, "parallel.pipeline_model_parallel_size=3", "rollout.in_process=false"],
            "parallel.tensor_model_parallel_size: the world of 16 processes is not divisible by "
            "parallel.tensor_model_parallel_size x parallel.pipeline_model_parallel_size = 1 x 3",
        ),
        (
            [*SLURM_GPU, MATH, "parallel.tensor_model_parallel_size=8", "rollout.in_process=false"],
            "parallel.tensor_model_parallel_size: tensor_model_parallel_size=8 does not divide model.num_attention_heads=12",
        ),
        (
            [*SLURM_GPU, "--ntasks-per-node", "16", MATH, "rollout.in_process=false"],
            "tasks per node: 16 exceeds the 8 GPUs per node (one rank per GPU)",
        ),
        ([*SLURM_GPU, RECIPE], "rollout.in_process: true needs a world of one process"),
        (
            [*SLURM_GPU, "--container-image", IMAGE, MATH, "rollout.in_process=false", "train.prompts_per_step=100"],
            "train.prompts_per_step: must be divisible by the data-parallel size 16",
        ),
        (
            ["slurm", "--account", "acct", "--gpus-per-node", "0", RECIPE],
            "--ntasks-per-node: must be given with --gpus-per-node 0",
        ),
        (
            [
                "slurm",
                "--account",
                "acct",
                "--gpus-per-node",
                "0",
                "--ntasks-per-node",
                "2",
                "--container-image",
                IMAGE,
                RECIPE,
            ],
            "--container-image: CPU runs (--gpus-per-node 0) run without a container",
        ),
        ([*SLURM_GPU, "--tunnel", "ssh", "--host", "login", MATH], "--user: is required with --tunnel ssh"),
        ([*SLURM_GPU, "--nodes", "0", MATH], "--nodes: must be >= 1, got 0"),
        (["local", "--nproc-per-node", "2", "recipes/missing.yaml"], "missing.yaml"),
        (["local", "--nproc-per-node", "2", RECIPE, "train.stepz=3"], "train.stepz"),
    ],
)
def test_bad_layouts_exit_2_naming_the_field_before_submitting(nemo_run_python, tmp_path, args, message):
    done = _launch(nemo_run_python, tmp_path, args[0], "--dry-run", *args[1:])  # a layout wrongly accepted: no job
    assert done.returncode == 2 and message in done.stderr, done.stderr[-4000:]
    assert not (tmp_path / "home").exists()  # nemo-run was not even imported


def test_a_job_directory_that_nemo_run_would_rewrite_is_refused(nemo_run_python, tmp_path):
    done = _launch(
        nemo_run_python,
        tmp_path,
        "slurm",
        "--account",
        "acct",
        "--gpus-per-node",
        "0",
        "--ntasks-per-node",
        "2",
        "--job-dir",
        "/scratch/nemo_run/jobs",
        "--dry-run",
        RECIPE,
    )
    assert done.returncode == 2, done.stderr
    assert "--job-dir: /scratch/nemo_run/jobs contains '/nemo_run', which nemo-run rewrites" in done.stderr
