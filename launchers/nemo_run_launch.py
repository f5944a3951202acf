"""``empg train`` as a nemo-run experiment: on this machine under torchrun, or on a Slurm cluster.

    python launchers/nemo_run_launch.py local [--nproc-per-node N] CONFIG.yaml [a.b.c=value ...] [--resume]
    python launchers/nemo_run_launch.py slurm --account ACC [--partition P] [--nodes 2] [--gpus-per-node 8]
        [--container-image IMAGE] [--container-mounts /data:/data,...] [--time 04:00:00]
        [--tunnel local|ssh --host H --user U --job-dir DIR] CONFIG.yaml [a.b.c=value ...] [--resume]

Run it from the repository root with an interpreter that has nemo-run (``make launch-venv`` builds
``.venv-launch``: nemo-run and PyYAML, no torch; see launchers/README.md). ``--dry-run`` prints what
would run (the generated sbatch script for Slurm) and submits nothing. The experiment's files and
logs go where nemo-run keeps them: ``$NEMORUN_HOME/experiments/<name>/<id>/`` (default
``~/.nemo_run``), or under ``--job-dir`` on the cluster for an SSH tunnel.

Before anything is submitted, the resolved config is checked against the layout (world size vs
tensor x pipeline parallel sizes, tasks per node vs GPUs per node and the tensor-parallel size, the
prompts' split over data-parallel replicas; ``megatron_empg/trainer/bind/launch_check.py``, shared with
the shell launchers): exit code 2 and a message naming the field otherwise. Without GPUs (``local``
on a machine without them, ``slurm --gpus-per-node 0``) the ranks run on gloo with
``rollout.in_process=false weight_sync.transport=shm_file`` unless the command line sets them.

On Slurm each task is one rank (empg maps SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to
RANK/WORLD_SIZE/LOCAL_RANK). ``--signal-seconds`` before the time limit Slurm sends SIGUSR1 to the
ranks: they checkpoint after the step in flight and stop, the task exits 75, and nemo-run's sbatch
script requeues the job (at most ``--retries`` times; failures count too); the requeued run
(SLURM_RESTART_COUNT > 0) continues with ``--resume``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # megatron_empg.config and the layout check need only PyYAML

from megatron_empg.config import ConfigError  # noqa: E402
from megatron_empg.trainer.bind.launch_check import resolve_launch  # noqa: E402

PROG = "nemo_run_launch.py"
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: stopped on the pre-emption warning after a checkpoint; run again

# One rank of a Slurm job (nemo-run's srun starts one per task). Slurm's SIGUSR1 reaches every process
# of the step: the trainer checkpoints after the step in flight and exits 0, bash runs the trap once it
# has, and the exit status tells nemo-run's sbatch script to requeue (it requeues on a non-zero one).
TASK_SCRIPT = """\
{cd}resume=
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then resume=--resume; fi  # a requeued run continues
stopped=0
trap 'stopped=1' USR1
{train} $resume
status=$?
if [ "$status" -eq 0 ] && [ "$stopped" -eq 1 ]; then exit {preempted}; fi
exit "$status"
"""


def _gpus_here() -> int:
    """The GPUs ``nvidia-smi`` lists on this machine (0 without a driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    done = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=60)
    return sum(line.startswith("GPU") for line in done.stdout.splitlines()) if done.returncode == 0 else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    executors = parser.add_subparsers(dest="executor", required=True)
    local = executors.add_parser("local", help="torchrun on this machine (run.LocalExecutor)")
    slurm = executors.add_parser("slurm", help="sbatch on a Slurm cluster (run.SlurmExecutor)")
    local.add_argument("--nproc-per-node", type=int, help="processes (default: the GPUs here, else 2 gloo ranks)")
    slurm.add_argument("--account", required=True)
    slurm.add_argument("--partition")
    slurm.add_argument("--nodes", type=int, default=1)
    slurm.add_argument("--gpus-per-node", type=int, default=8, help="0: gloo ranks on CPUs, no container")
    slurm.add_argument("--ntasks-per-node", type=int, help="default: --gpus-per-node (one task per GPU)")
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--time", default="04:00:00", help="the time limit of one run of the job")
    slurm.add_argument("--container-image", help="pyxis/enroot image of the ranks (see Dockerfile)")
    slurm.add_argument("--container-mounts", default="", help="src:dst[,src:dst...] (data, checkpoints)")
    slurm.add_argument("--signal-seconds", type=int, default=300, help="SIGUSR1 this long before the time limit")
    slurm.add_argument("--retries", type=int, default=3, help="requeues after a pre-emption or a failure")
    slurm.add_argument(
        "--tunnel",
        choices=("local", "ssh"),
        default="local",
        help="local: sbatch on this machine (a login node); ssh: through --host",
    )
    slurm.add_argument("--host")
    slurm.add_argument("--user")
    slurm.add_argument("--identity", help="SSH key file")
    slurm.add_argument("--job-dir", help="where nemo-run keeps the experiment on the cluster (ssh: required)")
    slurm.add_argument(
        "--packager",
        choices=("git", "none"),
        default="git",
        help="git: the job runs a git archive of HEAD (committed code only); none: this "
        "checkout in place (a shared filesystem, mounted at the same path)",
    )
    for sub in (local, slurm):
        sub.add_argument("--name", help="experiment name (default: empg-<config name>)")
        sub.add_argument("--python", default="python", help="the ranks' interpreter (default: python)")
        sub.add_argument("--dry-run", action="store_true", help="print what would run; submit nothing")
        sub.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
        sub.add_argument("config", help="YAML run config, relative to the repository root (the job's directory)")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    return parser


