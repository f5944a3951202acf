"""A bucket of named tensors through one flat CUDA buffer that another process on the same GPU maps:
the wire format both sides share (the trainer's ``weight_sync.cuda_ipc.CudaIpcTransport`` sends,
the engine's ``rollout.vllm_weight_transfer`` backend receives).

A description is plain data::

    {"gpu_uuid": str,                                     # the buffer's GPU, torch's device UUID
     "handle": {...},                                     # reduce_tensor's arguments, plain data
     "header": [[hf_name, dtype_name, shape, offset]]}    # where each tensor's bytes are

* **Plain data.** vLLM carries the update info from the engine's client to its core process over
  msgpack, which refuses functions, classes and dtypes unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
  (pickle for every message). The rebuild function is always ``rebuild_cuda_tensor`` and four of its
  arguments are fixed for a flat ``uint8`` buffer (``_FIXED``), so the description carries the others
  as ints, lists, bytes and bools, and dtypes by name.
* **By GPU UUID.** The receiver maps the buffer on its own index of that GPU: an engine's
  ``CUDA_VISIBLE_DEVICES`` is narrowed to its replica's GPUs, so the trainer's ``cuda:3`` may be its
  ``cuda:0``. ``receive_bucket`` copies the tensors out and synchronises before returning.
* **Aligned offsets** (``ALIGNMENT`` bytes): every ``view(dtype)`` of the buffer is legal and the copies
  stay on CUDA's vectorised path.

The pure parts (header, packing, unpacking, the handle's plain form and its device rewrite) work on
CPU tensors and are tested on CPU; mapping the buffer needs two processes on one GPU.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import rebuild_cuda_tensor

NamedTensors = Sequence[tuple[str, Tensor]]

ALIGNMENT = 256  # bytes; CUDA allocations are 256-byte aligned, and so is every tensor in the buffer
DESCRIPTION_KEYS = frozenset({"gpu_uuid", "handle", "header"})

# rebuild_cuda_tensor's parameters in order: reduce_tensor's arguments are a tuple in this order.
_PARAMETERS = tuple(inspect.signature(rebuild_cuda_tensor).parameters)
# Those fixed for a flat uint8 buffer (not sent) and those sent as plain data.
_FIXED = {
    "tensor_cls": torch.Tensor,
    "storage_cls": torch.storage.TypedStorage,
    "dtype": torch.uint8,
    "requires_grad": False,
}
HANDLE_KEYS = frozenset(_PARAMETERS) - frozenset(_FIXED)
_SHAPE_KEYS = ("tensor_size", "tensor_stride")


# --------------------------------------------------------------------------------------------
# The bucket's layout in the buffer.


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype name")
    return dtype


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def build_header(bucket: NamedTensors) -> tuple[list[list], int]:
    """Where each tensor of ``bucket`` goes in the flat buffer.

    ``bucket``: ``[(hf_name, tensor)]``, any dtypes, shapes and devices, at least one tensor. Returns
    the header, ``[[hf_name, dtype_name, shape, offset]]`` (``shape`` a list of ints, ``offset`` in
    bytes, a multiple of ``ALIGNMENT``; tensors in bucket order), and the bytes the buffer needs (the
    end of the last tensor; 0 when every tensor is empty).
    """
    if len(bucket) == 0:
        raise ValueError("a bucket needs at least one tensor")
    header, end = [], 0
    for name, tensor in bucket:
        offset = _aligned(end)
        header.append([name, dtype_name(tensor.dtype), list(tensor.shape), offset])
        end = offset + tensor.numel() * tensor.element_size()
    return header, end


def _entries(header: object, where: str = "header") -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """``header`` checked: ``(name, dtype, shape, offset, nbytes)`` per entry. Raises ``ValueError``
    naming ``where`` and the entry."""
    if isinstance(header, (str, bytes)) or not isinstance(header, Sequence) or len(header) == 0:
        raise ValueError(
            f"{where}: expected a non-empty list of [hf_name, dtype_name, shape, offset], got {header!r:.60}"
        )
    entries, names = [], set()
    for i, entry in enumerate(header):
        at = f"{where}[{i}]"
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 4:
            raise ValueError(f"{at}: expected [hf_name, dtype_name, shape, offset], got {entry!r:.80}")
        name, type_name, shape, offset = entry
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"{at}: expected a new non-empty hf_name, got {name!r}")
        dtype = _dtype(type_name, at)
        if not (isinstance(shape, Sequence) and all(_is_int(n) and n >= 0 for n in shape)):
            raise ValueError(f"{at}: expected the shape as a list of ints >= 0, got {shape!r}")
        if not (_is_int(offset) and offset >= 0 and offset % ALIGNMENT == 0):
            raise ValueError(f"{at}: expected an offset >= 0 that is a multiple of {ALIGNMENT}, got {offset!r}")
        names.add(name)
        entries.append((name, dtype, list(shape), offset, math.prod(shape) * dtype.itemsize))
    return entries


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _view(buffer: Tensor, dtype: torch.dtype, shape: list[int], offset: int, nbytes: int) -> Tensor:
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


def pack(bucket: NamedTensors, header: Sequence, buffer: Tensor) -> None:
    """Copy ``bucket``'s tensors into ``buffer`` (1-D ``uint8``, at least the size ``build_header``
    returned) at ``header``'s offsets. The copies are queued on ``buffer``'s device's current stream."""
    for (name, tensor), (_, dtype, shape, offset, nbytes) in zip(bucket, _entries(header), strict=True):
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            raise ValueError(f"pack: {name!r} is {tensor.dtype} {list(tensor.shape)}, the header says {dtype} {shape}")
        _view(buffer, dtype, shape, offset, nbytes).copy_(tensor)


