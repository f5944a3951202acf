"""``empg``: the command line.

    empg train CONFIG.yaml [a.b.c=value ...] [--resume | --overwrite]   # one process, or every rank under torchrun/srun
    empg check CONFIG.yaml [a.b.c=value ...] --world-size N [--gpu-memory-gib M]   # bind and check everything
    empg plan CONFIG.yaml [a.b.c=value ...] --world-size N [--gpu-memory-gib M] [--json]   # every rank's memory
    empg print-config CONFIG.yaml [a.b.c=value ...]       # the resolved config as YAML
    empg --version

The input contract (docs/faults-and-restarts.md): a bad config file, override, option, path or run
directory exits with code 2 and one line naming the field or the file, before anything starts and
before anything is written. Overrides may come before or after the options. ``train`` binds the
config (``trainer.bind.build.bind``) and, on rank 0, takes the run's directories
(``trainer.run.run_dir``: one run per directory; ``--resume`` / ``--overwrite`` and what an earlier run
left there) before it starts a process group, an engine or a model; ``--resume`` from a checkpoint
at or past ``train.steps`` says "nothing to do" and exits 0. Ctrl-C stops at once, without a
checkpoint, and says so in one line (SIGTERM is the signal that checkpoints first).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path

from megatron_empg.config import ConfigError, RunConfig, load_config, to_yaml


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-empg")
    except PackageNotFoundError:
        return "unknown"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_environment() -> int:
    """The number of ranks torchrun (``WORLD_SIZE``) or srun (``SLURM_NTASKS``) started; 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def init_distributed(timeout_minutes: float = 60.0, *, engine_ranks: int = 0, engine_tp: int = 1):
    """torch.distributed from torchrun/srun's environment (NCCL on GPUs), or a world of one (gloo);
    with ``engine_ranks``, the training and engine worlds and their link
    (``parallel.link.start_worlds``). A collective that waits longer than ``timeout_minutes``
    aborts the job. Returns this process's ``Role``."""
    import torch.distributed as dist

    from megatron_empg.parallel.link import Role, start_worlds

    if dist.is_initialized():
        return Role(is_engine=False, rank=dist.get_rank(), engine_ranks=0, link=None)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        )
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    return start_worlds(engine_ranks, datetime.timedelta(minutes=timeout_minutes), engine_tp=engine_tp)


