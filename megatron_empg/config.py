"""The run's configuration: typed dataclasses, built from YAML or dicts, with dotted CLI overrides.

Pure Python and ``yaml``: nothing here imports torch or megatron, so any layer may import it.

The machinery is generic and works for any (nested) dataclass::

    cfg = load_config(ModelConfig, "model_configs/qwen2.5-7b.yaml", ["rope_theta=5e5"])
    cfg = from_dict(ModelConfig, {...})           # type-checked, unknown keys rejected
    data = to_dict(cfg)                           # from_dict(ModelConfig, data) == cfg

* ``from_dict`` checks every value against the field's type hint (``int``, ``float`` (an int is
  accepted), ``bool`` (only a real bool), ``str``, ``X | None``, unions, ``Literal[...]``,
  ``list[X]``, ``tuple[X, ...]``, ``dict``, nested dataclasses), rejects unknown keys (listing the
  allowed ones) and missing required fields, and then calls ``validate()`` on every dataclass in the
  tree that has one, innermost first. Every error is a ``ConfigError`` whose message starts with the
  dotted path of the field, e.g. ``model.num_query_groups: expected int, got 'two'``.
* ``read_yaml`` follows a top-level ``defaults: base.yaml`` (merged under the file's own keys).
* ``apply_overrides`` applies ``a.b.c=value`` strings to a dict; values are parsed as YAML (``1e-6``,
  ``true``, ``[1, 2]``, ``null``, ``{a: 1}``). A key that does not exist is an error, except under a
  free-form ``dict`` field.

Cross-field checks live on the dataclasses as ``validate()`` methods that raise
``ConfigError(field, reason)`` with the field name relative to the dataclass; the caller adds the
dataclass's own path.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_configs"


class ConfigError(ValueError):
    """A configuration value is wrong. ``field`` is its dotted path ('' for the whole config)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}" if field else reason)


