"""How buckets of HF-named tensors reach a rollout engine: one ``Transport`` interface, four ways.

- ``InProcessTransport``: the engine lives in this process (CPU, or colocated on the same GPU):
  tensors go by reference.
- ``SharedMemoryFileTransport``: the engine runs in another process; each bucket is written as a
  safetensors file in shared memory (``/dev/shm``), loaded by the engine, then deleted.
- ``cuda_ipc.CudaIpcTransport``: the engine runs in another process on this rank's GPU; each bucket
  goes through one GPU buffer that the engine maps by CUDA IPC (GPU only).
- ``LinkTransport``: disaggregated engines on their own ranks (``rollout.placement``): training
  rank 0 broadcasts each bucket over the link to every engine's owner (NCCL on GPUs, gloo on
  CPU), which hands it to its engine through one of the transports above (``receive_weights``).

The engine side is anything with the ``WeightReceiver`` methods (``rollout.engine.RolloutEngine``
has them). Only the engine-holding rank owns a transport. ``TRANSPORTS`` names those that reach an
engine from its owner's process (``weight_sync.transport``); the trainer uses ``LinkTransport``
itself when the engines are disaggregated.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from megatron_empg.config import ConfigError
from megatron_empg.weight_sync.cuda_ipc import CudaIpcTransport
from megatron_empg.weight_sync.protocol import NamedTensors, Transport, WeightReceiver


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


class LinkTransport:
    """Training rank 0's side of a weight update for disaggregated engines: each bucket is
    broadcast over the ``parallel.link.Link`` to every engine's owner (NCCL on GPUs, gloo on CPU)
    as a header message (names, dtypes, shapes) and one flat byte buffer; ``receive_weights`` is
    the engines' side. The engines load the update after the rollout they are drawing."""

    def __init__(self, link) -> None:
        from megatron_empg.parallel.link import TRAINER

        self.link, self.src = link, TRAINER
        self._buffer: Tensor | None = None  # reused by every bucket of an update

    def begin(self) -> None:
        self.link.broadcast_object(("weights",), src=self.src)

    def send(self, bucket: NamedTensors) -> None:
        header, size = bucket_layout(bucket)
        self._buffer = _fitting(self._buffer, size, bucket[0][1].device if bucket else self.link.device)
        flat = pack_bucket(bucket, out=self._buffer[:size])[1]
        self.link.broadcast_object(("bucket", header, size), src=self.src)
        self.link.broadcast_tensor(flat, src=self.src)

    def finish(self, version: str) -> None:
        self.link.broadcast_object(("end", version), src=self.src)
        self._buffer = None  # the memory goes back between updates


def receive_weights(link, transport: Transport) -> tuple[str, int]:
    """An engine owner's side of one ``LinkTransport`` update, after its ``("weights",)`` message:
    every bucket into this engine through its own ``transport`` (``weight_sync.transport``: by
    reference, a shared-memory file or CUDA IPC). Returns (version, bytes received)."""
    from megatron_empg.parallel.link import TRAINER

    transport.begin()
    received, buffer = 0, None  # one buffer for every bucket (the transport copies what it is sent)
    while True:
        message = link.broadcast_object(src=TRAINER)
        if message[0] == "end":
            transport.finish(message[1])
            return message[1], received
        _, header, numel = message
        buffer = _fitting(buffer, numel, link.device)
        flat = link.broadcast_tensor(buffer[:numel], src=TRAINER)
        transport.send(unpack_bucket(header, flat))
        received += numel


def _fitting(buffer: Tensor | None, numel: int, device) -> Tensor:
    """``buffer`` if it holds ``numel`` bytes, else a new uint8 buffer of that size on ``device``."""
    if buffer is not None and buffer.numel() >= numel and buffer.device == torch.device(device):
        return buffer
    return torch.empty(numel, dtype=torch.uint8, device=device)


BucketHeader = list[tuple[str, torch.dtype, tuple[int, ...], int]]  # name, dtype, shape, byte offset
_ALIGN = 16  # each tensor starts at a multiple of it in the flat buffer, so any dtype can view it


def bucket_layout(bucket: NamedTensors) -> tuple[BucketHeader, int]:
    """(header, total bytes) of a bucket packed with each tensor at a multiple of 16 bytes."""
    header, offset = [], 0
    for name, t in bucket:
        header.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return header, offset


def pack_bucket(bucket: NamedTensors, out: Tensor | None = None) -> tuple[BucketHeader, Tensor]:
    """A bucket as (header, one flat uint8 tensor of its bytes, each tensor aligned to 16 bytes),
    for sending it in one message; into ``out`` (uint8, exactly the packed size) when given."""
    header, size = bucket_layout(bucket)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=bucket[0][1].device if bucket else "cpu")
    if out.numel() != size:
        raise ValueError(f"out holds {out.numel()} bytes, the bucket packs into {size}")
    for (_, t), (_, _, _, offset) in zip(bucket, header):
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + data.numel()].copy_(data)
    return header, out


def unpack_bucket(header: BucketHeader, flat: Tensor) -> list[tuple[str, Tensor]]:
    """``pack_bucket``'s inverse: views of ``flat``."""
    out = []
    for name, dtype, shape, offset in header:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append((name, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
    return out


def _shm_file_transport(engine: WeightReceiver, settings) -> SharedMemoryFileTransport:
    return SharedMemoryFileTransport(engine, settings.shm_dir)


def _cuda_ipc_transport(engine: WeightReceiver, settings):
    return CudaIpcTransport(engine)


# name -> build(engine, config.WeightSyncConfig)
TRANSPORTS = {
    "in_process": lambda engine, settings: InProcessTransport(engine),
    "shm_file": _shm_file_transport,
    "cuda_ipc": _cuda_ipc_transport,
}