def _rank_from_environment() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    config = load_config(RunConfig, path, overrides)
    config.model_config()  # resolve the model now: its errors are config errors too
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="empg", description="RL post-training on Megatron-Core (EMA-PG, RPG, GRPO)")
    parser.add_argument("--version", action="version", version=f"megatron-empg {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run the RL loop")
    check = commands.add_parser("check", help="bind and check every setting for a world size; start nothing")
    plan = commands.add_parser("plan", help="every rank's GPU memory per phase, and what fits when it does not")
    show = commands.add_parser("print-config", help="print the resolved config")
    for sub in (train, check, plan, show):
        sub.add_argument("config", help="YAML file (e.g. recipes/demo_cpu.yaml)")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    start = train.add_mutually_exclusive_group()
    start.add_argument(
        "--resume", action="store_true", help="continue from the newest intact checkpoint (none yet: start at step 0)"
    )
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run over an earlier run's checkpoints and metrics (deletes them)",
    )
    for sub in (check, plan):
        sub.add_argument("--world-size", type=int, default=1, help="the number of ranks the run will have (default 1)")
        sub.add_argument(
            "--gpu-memory-gib",
            type=float,
            default=None,
            help="each GPU's memory: check the memory plan against it (plan: default an H100 80GB)",
        )
    check.add_argument("--skip-paths", action="store_true", help="do not read data files or model directories")
    plan.add_argument("--json", action="store_true", help="the plan as JSON (bytes)")
    args = _parse(parser, argv)
    try:
        config = load_run_config(args.config, args.overrides)
        if args.command in ("check", "plan"):
            device = None if args.gpu_memory_gib is None else _gib_bytes(args.gpu_memory_gib)
            check_paths = args.command == "check" and not args.skip_paths
            components = _bind(
                config,
                args.world_size,
                check_paths=check_paths,
                device_bytes=device if args.command == "check" else None,
            )
    except ConfigError as e:
        parser.exit(2, f"empg: error: {e}\n")
    if args.command == "print-config":
        sys.stdout.write(to_yaml(config))
        return 0
    if args.command == "check":
        sys.stdout.write(_describe(components))
        return 0
    if args.command == "plan":
        return _plan(components, args.world_size, device, as_json=args.json)
    try:
        return _train(config, resume=args.resume, overwrite=args.overwrite)
    except KeyboardInterrupt:  # the stack of every thread is no help to a person who pressed Ctrl-C
        sys.stderr.write(
            "empg: interrupted (Ctrl-C): stopped without a checkpoint of this step; --resume continues from the "
            "newest checkpoint (SIGTERM, kill -TERM PID, checkpoints after the current step first)\n"
        )
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments, the overrides before and after the options alike (``empg check RECIPE
    --world-size 16 a.b=c``: argparse alone ends the positionals at the first option)."""
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *rest]
    return args


def _bind(config: RunConfig, world_size: int, *, check_paths: bool = True, device_bytes: int | None = None):
    from megatron_empg.trainer.bind.build import bind

    if world_size < 1:
        raise ConfigError("--world-size", f"must be >= 1, got {world_size}")
    return bind(config, world_size, check_paths=check_paths, device_bytes=device_bytes)


def _gib_bytes(gib: float) -> int:
    if not 1 <= gib <= 2**20:  # below 1 GiB no GPU this runs on: a unit mistaken (bytes, MiB?)
        raise ConfigError("--gpu-memory-gib", f"expected one GPU's memory in GiB, from 1 to {2**20}, got {gib}")
    return int(gib * 2**30)


def _plan(components, world_size: int, device_bytes: int | None, *, as_json: bool) -> int:
    """``empg plan``: the plan, and when it does not fit the changes that would; exit 0 either way
    (``empg check --gpu-memory-gib`` is the gate)."""
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_fixes import cheapest_fixes
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    plan = plan_memory(components, device_bytes=device_bytes)
    fixes = [] if plan.fits else cheapest_fixes(components, world_size, plan.device_bytes, bind=bind)
    if as_json:
        out = plan.to_json()
        out["fixes"] = [{"label": f.label, "overrides": list(f.overrides), "peak_bytes": f.peak_bytes} for f in fixes]
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return 0
    sys.stdout.write(plan.describe() + "\n")
    if fixes:
        sys.stdout.write("changes that fit:\n" + "".join(f"  {f.describe()}\n" for f in fixes))
    elif not plan.fits:
        sys.stdout.write("no change found that fits\n")
    return 0


def _describe(components) -> str:
    """What ``empg check`` found: the layout and the resolved names."""
    c, layout, loss = components.config, components.layout, components.config.algorithm.loss
    return (
        f"ok: {components.model.name} on {layout.world_size} ranks (TP {layout.tp} x PP {layout.pp}"
        f"{f' x CP {layout.cp}' if layout.cp > 1 else ''} x DP {layout.dp}); "
        f"per replica and step {layout.prompts_per_replica} prompts, {layout.samples_per_replica} samples in "
        f"{_micro_batches(c.train, layout)}; advantage {c.algorithm.advantage}, policy loss "
        f"{loss.policy_loss}, KL {loss.kl or 'none'}, reward {c.data.reward}, engine {c.rollout.engine} "
        f"x {layout.engines} ({layout.dp // layout.engines} replica(s) each{_engine_ranks(layout)}), weight sync "
        f"{c.weight_sync.transport}, max staleness {c.rollout.max_staleness}"
        f"{' with partial rollouts' if c.rollout.partial else ''}\n"
        f"attention {components.attention.describe()}; on a GPU: {_fusions(components.attention)}\n"
        f"{_experts(components)}{_anchor(components)}"
    )


def _anchor(components) -> str:
    """An FP8 anchor's line: which storage runs here and why."""
    if components.config.algorithm.anchor.compute_dtype != "float8_e4m3fn" or not components.stats.anchor:
        return ""
    kind, why = components.anchor_storage
    return f"anchor FP8 storage {kind} ({why})\n"


