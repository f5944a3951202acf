"""megatron_empg/trainer/bind/launch_check.py, the layout check every launcher runs before starting ranks:
the overrides it prints and the errors it names (the launchers' own tests run it through them)."""

from __future__ import annotations

import pytest

from megatron_empg.trainer.bind.launch_check import CPU_DEFAULTS, main

RECIPE = "recipes/demo_cpu.yaml"  # 16 prompts x 8 samples, micro-batches of 64, in-process engine
MATH = "recipes/r1_distill_qwen_1.5b_math_ema_pg.yaml"  # 128 prompts x 8 samples, micro-batches of 8


def _check(capsys, *args: str) -> tuple[int, list[str], str]:
    status = main(["--prog", "launcher", *args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def test_cpu_adds_the_defaults_the_overrides_do_not_set(capsys):
    status, overrides, _ = _check(capsys, "--world-size", "2", "--cpu", RECIPE, "train.micro_batch_size=8")
    assert status == 0 and overrides == ["train.micro_batch_size=8", *CPU_DEFAULTS]
    status, overrides, _ = _check(
        capsys, "--world-size", "1", "--cpu", RECIPE, "weight_sync.transport=in_process", "rollout.in_process=true"
    )
    assert status == 0 and overrides == ["weight_sync.transport=in_process", "rollout.in_process=true"]


def test_gpus_get_the_overrides_as_given(capsys):
    args = ("--world-size", "16", "--tasks-per-node", "8", "--gpus-per-node", "8", MATH, "train.seed=3")
    assert _check(capsys, *args) == (0, ["train.seed=3"], "")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "--world-size",
                "16",
                "--tasks-per-node",
                "8",
                "--gpus-per-node",
                "8",
                MATH,
                "parallel.tensor_model_parallel_size=16",
            ],
            "parallel.tensor_model_parallel_size: 16 does not divide the 8 tasks (GPUs) per node: a tensor-parallel group "
            "must sit within one node",
        ),
        (
            [
                "--world-size",
                "8",
                "--tasks-per-node",
                "4",
                "--gpus-per-node",
                "8",
                MATH,
                "parallel.tensor_model_parallel_size=8",
            ],
            "parallel.tensor_model_parallel_size: 8 does not divide the 4 tasks (GPUs) per node",
        ),
        (
            ["--world-size", "16", "--tasks-per-node", "16", "--gpus-per-node", "8", MATH],
            "tasks per node: 16 exceeds the 8 GPUs per node (one rank per GPU)",
        ),
        (
            [
                "--world-size",
                "16",
                "--tasks-per-node",
                "8",
                "--gpus-per-node",
                "8",
                MATH,
                "rollout.engines=single",
                "rollout.tensor_parallel_size=16",
            ],
            "rollout.tensor_parallel_size: 16 exceeds the 8 GPUs per node (the engine sits on one node)",
        ),
        (
            ["--world-size", "8", MATH, "rollout.engines=3"],
            "rollout.engines: 3 engines must divide the data-parallel size 8",
        ),
        (
            ["--world-size", "8", MATH, "parallel.tensor_model_parallel_size=2"],
            "rollout.tensor_parallel_size: 1 must equal parallel.tensor_model_parallel_size=2 with 4 engines",
        ),
        (
            ["--world-size", "6", MATH, "parallel.pipeline_model_parallel_size=4"],
            "parallel.tensor_model_parallel_size: the world of 6 processes is not divisible by",
        ),
        (
            ["--world-size", "2", "--cpu", "--gpus-per-node", "2", RECIPE],
            "--gpus-per-node: must be 0 for a CPU (gloo) run, got 2",
        ),
        (["--world-size", "0", RECIPE], "world size: must be >= 1, got 0"),
        (["--world-size", "2", RECIPE], "rollout.in_process: true needs a world of one process"),
        (["--world-size", "2", "recipes/missing.yaml"], "missing.yaml"),
    ],
)
def test_layouts_that_do_not_fit_exit_2_naming_the_field(capsys, args, message):
    status, overrides, err = _check(capsys, "--checked-for", "what was checked", *args)
    assert status == 2 and overrides == []
    assert err.startswith("launcher: error: ") and message in err and err.endswith(" (checked for what was checked)\n")
