"""Megatron <-> Hugging Face tensor names and layouts for the dense decoder families, table-driven.

One ``TensorRule`` per Megatron parameter says which HF tensors it is made of and how (``layout``):

- ``copy``: the same tensor under another name;
- ``qkv``: Megatron's fused ``linear_qkv`` holds, per query group, that group's query heads, then
  its key head, then its value head: ``[groups * (heads_per_group + 2) * head_dim, (hidden)]``.
  HF keeps ``q_proj`` ``[heads * head_dim, ...]``, ``k_proj``/``v_proj`` ``[groups * head_dim, ...]``;
- ``gate_up``: SwiGLU's ``linear_fc1`` is ``[gate; up]`` stacked on dim 0 (``[2 * ffn, hidden]``;
  an expert's ``ffn`` is ``moe_ffn_hidden_size``);
- ``vocab``: rows are the vocabulary; Megatron pads them to ``padded_vocab_size`` (zeros on the way
  in, dropped on the way out).

An ``Architecture`` is a list of rules plus its HF class name; adding a family is one entry of
``ARCHITECTURES``. A mixture of experts numbers its experts ``{e}`` (global expert indices, as
``mcore.weights.global_names`` gives them at any expert-parallel size): on disk HF keeps one tensor
per expert (``mlp.experts.{e}.gate_proj.weight``), the layout of the published checkpoints. Names are the Megatron local spec's, with global layer indices (what
``mcore.weights.global_names`` gives); the Transformer Engine spec's fused-norm names are mapped onto
them by ``canonical_name``. Everything here works on full tensors (TP-gathered: see ``tp_merge``)
and never changes values: a round trip is bit-exact.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from megatron_empg.config import FAMILIES, ConfigError, ModelConfig, from_dict
from megatron_empg.config.lora import LORA_TARGETS
from megatron_empg.config.peft import templates as peft_templates

Layout = Literal["copy", "qkv", "gate_up", "vocab"]


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One Megatron parameter and the HF tensors it is made of. ``{i}`` is the global layer index."""

    megatron: str
    hf: tuple[str, ...]
    layout: Layout
    family: str  # named in consistency-gate errors: "attention.qkv", "mlp.gate_up", "moe.experts.down", ...
    untied_only: bool = False  # exists only without tied embeddings (the output layer)

    @property
    def is_expert(self) -> bool:
        """One expert's tensor (``{e}`` in its names): its SwiGLU size is ``moe_ffn_hidden_size``."""
        return "{e}" in self.megatron


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str  # ModelConfig.family: a key of config.FAMILIES, which holds its HF names and flags
    rules: tuple[TensorRule, ...]

    @property
    def hf_architecture(self) -> str:
        """config.json's ``architectures`` entry."""
        return FAMILIES[self.family].hf_architecture


_L = "decoder.layers.{i}."
_HL = "model.layers.{i}."
DENSE_RULES = (
    TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "embedding"),
    TensorRule(_L + "input_layernorm.weight", (_HL + "input_layernorm.weight",), "copy", "norm"),
    TensorRule(
        _L + "self_attention.linear_qkv.weight",
        tuple(_HL + f"self_attn.{p}_proj.weight" for p in "qkv"),
        "qkv",
        "attention.qkv",
    ),
    TensorRule(
        _L + "self_attention.linear_proj.weight", (_HL + "self_attn.o_proj.weight",), "copy", "attention.o_proj"
    ),
    TensorRule(_L + "pre_mlp_layernorm.weight", (_HL + "post_attention_layernorm.weight",), "copy", "norm"),
    TensorRule(
        _L + "mlp.linear_fc1.weight",
        (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"),
        "gate_up",
        "mlp.gate_up",
    ),
    TensorRule(_L + "mlp.linear_fc2.weight", (_HL + "mlp.down_proj.weight",), "copy", "mlp.down"),
    TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", "norm"),
    TensorRule("output_layer.weight", ("lm_head.weight",), "vocab", "output_layer", untied_only=True),
)
QKV_BIAS_RULES = (
    TensorRule(
        _L + "self_attention.linear_qkv.bias",
        tuple(_HL + f"self_attn.{p}_proj.bias" for p in "qkv"),
        "qkv",
        "attention.qkv",
    ),
)
QK_NORM_RULES = (
    TensorRule(
        _L + "self_attention.q_layernorm.weight", (_HL + "self_attn.q_norm.weight",), "copy", "attention.qk_norm"
    ),
    TensorRule(
        _L + "self_attention.k_layernorm.weight", (_HL + "self_attn.k_norm.weight",), "copy", "attention.qk_norm"
    ),
)

