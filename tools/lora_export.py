"""The LoRA part of ``tools/convert_megatron_to_hf.py``: a checkpoint of a LoRA policy's adapters
(its ``empg_checkpoint.json`` records ``lora_base``) becomes

    a PEFT adapter (default)  OUT/adapter_config.json + OUT/adapter_model.safetensors (float32 as
                              trained, or ``--dtype``), which ``peft.PeftModel.from_pretrained(base,
                              OUT)`` loads onto the base
    merged weights (--merge) a HF model directory: the base's tensors with ``(alpha / r) B A``
                              added to each adapted projection's weight (in float32, cast once to
                              the written dtype), the base's config and tokenizer files

The base is the HF directory the checkpoint records (or ``--base``); its fingerprint must match the
recorded one (``mcore.lora.base``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tools.conversion import ArgumentProblem, resolve_dtype

if TYPE_CHECKING:
    import argparse

    from megatron_empg.config import ModelConfig
    from megatron_empg.mcore.convert import ModelCheckpointReader


def base_directory(args: argparse.Namespace, info: dict) -> Path:
    """The base HF directory (``--base``, else the recorded one), checked against the fingerprint."""
    from megatron_empg.mcore.lora.base import base_fingerprint

    recorded = info["lora_base"]
    base = Path(args.base) if args.base is not None else Path(recorded["path"])
    option = "--base" if args.base is not None else "CKPT"
    if not (base / "config.json").is_file():
        raise ArgumentProblem(option, f"the adapters' base {base} is not a HF model directory (no config.json)")
    if base_fingerprint(base) != recorded["fingerprint"]:
        raise ArgumentProblem(option, f"{base} is not the base the adapters were trained on ({recorded['path']})")
    return base


def adapters(reader: ModelCheckpointReader) -> dict[str, torch.Tensor]:
    """PEFT key -> the full adapter tensor, from an adapter checkpoint."""
    from megatron_empg.config.peft import peft_name

    return {peft_name(name): reader.read(name) for name in reader.names}


def write_peft(args: argparse.Namespace, reader: ModelCheckpointReader, model: ModelConfig) -> str:
    """OUT as a PEFT adapter (module docstring); a one-line summary."""
    from safetensors.torch import save_file

    from megatron_empg.config.peft import CONFIG_FILE, WEIGHTS_FILE, adapter_config
    from megatron_empg.mcore.convert import atomic_output_dir

    dtype = resolve_dtype(args.dtype, reader.dtypes.values(), f"checkpoint {reader.path}")
    tensors = {key: t.to(dtype).contiguous() for key, t in adapters(reader).items()}
    targets = model.lora.resolved_targets(moe=model.is_moe)
    config = adapter_config(model.lora, targets, reader.info["lora_base"]["path"])
    with atomic_output_dir(args.out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    count = sum(t.numel() for t in tensors.values())
    return f"wrote {args.out}: a PEFT LoRA adapter of {model.name} (r {model.lora.rank}, {count:,} parameters)"


def write_merged(args: argparse.Namespace, reader: ModelCheckpointReader, model: ModelConfig) -> str:
    """OUT as the base with the adapters merged in (module docstring); a one-line summary."""
    from safetensors import safe_open

    from megatron_empg.mcore.checkpoint import copy_hf_assets
    from megatron_empg.mcore.convert import atomic_output_dir
    from megatron_empg.weight_sync.hf_files import read_header
    from tools.safetensors_stream import PlannedTensor, SafetensorsShardWriter

    base = base_directory(args, reader.info)
    deltas = adapters(reader)
    scale = model.lora.scale
    stored = {file: read_header(file) for file in sorted(base.glob("*.safetensors"))}  # names, shapes, dtypes
    dtypes = {t.dtype for tensors in stored.values() for t in tensors.values()}
    dtype = resolve_dtype(args.dtype, dtypes, f"base {base}")
    merged = set()
    with atomic_output_dir(args.out) as tmp:
        planned = [PlannedTensor(n, t.shape, dtype) for tensors in stored.values() for n, t in tensors.items()]
        writer = SafetensorsShardWriter(tmp, planned, args.max_shard_size)
        for file, tensors in stored.items():
            with safe_open(str(file), framework="pt") as f:
                for name in tensors:
                    tensor = f.get_tensor(name)
                    stem = name.removesuffix(".weight")
                    a = deltas.get(f"base_model.model.{stem}.lora_A.weight")
                    b = deltas.get(f"base_model.model.{stem}.lora_B.weight")
                    if a is not None and b is not None:
                        tensor = tensor.float() + scale * (b.float() @ a.float())
                        merged.add(stem)
                    writer.write(name, tensor.to(dtype))
        writer.close()
        unmatched = sorted({k.rsplit(".lora_", 1)[0].removeprefix("base_model.model.") for k in deltas} - merged)
        if unmatched:
            raise ArgumentProblem("CKPT", f"adapters of weights the base {base} lacks: {unmatched[:4]}")
        hf_config = json.loads((base / "config.json").read_text())
        hf_config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        copy_hf_assets(base, tmp, exclude=("config.json",))
    return f"wrote {args.out}: {model.name} with its LoRA adapters merged ({len(merged)} weights changed)"
