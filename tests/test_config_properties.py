"""Every field of the config schema, given random bad values through the override path (YAML text,
as on the command line), is refused with a ``ConfigError`` naming that field, never another
exception: wrong types, NaN, +-inf, negative numbers (no number field of the schema takes one),
empty strings, null where the field takes none. The walk covers every ``Config`` class of
``RunConfig``'s tree and the model config (through ``model_overrides``), so a new field is tested
the day it is added. The negative control: each field's own value, written the same way, is
accepted."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_empg.config import ConfigError, ModelConfig, RunConfig, load_config
from megatron_empg.config.schema import unwrap_optional

# The optional sections present, so that their fields are checked too.
BASE = {
    "model": "tiny-qwen2",
    "tokenizer": "/tmp/tokenizer",
    "rollout": {"search_agent": {"retriever_url": "http://127.0.0.1:8000"}},
    "algorithm": {
        "dynamic_sampling": {},
        "distill": {"teacher": {"model": "tiny-qwen2", "checkpoint": "/tmp/teacher"}},
    },
    "model_overrides": ["lora.rank=4"],  # the model's optional section
}
MAPPING, LIST, TEXT = "{a: 1}", "[1]", "text"
NOT_NUMBERS = (".nan", ".inf", "-.inf", "true", TEXT, "''", MAPPING, LIST)


def _walk(cls: type, prefix: str) -> list[tuple[str, Any]]:
    """(dotted path, type) of every field of dataclass ``cls`` and of the dataclasses inside it."""
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        path, tp = f"{prefix}{field.name}", hints[field.name]
        out.append((path, tp))
        if dataclasses.is_dataclass(unwrap_optional(tp)):
            out += _walk(unwrap_optional(tp), f"{path}.")
    return out


FIELDS = _walk(RunConfig, "") + _walk(ModelConfig, "model.")


def _members(tp: Any) -> list[Any]:
    """The types a value of ``tp`` may take (a union's members; None left out)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [m for a in typing.get_args(tp) if a is not type(None) for m in _members(a)]
    return [tp]


def _bad_texts(tp: Any) -> set[str]:
    """YAML texts that no member of ``tp`` takes."""
    optional = type(None) in typing.get_args(tp)
    bad = None
    for member in _members(tp):
        origin = typing.get_origin(member)
        if member is bool:
            texts = {"1", "yes", "off", *NOT_NUMBERS} - {"true"}
        elif member in (int, float):
            texts = set(NOT_NUMBERS) | ({"1.5"} if member is int else set())
        elif member is str:
            texts = {"''", "1", "true", ".nan", MAPPING, LIST}
        elif origin is Literal:
            texts = {"bogus", "''", "1.5", MAPPING, LIST}
        elif member is list or origin is list:
            (item,) = typing.get_args(member) or (Any,)
            texts = {TEXT, "5", MAPPING} | {f"[{t}]" for t in _bad_texts(item) if not t.startswith("[")}
        elif member is dict or origin is dict:
            texts = {TEXT, "5", LIST}
        elif dataclasses.is_dataclass(member):
            texts = {TEXT, "5", LIST}
        else:
            raise AssertionError(f"no bad values for {member!r}: extend the test")
        bad = texts if bad is None else bad & texts
    return bad | (set() if optional else {"null"})


def _out_of_range(tp: Any):
    """Negative numbers, where ``tp`` takes numbers: no number field of the schema takes one."""
    members = _members(tp)
    if float in members:
        return st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False).map(repr)
    if int in members:
        return st.integers(max_value=-1).map(str)
    return st.nothing()


def _load(path: str, text: str) -> RunConfig:
    """The config with ``path=text`` (a model field through ``model_overrides``), resolved."""
    if path.startswith("model."):
        overrides = [*BASE["model_overrides"], f"{path.removeprefix('model.')}={text}"]
        config = load_config(RunConfig, {**BASE, "model_overrides": overrides})
    else:
        config = load_config(RunConfig, BASE, [f"{path}={text}"])
    config.model_config()
    return config


def _own_value(path: str) -> str:
    """The field's value in the base config, as YAML text."""
    obj: Any = load_config(RunConfig, BASE)
    if path.startswith("model."):
        obj = obj.model_config()
        path = path.removeprefix("model.")
    for part in path.split("."):
        obj = getattr(obj, part)
    value = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_the_walk_reaches_every_config_class():
    classes = {unwrap_optional(tp).__name__ for _, tp in FIELDS if dataclasses.is_dataclass(unwrap_optional(tp))}
    assert classes >= {
        "SearchAgentConfig",
        "DynamicSamplingConfig",
        "PhaseTimeouts",
        "LossConfig",
        "ParallelConfig",
        "LoraConfig",
    }
    assert len(FIELDS) > 150


@pytest.mark.parametrize(("path", "tp"), FIELDS, ids=[path for path, _ in FIELDS])
@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_a_bad_value_is_refused_naming_its_field(path, tp, data):
    text = data.draw(st.sampled_from(sorted(_bad_texts(tp))) | _out_of_range(tp), label="value")
    with pytest.raises(ConfigError) as refused:
        _load(path, text)
    field = refused.value.field
    assert field == path or field.startswith((f"{path}.", f"{path}[")), f"{path}={text}: {refused.value}"
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("path", "tp"), FIELDS, ids=[path for path, _ in FIELDS])
def test_the_fields_own_value_is_accepted(path, tp):
    _load(path, _own_value(path))
