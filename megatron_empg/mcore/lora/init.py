"""A LoRA policy's adapters' first values (``mcore.lora.model`` allocates them).

``initialize_adapters`` draws each adapter's A from a generator seeded with the run's seed and the
adapter's global name (the full model's layer index), whole, then takes this rank's TP shard: every
parallel layout starts from the same adapters. B starts at zero, so the adapted model starts as its
base (PEFT's default).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

from megatron_empg.config.lora import LoraConfig
from megatron_empg.mcore import weights
from megatron_empg.mcore.lora.model import adapters


@torch.no_grad()
def initialize_adapters(chunks: Sequence[torch.nn.Module], lora: LoraConfig, seed: int) -> None:
    """A of each adapter drawn whole from (``seed``, its global name), this rank's TP shard taken;
    B zeros (module docstring)."""
    from megatron_empg.mcore.lora.layers import COLUMN_ROLES

    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        offset = weights.layer_offset(module)
        for name, linear in adapters(module):
            tp, tp_rank = linear.tp_group.size(), linear.tp_group.rank()
            for target, pair in linear.lora.items():
                key = weights.global_name(f"{name}.lora.{target}.lora_A", offset)
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                column = linear.lora_role in COLUMN_ROLES
                inputs = pair.lora_A.shape[1] * (1 if column else tp)
                full = torch.empty(lora.rank, inputs, dtype=torch.float32)
                if lora.init == "kaiming":  # torch.nn.Linear's (PEFT's default): bound 1 / sqrt(in)
                    torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                else:
                    torch.nn.init.normal_(full, std=1 / lora.rank, generator=generator)
                if not column:
                    full = full.chunk(tp, dim=1)[tp_rank]
                pair.lora_A.copy_(full)
                pair.lora_B.zero_()