_E = _L + "mlp.experts.local_experts.{e}."
_HE = _HL + "mlp.experts.{e}."
MOE_RULES = (
    TensorRule(_L + "mlp.router.weight", (_HL + "mlp.gate.weight",), "copy", "moe.router"),
    TensorRule(
        _E + "linear_fc1.weight", (_HE + "gate_proj.weight", _HE + "up_proj.weight"), "gate_up", "moe.experts.gate_up"
    ),
    TensorRule(_E + "linear_fc2.weight", (_HE + "down_proj.weight",), "copy", "moe.experts.down"),
)
_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
SPARSE_RULES = tuple(r for r in DENSE_RULES if not r.megatron.endswith(_DENSE_MLP)) + MOE_RULES

# A LoRA policy's adapters (mcore.lora), named as PEFT names them: matched by every architecture,
# never part of a HF checkpoint's tensors (megatron_tensor_names leaves them out).
LORA_RULES = tuple(
    TensorRule(ours, (peft,), "copy", f"lora.{target}")
    for target in LORA_TARGETS
    for ours, peft in (peft_templates(target, matrix) for matrix in "AB")
)

ARCHITECTURES: dict[str, Architecture] = {
    "qwen2": Architecture("qwen2", DENSE_RULES + QKV_BIAS_RULES),
    "llama": Architecture("llama", DENSE_RULES),
    "qwen3": Architecture("qwen3", DENSE_RULES + QK_NORM_RULES),
    "qwen3_moe": Architecture("qwen3_moe", SPARSE_RULES + QK_NORM_RULES),
}

# The Transformer Engine spec fuses the pre-attention / pre-MLP RMSNorm into the next linear layer.
TE_NAME_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_TE_ALIAS = re.compile(r"^(decoder\.layers\.\d+\.)(" + "|".join(map(re.escape, TE_NAME_ALIASES)) + r")$")
# TE's grouped experts (``moe_grouped_gemm``) keep expert e's weights as ``linear_fc{1,2}.weight<e>``.
_TE_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def canonical_name(megatron_name: str) -> str:
    """A Megatron parameter name in the local spec's spelling (TE's fused-norm names and grouped
    experts mapped)."""
    match = _TE_ALIAS.match(megatron_name)
    if match:
        return f"{match.group(1)}{TE_NAME_ALIASES[match.group(2)]}"
    match = _TE_GROUPED.match(megatron_name)
    if match:
        return f"{match.group(1)}local_experts.{match.group(3)}.{match.group(2)}.weight"
    return megatron_name


def architecture(model: ModelConfig) -> Architecture:
    try:
        return ARCHITECTURES[model.family]
    except KeyError:
        raise ConfigError("family", f"no weight mapping for family {model.family!r}; known: {sorted(ARCHITECTURES)}")


def _rules(model: ModelConfig) -> list[TensorRule]:
    return [r for r in architecture(model).rules if not (r.untied_only and model.tie_word_embeddings)]


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
    return re.compile("^" + pattern + "$")


@dataclasses.dataclass(frozen=True)
class _Match:
    rule: TensorRule
    layer: int | None
    expert: int | None

    def format(self, template: str) -> str:
        return template.format(i=self.layer, e=self.expert)


_RULE_REGEX: dict[str, re.Pattern] = {}


def _find_rule(megatron_name: str, model: ModelConfig) -> _Match:
    name = canonical_name(megatron_name)
    for rule in architecture(model).rules + LORA_RULES:
        regex = _RULE_REGEX.setdefault(rule.megatron, _template_regex(rule.megatron))
        match = regex.match(name)
        if match is None:
            continue
        groups = match.groupdict()
        layer = int(groups["i"]) if "i" in groups else None
        expert = int(groups["e"]) if "e" in groups else None
        if layer is not None and not 0 <= layer < model.num_layers:
            raise KeyError(f"{megatron_name}: layer {layer} is outside the model's {model.num_layers} layers")
        if expert is not None and not 0 <= expert < (model.num_experts or 0):
            raise KeyError(f"{megatron_name}: expert {expert} is outside the model's {model.num_experts} experts")
        return _Match(rule, layer, expert)  # a tied output layer matches too; it maps to no HF tensor
    raise KeyError(f"{megatron_name!r} is not a parameter of a {model.family} model (no mapping rule matches)")