def _check_arguments(args: argparse.Namespace) -> None:
    """Command-line values that no layout can use: a ``ConfigError`` naming the option."""
    if args.executor == "local":
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise ConfigError("--nproc-per-node", f"must be >= 1, got {args.nproc_per_node}")
        return
    for name in ("nodes", "ntasks_per_node", "cpus_per_task", "retries", "signal_seconds", "gpus_per_node"):
        value, least = getattr(args, name), 0 if name in ("retries", "gpus_per_node") else 1
        if value is not None and value < least:
            raise ConfigError("--" + name.replace("_", "-"), f"must be >= {least}, got {value}")
    if args.gpus_per_node == 0 and args.ntasks_per_node is None:
        raise ConfigError("--ntasks-per-node", "must be given with --gpus-per-node 0 (gloo ranks per node)")
    if args.gpus_per_node == 0 and args.container_image:
        raise ConfigError("--container-image", "CPU runs (--gpus-per-node 0) run without a container")
    if args.tunnel == "ssh":
        for name in ("host", "user", "job_dir"):
            if not getattr(args, name):
                raise ConfigError("--" + name.replace("_", "-"), "is required with --tunnel ssh")
    if not args.container_image:
        # Without a container nemo-run rewrites every '/nemo_run' in the job's scripts to the job's
        # directory (its container mount point), paths that merely contain it included.
        nemorun_home = os.environ.get("NEMORUN_HOME", os.path.expanduser("~/.nemo_run"))
        paths = {"--job-dir": args.job_dir or os.path.join(nemorun_home, "experiments")}
        if args.packager == "none":
            paths["the repository"] = str(REPO)
        for name, path in paths.items():
            if "/nemo_run" in path:
                raise ConfigError(
                    name,
                    f"{path} contains '/nemo_run', which nemo-run rewrites in jobs without a "
                    "container: use another directory (or NEMORUN_HOME)",
                )


