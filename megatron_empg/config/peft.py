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


def templates(target: str, matrix: str) -> tuple[str, str]:
    """(our name, PEFT's key) of ``target``'s ``matrix`` (A or B), ``{i}`` the layer (the weight
    mapping's rules: ``weight_sync.mapping.LORA_RULES``)."""
    module = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    ours = f"decoder.layers.{{i}}.{LORA_TARGETS[target][0]}.lora.{target}.lora_{matrix}"
    return ours, f"base_model.model.model.layers.{{i}}.{module}.{target}.lora_{matrix}.weight"


_NAMES = [(*templates(t, m), t) for t in LORA_TARGETS for m in "AB"]


def _regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_OURS = [(_regex(ours), peft) for ours, peft, _ in _NAMES]
_PEFT = [(_regex(peft), ours) for ours, peft, _ in _NAMES]


def peft_name(name: str) -> str:
    """Our adapter's global name -> PEFT's key (ValueError for any other name)."""
    for regex, peft in _OURS:
        if match := regex.match(name):
            return peft.format(i=match.group("i"))
    raise ValueError(f"{name!r} is not an adapter's name")


def megatron_name(key: str) -> str:
    """PEFT's key -> our adapter's global name (ValueError for a key of another module)."""
    for regex, ours in _PEFT:
        if match := regex.match(key):
            return ours.format(i=match.group("i"))
    raise ValueError(f"{key!r} is not a LoRA key of an adapted projection ({list(LORA_TARGETS)})")


def is_peft_key(key: str) -> bool:
    """Whether ``key`` is a PEFT LoRA tensor of an adapted projection."""
    return any(regex.match(key) for regex, _ in _PEFT)


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
