"""Reading a Hugging Face model directory without loading it: ``config.json`` as a ``ModelConfig``
and the safetensors' headers (``SafetensorsDirectory``: names, dtypes, shapes, byte ranges checked
against the files' sizes; ``read`` one tensor at a time). ``check_hf_directory`` is the one check
of such a directory, shared by the converter (tools/convert_hf_to_megatron.py) and the bind step
(``checkpoint.init_from``): every problem is an ``HFDirectoryError`` naming the file.
``architecture_differences`` compares two model configs field by field (a HF directory or a
checkpoint against the run's model).

Safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}``, then the tensor bytes; offsets are relative to the end of the header.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_empg.config import ConfigError, ModelConfig

INDEX_FILE = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_LISTED = 12  # names listed in one message
# ModelConfig fields that decide the tensors' names, shapes and meaning.
ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "norm_epsilon",
    "add_qkv_bias",
    "qk_layernorm",
    "tie_word_embeddings",
)


class HFDirectoryError(ValueError):
    """A Hugging Face model directory is not one, or not of a model this code builds."""


class SafetensorsError(HFDirectoryError):
    """A safetensors file or directory is unreadable, incomplete or inconsistent."""


def listed(names: Sequence[str]) -> str:
    """The first ``MAX_LISTED`` names, and how many more."""
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its bytes are ``[begin, end)`` of ``path``."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors listed in the header of the safetensors file ``path`` (absolute byte ranges),
    checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path} is truncated: no header")
        (header_len,) = struct.unpack("<Q", raw)
        if 8 + header_len > size:
            raise SafetensorsError(f"{path} is truncated: its header needs {header_len} bytes")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise SafetensorsError(f"{path} has an unreadable header ({e})") from e
    start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has the unsupported dtype {entry.get('dtype')!r}")
        begin, end = entry["data_offsets"]
        tensors[name] = StoredTensor(path, DTYPES[entry["dtype"]], tuple(entry["shape"]), start + begin, start + end)
    end = max((t.end for t in tensors.values()), default=start)
    if end > size:
        raise SafetensorsError(f"{path} is truncated: {size} bytes, its header describes {end}")
    return tensors


class SafetensorsDirectory:
    """The tensors of a HF model directory: ``model.safetensors.index.json`` and its shards, or
    every ``*.safetensors`` file when there is no index."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index_path = self.directory / INDEX_FILE
        self.tensors: dict[str, StoredTensor] = {}
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise SafetensorsError(f"{index_path} is not a safetensors index ({e!r})") from e
            files = sorted(set(weight_map.values()))
            missing_files = [f for f in files if not (self.directory / f).is_file()]
            if missing_files:
                raise SafetensorsError(f"{index_path} names shard files that do not exist: {missing_files}")
        else:
            weight_map = None
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not files:
                raise SafetensorsError(f"{self.directory} has no *.safetensors files (and no {INDEX_FILE})")
        for file in files:
            for name, tensor in read_header(self.directory / file).items():
                if name in self.tensors:
                    raise SafetensorsError(f"tensor {name} is in both {self.tensors[name].path.name} and {file}")
                self.tensors[name] = tensor
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if n not in self.tensors or self.tensors[n].path.name != f]
            if absent:
                raise SafetensorsError(f"{index_path} lists tensors that its shard files do not hold: {absent[:10]}")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, read from disk into new memory."""
        stored = self.tensors[name]
        tensor = torch.empty(stored.shape, dtype=stored.dtype)
        nbytes = stored.end - stored.begin
        if nbytes != tensor.numel() * tensor.element_size():
            raise SafetensorsError(f"{stored.path}: {name} has {nbytes} bytes for {stored.dtype} {stored.shape}")
        if nbytes:
            buffer = tensor.reshape(-1).view(torch.uint8).numpy()
            with open(stored.path, "rb") as f:
                f.seek(stored.begin)
                if f.readinto(buffer) != nbytes:
                    raise SafetensorsError(f"{stored.path} is truncated inside {name}")
        return tensor


def architecture_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """``"field: a != b"`` for every architecture field in which ``a`` and ``b`` differ."""
    return [
        f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in ARCHITECTURE_FIELDS if getattr(a, f) != getattr(b, f)
    ]


def read_hf_config(directory: str | os.PathLike, name: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of ``directory``'s ``config.json`` (``name``: its name)."""
    from megatron_empg.weight_sync import mapping

    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFDirectoryError(f"{directory} has no config.json (expected a Hugging Face model directory)")
    try:
        hf_config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise HFDirectoryError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise HFDirectoryError(f"{path} holds a JSON {type(hf_config).__name__}, not an object")
    try:
        return mapping.model_config_from_hf(hf_config, name=name or Path(directory).resolve().name)
    except ConfigError as e:  # an unknown architecture or an unsupported field
        raise HFDirectoryError(f"{path}: {e}") from None


def check_hf_directory(
    directory: str | os.PathLike, name: str | None = None
) -> tuple[ModelConfig, SafetensorsDirectory]:
    """``directory``'s model (``read_hf_config``) and its safetensors (headers read, sizes checked,
    every tensor the model needs present)."""
    from megatron_empg.weight_sync import mapping

    model = read_hf_config(directory, name)
    stored = SafetensorsDirectory(directory)
    needed = mapping.hf_tensor_names(model)
    missing = [n for n in needed if n not in stored.tensors]
    if missing:
        raise HFDirectoryError(
            f"tensors missing from the safetensors ({len(missing)} of {len(needed)}): {listed(missing)}"
        )
    return model, stored
