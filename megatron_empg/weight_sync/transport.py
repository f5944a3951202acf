"""How buckets of HF-named tensors reach a rollout engine: one ``Transport`` interface, four ways.

- ``InProcessTransport``: the engine lives in this process (CPU, or colocated on the same GPU):
  tensors go by reference.
- ``SharedMemoryFileTransport``: the engine runs in another process; each bucket is written as a
  safetensors file in shared memory (``/dev/shm``), loaded by the engine, then deleted.
- ``cuda_ipc.CudaIpcTransport``: the engine runs in another process on this rank's GPU; each bucket
  goes through one GPU buffer that the engine maps by CUDA IPC (GPU only).
- ``NcclTransport``: a disaggregated engine on other GPUs, through vLLM's NCCL weight-transfer
  backend (``NCCLTrainerWeightTransferEngine``); GPU only.

The engine side is anything with the ``WeightReceiver`` methods (``rollout.engine.RolloutEngine``
has them). Only the engine-holding rank owns a transport. ``TRANSPORTS`` names those the trainer
builds (``weight_sync.transport``): the NCCL one needs disaggregated engines, which it does not run.
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Protocol, Sequence

import torch
from torch import Tensor

from megatron_empg.config import ConfigError

NamedTensors = Sequence[tuple[str, Tensor]]


class WeightReceiver(Protocol):
    """The rollout engine's side of a weight update (see ``rollout.engine.RolloutEngine``)."""

    def begin_weight_update(self) -> None: ...

    def update_weights(
        self, *, named_tensors: NamedTensors | None = None, path: str | None = None, ipc: dict | None = None
    ) -> None: ...

    def finish_weight_update(self, version: str) -> None: ...


class Transport(Protocol):
    """One weight update: ``begin()``, ``send(bucket)`` per bucket (HF names, full tensors),
    ``finish(version)``, which also makes the engine drop KV computed with the old weights."""

    def begin(self) -> None: ...

    def send(self, bucket: NamedTensors) -> None: ...

    def finish(self, version: str) -> None: ...


class InProcessTransport:
    """Tensors by reference into an engine in this process."""

    def __init__(self, engine: WeightReceiver) -> None:
        self.engine = engine

    def begin(self) -> None:
        self.engine.begin_weight_update()

    def send(self, bucket: NamedTensors) -> None:
        self.engine.update_weights(named_tensors=list(bucket))

    def finish(self, version: str) -> None:
        self.engine.finish_weight_update(version)


def check_free_space(directory: str | os.PathLike, needed_bytes: int) -> None:
    """Raise ``ConfigError`` (``weight_sync.shm_dir``) unless ``directory`` (a tmpfs) has room for
    one bucket file of ``needed_bytes``; the message says how to make room. Docker gives a container
    64 MB of ``/dev/shm`` unless it runs with ``--ipc=host`` or ``--shm-size``."""
    if not Path(directory).is_dir():
        raise ConfigError("weight_sync.shm_dir", f"{str(directory)!r} is not a directory")
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise ConfigError(
            "weight_sync.shm_dir",
            f"{directory} has {free / 2**20:.0f} MiB free but one weight-sync bucket file needs "
            f"{needed_bytes / 2**20:.0f} MiB. In Docker, run the container with --ipc=host or --shm-size=16g "
            f"(its default /dev/shm is 64 MB); or lower weight_sync.bucket_size_mb (a bucket never holds less "
            f"than the largest tensor), or set weight_sync.shm_dir to a larger tmpfs",
        )


class SharedMemoryFileTransport:
    """A safetensors file per bucket in ``directory`` (tmpfs by default), for an engine in another
    process. At most one bucket's file exists at a time; it is removed even when loading fails."""

    def __init__(self, engine: WeightReceiver, directory: str | os.PathLike = "/dev/shm") -> None:
        self.engine = engine
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"weight_sync.shm_dir={str(directory)!r} is not a directory")
        self._counter = itertools.count()

    def begin(self) -> None:
        self.engine.begin_weight_update()

    def send(self, bucket: NamedTensors) -> None:
        from safetensors.torch import save_file

        path = self.directory / f"empg-weights-{os.getpid()}-{next(self._counter)}.safetensors"
        try:
            save_file({name: tensor.detach().contiguous().cpu() for name, tensor in bucket}, str(path))
            self.engine.update_weights(path=str(path))
        finally:
            path.unlink(missing_ok=True)

    def finish(self, version: str) -> None:
        self.engine.finish_weight_update(version)


class NcclTransport:
    """Broadcast to a disaggregated vLLM engine over NCCL (GPU only; not exercised on CPU CI).

    Wraps vLLM's ``NCCLTrainerWeightTransferEngine``: the engine's workers join an NCCL group with
    this rank as rank 0 (``init_info``: master address/port, world size = 1 + engine workers) and
    ``client`` is a ``vllm.distributed.weight_transfer`` sync client of the engine (for a server,
    ``HTTPVLLMWeightSyncClient``). vLLM's protocol declares every tensor before sending any, so the
    buckets of one update are collected as references and sent in ``finish``.
    """

    def __init__(self, client, *, master_address: str, master_port: int, world_size: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.transport=nccl needs CUDA GPUs; use in_process or shm_file on CPU")
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        self._source = _bucket_source()
        init_info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size)
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(init_info, client=client, source=self._source)
        self._client = client

    def begin(self) -> None:
        self._source.tensors = []

    def send(self, bucket: NamedTensors) -> None:
        self._source.tensors.extend(bucket)

    def finish(self, version: str) -> None:
        self._engine.send_weights()
        self._source.tensors = []


def _shm_file_transport(engine: WeightReceiver, settings) -> SharedMemoryFileTransport:
    return SharedMemoryFileTransport(engine, settings.shm_dir)


def _cuda_ipc_transport(engine: WeightReceiver, settings):
    from megatron_empg.weight_sync.cuda_ipc import CudaIpcTransport  # it imports this module

    return CudaIpcTransport(engine)


# name -> build(engine, config.WeightSyncConfig)
TRANSPORTS = {
    "in_process": lambda engine, settings: InProcessTransport(engine),
    "shm_file": _shm_file_transport,
    "cuda_ipc": _cuda_ipc_transport,
}


def _bucket_source():
    """A vLLM ``WeightSource`` over the tensors collected for one update (``.tensors``); its class
    is built here because vLLM is imported only when the NCCL transport is used."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class BucketSource(WeightSource):
        def __init__(self) -> None:
            self.tensors: list[tuple[str, Tensor]] = []

        def metadata(self) -> list:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors]

        def __iter__(self):
            return iter(self.tensors)

    return BucketSource()