def _experts(components) -> str:
    """A mixture of experts' line: which experts' implementation runs, why, and its GEMMs on a GPU."""
    experts = components.experts
    if experts is None:
        return ""
    bf16 = components.config.train.params_dtype == "bfloat16"
    return f"experts {experts.describe()}; on a GPU: {experts.gemm(cuda=True, bf16=bf16)}\n"


def _fusions(attention) -> str:
    from megatron_empg.mcore.fusions import fusion_plan

    return fusion_plan(attention, cuda=True).describe()


def _engine_ranks(layout) -> str:
    return f", on {layout.engine_ranks} engine ranks of their own" if layout.engine_ranks else ""


def _micro_batches(train, layout) -> str:
    layout_name = "packed" if train.packing else "padded"
    forward = train.max_tokens_per_forward_microbatch
    forward = f" (old and anchor passes: their rows back to back, at most {forward} tokens)" if forward else ""
    if layout.micro_batches_per_replica is None:
        return f"{layout_name} micro-batches of at most {train.max_tokens_per_microbatch} tokens{forward}"
    return f"{layout.micro_batches_per_replica} {layout_name} micro-batches{forward}"


def _train(config: RunConfig, *, resume: bool, overwrite: bool = False) -> int:
    from megatron_empg.trainer.run.console import configure_logging
    from megatron_empg.trainer.run.run_dir import RunDirectoryError, hold_run_directories

    rank, world_size = _rank_from_environment(), world_size_from_environment()
    configure_logging(config.logging, rank=rank, world_size=world_size)  # before vLLM and Megatron log anything
    done = _nothing_to_do(config) if resume else None
    if done is not None:  # every rank reads the same checkpoint directory, so all stop here
        if rank == 0:
            sys.stdout.write(f"empg: nothing to do: {done}\n")
        return 0
    held = None
    if rank == 0:  # one run per directory: a second one is refused at once (before torch is imported)
        try:
            held = hold_run_directories(config)
        except (RunDirectoryError, ConfigError) as error:
            sys.stderr.write(f"empg: error: {error}\n")
            return 2
    try:
        return _bind_and_run(config, world_size, held, resume=resume, overwrite=overwrite)
    finally:
        if held is not None:
            held.release()


def _bind_and_run(config: RunConfig, world_size: int, held, *, resume: bool, overwrite: bool) -> int:
    from megatron_empg.mcore.checkpoint.files import CheckpointError, remove_leftovers
    from megatron_empg.trainer.run.metrics_log import MetricsFileError
    from megatron_empg.trainer.run.run_dir import RunDirectoryError, check_start

    try:
        components = _bind(config, world_size)  # seconds, and before anything starts
        if held is not None:  # what an earlier run left there (after the bind: --overwrite deletes it)
            check_start(config, resume=resume, overwrite=overwrite, previous=held.previous)
            remove_leftovers(config.checkpoint.dir)  # of crashed saves: this run holds the directory
            held.claim()  # the first write of this run: every check passed
    except (ConfigError, RunDirectoryError, CheckpointError, MetricsFileError, OSError) as error:
        if held is not None:  # rank 0 speaks for all, and leaves no directory it created
            sys.stderr.write(f"empg: error: {error}\n")
            held.release(undo=True)
        return 2
    return _run(config, components, resume=resume)


def _nothing_to_do(config: RunConfig) -> str | None:
    """Why a ``--resume`` has no step left to train (its checkpoint is at or past ``train.steps``),
    or None. Reads files only."""
    from megatron_empg.mcore.checkpoint import CheckpointError, find_latest_checkpoint

    try:
        found = find_latest_checkpoint(config.checkpoint.dir) if Path(config.checkpoint.dir).is_dir() else None
    except CheckpointError:  # no intact checkpoint: the resume says so, with what it found (not a traceback here)
        return None
    if found is None or found.step < config.train.steps:
        return None
    return f"the newest checkpoint, {found.path}, is at step {found.step} and train.steps is {config.train.steps}"


