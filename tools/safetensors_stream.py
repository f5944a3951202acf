"""Read and write Hugging Face safetensors checkpoints one tensor at a time (for the converters).

``SafetensorsDirectory(hf_dir)`` (``megatron_empg.weight_sync.hf_files``, which the bind step shares)
reads only the headers up front; ``read(name)`` reads one tensor's bytes with plain file I/O into a
fresh tensor (no memory map stays behind). ``SafetensorsShardWriter``
takes the list of (name, shape, dtype) in the order the tensors will come, splits it into shards
of at most ``max_shard_size`` bytes (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json``), writes each shard's header first and each tensor's bytes
as it arrives: memory is the tensor being written, whatever the model's size.

File format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the little-endian tensor bytes; offsets are
relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from megatron_empg.weight_sync.hf_files import DTYPES, INDEX_FILE, SafetensorsDirectory, SafetensorsError  # noqa: F401

SINGLE_FILE = "model.safetensors"
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9 bytes (units B, KB, MB, GB, TB and KiB .. TiB; a bare number is bytes)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size such as 500MB, 5GB or 2GiB, got {text!r}")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]
    if value < 1:
        raise ValueError(f"the size must be at least 1 byte, got {text!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsShardWriter:
    """Writes ``plan`` (the tensors in the order they will be given to ``write``) into ``out_dir``
    as safetensors shards of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its
    own). Call ``write`` for each planned tensor in order, then ``close``; files are fsynced."""

    def __init__(self, out_dir: str | os.PathLike, plan: Sequence[PlannedTensor], max_shard_size: int) -> None:
        self.out_dir = Path(out_dir)
        self.plan = list(plan)
        names = [t.name for t in self.plan]
        if len(set(names)) != len(names):
            raise ValueError(f"the plan names a tensor twice: {sorted({n for n in names if names.count(n) > 1})}")
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for tensor in self.plan:
            if shards[-1] and size + tensor.nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(tensor)
            size += tensor.nbytes
        count = len(shards)
        self.shards = [
            (SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors", shard)
            for i, shard in enumerate(shards)
        ]
        self.total_size = sum(t.nbytes for t in self.plan)
        self._next = 0  # index into plan of the next tensor to write
        self._file: BinaryIO | None = None  # the shard being written
        self._shard = -1  # its index in shards
        self._left = 0  # tensors it still lacks

    @staticmethod
    def _header(tensors: Sequence[PlannedTensor]) -> bytes:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            header[t.name] = {
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (same name, shape and dtype as planned)."""
        if self._next >= len(self.plan):
            raise ValueError(f"{name}: all {len(self.plan)} planned tensors are written already")
        planned = self.plan[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (planned.name, planned.shape, planned.dtype):
            raise ValueError(
                f"expected {planned.name} {planned.dtype} {planned.shape} next, got {name} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        if self._file is None:
            self._shard += 1
            file_name, tensors = self.shards[self._shard]
            self._file = open(self.out_dir / file_name, "wb")
            self._file.write(self._header(tensors))
            self._left = len(tensors)
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        self._left -= 1
        if self._left == 0:
            self._close_file()

    def _close_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None

    def close(self) -> list[str]:
        """Check that every planned tensor was written; write the index (several shards). Returns the
        file names written."""
        if self._next != len(self.plan):
            if self._file is not None:
                self._file.close()
            raise ValueError(f"only {self._next} of {len(self.plan)} planned tensors were written")
        files = [file_name for file_name, _ in self.shards]
        if len(self.shards) > 1:
            index = {
                "metadata": {"total_size": self.total_size},
                "weight_map": {t.name: file_name for file_name, shard in self.shards for t in shard},
            }
            with open(self.out_dir / INDEX_FILE, "w") as f:
                json.dump(index, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            files.append(INDEX_FILE)
        return files