def megatron_tensor_names(model: ModelConfig) -> list[str]:
    """The full model's Megatron parameter names (local spec, global layer indices, TP1/PP1)."""
    names = []
    for rule in _rules(model):
        layers = range(model.num_layers) if "{i}" in rule.megatron else [None]
        experts = range(model.num_experts or 0) if rule.is_expert else [None]
        names.extend(rule.megatron.format(i=i, e=e) for i in layers for e in experts)
    return names


def hf_tensor_names(model: ModelConfig) -> list[str]:
    """Every tensor of the HF checkpoint (without ``lm_head.weight`` when embeddings are tied)."""
    return [hf for name in megatron_tensor_names(model) for hf in hf_names_of(name, model)]


def hf_names_of(megatron_name: str, model: ModelConfig) -> tuple[str, ...]:
    """The HF tensors the Megatron tensor ``megatron_name`` is made of (``()``: a tied output layer)."""
    match = _find_rule(megatron_name, model)
    if match.rule.untied_only and model.tie_word_embeddings:
        return ()
    return tuple(match.format(t) for t in match.rule.hf)


def tensor_rule(megatron_name: str, model: ModelConfig) -> TensorRule:
    """The rule of a Megatron tensor: its HF names, ``layout`` and ``family`` (``attention.qkv``,
    ``mlp.gate_up``, ``norm``, ``moe.router``, ...)."""
    return _find_rule(megatron_name, model).rule


# --------------------------------------------------------------------------------------------
# Layout transforms (pure, exact).


def _qkv_sizes(model: ModelConfig) -> tuple[int, int, int]:
    """(query groups, query heads per group, head dim)."""
    return model.num_query_groups, model.num_attention_heads // model.num_query_groups, model.kv_channels


def split_qkv(fused: Tensor, model: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron ``linear_qkv`` weight ``[G*(Q+2)*D, H]`` (or bias ``[G*(Q+2)*D]``) -> HF q, k, v
    (``[G*Q*D, ...]``, ``[G*D, ...]``, ``[G*D, ...]``), same dtype."""
    groups, per_group, head_dim = _qkv_sizes(model)
    rows = groups * (per_group + 2) * head_dim
    if fused.size(0) != rows:
        raise ValueError(f"linear_qkv has {fused.size(0)} rows; the model's heads need {rows}")
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(groups * per_group * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, model: ModelConfig) -> Tensor:
    """Inverse of ``split_qkv``: HF q, k, v -> Megatron's per-group ``[G*(Q+2)*D, ...]``."""
    groups, per_group, head_dim = _qkv_sizes(model)
    expected = {"q": groups * per_group * head_dim, "k": groups * head_dim, "v": groups * head_dim}
    for label, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.size(0) != expected[label]:
            raise ValueError(f"{label}_proj has {tensor.size(0)} rows; the model's heads need {expected[label]}")
    rest = q.shape[1:]
    return torch.cat(
        [
            q.reshape(groups, per_group, head_dim, *rest),
            k.reshape(groups, 1, head_dim, *rest),
            v.reshape(groups, 1, head_dim, *rest),
        ],
        dim=1,
    ).reshape(-1, *rest)


def _ffn_size(rule: TensorRule, model: ModelConfig) -> tuple[str, int]:
    """The (field name, size) of the SwiGLU that ``rule``'s tensor belongs to."""
    if rule.is_expert:
        return "moe_ffn_hidden_size", model.moe_ffn_hidden_size
    return "ffn_hidden_size", model.ffn_hidden_size


def split_gate_up(fc1: Tensor, model: ModelConfig, *, expert: bool = False) -> tuple[Tensor, Tensor]:
    """Megatron ``linear_fc1`` ``[2*F, H]`` -> HF gate ``[F, H]``, up ``[F, H]`` (F: an expert's
    ``moe_ffn_hidden_size`` when ``expert``, else ``ffn_hidden_size``)."""
    field, size = (
        ("moe_ffn_hidden_size", model.moe_ffn_hidden_size) if expert else ("ffn_hidden_size", model.ffn_hidden_size)
    )
    if fc1.size(0) != 2 * size:
        raise ValueError(f"linear_fc1 has {fc1.size(0)} rows; expected 2 x {field} = {2 * size}")
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def tp_merge(shards: Sequence[Tensor], partition: tuple[int, int] | None) -> Tensor:
    """The full tensor from its TP shards (in TP rank order); inverse of ``mcore.weights.tp_slice``.

    ``partition`` is Megatron's (partition_dim, partition_stride) of the parameter (None:
    replicated, the first shard is the tensor). With stride s, rank r holds global chunks
    ``r, r + tp, ..., r + (s-1) * tp`` of ``tp * s`` equal chunks, concatenated.
    """
    if partition is None or len(shards) == 1:
        return shards[0]
    dim, stride = partition
    if stride == 1:
        return torch.cat(list(shards), dim=dim)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][j] for j in range(stride) for rank in range(len(shards))], dim=dim)


