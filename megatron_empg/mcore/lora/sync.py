"""What a LoRA policy's weight sync pushes (``weight_sync.lora_mode``), one class per mode:

    merged    every weight under HF's names, each adapted projection's as ``W + (alpha / r) B A``
              (``mcore.weights.named_weight_shards``); the engine serves the merged model, any
              engine, the bytes of the whole model per sync
    adapter   the adapters only, under PEFT's names (``mcore.weights.named_weight_shards(adapters=True)``);
              the engine keeps the base it started from and serves them as a LoRA adapter (vLLM's
              ``LoRARequest``): the bytes of the adapters per sync

A policy without adapters syncs every weight (``merged`` means that: nothing to merge).
"""

from __future__ import annotations

from collections.abc import Sequence


class MergedWeights:
    """Every weight, the adapters merged in."""

    name = "merged"
    engine_holds_base = False  # the engine may start from dummy weights: the first sync brings all

    def shards(self, chunks: Sequence) -> list:
        from megatron_empg.mcore.weights import named_weight_shards

        return named_weight_shards(chunks)


class AdapterWeights:
    """The adapters only; the engine starts from the base's weights."""

    name = "adapter"
    engine_holds_base = True

    def shards(self, chunks: Sequence) -> list:
        from megatron_empg.mcore.weights import named_weight_shards

        return named_weight_shards(chunks, adapters=True)


LORA_SYNC_MODES: dict[str, type] = {"merged": MergedWeights, "adapter": AdapterWeights}