def _run(config: RunConfig, components, *, resume: bool) -> int:
    from megatron_empg.trainer.run import watchdog

    role = init_distributed(
        config.distributed.timeout_minutes,
        engine_ranks=components.layout.engine_ranks,
        engine_tp=config.rollout.tensor_parallel_size,
    )
    watchdog.install(
        config, _rank_from_environment(), world_size_from_environment(), role="engine" if role.is_engine else "training"
    )
    try:
        return _serve_engines(components, role) if role.is_engine else _train_here(config, components, role, resume)
    finally:
        watchdog.uninstall()


def _train_here(config: RunConfig, components, role, resume: bool) -> int:
    import torch.distributed as dist

    from megatron_empg.mcore.checkpoint.files import CheckpointError, SaveError
    from megatron_empg.rollout.retriever.client import RetrieverError
    from megatron_empg.trainer.loop import Trainer
    from megatron_empg.trainer.run import watchdog
    from megatron_empg.trainer.run.metrics_log import MetricsLogger

    failed = None
    try:
        trainer = Trainer(components, link=role.link)
    except ConfigError as error:  # what only the machine can tell (e.g. /dev/shm too small): before the engine
        failed = (2, str(error))
    except RetrieverError as error:  # rollout.search_agent's retriever is not there
        failed = (1, str(error))
    if failed is not None:  # out of the except block (its traceback holds the half-built trainer's groups)
        sys.stderr.write(f"empg: error: {failed[1]}\n")
        _release_distributed()
        return failed[0]
    logger = MetricsLogger(config, config.train.steps, enabled=dist.get_rank() == 0)
    try:
        trainer.run(resume=resume, logger=logger)
    except SaveError as error:
        # A full disk: the checkpoints before it are intact and space may come back, so the launcher
        # restarts from the last one (supervisor.max_restarts bounds a disk that stays full).
        if dist.get_rank() == 0:
            sys.stderr.write(f"empg: error: {error} Exit {watchdog.RESTARTABLE_EXIT} (restartable).\n")
        watchdog.exit_restartable(f"checkpoint save failed: {error}")
        return watchdog.RESTARTABLE_EXIT
    except CheckpointError as error:  # no intact checkpoint to resume from: said plainly
        if dist.get_rank() == 0:
            sys.stderr.write(f"empg: error: {error}\n")
        return 1
    except BaseException as error:  # before the clean-up, which may wait on a lost peer
        watchdog.failed(error)  # a lost peer: exits restartable here; else the heartbeat says crashed
        raise
    finally:
        logger.close()
        trainer.shutdown()
        del trainer
        _release_distributed()
    return 0


def _serve_engines(components, role) -> int:
    """An engine rank of a disaggregated job: serve the training ranks until they stop."""
    from megatron_empg.trainer.engines.engine_rank import EngineRank
    from megatron_empg.trainer.run import watchdog

    failed = None
    try:
        engines = EngineRank(components, role.link)
    except ConfigError as error:
        failed = str(error)
    if failed is not None:  # out of the except block (its traceback holds the half-built engine rank)
        sys.stderr.write(f"empg: error: {failed}\n")
        _release_distributed()
        return 2
    try:
        engines.serve()
    except BaseException as error:
        watchdog.failed(error)
        raise
    finally:
        engines.shutdown()
        del engines
        _release_distributed()
    return 0


def _release_distributed() -> None:
    """Free every process group now, not in interpreter teardown: a gloo group freed there can abort
    the process from its threads ("terminate called without an active exception", exit -6 after a
    clean run). The model's groups sit in reference cycles (DDP), hence the collection."""
    import gc

    import torch.distributed as dist

    from megatron_empg.mcore import parallel_state

    parallel_state.destroy_model_parallel()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
