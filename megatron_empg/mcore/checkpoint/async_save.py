"""Saves whose files are written while training goes on (``checkpoint.async_save``).

A save (``save.start_save``, every rank) plans with Megatron's ``dist_checkpointing`` (the
collectives), then either writes the shard files at once (``staging`` None: the synchronous save,
streaming each tensor from the device as it writes) or copies this rank's share of the state into
``HostStaging``'s buffers and hands the writing to a thread (``PendingSave``). The copy is what
training waits for: on a GPU, device-to-host copies into pinned buffers that are kept and reused
by every later save (allocated at the first), one synchronize at the end. The thread writes through
the same streaming writer (``mcore.checkpoint.stream``: 8 MiB writes, CRC32 beside them, one fsync
per file) and runs no collective; file writes and CRC32s release the GIL, so the training thread
keeps its CPU.

The commit stays where it was: every rank together, later, once every rank's thread is done
(``written_everywhere``: one MIN all-reduce of a flag, asked at each step's end), ``save.finish_save``
gathers Megatron's write results, writes its metadata, our manifest and completion marker, renames
the temp directory and rewrites ``latest``. Until then the previous checkpoint is the newest
complete one: a crash while the thread writes leaves a ``*.tmp-*`` directory that nothing loads
and the previous checkpoint intact. A full disk fails the write in the thread; the commit then
raises the usual ``CheckpointError`` on every rank together.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_empg.parallel.collectives import collective_device


@dataclasses.dataclass
class SaveTarget:
    """Where a save goes and what its commit writes (``save.commit_save``)."""

    root: Path
    tmp: Path
    final: Path
    nonce: str
    step: int
    keep_last: int | None
    model: Any  # parts.ModelMetadata
    checksums: bool
    info: dict
    streaming: Any  # stream.StreamingSaveStrategy: the manifest entries of the files this rank wrote


class HostStaging:
    """Host buffers a background save copies this rank's tensors into: pinned on a GPU machine,
    allocated at the first save and reused by the next ones (a buffer is replaced only where a
    tensor's shape or dtype changed). ``bytes``: what the last ``stage`` copied."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self.bytes = 0

    def _buffer(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        if i < len(self._buffers):
            old = self._buffers[i]
            if old.shape == tensor.shape and old.dtype == tensor.dtype:
                return old
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
        if i < len(self._buffers):
            self._buffers[i] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    def stage(self, write_buckets: list) -> list:
        """Megatron's write buckets ``[(path, file name, (bytes items, [(item, tensor)]))]`` with
        every tensor replaced by its host copy (device copies asynchronous, then one synchronize)."""
        staged, i, nbytes = [], 0, 0
        for path, name, (bytes_data, tensor_data) in write_buckets:
            copies = []
            for item, tensor in tensor_data:
                buffer = self._buffer(i, tensor)
                buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                copies.append((item, buffer))
                nbytes += buffer.numel() * buffer.element_size()
                i += 1
            staged.append((path, name, (bytes_data, copies)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.bytes = nbytes
        return staged


class PendingSave:
    """A planned save's writing on this rank: done in the constructor (no ``staging``), or by a
    thread over the staged copies. ``blocking_s``: seconds from the save's start to the return of
    the constructor (what training waited for); ``persist_s``: the writing's own seconds."""

    def __init__(self, target: SaveTarget, request, staging: HostStaging | None, started: float) -> None:
        self.target, self.request = target, request
        self.persist_s = 0.0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if request.async_fn is not None:  # None: nothing to write on this rank
            args = list(request.async_fn_args)
            if staging is None:
                self._write(args)
            else:
                args[1] = staging.stage(args[1])
                self._thread = threading.Thread(target=self._write, args=(args,), name="checkpoint-writer", daemon=True)
                self._thread.start()
        self.blocking_s = time.perf_counter() - started

    def _write(self, args: list) -> None:
        start = time.perf_counter()
        try:  # the writer hands its own errors (a full disk) to the finalisation, which raises them
            self.request.async_fn(*args, **self.request.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by finalize, on the training thread
            self.error = e
        self.persist_s = time.perf_counter() - start

    @property
    def in_background(self) -> bool:
        return self._thread is not None

    def written_here(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def written_everywhere(self) -> bool:
        """Whether every rank's writing is done; every rank calls it (one MIN all-reduce)."""
        if dist.get_world_size() == 1:
            return self.written_here()
        flag = torch.tensor([int(self.written_here())], device=collective_device(dist.group.WORLD))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def wait(self) -> None:
        """Until this rank's writing is done."""
        if self._thread is not None:
            self._thread.join()

    def finalize(self) -> None:
        """Megatron's end of the save, every rank: a barrier, the write results gathered, its
        metadata written (``execute_sync``'s order)."""
        if self.error is not None:
            raise self.error
        dist.barrier()
        for fn in self.request.finalize_fns:
            fn()
