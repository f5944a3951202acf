"""A LoRA policy's base, as its checkpoints reference it: the path and a fingerprint.

The fingerprint is a SHA-256 over the base directory's files (recursively, sorted, the ``hf/``
assets and the checkpoint's own ``empg_checkpoint.json`` timestamps aside): each file's relative
path, its size, and the SHA-256 of its first and last MiB. Reading 2 MiB per file keeps it cheap
on a 16 GB base; a changed header, a truncated or extended file, a renamed or added shard all
change it. A resume compares the configured base's fingerprint with the one its checkpoint
recorded and refuses another base.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_PIECE = 2**20
_SKIPPED = {"empg_checkpoint.json"}  # rewritten with a time stamp; the tensors' files identify the base


def base_fingerprint(path: str | Path) -> str:
    """The fingerprint of the base at ``path`` (a directory, or one file): module docstring."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and p.name not in _SKIPPED)
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root) if file != root else file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(hashlib.sha256(f.read(_PIECE)).digest())
            if size > _PIECE:
                f.seek(max(_PIECE, size - _PIECE))
                digest.update(hashlib.sha256(f.read(_PIECE)).digest())
    return digest.hexdigest()


def peft_adapter(path: str | Path) -> dict | None:
    """``path``'s PEFT ``adapter_config.json`` when ``path`` is a PEFT adapter directory, else None."""
    import json

    from megatron_empg.config.peft import CONFIG_FILE

    config = Path(path) / CONFIG_FILE
    return json.loads(config.read_text()) if config.is_file() else None


def base_path(init_from: str | Path) -> Path:
    """The base of a LoRA run started from ``init_from``: the directory itself, or the base a PEFT
    adapter directory names (``base_model_name_or_path``, a local directory)."""
    adapter = peft_adapter(init_from)
    if adapter is None:
        return Path(init_from)
    base = adapter.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"{init_from}: a PEFT adapter whose base_model_name_or_path ({base!r}) is not a local HF model "
            "directory; set it to the base's directory"
        )
    return Path(base)


def base_record(path: str | Path) -> dict[str, str]:
    """``{"path", "fingerprint"}`` of the base at ``path`` (what a checkpoint records)."""
    return {"path": str(Path(path).resolve()), "fingerprint": base_fingerprint(path)}
