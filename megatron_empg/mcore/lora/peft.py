"""PEFT's LoRA format, which our adapters are exactly (one per HF projection): the tensor names and
``adapter_config.json``. Pure Python (no torch, no megatron).

    ours  decoder.layers.<i>.self_attention.linear_qkv.lora.q_proj.lora_A        [r, in]
    PEFT  base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight         [r, in]

and ``lora_B`` alike (``[out, r]``); o_proj lives on ``linear_proj``, gate/up on ``linear_fc1``,
down on ``linear_fc2`` (``config.lora.LORA_TARGETS``). PEFT's update is ``(lora_alpha / r) B A``,
ours ``(alpha / rank) B A``: the same numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megatron_empg.config.lora import ATTENTION_TARGETS, LORA_TARGETS, LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_OURS = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.linear_\w+\.lora\.([a-z_]+)\.lora_(A|B)$")
_PEFT = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight$")


def peft_name(name: str) -> str:
    """Our adapter's global name -> PEFT's key (ValueError for any other name)."""
    match = _OURS.match(name)
    if match is None or match.group(3) not in LORA_TARGETS:
        raise ValueError(f"{name!r} is not an adapter's name")
    layer, _, target, matrix = match.groups()
    module = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{module}.{target}.lora_{matrix}.weight"


def megatron_name(key: str) -> str:
    """PEFT's key -> our adapter's global name (ValueError for a key of another module)."""
    match = _PEFT.match(key)
    if match is None or match.group(3) not in LORA_TARGETS:
        raise ValueError(f"{key!r} is not a LoRA key of an adapted projection ({list(LORA_TARGETS)})")
    layer, _, target, matrix = match.groups()
    return f"decoder.layers.{layer}.{LORA_TARGETS[target][0]}.lora.{target}.lora_{matrix}"


def adapter_config(lora: LoraConfig, targets: tuple[str, ...], base: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``lora`` adapting ``targets`` of the base at ``base``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def lora_overrides(config: Mapping[str, Any], source: str) -> list[str]:
    """``model_overrides`` giving the ``model.lora`` of a PEFT ``adapter_config.json`` (``source``
    names it in errors: ValueError for what our adapters cannot be)."""
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (LORA only)")
    for key, plain in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, plain) != plain:
            problems.append(f"{key}={config[key]!r}")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config['modules_to_save']!r}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        problems.append("per-module ranks or alphas (rank_pattern, alpha_pattern)")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = list(LORA_TARGETS) if targets == "all-linear" else [targets]
    unknown = [t for t in targets or [] if t not in LORA_TARGETS]
    if not targets or unknown:
        problems.append(f"target_modules {targets!r} (ours: {list(LORA_TARGETS)})")
    if problems:
        raise ValueError(f"{source}: not an adapter this trainer takes: {'; '.join(problems)}")
    targets = [t for t in LORA_TARGETS if t in targets]  # one order, whatever the file's
    return [
        f"lora.rank={int(config['r'])}",
        f"lora.alpha={float(config['lora_alpha'])}",
        f"lora.dropout={float(config.get('lora_dropout', 0.0))}",
        f"lora.targets=[{','.join(targets)}]",
    ]