def _train_args(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The arguments of ``python -m megatron_empg.trainer.cli``."""
    return ["train", args.config, *overrides, *(["--resume"] if args.resume else [])]


def _local(args: argparse.Namespace, run, overrides: list[str]):
    """run.LocalExecutor with nemo-run's torchrun launcher (torchrun from the ranks' interpreter)."""
    env = {}
    if os.sep in args.python:
        env["PATH"] = f"{Path(args.python).absolute().parent}{os.pathsep}{os.environ['PATH']}"
    executor = run.LocalExecutor(ntasks_per_node=args.ntasks, launcher="torchrun", env_vars=env)
    task = run.Script(path="megatron_empg.trainer.cli", m=True, entrypoint="python", args=_train_args(args, overrides))
    return executor, task


def _slurm(args: argparse.Namespace, run, overrides: list[str]):
    """run.SlurmExecutor, one task per rank, each running ``TASK_SCRIPT``."""
    if args.tunnel == "ssh":
        tunnel = run.SSHTunnel(host=args.host, user=args.user, job_dir=args.job_dir, identity=args.identity)
    else:
        tunnel = run.LocalTunnel(job_dir=args.job_dir or "")
    mounts = [m for m in args.container_mounts.split(",") if m]
    if args.packager == "git":
        # include_submodules=False: this repository has none, and looking for them walks the whole tree.
        packager, cd = run.GitArchivePackager(include_submodules=False), ""
    else:
        packager, cd = run.Packager(), f"cd {shlex.quote(str(REPO))}\n"
        if args.container_image:
            mounts.append(f"{REPO}:{REPO}")
    env = {
        # Rendezvous (torch.distributed env://): the first node of the allocation ($head_node, set by
        # nemo-run's script) and a port fixed per job, so that a requeued run reuses it.
        "MASTER_ADDR": "$head_node",
        "MASTER_PORT": "$((20000 + SLURM_JOB_ID % 20000))",
    }
    gpus = args.gpus_per_node
    executor = run.SlurmExecutor(
        account=args.account,
        partition=args.partition,
        nodes=args.nodes,
        ntasks_per_node=args.ntasks,
        gpus_per_node=gpus or None,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        container_image=args.container_image,
        container_mounts=mounts,
        tunnel=tunnel,
        packager=packager,
        signal=f"USR1@{args.signal_seconds}",
        retries=args.retries,
        env_vars=env,
        job_name_prefix=f"{args.name}-",
        # Slurm >= 22.05: srun does not take --cpus-per-task from the allocation unless told.
        srun_args=[f"--cpus-per-task={args.cpus_per_task}"] if args.cpus_per_task else None,
    )
    train = shlex.join([args.python, "-m", "megatron_empg.trainer.cli", *_train_args(args, overrides)])
    task = run.Script(inline=TASK_SCRIPT.format(cd=cd, train=train, preempted=PREEMPTED_EXIT))
    return executor, task


def _layout(args: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, tasks per node, GPUs per node) of the run."""
    if args.executor == "local":
        gpus = _gpus_here()
        return 1, args.nproc_per_node or gpus or 2, gpus
    return args.nodes, args.ntasks_per_node or args.gpus_per_node, args.gpus_per_node


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.name = args.name or f"empg-{Path(args.config).stem}"
    try:
        _check_arguments(args)
    except ConfigError as error:
        sys.stderr.write(f"{PROG}: error: {error}\n")
        return 2
    nodes, args.ntasks, gpus = _layout(args)
    config = args.config if Path(args.config).is_absolute() else str(REPO / args.config)
    try:
        overrides = resolve_launch(
            config,
            args.overrides,
            world_size=nodes * args.ntasks,
            tasks_per_node=args.ntasks,
            gpus_per_node=gpus,
            cpu=gpus == 0,
        )
    except ConfigError as error:
        checked = f"{nodes} nodes x {args.ntasks} tasks, {gpus} GPUs per node"
        sys.stderr.write(f"{PROG}: error: {error} (checked for {checked})\n")
        return 2

    import nemo_run as run

    executor, task = (_local if args.executor == "local" else _slurm)(args, run, overrides)
    os.chdir(REPO)  # the job's code: nemo-run packages (or runs) the repository from here
    with run.Experiment(args.name, executor=executor) as exp:
        exp.add(task, name="train")
        if args.dry_run:
            return _dry_run(exp, args.executor)
        exp.run(detach=args.executor == "slurm", tail_logs=args.executor == "local")
    # Leaving the experiment waited for a local job (a Slurm one runs on, detached).
    job = exp.jobs[0]
    if args.executor == "slurm":
        print(f"{PROG}: submitted Slurm job {job.handle.rsplit('/', 1)[-1]} (experiment {exp._id})")
        return 0
    print(f"{PROG}: local job {job.state.name} (experiment {exp._id})")
    return 0 if job.state.name == "SUCCEEDED" else 1


def _dry_run(exp, executor: str) -> int:
    """Print what would run (Slurm: the generated sbatch script, then the script each task runs) and
    remove the experiment's files."""
    exp.dryrun(log=executor == "local", delete_exp_dir=False)
    if executor == "slurm":
        job_executor = exp.jobs[0].executor
        sys.stdout.write(Path(job_executor.experiment_dir, f"{job_executor.job_name}_sbatch.sh").read_text())
        task_script = Path(job_executor.job_dir, "scripts", "train.sh")
        sys.stdout.write(f"\n# ---- each task runs {task_script} ----\n{task_script.read_text()}")
    shutil.rmtree(exp._exp_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