# --------------------------------------------------------------------------------------------
# Whole-tensor conversion.


def to_hf(megatron_name: str, full: Tensor, model: ModelConfig) -> list[tuple[str, Tensor]]:
    """One full (TP1) Megatron tensor -> its HF tensors (padded vocabulary rows dropped; a tied
    output layer gives ``[]``). Dtypes are kept."""
    rule = _find_rule(megatron_name, model).rule
    names = hf_names_of(megatron_name, model)
    if not names:
        return []
    if rule.layout == "qkv":
        return list(zip(names, split_qkv(full, model)))
    if rule.layout == "gate_up":
        return list(zip(names, split_gate_up(full, model, expert=rule.is_expert)))
    if rule.layout == "vocab":
        if full.size(0) < model.vocab_size:
            raise ValueError(f"{megatron_name} has {full.size(0)} rows, fewer than vocab_size={model.vocab_size}")
        return [(names[0], full[: model.vocab_size])]
    return [(names[0], full)]


def to_megatron(
    megatron_name: str, hf_tensors: Mapping[str, Tensor], model: ModelConfig, padded_vocab_size: int
) -> Tensor:
    """The full (TP1) Megatron tensor ``megatron_name`` from its HF tensors (``hf_names_of``).

    Vocabulary rows are zero-padded from ``vocab_size`` to ``padded_vocab_size``. A missing HF
    tensor is a ``KeyError`` naming it; a wrong shape a ``ValueError``.
    """
    rule = _find_rule(megatron_name, model).rule
    names = hf_names_of(megatron_name, model)
    if not names:
        raise KeyError(f"{megatron_name} is tied to the embedding: it has no HF tensor of its own")
    missing = [n for n in names if n not in hf_tensors]
    if missing:
        raise KeyError(f"{megatron_name} needs the HF tensors {missing}, which are missing")
    parts = [hf_tensors[n] for n in names]
    if rule.layout == "qkv":
        return merge_qkv(*parts, model)
    if rule.layout == "gate_up":
        gate, up = parts
        field, size = _ffn_size(rule, model)
        if gate.shape != up.shape or gate.size(0) != size:
            raise ValueError(
                f"{names[0]} {tuple(gate.shape)} and {names[1]} {tuple(up.shape)} must both have {field}={size} rows"
            )
        return torch.cat([gate, up], dim=0)
    if rule.layout == "vocab":
        (table,) = parts
        if table.size(0) != model.vocab_size:
            raise ValueError(f"{names[0]} has {table.size(0)} rows; the config's vocab_size is {model.vocab_size}")
        if padded_vocab_size < model.vocab_size:
            raise ValueError(f"padded_vocab_size={padded_vocab_size} < vocab_size={model.vocab_size}")
        return torch.cat([table, table.new_zeros(padded_vocab_size - table.size(0), *table.shape[1:])])
    return parts[0]


