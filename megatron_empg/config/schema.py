"""The config machinery: the base of every config class (``Config``: choices, the rules of each
type and ``validate()`` checked on construction; ``named_in`` marks a field that names a registry
entry; ``field_docs`` reads the fields' descriptions), typed dataclasses from dicts (``from_dict``,
``to_dict``), dotted overrides (``apply_overrides``, ``load_config``). ``ConfigError`` is
``errors``'s, YAML reading ``yaml_files``'s."""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import math
import os
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

import yaml

from megatron_empg.config.errors import ConfigError, describe
from megatron_empg.config.yaml_files import parse_yaml, read_yaml, yaml11_hint, yaml_error_line

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Config classes: one way to check themselves, choices, registry names, field descriptions.


class Config:
    """The base of every config dataclass (``@dataclasses.dataclass(frozen=True)``): constructing
    one, from YAML or directly, checks every field whose type holds a ``Literal`` (the one list of
    its choices), the rules every value of a type obeys (``_coerce``: a float is finite, a str is
    not empty), then runs the class's ``validate()`` (ranges, cross-field checks). A ``ConfigError``
    names the field relative to the class; ``from_dict`` prefixes the class's dotted path.

    Each field is described by a string literal on the line after it (an attribute docstring, read
    by ``field_docs``; ``tools/config_docs.py`` writes docs/configuration.md from them)."""

    def __post_init__(self) -> None:
        for name, tp in _checked_fields(type(self)):
            _coerce(tp, getattr(self, name), name)
        self.validate()

    def validate(self) -> None:
        """Cross-field checks: raise ``ConfigError(field, reason)``. None by default."""


MAX_SECONDS = 1e9  # about 31 years: longer waits overflow timedelta and the OS's timers


def check_duration(field: str, value: float | None, unit: str = "seconds", *, per_second: float = 1.0) -> None:
    """A duration field (``value`` in ``unit``, ``per_second`` of them a second; None: not set)
    is > 0 and at most ``MAX_SECONDS``: a longer one passes as a number, then overflows a timer."""
    if value is not None and not 0 < value <= MAX_SECONDS * per_second:
        raise ConfigError(field, f"expected {unit} > 0 and <= {MAX_SECONDS * per_second:.3g}, got {value!r}")


REGISTRY = "registry"  # field metadata: "package.module:NAME" of the registry a str field names an entry of
REGISTRY_ALSO = "registry_also"  # field metadata: names accepted besides the registry's


def named_in(registry: str, default: Any, *, also: tuple[str, ...] = ()) -> Any:
    """A ``str`` field whose value is a key of ``registry`` (``"package.module:NAME"``, a dict or a
    tuple of names) or one of ``also``. The config layer imports no registry: the bind step checks
    the name, and the docs list the registry's keys (a test keeps the two the same registry)."""
    return dataclasses.field(default=default, metadata={REGISTRY: registry, REGISTRY_ALSO: also})


