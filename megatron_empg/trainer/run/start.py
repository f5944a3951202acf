"""What a run starts from: the tokenizer, the HF config the engine is built from, the policy's
first weights (a HF directory or a Megatron checkpoint), a checkpoint root's newest directory, and
the module names under which older checkpoints pickled the trainer's classes."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_empg.config import ModelConfig, RunConfig


def load_tokenizer(config: RunConfig):
    """``config.tokenizer``, else the tokenizer of ``checkpoint.init_from`` / ``continue_from`` (a HF
    directory, or a checkpoint with its ``hf/`` assets)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_source(config)))


def tokenizer_source(config: RunConfig) -> Path:
    """The directory ``load_tokenizer`` reads."""
    if config.tokenizer is not None:
        return Path(config.tokenizer)
    return hf_assets(config.checkpoint.init_from or config.checkpoint.continue_from)


def hf_assets(path: str | Path) -> Path:
    """A HF directory itself, or a checkpoint's (a step_N directory or a root's newest) hf/ assets."""
    init = Path(path)
    if not (init / "config.json").is_file() and not (init / "hf").is_dir():
        init = checkpoint_directory(init)
    return init / "hf" if (init / "hf").is_dir() else init


def write_hf_config(model: ModelConfig, out_dir: Path) -> None:
    """``model``'s HF ``config.json`` in ``out_dir`` (float32: the engine's dtype is its own setting)."""
    from transformers import AutoConfig

    AutoConfig.for_model(**{**model.to_hf_config(), "dtype": "float32"}).save_pretrained(out_dir)


def load_initial_weights(chunks, init_from: str, model, config: RunConfig, groups) -> None:
    """The policy's first weights from a HF directory (``config.json`` + safetensors), a PEFT LoRA
    adapter directory (its base's weights and the adapters: ``config.peft``), or a Megatron
    checkpoint (converted or from training: its model part only)."""
    from megatron_empg.mcore.lora.base import base_path, peft_adapter

    path = Path(init_from)
    adapter = peft_adapter(path)
    if adapter is not None or (path / "config.json").is_file():
        from megatron_empg.mcore.weights import load_full_state_dict
        from megatron_empg.weight_sync import mapping

        base = base_path(path)
        hf = _safetensors(base)
        full = mapping.to_megatron_state_dict(hf, model, config.parallel.padded_vocab_size(model.vocab_size))
        if adapter is not None:
            from megatron_empg.config.peft import megatron_name

            full.update({megatron_name(key): tensor for key, tensor in _safetensors(path).items()})
        load_full_state_dict(chunks, full, vocab_size=model.vocab_size, canonical_name=mapping.canonical_name)
        return
    from megatron_empg.mcore.checkpoint import CheckpointParts, load_checkpoint

    load_checkpoint(checkpoint_directory(path), CheckpointParts(chunks), groups, strict=False)


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def checkpoint_directory(path: str | Path) -> Path:
    """A checkpoint root's newest complete checkpoint, or ``path`` itself (a ``step_N`` directory)."""
    from megatron_empg.mcore.checkpoint import find_latest_checkpoint

    found = find_latest_checkpoint(path)
    return found.path if found is not None else Path(path)


# The trainer's modules whose classes a checkpoint pickles (rollouts drawn ahead by disaggregated
# engines: ``StepRollout`` of ``Sample``s), under the names they had before the trainer's groups.
RENAMED_MODULES = {
    "megatron_empg.trainer.collect": "megatron_empg.trainer.engines.collect",
    "megatron_empg.trainer.batch": "megatron_empg.trainer.batching.batch",
}


@contextlib.contextmanager
def old_module_names() -> Iterator[None]:
    """While loading a checkpoint: the old names of ``RENAMED_MODULES`` resolve to the modules, so a
    checkpoint written before the move unpickles (its classes are the same)."""
    added = [old for old in RENAMED_MODULES if old not in sys.modules]
    for old in added:
        sys.modules[old] = importlib.import_module(RENAMED_MODULES[old])
    try:
        yield
    finally:
        for old in added:
            del sys.modules[old]