def unpack(buffer: Tensor, header: Sequence) -> list[tuple[str, Tensor]]:
    """``[(hf_name, view)]``: views of ``buffer`` (1-D ``uint8``) with each tensor's dtype and shape,
    in header order. They alias the buffer: copy them before it is refilled."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"unpack: expected a 1-D uint8 buffer, got {buffer.dtype} {list(buffer.shape)}")
    views = []
    for name, dtype, shape, offset, nbytes in _entries(header):
        if offset + nbytes > buffer.numel():
            raise ValueError(f"unpack: {name!r} ends at byte {offset + nbytes}, past the buffer's {buffer.numel()}")
        views.append((name, _view(buffer, dtype, shape, offset, nbytes)))
    return views


# --------------------------------------------------------------------------------------------
# The handle: reduce_tensor's result as plain data, and back on the engine's index of the GPU.


def handle_to_wire(rebuild: object, args: tuple) -> dict[str, Any]:
    """``reduce_tensor(buffer)`` (``rebuild``, ``args``) of a flat ``uint8`` CUDA buffer as plain
    data: ``args`` by parameter name (``HANDLE_KEYS``), sizes and strides as lists of ints, the
    handles as bytes. Raises ``ValueError`` for any other tensor."""
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"expected the handle of a CUDA tensor (rebuild_cuda_tensor), got {rebuild!r}")
    named = dict(zip(_PARAMETERS, args, strict=True))
    fixed = {key: named[key] for key in _FIXED}
    if fixed != _FIXED:
        raise ValueError(f"expected the handle of a flat uint8 buffer without grad ({_FIXED}), got {fixed}")
    wire = {key: named[key] for key in HANDLE_KEYS}
    for key in _SHAPE_KEYS:
        wire[key] = [int(n) for n in named[key]]
    return wire


def rebuild_args(description: Mapping[str, Any], uuid_to_index: Mapping[str, int]) -> tuple:
    """``rebuild_cuda_tensor``'s arguments for ``description``'s buffer in this process: the fixed
    ones restored and ``storage_device`` rewritten to the local index of the buffer's GPU
    (``uuid_to_index``: GPU UUID -> this process's CUDA index). Raises ``ValueError`` when this
    process does not see that GPU."""
    uuid = description["gpu_uuid"]
    if uuid not in uuid_to_index:
        raise ValueError(
            f"ipc: the bucket is on GPU {uuid}, which this process does not see (it sees {sorted(uuid_to_index)}); "
            "weight_sync.transport=cuda_ipc needs the engine on its trainer rank's GPU"
        )
    named = {**description["handle"], **_FIXED, "storage_device": uuid_to_index[uuid]}
    for key in _SHAPE_KEYS:
        named[key] = tuple(named[key])
    return tuple(named[key] for key in _PARAMETERS)


def check_description(description: object, argument: str = "ipc") -> None:
    """Raise (``TypeError`` / ``ValueError`` naming ``argument``) unless ``description`` has the
    keys, handle fields and header of a bucket's description (module docstring). Sequences may be
    lists or tuples: msgpack turns tuples into lists."""
    if not isinstance(description, Mapping):
        raise TypeError(f"{argument}: expected a dict describing a CUDA IPC bucket, got {type(description).__name__}")
    if set(description) != DESCRIPTION_KEYS:
        raise ValueError(f"{argument}: expected the keys {sorted(DESCRIPTION_KEYS)}, got {sorted(description)}")
    if not isinstance(description["gpu_uuid"], str) or not description["gpu_uuid"]:
        raise ValueError(f"{argument}['gpu_uuid']: expected a GPU UUID string, got {description['gpu_uuid']!r}")
    handle = description["handle"]
    if not isinstance(handle, Mapping) or set(handle) != HANDLE_KEYS:
        keys = sorted(handle) if isinstance(handle, Mapping) else type(handle).__name__
        raise ValueError(f"{argument}['handle']: expected the keys {sorted(HANDLE_KEYS)}, got {keys}")
    _entries(description["header"], f"{argument}['header']")


# --------------------------------------------------------------------------------------------
# CUDA: the engine's side and the trainer's side.


def local_gpu_uuids() -> dict[str, int]:
    """GPU UUID -> CUDA index, for the GPUs this process sees."""
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def open_bucket(description: Mapping[str, Any]) -> Tensor:
    """Map ``description``'s buffer in this process: a 1-D ``uint8`` tensor on the local index of its GPU."""
    return rebuild_cuda_tensor(*rebuild_args(description, local_gpu_uuids()))


def receive_bucket(description: Mapping[str, Any], device: torch.device) -> list[tuple[str, Tensor]]:
    """The bucket's ``[(hf_name, tensor)]``, copied onto ``device``, in header order. The copies are
    complete when this returns (the trainer refills the buffer next), and the mapping is dropped."""
    check_description(description)
    buffer = open_bucket(description)
    tensors = [(name, view.to(device, copy=True)) for name, view in unpack(buffer, description["header"])]
    for used in {buffer.device, torch.device(device)}:
        torch.cuda.synchronize(used)
    return tensors