def literal_choices(tp: Any) -> tuple:
    """Every ``Literal`` value inside type ``tp`` (unions and item types included), in order."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return tuple(c for arg in typing.get_args(tp) if arg is not Ellipsis for c in literal_choices(arg))


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """The fields a directly constructed ``cls`` checks against their type: those whose type holds
    a ``Literal``, a float or a str (ints and bools have no value their type's rules refuse)."""
    hints = _hints(cls)
    return tuple(
        (name, hints[name])
        for name in _init_fields(cls)
        if literal_choices(hints[name]) or _holds_text_or_float(hints[name])
    )


def _holds_text_or_float(tp: Any) -> bool:
    return tp in (float, str) or any(_holds_text_or_float(a) for a in typing.get_args(tp) if a is not Ellipsis)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` -> its attribute docstring (the string literal on the line
    after its declaration), whitespace collapsed; '' for a field without one."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for statement, following in zip(body, body[1:]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            value = following.value if isinstance(following, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[statement.target.id] = " ".join(value.value.split())
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------------------------
# Building dataclasses from dicts.


def join_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


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
        raise ConfigError(path, f"expected {_type_name(tp)}, got {describe(value)}")
    if origin is Literal:
        for option in args:
            if value == option and type(value) is type(option):
                return option
        raise ConfigError(path, f"expected {_type_name(tp)}, got {describe(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {describe(value)}")
        return _build(tp, value, path)
    if tp is type(None):
        if value is not None:
            raise ConfigError(path, f"expected None, got {describe(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected bool (true/false), got {describe(value)}{yaml11_hint(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected int, got {describe(value)}{yaml11_hint(value)}")
        return value
    if tp is float:
        # the one check of every float field: NaN passes `x < 0` and infinity `x > 0`, so no
        # field's own range check would catch them
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected float, got {describe(value)}{yaml11_hint(value)}")
        number = float(value) if isinstance(value, float) or abs(value) < 2**1023 else math.inf
        if not math.isfinite(number):
            raise ConfigError(path, f"expected a finite number, got {describe(value)}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected str, got {describe(value)}")
        if not value:  # never meant: `dir: ""` would be the current directory, `tokenizer: ""` none
            raise ConfigError(path, "expected a non-empty str, got ''")
        return value
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {_type_name(tp)}, got {describe(value)}")
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
            raise ConfigError(path, f"expected {_type_name(tp)}, got {describe(value)}")
        key_type, value_type = args if args else (Any, Any)
        return {
            _coerce(key_type, k, join_path(path, k)): _coerce(value_type, v, join_path(path, k))
            for k, v in value.items()
        }
    raise TypeError(f"{path}: field type {tp!r} is not supported by megatron_empg.config")


def _build(cls: type[T], data: Mapping, path: str) -> T:
    fields = _init_fields(cls)
    allowed = ", ".join(fields)
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(path, f"keys must be strings, got {bad!r}; allowed keys: {allowed}")
    retired = getattr(cls, "RETIRED", {})
    for key in data:
        if key in retired:  # a key that was replaced: say by what
            raise ConfigError(join_path(path, key), retired[key])
    unknown = [k for k in data if k not in fields]
    if unknown:
        what = "unknown key" if len(unknown) == 1 else "unknown keys"
        raise ConfigError(", ".join(join_path(path, k) for k in unknown), f"{what}; allowed keys: {allowed}")
    missing = [name for name, f in fields.items() if _is_required(f) and name not in data]
    if missing:
        what = "missing required field" if len(missing) == 1 else "missing required fields"
        raise ConfigError(", ".join(join_path(path, k) for k in missing), what)
    hints = _hints(cls)
    values = {name: _coerce(hints[name], value, join_path(path, name)) for name, value in data.items()}
    try:
        obj = cls(**values)
        if not isinstance(obj, Config) and callable(getattr(obj, "validate", None)):
            obj.validate()  # a plain dataclass's checks (a Config ran its own on construction)
        return obj
    except ConfigError as e:  # the class's own check: give it the field's full path
        raise ConfigError(join_path(path, e.field) if e.field else path, e.reason) from None


def from_dict(cls: type[T], data: Mapping, *, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``: type-checked, unknown keys rejected, each config class
    checking itself on construction (``Config``), errors prefixed with ``path``."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping ({cls.__name__}), got {describe(data)}")
    return _build(cls, data, path)


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


def unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X`` (other types as they are)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_free_form(tp: Any) -> bool:
    """A field whose keys are not fixed by the schema (``dict``, ``dict[K, V]``, ``Any``)."""
    tp = unwrap_optional(tp)
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
        raise ConfigError(key.strip(), f"cannot parse override value {text!r} as YAML: {yaml_error_line(e)}") from None
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
                if part in getattr(tp, "RETIRED", {}):  # a key that was replaced: say by what
                    raise ConfigError(where, tp.RETIRED[part])
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
                inner = unwrap_optional(tp)
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
                raise ConfigError(where, f"is {describe(child)}, not a mapping; cannot set {'.'.join(parts)}")
            node = child
    return result


def load_config(cls: type[T], path_or_dict: str | os.PathLike | Mapping, overrides: Iterable[str] = ()) -> T:
    """Read a YAML file (or take a dict), apply the dotted overrides, build and validate ``cls``."""
    data = path_or_dict if isinstance(path_or_dict, Mapping) else read_yaml(path_or_dict)
    return from_dict(cls, apply_overrides(data, overrides, cls=cls))
