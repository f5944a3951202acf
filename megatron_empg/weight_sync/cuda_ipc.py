"""CUDA IPC weight transport: each bucket through one GPU buffer that an engine process on the same GPU maps.

For a vLLM engine colocated on the trainer rank's GPU, in a child process of its own. Per bucket the
trainer copies the tensors into one flat ``uint8`` CUDA buffer, exports it with
``torch.multiprocessing.reductions.reduce_tensor`` and hands the engine a small plain-data
description (``update_weights(ipc=description)``; the format, shared with the engine's side, is
``parallel.cuda_ipc``). The choices:

* **One export per bucket.** Each ``reduce_tensor`` call puts a new reference count on the buffer,
  which the engine's mapping of that export releases once when it dies; the engine maps each bucket
  once and drops the mapping before ``update_weights`` returns, so the counts balance. torch keeps
  a record and a CUDA event per export until the buffer is freed, so ``finish`` frees it (which also
  gives its memory back to the trainer between syncs); within one sync a bucket reuses it when it fits.
* **Copies out, finished before returning.** vLLM's layerwise reload keeps the tensors it is given
  until their layer is complete, possibly after later buckets, and the next bucket overwrites the
  buffer; ``update_weights`` blocks until the engine's copies are done, so the buffer may be refilled
  as soon as it returns. The copies into the buffer are synchronised before the export.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.multiprocessing.reductions import reduce_tensor

from megatron_empg.config import ConfigError
from megatron_empg.parallel.cuda_ipc import ALIGNMENT, build_header, handle_to_wire, pack
from megatron_empg.weight_sync.protocol import NamedTensors, WeightReceiver


class CudaIpcTransport:
    """Buckets through one CUDA buffer on this rank's GPU into an engine process on the same GPU
    (module docstring). ``device``: the CUDA index of the buffer (default: the current device).
    ``engine.update_weights(ipc=...)`` must return only once the engine has copied the bucket out.

    Raises ``ConfigError`` (``weight_sync.transport``) without CUDA.
    """

    def __init__(self, engine: WeightReceiver, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "weight_sync.transport",
                "cuda_ipc needs CUDA GPUs (the engine maps the trainer's GPU memory); use shm_file on CPU",
            )
        self.engine = engine
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.gpu_uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._buffer: Tensor | None = None

    def begin(self) -> None:
        self.engine.begin_weight_update()

    def send(self, bucket: NamedTensors) -> None:
        bucket = list(bucket)
        header, nbytes = build_header(bucket)
        try:
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._free_buffer()
                # At least ALIGNMENT bytes: a storage of 0 bytes has no CUDA allocation to share.
                self._buffer = torch.empty(max(nbytes, ALIGNMENT), dtype=torch.uint8, device=self.device)
            pack(bucket, header, self._buffer)
            torch.cuda.current_stream(self.device).synchronize()
            handle = handle_to_wire(*reduce_tensor(self._buffer))
            self.engine.update_weights(ipc={"gpu_uuid": self.gpu_uuid, "handle": handle, "header": header})
        except BaseException:
            self._free_buffer()
            raise

    def finish(self, version: str) -> None:
        try:
            self.engine.finish_weight_update(version)
        finally:
            self._free_buffer()

    def _free_buffer(self) -> None:
        if self._buffer is None:
            return
        self._buffer = None
        # A buffer that an engine still maps waits in torch's IPC limbo; free those whose mappings are gone.
        torch.cuda.ipc_collect()