def to_megatron_state_dict(
    hf_tensors: Mapping[str, Tensor], model: ModelConfig, padded_vocab_size: int
) -> dict[str, Tensor]:
    """The full (TP1/PP1) Megatron state dict of a complete HF state dict (``to_megatron`` of every
    ``megatron_tensor_names``; what ``mcore.weights.load_full_state_dict`` takes)."""
    return {
        name: to_megatron(
            name, {n: hf_tensors[n] for n in hf_names_of(name, model) if n in hf_tensors}, model, padded_vocab_size
        )
        for name in megatron_tensor_names(model)
    }


# --------------------------------------------------------------------------------------------
# HF config -> ModelConfig.


_HF_FAMILY = {arch.hf_architecture: family for family, arch in ARCHITECTURES.items()}


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either spelling: transformers >= 5 ``rope_parameters`` or
    the older ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_theta", "the HF config has neither rope_parameters.rope_theta nor rope_theta")
    scaling.update(params)
    if "type" in scaling:  # the oldest spelling
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def model_config_from_hf(hf_config: Mapping[str, Any], name: str | None = None) -> ModelConfig:
    """A ``ModelConfig`` from a HF ``config.json`` dict; ``ConfigError`` for an unknown
    architecture or a feature the Megatron build does not have (sliding windows, MLP bias, ...)."""

    def required(key: str) -> Any:
        if hf_config.get(key) is None:
            raise ConfigError(key, "missing from the HF config")
        return hf_config[key]

    architectures = hf_config.get("architectures") or []
    known = [a for a in architectures if a in _HF_FAMILY]
    if len(known) != 1:
        raise ConfigError(
            "architectures",
            f"expected exactly one of {sorted(_HF_FAMILY)}, got {architectures!r}",
        )
    family = _HF_FAMILY[known[0]]
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", f"only silu (SwiGLU) is supported, got {hf_config['hidden_act']!r}")
    if hf_config.get("mlp_bias"):
        raise ConfigError("mlp_bias", "MLP biases are not supported")
    if hf_config.get("use_sliding_window"):
        raise ConfigError("use_sliding_window", "sliding-window attention is not supported")
    if family == "llama" and hf_config.get("attention_bias"):
        raise ConfigError("attention_bias", "llama with attention biases is not supported")
    theta, scaling = _rope_from_hf(hf_config)
    heads = required("num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if family == "qwen2" or (family == "llama" and head_dim == required("hidden_size") // heads):
        head_dim = None  # derived (qwen2 has no head_dim; Qwen3 configs always state it)
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    data = {
        "name": name or hf_config.get("_name_or_path") or family,
        "family": family,
        "num_layers": required("num_hidden_layers"),
        "hidden_size": required("hidden_size"),
        "ffn_hidden_size": required("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": hf_config.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "vocab_size": required("vocab_size"),
        "max_position_embeddings": required("max_position_embeddings"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_epsilon": float(required("rms_norm_eps")),
        "add_qkv_bias": FAMILIES[family].add_qkv_bias,
        "qk_layernorm": FAMILIES[family].qk_layernorm,
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "initializer_range": float(hf_config.get("initializer_range", 0.02)),
        "bos_token_id": hf_config.get("bos_token_id"),
        "eos_token_id": hf_config.get("eos_token_id"),
        "pad_token_id": hf_config.get("pad_token_id"),
        "dtype": dtype,
    }
    if FAMILIES[family].moe:
        data.update(_moe_from_hf(hf_config, required))
    return from_dict(ModelConfig, data)


def _moe_from_hf(hf_config: Mapping[str, Any], required) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config.json (transformers >= 5 writes ``num_local_experts``,
    the published checkpoints ``num_experts``); dense layers among sparse ones are refused."""
    if hf_config.get("decoder_sparse_step", 1) != 1 or hf_config.get("mlp_only_layers"):
        raise ConfigError(
            "mlp_only_layers",
            "dense layers among the sparse ones (decoder_sparse_step != 1 or mlp_only_layers) are not supported",
        )
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if experts is None:
        raise ConfigError("num_experts", "missing from the HF config (nor num_local_experts)")
    return {
        "num_experts": experts,
        "moe_router_topk": required("num_experts_per_tok"),
        "moe_ffn_hidden_size": required("moe_intermediate_size"),
        "moe_norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)),
        "moe_aux_loss_coeff": float(hf_config.get("router_aux_loss_coef", 0.0)),
    }