# --------------------------------------------------------------------------------------------
# YAML: PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string; accept it as a float.


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` that also reads ``1e-6`` as a float."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def read_yaml(path: str | os.PathLike, *, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML file's top-level mapping. ``defaults: base.yaml`` in it (a path relative to the file)
    names a base config that the file's own keys are merged over: mappings key by key, any other
    value (and an empty mapping ``{}``, which clears one) replaces the base's. Bases may have bases
    (as in NeMo-RL's recipes); a cycle is an error."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError("defaults", f"{path}: a cycle of defaults files: {' -> '.join(map(str, (*_seen, path)))}")
    data = parse_yaml(path.read_text())
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: expected a mapping at the top level, got {_describe(data)}")
    base_name = data.pop("defaults", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise ConfigError("defaults", f"{path}: expected the path of a YAML file, got {_describe(base_name)}")
    base_path = path.parent / base_name
    if not base_path.is_file():
        raise ConfigError("defaults", f"{path}: the base config {base_path} does not exist")
    return _merged(read_yaml(base_path, _seen=(*_seen, path)), data)


def _merged(base: Mapping, update: Mapping) -> dict:
    out = dict(base)
    for key, value in update.items():
        merge = isinstance(value, Mapping) and len(value) > 0 and isinstance(out.get(key), Mapping)
        out[key] = _merged(out[key], value) if merge else value
    return out


# --------------------------------------------------------------------------------------------
# Building dataclasses from dicts.


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list ({_short_repr(value)})"
    return _short_repr(value)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if args else origin.__name__
    return getattr(tp, "__name__", repr(tp))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """``value`` checked against (and where lossless converted to) type ``tp``."""
    if tp is Any or tp is object:
        return copy.deepcopy(value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"expected {_type_name(tp)}, got None")
        candidates = [a for a in args if a is not type(None)]
        errors = []
        for candidate in candidates:
            try:
                return _coerce(candidate, value, path)
            except ConfigError as e:
                errors.append(e)
        if len(candidates) == 1:  # `X | None`: X's own error is the most precise
            raise errors[0]
        raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        for option in args:
            if value == option and type(value) is type(option):
                return option
        raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
        return _build(tp, value, path)
    if tp is type(None):
        if value is not None:
            raise ConfigError(path, f"expected None, got {_describe(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool (true/false), got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float, got {_describe(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str, got {_describe(value)}")
        return value
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
        if (tp is tuple or origin is tuple) and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(path, f"expected {_type_name(tp)} ({len(args)} items), got {len(value)} items")
            items = [_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
        else:
            item_type = args[0] if args else Any
            items = [_coerce(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (tp is tuple or origin is tuple) else items
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {_describe(value)}")
        key_type, value_type = args if args else (Any, Any)
        return {
            _coerce(key_type, k, _join(path, k)): _coerce(value_type, v, _join(path, k)) for k, v in value.items()
        }
    raise TypeError(f"{path}: field type {tp!r} is not supported by megatron_empg.config")


def _build(cls: type[T], data: Mapping, path: str) -> T:
    fields = _init_fields(cls)
    allowed = ", ".join(fields)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(path, f"keys must be strings, got {bad!r}; allowed keys: {allowed}")
    unknown = [k for k in data if k not in fields]
    if unknown:
        what = "unknown key" if len(unknown) == 1 else "unknown keys"
        raise ConfigError(", ".join(_join(path, k) for k in unknown), f"{what}; allowed keys: {allowed}")
    missing = [name for name, f in fields.items() if _is_required(f) and name not in data]
    if missing:
        what = "missing required field" if len(missing) == 1 else "missing required fields"
        raise ConfigError(", ".join(_join(path, k) for k in missing), what)
    hints = _hints(cls)
    values = {name: _coerce(hints[name], value, _join(path, name)) for name, value in data.items()}
    try:
        return cls(**values)
    except ConfigError as e:  # a `__post_init__` validation: give it the field's full path
        raise ConfigError(_join(path, e.field) if e.field else path, e.reason) from None


def _children(obj: Any, path: str) -> Iterable[tuple[Any, str]]:
    """The dataclass instances directly inside ``obj`` (fields, list items, dict values)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = _join(path, f.name)
        if isinstance(value, (list, tuple)):
            yield from ((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, dict):
            yield from ((v, _join(where, k)) for k, v in value.items())
        else:
            yield value, where


def validate_tree(obj: Any, path: str = "") -> None:
    """Call ``validate()`` on ``obj`` and every dataclass inside it, innermost first.

    A ``ConfigError`` raised by a nested ``validate()`` gets the nested dataclass's path prefixed.
    """
    for child, where in _children(obj, path):
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            validate_tree(child, where)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(_join(path, e.field) if e.field else path, e.reason) from None


def from_dict(cls: type[T], data: Mapping, *, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data`` (type-checked), then run ``validate_tree`` on it."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping ({cls.__name__}), got {_describe(data)}")
    obj = _build(cls, data, path)
    validate_tree(obj, path)
    return obj


def to_dict(obj: Any) -> Any:
    """Plain YAML-friendly data (dicts, lists, scalars) of a dataclass tree; ``from_dict`` inverts it."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return copy.deepcopy(obj)


def to_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------------------------
# Dotted overrides.


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_free_form(tp: Any) -> bool:
    """A field whose keys are not fixed by the schema (``dict``, ``dict[K, V]``, ``Any``)."""
    tp = _unwrap_optional(tp)
    return tp is dict or typing.get_origin(tp) is dict or tp is Any


def parse_override(override: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], YAML-parsed value)."""
    if not isinstance(override, str) or "=" not in override:
        raise ConfigError("", f"override {override!r} is not of the form dotted.key=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError("", f"override {override!r}: empty key component in {key!r}")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(key.strip(), f"cannot parse override value {text!r} as YAML: {e}") from None
    return parts, value


def apply_overrides(data: Mapping, overrides: Iterable[str], *, cls: type | None = None) -> dict:
    """A copy of ``data`` with each ``dotted.key=value`` override applied, in order.

    With ``cls`` (the dataclass ``data`` describes), a key exists if the schema has it, so fields
    left at their defaults can be overridden; without it, a key exists if ``data`` has it. Under a
    free-form dict field any key may be set (missing intermediate mappings are created).
    """
    result = copy.deepcopy(dict(data))
    for override in overrides:
        parts, value = parse_override(override)
        node: dict = result
        tp: Any = cls
        for depth, part in enumerate(parts):
            where = ".".join(parts[: depth + 1])
            last = depth == len(parts) - 1
            free = tp is None and cls is not None  # inside a free-form dict field
            if cls is not None and not free:
                fields = _init_fields(tp)
                if part not in fields:
                    raise ConfigError(where, f"unknown key in override {override!r}; allowed keys: {', '.join(fields)}")
                tp = _hints(tp)[part]
            elif cls is None and part not in node:
                allowed = ", ".join(map(str, node)) or "(none)"
                raise ConfigError(where, f"unknown key in override {override!r}; existing keys: {allowed}")
            if last:
                node[part] = value
                break
            if cls is not None and not free:
                inner = _unwrap_optional(tp)
                if _is_free_form(tp):
                    tp = None  # everything below is free-form
                elif dataclasses.is_dataclass(inner):
                    tp = inner
                else:
                    raise ConfigError(where, f"is {_type_name(tp)}, not a mapping; cannot set {'.'.join(parts)}")
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(where, f"is {_describe(child)}, not a mapping; cannot set {'.'.join(parts)}")
            node = child
    return result


def load_config(cls: type[T], path_or_dict: str | os.PathLike | Mapping, overrides: Iterable[str] = ()) -> T:
    """Read a YAML file (or take a dict), apply the dotted overrides, build and validate ``cls``."""
    data = path_or_dict if isinstance(path_or_dict, Mapping) else read_yaml(path_or_dict)
    return from_dict(cls, apply_overrides(data, overrides, cls=cls))


# --------------------------------------------------------------------------------------------
# Model and parallelism.

Family = Literal["qwen2", "llama", "qwen3"]

_HF_ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# What each family's HF implementation hard-codes, as (field, required value).
_FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "qwen2": {"add_qkv_bias": True, "qk_layernorm": False},
    "llama": {"add_qkv_bias": False, "qk_layernorm": False},
    "qwen3": {"add_qkv_bias": False, "qk_layernorm": True},
}
# The rope scalings the Megatron build and the HF config both support, with their required keys.
_ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model (Qwen2/2.5, Llama-3.x, Qwen3 dense): RMSNorm, SwiGLU, RoPE, GQA.

    Sizes use Megatron's names; ``to_hf_config()`` gives the Hugging Face spelling. ``vocab_size`` is
    the HF vocabulary (rows of the HF embedding); Megatron pads it, see ``padded_vocab_size``.
    """

    name: str
    family: Family
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (GQA); = num_attention_heads for MHA
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_epsilon: float
    add_qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (Qwen3 sets it)
    rope_scaling: dict[str, Any] | None = None  # HF spelling, e.g. Llama-3.1's {rope_type: llama3, ...}
    hidden_act: Literal["silu"] = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # of the published weights
    hf_model_id: str | None = None  # Hugging Face Hub id of the published checkpoint

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (Megatron's ``kv_channels``, HF's ``head_dim``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "max_position_embeddings"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError("head_dim", f"must be positive or null, got {self.head_dim}")
        for name in ("rope_theta", "norm_epsilon", "initializer_range"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive finite number, got {value}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"num_attention_heads={self.num_attention_heads} does not divide hidden_size={self.hidden_size} "
                "(set head_dim to use heads of another size)",
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                "num_query_groups",
                f"num_query_groups={self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}",
            )
        if self.kv_channels % 2:
            raise ConfigError("head_dim", f"the head dimension must be even for RoPE, got {self.kv_channels}")
        for flag, required in _FAMILY_FLAGS[self.family].items():
            if getattr(self, flag) != required:
                raise ConfigError(flag, f"family {self.family!r} requires {flag}: {str(required).lower()}")
        if self.family in ("qwen2", "llama") and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"family {self.family!r} (Hugging Face) needs num_attention_heads={self.num_attention_heads} "
                f"to divide hidden_size={self.hidden_size}",
            )
        if self.family == "qwen2" and self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise ConfigError("head_dim", "family 'qwen2' has no head_dim: leave it null (= hidden_size // heads)")
        self._validate_rope_scaling()
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                if token is not None and not 0 <= token < self.vocab_size:
                    raise ConfigError(name, f"token id {token} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type")
        if rope_type not in _ROPE_SCALING_KEYS:
            raise ConfigError(
                "rope_scaling.rope_type",
                f"supported rope scalings are {sorted(_ROPE_SCALING_KEYS)} (or rope_scaling: null), got {rope_type!r}",
            )
        required = _ROPE_SCALING_KEYS[rope_type]
        allowed = ("rope_type", *required)
        for key in self.rope_scaling:
            if key not in allowed:
                raise ConfigError(f"rope_scaling.{key}", f"unknown key for rope_type {rope_type!r}; allowed: {allowed}")
        for key in required:
            value = self.rope_scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(
                    f"rope_scaling.{key}", f"rope_type {rope_type!r} needs a positive number, got {value!r}"
                )
        if rope_type == "llama3" and not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
            raise ConfigError("rope_scaling.high_freq_factor", "must be greater than low_freq_factor")

    def num_parameters(self, *, padded_vocab_size: int | None = None) -> int:
        """Number of weights of the model (embedding rows = ``padded_vocab_size`` or ``vocab_size``)."""
        embedding = (padded_vocab_size or self.vocab_size) * self.hidden_size
        tied = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.parameters_per_layer() + self.hidden_size + embedding * tied

    def parameters_per_layer(self) -> int:
        """Weights of one transformer layer: attention, SwiGLU MLP and the two RMSNorms."""
        h, d = self.hidden_size, self.kv_channels
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        if self.add_qkv_bias:
            attention += q + 2 * kv
        if self.qk_layernorm:
            attention += 2 * d
        mlp = 3 * h * self.ffn_hidden_size  # gate, up, down
        return attention + mlp + 2 * h  # + input and pre-MLP RMSNorm

    def to_hf_config(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.AutoConfig.for_model`` (transformers >= 5 spelling:
        ``rope_parameters`` holds ``rope_theta`` and the scaling; ``dtype`` not ``torch_dtype``)."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        hf: dict[str, Any] = {
            "model_type": self.family,
            "architectures": [_HF_ARCHITECTURE[self.family]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": copy.copy(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "dtype": self.dtype,
        }
        if self.family in ("llama", "qwen3"):
            hf.update(head_dim=self.kv_channels, attention_bias=False)
        if self.family == "llama":
            hf.update(mlp_bias=False)
        if self.family in ("qwen2", "qwen3"):
            hf.update(use_sliding_window=False)
        return hf


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by * TP``."""
    for name, value in (("vocab_size", vocab_size), ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
                        ("tensor_model_parallel_size", tensor_model_parallel_size)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(name, f"must be a positive int, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism; the data-parallel size is what the world size leaves over."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None  # model chunks per pipeline rank
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if vpp < 2:
                raise ConfigError("virtual_pipeline_model_parallel_size", f"must be >= 2 or null, got {vpp}")
            if self.pipeline_model_parallel_size < 2:
                raise ConfigError(
                    "virtual_pipeline_model_parallel_size",
                    "needs pipeline_model_parallel_size >= 2 (interleaving splits each pipeline rank's layers)",
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("sequence_parallel", "needs tensor_model_parallel_size > 1")

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)

    def validate_world_size(self, world_size: int) -> None:
        if world_size < 1 or world_size % self.model_parallel_size:
            raise ConfigError(
                "tensor_model_parallel_size",
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size = {self.tensor_model_parallel_size} x "
                f"{self.pipeline_model_parallel_size}",
            )

    def validate_for(self, model: ModelConfig, world_size: int | None = None) -> None:
        """Check that ``model`` can be split this way (and, if given, over ``world_size`` ranks)."""
        self.validate()
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        for field in ("num_attention_heads", "num_query_groups"):
            if getattr(model, field) % tp:
                raise ConfigError(
                    "tensor_model_parallel_size",
                    f"tensor_model_parallel_size={tp} does not divide model.{field}={getattr(model, field)}",
                )
        if model.num_layers % pp:
            raise ConfigError(
                "pipeline_model_parallel_size",
                f"pipeline_model_parallel_size={pp} does not divide model.num_layers={model.num_layers}",
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and model.num_layers % (pp * vpp):
            raise ConfigError(
                "virtual_pipeline_model_parallel_size",
                f"model.num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size x "
                f"virtual_pipeline_model_parallel_size = {pp} x {vpp}",
            )
        if world_size is not None:
            self.validate_world_size(world_size)


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam with grad clipping and a linear warmup + decay LR schedule (Megatron's argument names).

    ``lr_decay_steps`` null: no decay after the warmup (constant at ``lr``). ``clip_grad`` 0: off.
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.lr_warmup_steps < 0:
            raise ConfigError("lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError("lr_decay_style", f"expected one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(
                "lr_decay_steps", f"must exceed lr_warmup_steps={self.lr_warmup_steps}, got {self.lr_decay_steps!r}"
            )
        if self.clip_grad < 0:
            raise ConfigError("clip_grad", f"must be >= 0 (0 disables clipping), got {self.clip_grad!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The update-pass objective: arguments of ``parallel.rl_loss.rl_loss`` (see there).

    loss = agg(policy loss) + kl_coef * agg(KL) - entropy_coef * agg(entropy). ``policy_loss`` is
    a key of ``parallel.rl_loss.ALL_POLICY_LOSSES`` (``ppo_clip``: GRPO / DAPO / dual-clip;
    ``rpg``, ``rpg_reinforce*``, ``rpg_dual_clip``) with ``policy_loss_args`` its keyword arguments;
    ``kl`` is null, a sampled estimator (``k1`` .. ``k5``, ``k3pp``), ``topk``, an RPG penalty
    (``rpg_fkl``, ``rpg_rkl``, ``rpg_ufkl``, ``rpg_urkl``, ``rpg_ujs``: d(pi / pi_anchor)) or
    ``grpo_corrected`` (RPG's importance-weighted GRPO KL), with ``kl_args`` (``importance_weight``,
    ``iw_clip``; for ``topk`` also ``direction``, ``tail``, ``tail_grad``; for the RPG terms
    ``max_abs_value``);
    ``agg_mode`` one of ``core.aggregation.AGG_MODES``. The names and arguments are resolved and
    checked by ``trainer.build.bind`` (``empg check``), before anything starts.
    """

    policy_loss: str = "ppo_clip"
    policy_loss_args: dict = dataclasses.field(default_factory=dict)
    kl: str | None = None
    kl_coef: float = 0.0
    kl_args: dict = dataclasses.field(default_factory=dict)
    entropy_coef: float = 0.0
    log_entropy: bool = True
    agg_mode: str = "token-mean"
    chunk_size: int | None = None
    inplace_backward: bool = True  # the logits are Megatron's output buffer, read by nothing else

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef!r}")
        if self.kl is None and self.kl_coef != 0:
            raise ConfigError("kl_coef", f"is {self.kl_coef!r} but kl is null (no estimator)")
        if self.kl is None and self.kl_args:
            raise ConfigError("kl_args", f"are set ({sorted(self.kl_args)}) but kl is null (no estimator)")
        if self.entropy_coef < 0:
            raise ConfigError("entropy_coef", f"must be >= 0 (a bonus: loss -= coef * H), got {self.entropy_coef!r}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("chunk_size", f"must be >= 1 or null, got {self.chunk_size!r}")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the rollout engine samples responses (vLLM's ``SamplingParams`` names).

    ``top_k`` null and ``top_p`` 1.0 sample from the whole distribution. ``seed`` null draws a
    fresh seed per request; an int makes the rollouts of a step reproducible.
    """

    n: int = 8  # responses per prompt (the GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 512
    min_tokens: int = 0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError("n", f"must be >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k", f"must be >= 1 or null (off), got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")


@dataclasses.dataclass(frozen=True)
class SearchAgentConfig:
    """Multi-turn search-agent rollouts (Search-R1's protocol, ``rollout.search_agent``).

    The policy writes ``<search>query</search>`` or ``<answer>...</answer>``; after a search the
    ``topk`` passages of the retriever at ``retriever_url`` (a Search-R1-compatible server, e.g.
    ``python -m megatron_empg.rollout.retriever serve``) are appended inside
    ``<information>...</information>``, cut to ``max_obs_tokens`` tokens, and the policy continues.
    ``max_turns`` turns may search; one more, final turn may only answer. ``rollout.sampling.max_tokens``
    bounds each turn's generation, ``train.max_seq_len`` a whole episode. Each retriever request is
    tried ``1 + retries`` times, each bounded by ``timeout_s``; then the step fails.
    """

    retriever_url: str
    topk: int = 3
    max_turns: int = 4
    max_obs_tokens: int = 500
    timeout_s: float = 10.0
    retries: int = 3

    @property
    def turns_per_episode(self) -> int:
        """The most ``generate`` calls an episode takes (each draws from its own seed)."""
        return self.max_turns + 1

    def validate(self) -> None:
        if not self.retriever_url.startswith(("http://", "https://")):
            raise ConfigError("retriever_url", f"expected an http(s) URL such as http://127.0.0.1:8000, got {self.retriever_url!r}")
        if self.topk < 1:
            raise ConfigError("topk", f"must be >= 1, got {self.topk!r}")
        if self.max_turns < 0:
            raise ConfigError("max_turns", f"must be >= 0 (0: answer without searching), got {self.max_turns!r}")
        if self.max_obs_tokens < 1:
            raise ConfigError("max_obs_tokens", f"must be >= 1, got {self.max_obs_tokens!r}")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s!r}")
        if self.retries < 0:
            raise ConfigError("retries", f"must be >= 0, got {self.retries!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine (vLLM): sampling, and how the engine is run.

    ``in_process``: the engine core runs in the trainer's process (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weight updates pass tensors by reference; otherwise
    it is a child process and updates go through a shared-memory file. ``kv_cache_gib`` sizes the
    KV cache on CPU (``VLLM_CPU_KVCACHE_SPACE``); on GPU ``gpu_memory_utilization`` does.
    ``sleep_while_training`` (GPU, colocated) releases the engine's memory while the trainer
    trains: ``sleep_level`` 1 offloads the weights to host memory and drops the KV cache, 2 drops
    both (the weights are synced again before the next rollout anyway). ``engine``: a name of
    ``rollout.engines.ENGINES`` (``vllm``; ``hf``, transformers in the trainer's process, for
    machines without vLLM). ``search_agent``: multi-turn rollouts with a search tool
    (``SearchAgentConfig``) instead of one response per sample.

    ``engines``: how many engines sample a step (``parallel.placement``): ``per_replica`` (one per
    data-parallel replica, on its first GPUs), ``single`` (one, on global rank 0, for the whole
    world) or an int E dividing the data-parallel size (engine e serves replicas
    ``[e*DP/E, (e+1)*DP/E)``). Each engine process takes ``kv_cache_gib`` / ``gpu_memory_utilization``.

    ``placement``: ``colocated`` (the engines live on training ranks, as ``engines`` says) or
    ``disaggregated``: the last ``engine_ranks`` ranks of the job only run engines, one per
    ``tensor_parallel_size`` of them (E = engine_ranks / tensor_parallel_size, dividing the
    data-parallel size of the other ranks, which train); training replica 0 broadcasts the weights
    to every engine after each step (``weight_sync.transport`` is then how an engine rank hands
    them to its own engine). ``mode``: ``sync`` (a step's samples are drawn with the weights it
    starts from) or ``one_step_off`` (disaggregated only: the engines draw step s+1's samples with
    step s's starting weights while step s trains; each sample carries the version that drew it).
    """

    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: int | None = None  # null: the model's max_position_embeddings
    enforce_eager: bool = False
    in_process: bool = True
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: int = 1
    sleep_while_training: bool = True
    sleep_level: Literal[1, 2] = 2
    seed: int = 0
    engine: str = "vllm"
    engines: Literal["per_replica", "single"] | int = "per_replica"
    search_agent: SearchAgentConfig | None = None  # null: one response per sample, no tools
    placement: Literal["colocated", "disaggregated"] = "colocated"
    engine_ranks: int = 0  # disaggregated: how many of the job's ranks only run engines
    mode: Literal["sync", "one_step_off"] = "sync"

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def num_engines(self, dp: int) -> int:
        """E for a run of ``dp`` data-parallel replicas (``engines``, or disaggregated
        ``engine_ranks / tensor_parallel_size``; E need not divide ``dp`` here: ``trainer.layout``
        checks that)."""
        if self.disaggregated:
            return self.engine_ranks // self.tensor_parallel_size
        return {"per_replica": dp, "single": 1}.get(self.engines, self.engines)  # type: ignore[arg-type]

    def validate(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2 or null, got {self.max_model_len!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_gib < 1:
            raise ConfigError("kv_cache_gib", f"must be >= 1 (whole GiB), got {self.kv_cache_gib!r}")
        if isinstance(self.engines, int) and self.engines < 1:
            raise ConfigError("engines", f"must be per_replica, single or an int >= 1, got {self.engines!r}")
        if self.disaggregated:
            if self.engine_ranks < 1:
                raise ConfigError("engine_ranks", f"must be >= 1 with placement disaggregated, got {self.engine_ranks!r}")
            if self.engine_ranks % self.tensor_parallel_size:
                raise ConfigError("engine_ranks", f"{self.engine_ranks} must be a multiple of tensor_parallel_size="
                                  f"{self.tensor_parallel_size} (each engine runs on that many engine ranks)")  # fmt: skip
            if self.engines != "per_replica":
                raise ConfigError("engines", f"is for placement colocated; disaggregated engines are engine_ranks / "
                                  f"tensor_parallel_size (leave engines at per_replica), got {self.engines!r}")  # fmt: skip
        elif self.engine_ranks:
            raise ConfigError("engine_ranks", f"needs placement disaggregated (colocated engines use training ranks), "
                              f"got {self.engine_ranks!r}")  # fmt: skip
        if self.mode == "one_step_off" and not self.disaggregated:
            raise ConfigError("mode", "one_step_off needs placement disaggregated: colocated engines share the "
                              "training GPUs, so generation cannot overlap training")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig:
    """Pushing the policy's weights into the rollout engine, and the consistency gate after it.

    ``transport``: a name of ``weight_sync.transport.TRANSPORTS``: ``in_process`` (tensors by
    reference: an in-process engine, CPU or colocated GPU), ``shm_file`` (a safetensors file per
    bucket in ``shm_dir``, a tmpfs: an engine in another process), ``cuda_ipc`` (a CUDA IPC handle
    of a GPU buffer per bucket: an engine process on its owner's GPU; engine TP 1). ``gate_tolerance``: the largest
    allowed |log-prob difference| between trainer and engine on the probe batch (null: no gate).
    """

    transport: str = "in_process"
    bucket_size_mb: float = 512.0
    shm_dir: str = "/dev/shm"
    gate_tolerance: float | None = 1e-4
    probe_num_sequences: int = 2
    probe_length: int = 160  # > one KV-cache block (128 on CPU), so a stale prefix cache shows
    probe_continuation: int = 8  # tokens sampled after the probe: checks the generation path too
    probe_seed: int = 0

    def validate(self) -> None:
        if not self.bucket_size_mb > 0:
            raise ConfigError("bucket_size_mb", f"must be > 0, got {self.bucket_size_mb!r}")
        if self.gate_tolerance is not None and not self.gate_tolerance > 0:
            raise ConfigError("gate_tolerance", f"must be > 0 or null (no gate), got {self.gate_tolerance!r}")
        if self.probe_num_sequences < 1:
            raise ConfigError("probe_num_sequences", f"must be >= 1, got {self.probe_num_sequences!r}")
        if self.probe_length < 2:
            raise ConfigError("probe_length", f"must be >= 2, got {self.probe_length!r}")
        if self.probe_continuation < 0:
            raise ConfigError("probe_continuation", f"must be >= 0, got {self.probe_continuation!r}")


DATA_SOURCES = ("files", "arithmetic")  # = tasks.registry.PROMPT_SOURCES (config imports no task)
DATA_FILE_SUFFIXES = (".parquet", ".jsonl")
ARITHMETIC_OPS = ("+", "-", "*")


def _check_data_files(field: str, paths: list[str]) -> None:
    """Each of ``paths`` (the list ``field``) names a parquet or JSONL file."""
    for i, path in enumerate(paths):
        if not path.endswith(DATA_FILE_SUFFIXES):
            raise ConfigError(f"{field}[{i}]", f"expected a {' or '.join(DATA_FILE_SUFFIXES)} file, got {path!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training prompts and the reward that scores their responses (``rollout.data``, ``tasks``).

    ``source``: ``files`` reads ``train_files`` (parquet or JSONL, one record per row);
    ``arithmetic`` generates small arithmetic problems ("12+7=") from ``seed`` on the fly, with
    operands of up to ``arithmetic_digits`` digits and the operators ``arithmetic_ops``
    (``tasks.arithmetic``). ``reward`` is a key of ``tasks.registry.REWARDS`` (checked at bind).

    A record's ``prompt_key`` holds a string or a list of chat messages (``{role, content}``), its
    ``answer_key`` a string, an int or a list of strings (several gold answers); a dotted key
    (``reward_model.ground_truth``) reaches into nested records. With ``apply_chat_template`` and a
    tokenizer that has a chat template, prompts are rendered by it with the generation prompt
    (``system_prompt`` as a first system message), else as plain text. ``prompt_template``, a
    format string with one ``{prompt}`` field, rewrites the user's text first (a string prompt, or
    the last user message), e.g. ``"{prompt} Let's think step by step and output the final answer
    within \\boxed{{}}."`` (literal braces doubled, as in ``str.format``). A prompt longer than
    ``max_prompt_tokens`` is an error, or with ``drop_long_prompts`` dropped and counted.
    ``shuffle``: each epoch's order is a permutation drawn from (``seed``, epoch).

    Rewards that check answers in worker processes (``math``, ``math_dapo``: math-verify, whose
    sympy can work on one expression for ever) run ``reward_workers`` processes per rank and give
    each sample at most ``reward_timeout_s`` seconds (then it scores 0, counted in
    ``reward/timeouts``). ``reward_budget_s`` (null: none) bounds a step's scoring on each rank:
    once it has taken that long, the samples not yet checked score 0 (not the reward's incorrect
    score) and ``reward/unscored`` is their fraction of the step's samples (logged with a budget
    only); a validation call of ``validation.batch_size`` prompts gets the whole budget.
    """

    source: Literal["files", "arithmetic"] = "arithmetic"
    reward: str = "arithmetic"
    train_files: list[str] = dataclasses.field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    prompt_template: str | None = None
    apply_chat_template: bool = True
    max_prompt_tokens: int = 1024
    drop_long_prompts: bool = False
    shuffle: bool = True
    seed: int = 0
    arithmetic_digits: int = 2
    arithmetic_ops: list[Literal["+", "-", "*"]] = dataclasses.field(default_factory=lambda: ["+", "-"])
    reward_workers: int = 2
    reward_timeout_s: float = 5.0
    reward_budget_s: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError("source", f"expected one of {DATA_SOURCES}, got {self.source!r}")
        if self.source == "files":
            if not self.train_files:
                raise ConfigError("train_files", "source 'files' needs at least one .parquet or .jsonl file")
            _check_data_files("train_files", self.train_files)
        elif self.source == "arithmetic":
            if self.train_files:
                raise ConfigError("train_files", "source 'arithmetic' generates its prompts: leave train_files empty")
            if self.reward != "arithmetic":
                raise ConfigError("reward", f"source 'arithmetic' needs reward 'arithmetic', got {self.reward!r}")
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name):
                raise ConfigError(name, "must be a non-empty key")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ConfigError("system_prompt", "must be null or non-empty text")
        if self.prompt_template is not None:
            try:
                self.prompt_template.format(prompt="")
            except (KeyError, IndexError, ValueError) as error:
                raise ConfigError(
                    "prompt_template", f"must be a format string whose only field is {{prompt}} ({error!r})"
                ) from None
            if "{prompt}" not in self.prompt_template:
                raise ConfigError("prompt_template", "must contain the field {prompt}")
        if self.max_prompt_tokens < 1:
            raise ConfigError("max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens!r}")
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0, got {self.seed!r}")
        if not 1 <= self.arithmetic_digits <= 9:
            raise ConfigError("arithmetic_digits", f"must be in [1, 9], got {self.arithmetic_digits!r}")
        if not self.arithmetic_ops or len(set(self.arithmetic_ops)) != len(self.arithmetic_ops):
            raise ConfigError(
                "arithmetic_ops", f"expected distinct operators from {ARITHMETIC_OPS}, got {self.arithmetic_ops!r}"
            )
        for i, op in enumerate(self.arithmetic_ops):
            if op not in ARITHMETIC_OPS:
                raise ConfigError(f"arithmetic_ops[{i}]", f"expected one of {ARITHMETIC_OPS}, got {op!r}")
        if self.reward_workers < 1:
            raise ConfigError("reward_workers", f"expected a number of processes >= 1, got {self.reward_workers!r}")
        if not 0 < self.reward_timeout_s < math.inf:
            raise ConfigError("reward_timeout_s", f"expected finite seconds > 0, got {self.reward_timeout_s!r}")
        if self.reward_budget_s is not None and not 0 < self.reward_budget_s < math.inf:
            raise ConfigError(
                "reward_budget_s", f"expected finite seconds > 0, or null for no budget, got {self.reward_budget_s!r}"
            )


ANCHOR_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """The reference policy of the KL term: an EMA of the policy with a float32 master.

    Every ``period`` optimizer steps: anchor <- tau * anchor + (1 - tau) * policy. ``tau`` 1 keeps
    the initial policy (GRPO's fixed reference); ``tau`` 0 with ``period`` 1 is RPG's iterative reset.
    ``compute_dtype``: the anchor's forward weights (the master stays float32). For
    ``float8_e4m3fn``, ``fp8``: ``te`` stores Transformer Engine FP8 parameters (``fp8_param``;
    GPU with TE, and not with the distributed optimizer, whose buffers would need the policy in
    FP8 too), ``emulated`` FP8 values with per-tensor scales in the forward dtype (any machine:
    the arithmetic without the memory saving), ``auto`` TE where it can, else emulated.
    ``master_on_cpu``: the float32 master in pinned host memory (GPU), for memory.
    """

    tau: float = 0.95
    period: int = 10
    first_update: int | None = None  # null: after `period` steps
    compute_dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = "bfloat16"
    fp8: Literal["auto", "te", "emulated"] = "auto"
    master_on_cpu: bool = False

    def validate(self) -> None:
        if not 0 <= self.tau <= 1:
            raise ConfigError("tau", f"must be in [0, 1], got {self.tau!r}")
        if self.period < 1:
            raise ConfigError("period", f"must be >= 1, got {self.period!r}")
        if self.first_update is not None and self.first_update < 1:
            raise ConfigError("first_update", f"must be >= 1 or null, got {self.first_update!r}")
        if self.fp8 == "te" and self.compute_dtype != "float8_e4m3fn":
            raise ConfigError("fp8", f"te stores FP8 weights: it needs compute_dtype float8_e4m3fn, got {self.compute_dtype}")


DYNAMIC_SAMPLING_METRICS = ("acc", "reward")


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a group whose responses all
    score the same ``metric`` (``acc``: all correct or all wrong; ``reward``: one reward, the
    overlong penalty included) has no advantage, so it is dropped and more prompts are sampled,
    ``prompts_per_gen_batch`` at a time (verl's ``gen_batch_size``; null: ``train.prompts_per_step``),
    until every replica holds its ``train.prompts_per_step`` / DP groups, for at most
    ``max_num_gen_batches`` generation batches a step. If they are spent, the dropped groups fill
    what is missing (they add no policy gradient) and a warning says how many; verl stops the run
    instead."""

    metric: Literal["acc", "reward"] = "acc"
    prompts_per_gen_batch: int | None = None
    max_num_gen_batches: int = 20

    def validate(self) -> None:
        if self.max_num_gen_batches < 1:
            raise ConfigError("max_num_gen_batches", f"must be >= 1, got {self.max_num_gen_batches!r}")
        if self.prompts_per_gen_batch is not None and self.prompts_per_gen_batch < 1:
            raise ConfigError("prompts_per_gen_batch", f"must be >= 1 or null, got {self.prompts_per_gen_batch!r}")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """What one RL step optimizes: advantages (``advantage``: a name of ``core.advantages``'
    registry), the update-pass loss (policy loss + KL to the anchor + entropy), the Top-k KL's k,
    and how the rollout batch is split into optimizer steps.

    ``loss.kl`` null trains without a reference (no anchor is built). ``mini_batches``: optimizer
    steps per rollout batch (the old log-probs are computed once, before the first).
    ``mask_truncated``: responses cut by ``max_tokens`` carry no loss (DAPO's overlong filter).
    ``overlong_buffer`` > 0: DAPO's soft overlong punishment, a response of L tokens loses
    ``overlong_penalty * (L - (rollout.sampling.max_tokens - overlong_buffer)) / overlong_buffer`` of
    its reward when L passes ``max_tokens - overlong_buffer`` (``rollout.rewards.overlong_penalty``).
    ``dynamic_sampling``: DAPO's group filter (``DynamicSamplingConfig``); null: every group trains.
    ``behavior_is``: the importance correction of the sampled-token loss terms against the engine's
    sampling policy mu (a name of ``core.behavior_is``' registry: ``none``, ``tis``: min(pi_old/mu,
    C), ``mis``: pi_old/mu where it lies in [1/C, C], else 0), C = ``behavior_is_cap`` >= 1.
    """

    advantage: str = "grpo"
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    anchor: AnchorConfig = dataclasses.field(default_factory=AnchorConfig)
    topk: int = 32
    mini_batches: int = 1
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: DynamicSamplingConfig | None = None
    behavior_is: str = "none"
    behavior_is_cap: float = 2.0

    @property
    def anchor_is_behaviour_policy(self) -> bool:
        """Whether the anchor is, at every step, the policy that sampled it: tau 0 once per step
        (after its ``mini_batches`` optimizer steps), RPG's iterative reference."""
        anchor = self.anchor
        return anchor.tau == 0 and anchor.period == self.mini_batches and anchor.first_update in (None, anchor.period)

    def validate(self) -> None:
        if self.topk < 1:
            raise ConfigError("topk", f"must be >= 1, got {self.topk!r}")
        if self.mini_batches < 1:
            raise ConfigError("mini_batches", f"must be >= 1, got {self.mini_batches!r}")
        if self.overlong_buffer < 0:
            raise ConfigError("overlong_buffer", f"must be >= 0 (0: off), got {self.overlong_buffer!r}")
        if self.overlong_penalty < 0:
            raise ConfigError("overlong_penalty", f"must be >= 0, got {self.overlong_penalty!r}")
        if not self.behavior_is_cap >= 1:  # also rejects NaN
            raise ConfigError("behavior_is_cap", f"must be >= 1, got {self.behavior_is_cap!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop: ``steps`` RL steps of ``prompts_per_step`` prompts (x ``rollout.sampling.n``
    responses) of at most ``max_seq_len`` tokens each, in micro-batches of ``micro_batch_size``
    sequences, or (``max_tokens_per_microbatch``) of as many as fit that many tokens.

    ``packing``: a micro-batch is one row of its sequences back to back, attention and positions
    restarting at each (Megatron's THD layout), instead of one right-padded row per sequence.
    ``max_tokens_per_microbatch`` needs it and must hold a sequence of ``max_seq_len``.
    ``balance``: each mini-batch's samples are split between the replicas of one engine by
    estimated compute (tokens plus the attention's quadratic term) rather than kept where they
    were sampled; the gradient is the same.

    ``recompute``: activation recompute in the update pass (Megatron's): ``none``; ``selective``
    (the core attention, whose [b, heads, s, s] scores dominate long sequences); ``full`` (whole
    layers, ``recompute_num_layers`` per checkpointed unit: only their inputs are kept, each is run
    again in the backward pass). The gradient is the same; the time goes up and the memory down.

    ``fused_output_loss``: the update pass computes the logits from the output layer's input and
    weight one chunk of tokens at a time inside the loss (``parallel.fused_output``), so that the
    [tokens, V / TP] logits and their gradient never exist whole: at 16,384 tokens of a 151,936
    vocabulary 0.78 GB of GPU memory instead of 5.4 GB, for 1.5x the output layer's and the loss's
    time (one more GEMM; H100, benchmarks/README.md). The gradient is the same up to rounding.
    """

    steps: int = 100
    prompts_per_step: int = 64
    micro_batch_size: int = 8
    max_seq_len: int = 1024
    seed: int = 1234
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 1
    packing: bool = True
    max_tokens_per_microbatch: int | None = None
    balance: bool = True
    fused_output_loss: bool = False

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "recompute_num_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)!r}")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len", f"must be >= 2, got {self.max_seq_len!r}")
        budget = self.max_tokens_per_microbatch
        if budget is not None:
            if not self.packing:
                raise ConfigError("max_tokens_per_microbatch", "needs packing: true (a token budget fills packed rows)")
            if budget < self.max_seq_len:
                raise ConfigError(
                    "max_tokens_per_microbatch",
                    f"{budget} cannot hold a sequence of max_seq_len={self.max_seq_len} tokens; set it to at least that",
                )


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """Held-out prompts answered and scored under the current weights every ``interval`` steps
    (0: never) and, with ``at_start``, before the first step of a run that does not ``--resume``
    (logged at the step it starts from: 0, or that of ``checkpoint.continue_from``).

    ``files`` (parquet or JSONL) are read like ``data``'s training files (keys, template, chat
    template, prompt length) and scored by ``data.reward``; with ``rollout.search_agent`` the
    answers are whole search episodes. Prompts are grouped by data source, a record's
    ``data_source`` column, else its file's name without suffix, keeping the first
    ``max_prompts_per_source`` of each (null: all). Responses are sampled as in
    ``rollout.sampling`` (``max_tokens``, stop strings, seed) but with this section's ``n``,
    ``temperature``, ``top_p`` and ``top_k``: by default one greedy answer per prompt. The engine
    takes ``batch_size`` prompts per call. Metrics: ``val/<source>/reward/mean``, ``.../accuracy``,
    the reward's own (``.../reward/exact_match``), response lengths, the agent's ``rollout/*_mean``,
    and the same over all sources as ``val/...``.
    """

    files: list[str] = dataclasses.field(default_factory=list)
    interval: int = 0
    at_start: bool = False
    max_prompts_per_source: int | None = None
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    batch_size: int = 512

    def validate(self) -> None:
        _check_data_files("files", self.files)
        if self.interval < 0:
            raise ConfigError("interval", f"must be >= 0 (0: never), got {self.interval!r}")
        if (self.interval or self.at_start) and not self.files:
            raise ConfigError("files", "a validation pass (interval > 0 or at_start) needs at least one file")
        if self.files and not (self.interval or self.at_start):
            raise ConfigError("interval", "files are set but no pass is asked for: set interval > 0 or at_start: true")
        if self.max_prompts_per_source is not None and self.max_prompts_per_source < 1:
            raise ConfigError(
                "max_prompts_per_source", f"must be >= 1 or null (all), got {self.max_prompts_per_source!r}"
            )
        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {self.batch_size!r}")
        self.sampling(SamplingConfig())  # SamplingConfig's checks of n, temperature, top_p and top_k

    def sampling(self, rollout: SamplingConfig) -> SamplingConfig:
        """``rollout`` with this section's ``n``, ``temperature``, ``top_p`` and ``top_k``."""
        return dataclasses.replace(rollout, n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go, every ``interval`` steps: the console, ``<dir>/metrics.jsonl``, Weights &
    Biases (offline when no API key is set).

    Console: on a terminal a progress bar (``progress``: ``auto`` is rich's), elsewhere (a Slurm log
    file, a pipe) one line per logged step; ``none``: neither. ``third_party_level``: the level of
    other libraries' loggers (vLLM, Megatron, transformers, torch): ``WARNING`` hides their INFO
    chatter, ``INFO`` or ``DEBUG`` restore it.
    """

    dir: str = "runs/empg"
    progress: Literal["auto", "rich", "tqdm", "none"] = "auto"
    third_party_level: str = "WARNING"
    jsonl: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-empg"
    wandb_run_name: str | None = None
    interval: int = 1

    def validate(self) -> None:
        if self.interval < 1:
            raise ConfigError("interval", f"must be >= 1, got {self.interval!r}")
        if self.third_party_level not in LOG_LEVELS:
            raise ConfigError("third_party_level", f"expected one of {LOG_LEVELS}, got {self.third_party_level!r}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # the logging module's level names


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Atomic distributed checkpoints under ``dir`` every ``interval`` steps (0: only at the end
    and on SIGTERM/SIGUSR1), keeping the ``keep_last`` newest. ``init_from``: the policy's first
    weights: a HF model directory, a converted or training checkpoint, or null (random init).

    ``continue_from``: a training checkpoint of an earlier stage (e.g. the 8k stage of a staged
    long-context run) whose whole training state (policy, optimizer, LR schedule, EMA anchor,
    step counter) this run starts from, under its own data and length settings: the prompt order
    of this run's ``data`` section, continued at the step counter. Applies when this run's
    ``dir`` has no checkpoint to ``--resume`` from.

    ``verify``: how a resume makes sure the checkpoint's files are intact (a damaged newest one is
    skipped for an older one). ``checksum``: every file's CRC32 is recorded at save and compared at
    resume, the ranks sharing the reads (one extra read of the checkpoint at each save and resume,
    about 3 GB/s per rank from the page cache). ``size``: file sizes only (a ``stat`` per file;
    catches truncated and missing files, not damaged content).
    """

    dir: str = "runs/empg/checkpoints"
    interval: int = 50
    keep_last: int | None = 3
    init_from: str | None = None
    continue_from: str | None = None
    optimizer_format: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    verify: Literal["checksum", "size"] = "checksum"

    def validate(self) -> None:
        if self.init_from is not None and self.continue_from is not None:
            raise ConfigError("continue_from", "and init_from are exclusive (continue_from carries the policy weights)")
        if self.interval < 0:
            raise ConfigError("interval", f"must be >= 0 (0: only at the end), got {self.interval!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", f"must be >= 1 or null (keep all), got {self.keep_last!r}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The process group. ``timeout_minutes``: how long a collective may wait before the NCCL
    watchdog (or gloo) aborts the job. Phases that some ranks wait through (the rollout and
    validation passes of the slowest engine) must end within it."""

    timeout_minutes: float = 60.0

    def validate(self) -> None:
        if not self.timeout_minutes > 0:
            raise ConfigError("timeout_minutes", f"must be > 0, got {self.timeout_minutes!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run (``empg train CONFIG.yaml [a.b.c=value ...]``).

    ``model``: a name in ``model_configs/`` or a YAML path; ``model_overrides``: dotted overrides
    of it. ``tokenizer``: a HF directory with the tokenizer (the engine's too); null: the HF
    directory of ``checkpoint.init_from``.
    """

    model: str
    model_overrides: list[str] = dataclasses.field(default_factory=list)
    tokenizer: str | None = None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def model_config(self) -> ModelConfig:
        """The resolved ``ModelConfig`` (errors name ``model`` / ``model_overrides``)."""
        try:
            return load_model_config(self.model, self.model_overrides)
        except ConfigError as e:
            raise ConfigError(_join("model", e.field) if e.field != "model" else "model", e.reason) from None

    def validate(self) -> None:
        if self.tokenizer is None and self.checkpoint.init_from is None and self.checkpoint.continue_from is None:
            raise ConfigError(
                "tokenizer",
                "needed when checkpoint.init_from and checkpoint.continue_from are null "
                "(the engine needs a tokenizer)",
            )
        if not self.rollout.in_process and self.weight_sync.transport == "in_process":
            raise ConfigError(
                "weight_sync.transport",
                "in_process hands tensors to the engine by reference, which needs rollout.in_process=true; an engine "
                "in its own process (rollout.in_process=false) takes shm_file",
            )
        if self.validation.interval % self.logging.interval:  # else a pass's metrics fall between two records
            raise ConfigError(
                "validation.interval",
                f"must be a multiple of logging.interval={self.logging.interval}, got {self.validation.interval}",
            )


def model_config_path(name: str) -> Path:
    """``model_configs/<name>.yaml``; a ``ConfigError`` lists the known names if there is none."""
    path = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
        raise ConfigError("model", f"no model config named {name!r} in {MODEL_CONFIG_DIR}; known: {known}")
    return path


def load_model_config(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> ModelConfig:
    """A ``ModelConfig`` from a YAML path, or from a name in ``model_configs/`` ("qwen2.5-7b")."""
    path = Path(name_or_path)
    if not path.is_file() and len(path.parts) == 1 and path.suffix not in (".yaml", ".yml"):
        path = model_config_path(str(name_or_path))
    return load_config(ModelConfig, path, overrides)
