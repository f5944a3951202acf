"""What every launcher checks before it starts ``empg train`` on many processes, in one place:
``launchers/torchrun.sh``, ``launchers/slurm/train.sbatch`` (as ``python -m``) and
``launchers/nemo_run_launch.py`` (imported) all call ``resolve_launch``.

    python -m megatron_empg.trainer.bind.launch_check --prog NAME --world-size N [--tasks-per-node T]
        [--gpus-per-node G] [--cpu] [--checked-for TEXT] CONFIG.yaml [a.b.c=value ...]

prints the overrides to run with, one per line (the given ones, then the CPU defaults they do not
set), or exits with code 2 and ``NAME: error: <field>: <what was expected> (checked for TEXT)``.

Where torch is importable (the launchers in the container) it runs the whole bind step
(``trainer.bind.build.bind``: every name, argument and limit; the files are left to ``empg train``,
which checks them first thing on the nodes that see them); without torch (a login node with just
PyYAML, nemo-run's environment) the layout (``trainer.bind.layout``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from megatron_empg.config import ConfigError

# Without GPUs (gloo) the vLLM engine cannot live inside a training rank of a world > 1: the engine
# core runs in its own process (beside its owner rank) and weights reach it through files in /dev/shm.
CPU_DEFAULTS = ("rollout.in_process=false", "weight_sync.transport=shm_file")


def resolve_launch(
    config: str,
    overrides: list[str],
    *,
    world_size: int,
    tasks_per_node: int | None = None,
    gpus_per_node: int = 0,
    cpu: bool = False,
) -> list[str]:
    """The overrides to launch ``config`` with on ``world_size`` processes (``tasks_per_node`` per
    node, each with one of ``gpus_per_node`` GPUs; ``cpu``: gloo ranks, the CPU defaults added where
    the overrides do not set them), after checking that the resolved config fits that layout.

    Raises ``ConfigError`` naming the field (or the launcher option) that does not fit, or the
    config file that cannot be read."""
    from megatron_empg.trainer.cli import load_run_config

    if cpu and gpus_per_node:
        raise ConfigError("--gpus-per-node", f"must be 0 for a CPU (gloo) run, got {gpus_per_node}")
    resolved = list(overrides)
    if cpu:
        given = {o.split("=", 1)[0] for o in overrides}
        resolved += [d for d in CPU_DEFAULTS if d.split("=", 1)[0] not in given]
    run = load_run_config(config, resolved)
    if gpus_per_node and tasks_per_node is not None:
        if tasks_per_node > gpus_per_node:
            raise ConfigError(
                "tasks per node", f"{tasks_per_node} exceeds the {gpus_per_node} GPUs per node (one rank per GPU)"
            )
        tp = run.parallel.tensor_model_parallel_size
        if tasks_per_node % tp:
            raise ConfigError(
                "parallel.tensor_model_parallel_size",
                f"{tp} does not divide the {tasks_per_node} tasks (GPUs) per node: a tensor-parallel group "
                f"must sit within one node",
            )
    if gpus_per_node and run.rollout.tensor_parallel_size > gpus_per_node:
        raise ConfigError(
            "rollout.tensor_parallel_size",
            f"{run.rollout.tensor_parallel_size} exceeds the {gpus_per_node} GPUs per node (the engine sits on one node)",
        )
    if importlib.util.find_spec("torch") is not None:
        from megatron_empg.trainer.bind.build import bind

        bind(run, world_size, check_paths=False)
    else:
        from megatron_empg.trainer.bind.layout import check_layout

        check_layout(run, run.model_config(), world_size)
    return resolved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_empg.trainer.bind.launch_check",
        description="Check a launch layout against a config; print the overrides to run with.",
    )
    parser.add_argument("--prog", default="launch_check", help="the launcher's name, for the error message")
    parser.add_argument("--world-size", type=int, required=True, help="processes in all")
    parser.add_argument("--tasks-per-node", type=int, help="processes per node")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: none)")
    parser.add_argument("--cpu", action="store_true", help="gloo ranks: add the CPU defaults the overrides lack")
    parser.add_argument("--checked-for", default="", help="what the error message says was checked")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)  # overrides before and after the options
    try:
        if args.world_size < 1:
            raise ConfigError("world size", f"must be >= 1, got {args.world_size}")
        resolved = resolve_launch(
            args.config,
            args.overrides,
            world_size=args.world_size,
            tasks_per_node=args.tasks_per_node,
            gpus_per_node=args.gpus_per_node,
            cpu=args.cpu,
        )
    except ConfigError as error:
        where = f" (checked for {args.checked_for})" if args.checked_for else ""
        sys.stderr.write(f"{args.prog}: error: {error}{where}\n")
        return 2
    sys.stdout.write("".join(f"{o}\n" for o in resolved))
    return 0


if __name__ == "__main__":
    sys.exit(main())
