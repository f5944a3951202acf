"""``empg``: the command line.

    empg train CONFIG.yaml [a.b.c=value ...] [--resume]   # one process, or every rank under torchrun/srun
    empg print-config CONFIG.yaml [a.b.c=value ...]       # the resolved config as YAML
    empg --version

Bad configs and overrides exit with code 2 and a message naming the dotted field.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys

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


def init_distributed() -> None:
    """torch.distributed from torchrun/srun's environment (NCCL on GPUs), or a world of one (gloo)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # srun without torchrun
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))  # fmt: skip
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))  # fmt: skip
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


def _configure_logging() -> None:
    """INFO on rank 0, warnings and errors only on the other ranks (each rank of a torchrun/srun
    job writes to the same console); several ranks prefix their lines with ``[rank N]``."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    prefix = f"[rank {rank}] " if world > 1 else ""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")  # fmt: skip


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    config = load_config(RunConfig, path, overrides)
    config.model_config()  # resolve the model now: its errors are config errors too
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="empg", description="RL post-training on Megatron-Core (EMA-PG, RPG, GRPO)")
    parser.add_argument("--version", action="version", version=f"megatron-empg {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run the RL loop")
    show = commands.add_parser("print-config", help="print the resolved config")
    for sub in (train, show):
        sub.add_argument("config", help="YAML file (e.g. recipes/demo_cpu.yaml)")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        parser.exit(2, f"empg: error: {e}\n")
    if args.command == "print-config":
        sys.stdout.write(to_yaml(config))
        return 0
    return _train(config, resume=args.resume)


def _train(config: RunConfig, *, resume: bool) -> int:
    import torch.distributed as dist

    from megatron_empg.rollout.retriever import RetrieverError
    from megatron_empg.trainer.loop import RunDirectoryError, Trainer, check_fresh_start
    from megatron_empg.trainer.metrics_log import MetricsLogger

    _configure_logging()
    try:
        if not resume:
            check_fresh_start(config)  # before minutes of start-up
    except RunDirectoryError as error:
        sys.stderr.write(f"empg: error: {error}\n")
        return 2
    init_distributed()
    try:
        config.validate_world_size(dist.get_world_size())
    except ConfigError as error:
        if dist.get_rank() == 0:
            sys.stderr.write(f"empg: error: {error}\n")
        dist.destroy_process_group()
        return 2
    try:
        trainer = Trainer(config)
    except RetrieverError as error:  # rollout.search_agent's retriever is not there
        sys.stderr.write(f"empg: error: {error}\n")
        dist.destroy_process_group()
        return 1
    logger = MetricsLogger(config, config.train.steps, enabled=dist.get_rank() == 0)
    try:
        trainer.run(resume=resume, logger=logger)
    finally:
        logger.close()
        trainer.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
