"""The save strategy of ``mcore.checkpoint``: Megatron's torch_dist save (``dist_checkpointing``'s
planning, files, ``.metadata`` and finalisation: the format does not change) with the writing
replaced by a streaming writer.

Megatron's writer (``FileSystemWriterAsync``, megatron-core 0.19.2), measured on a 3.4 GB
checkpoint (``benchmarks/checkpoint_save.py``), spent 5x a plain sequential write of the same bytes:

    writes      ``torch.save`` hands each tensor's storage to one ``write()`` call; a 1 GiB
                ``write()`` ran 4-7x slower than the same bytes in 1-16 MiB pieces
    CRC32s      torch.save computes a CRC32 of every zip record, and the manifest's CRC32s were a
                second pass reading every file back after the save
    copies      CPU tensors that are views (every parameter: a view of its DDP buffer) are cloned
                whole before writing; on CUDA every tensor is copied to pinned host memory before
                the first byte is written (the whole checkpoint held on the host at once, and
                the pinned blocks stay cached by torch's host allocator afterwards)

This writer, per file: tensors are serialised by ``torch.save`` as before (same bytes but for the
zip records' CRC32 fields, which are 0: ``torch.load`` ignores them, and the manifest holds a
CRC32 of the whole file) into a sink that cuts every write into ``WRITE_CHUNK`` pieces while a
thread adds the same bytes to the file's CRC32 (``StreamingSaveStrategy.files``: the manifest
entries of the files this rank wrote, so nothing is read back). A CPU view is given a storage of its own
bytes (the same memory, no copy). A device tensor is copied to the host just before it is written,
the next one's copy overlapping this one's write (one tensor at a time on the host, pageable
memory). One fsync per file at the end, as before.

With more than one data-parallel rank, ``save_strategy`` wraps it in Megatron's
``FullyParallelSaveStrategyWrapper`` over the DP group (Megatron-LM's default,
``--ckpt-fully-parallel-save``): the replicated tensors (model, optimizer, anchor) are spread over
the DP ranks by size instead of all being written by DP rank 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import itertools
import os
import zlib
from collections.abc import Iterator

import torch

from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402  (after the shims)
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402
from torch.distributed.checkpoint import filesystem as _dcp_filesystem  # noqa: E402

WRITE_CHUNK = 8 << 20  # bytes per write(): 1-8 MiB wrote fastest on the CPU VM; one huge write() 4-7x slower

# torch.distributed.checkpoint's per-item writer, as Megatron's writer calls it (its arguments
# changed across torch versions: the transforms and the serialization format were added).
_WRITE_ITEM_PARAMS = inspect.signature(_dcp_filesystem._write_item).parameters


class _Sink:
    """A file being written: every ``write`` goes out in ``WRITE_CHUNK`` pieces while ``crc_pool``
    (one thread; None: no checksum) adds the data to the file's CRC32 (``zlib.crc32``, the
    manifest's; it releases the GIL, so the CRC32 runs beside the write). ``tell``: the bytes
    written (the file is written from its start, never seeked)."""

    def __init__(self, file, crc_pool: concurrent.futures.Executor | None) -> None:
        self.file = file
        self.crc_pool = crc_pool
        self.size = 0
        self.crc32 = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")  # valid during this call only (torch's buffer)
        crc32 = self.crc_pool.submit(zlib.crc32, view, self.crc32) if self.crc_pool is not None else None
        try:
            for start in range(0, len(view), WRITE_CHUNK):
                self.file.write(view[start : start + WRITE_CHUNK])
        finally:  # the thread reads ``view``: neither return nor raise (a full disk) before it is done
            if crc32 is not None:
                self.crc32 = crc32.result()
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.file.flush()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it owns its storage (or is not a contiguous CPU tensor); else a tensor over the
    same memory whose storage is exactly its bytes, so that ``torch.save`` writes those bytes alone
    and Megatron's writer does not clone it."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or storage.nbytes() == nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start : start + nbytes], 0, tensor.shape)


def _on_host(tensor_data: list) -> Iterator[tuple]:
    """``(write item, CPU tensor)`` of ``tensor_data`` in order; a device tensor is copied to the
    host in a worker thread while the previous one is written (both release the GIL)."""
    if all(tensor.device.type == "cpu" for _, tensor in tensor_data):
        yield from tensor_data
        return
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-d2h") as pool:
        copies = [pool.submit(tensor.detach().to, "cpu") for _, tensor in tensor_data[:1]]
        for i, (item, _) in enumerate(tensor_data):
            if i + 1 < len(tensor_data):
                copies.append(pool.submit(tensor_data[i + 1][1].detach().to, "cpu"))
            yield item, copies[i].result()
            copies[i] = None  # this tensor's host copy is freed once written


def _write_file(path: str, storage_key: str, bytes_data: list, tensor_data: list, checksums: bool):
    """Write one file of the plan: its byte items, then its tensors, then fsync. Returns the
    items' ``WriteResult``s and the file's manifest entry ``{"size", "crc32"}``."""
    kwargs = {}
    if "serialization_format" in _WRITE_ITEM_PARAMS:
        kwargs["serialization_format"] = _dcp_filesystem.SerializationFormat.TORCH_SAVE
    transforms = [_dcp_filesystem._StorageWriterTransforms()] if "transforms" in _WRITE_ITEM_PARAMS else []
    results = []
    with contextlib.ExitStack() as stack:
        crc_pool = None
        if checksums:
            crc_pool = stack.enter_context(
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc")
            )
        f = stack.enter_context(open(path, "wb", buffering=WRITE_CHUNK))
        sink = _Sink(f, crc_pool)
        for item, data in itertools.chain(bytes_data, _on_host(tensor_data)):
            results.append(_dcp_filesystem._write_item(*transforms, sink, data, item, storage_key, **kwargs))
        f.flush()
        os.fsync(f.fileno())
    entry = {"size": sink.size, "crc32": sink.crc32} if checksums else {"size": sink.size}
    return results, entry


class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
    """``TorchDistSaveShardedStrategy`` (backend torch_dist, version 1: what the loader reads) whose
    synchronous ``save`` writes through ``_write_file`` (module docstring). After a save,
    ``files`` holds the manifest entries (``{"size", "crc32"}``, CRC32 only with ``checksums``) of
    the files this rank wrote, by name relative to the checkpoint directory."""

    def __init__(self, checksums: bool = True) -> None:
        super().__init__("torch_dist", 1)
        self.checksums = checksums
        self.files: dict[str, dict[str, int]] = {}

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        """Megatron's plan (collectives, every rank) and an ``AsyncRequest`` whose ``async_fn`` is our
        writer (``_write_buckets``; no collective) over the write buckets in ``async_fn_args[1]``
        (None: nothing to write on this rank), and whose ``finalize_fns`` gather the results and
        write the metadata (collectives, every rank). Megatron's own ``preload_fn`` (every tensor to
        the host at once) is dropped: ``save`` stages as it writes, ``mcore.checkpoint.async_save``
        into reused host buffers."""
        for sharded in nested_values(sharded_state_dict):
            if isinstance(sharded, ShardedTensor) and torch.is_tensor(sharded.data):
                sharded.data = _own_storage(sharded.data)
        request = super().async_save(sharded_state_dict, checkpoint_dir, async_strategy="mcore")
        if request.async_fn is not None:
            request = request._replace(async_fn=self._write_buckets, preload_fn=None)
        return request

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()

    def _write_buckets(self, rank: int, write_buckets: list, results_queue) -> None:
        """Write every bucket (one file each) and put ``{bucket index: [WriteResult]}`` in
        ``results_queue``, or the exception, as Megatron's writer does."""
        results = {}
        torch_crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)  # the zip records' CRC32s: the file's is ours
        try:
            for i, (path, file_name, (bytes_data, tensor_data)) in enumerate(write_buckets):
                results[i], self.files[file_name] = _write_file(
                    path, file_name, bytes_data, tensor_data, self.checksums
                )
        except Exception as e:  # noqa: BLE001 - handed to Megatron's finalisation, which raises it on every rank
            results = e
        finally:
            torch.serialization.set_crc32_options(torch_crc32)
        if results_queue is not None:
            results_queue.put(results)


def save_strategy(groups, checksums: bool) -> tuple[object, StreamingSaveStrategy]:
    """The ``sharded_strategy`` for ``dist_checkpointing.save`` (fully parallel over the ranks that
    hold the same weights, DP x CP, when there are several) and the streaming strategy under it
    (its ``files`` after the save)."""
    streaming = StreamingSaveStrategy(checksums)
    if groups.sum_size == 1:
        return streaming, streaming
    return FullyParallelSaveStrategyWrapper(streaming, groups.sum_group), streaming
