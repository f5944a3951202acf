"""Reading YAML: config files (``read_yaml``, with ``defaults:`` bases) and override values
(``parse_yaml``). Every error is one line naming the file and the line."""

from __future__ import annotations

import os
import re
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import yaml

from megatron_empg.config.errors import ConfigError, describe

# PyYAML follows YAML 1.1, which misreads what a person means: ``off``/``yes`` become bools,
# ``010`` is octal 8 and a repeated key silently drops its first block. The loader reads plain
# scalars as YAML 1.2's core schema does (only true/false are bools, ints are decimal without a
# leading zero, or 0x/0o), so such text stays text: a str field gets it as written and a bool or
# int field refuses it naming the field (``schema._coerce``); a repeated key is an error naming it; and
# ``1e-6`` (no dot) is a float.


_YAML11_TAGS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int")  # resolved in YAML 1.2's form below


class _Loader(yaml.SafeLoader):
    yaml_implicit_resolvers = {
        first: [(tag, regex) for tag, regex in resolvers if tag not in _YAML11_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key == "<<" and key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1}; a repeated key would "
                    "drop the first one's value)",
                    key_node.start_mark,
                )
            if isinstance(key, Hashable):
                seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
# YAML 1.1 words and numbers that the loader above reads as text; a bool or int field given one
# says how to write what was probably meant.
_YAML11_TEXT = re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF|[-+]?0[0-9_]+|[-+]?0b[01_]+)$")


def _construct_yaml_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_yaml_int)


def yaml_error_line(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line, column)."""
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    return " ".join(f"{where}{f'{context}: ' if context else ''}{problem}".split())


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2's plain scalars (module comment), ``1e-6`` read as a float
    and a repeated mapping key refused (``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def read_yaml(path: str | os.PathLike, *, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML file's top-level mapping. ``defaults: base.yaml`` in it (a path relative to the file)
    names a base config that the file's own keys are merged over: mappings key by key, any other
    value (and an empty mapping ``{}``, which clears one) replaces the base's. Bases may have bases
    (as in NeMo-RL's recipes); a cycle is an error. A file that cannot be read or parsed is a
    ``ConfigError`` naming it (and the line)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError("defaults", f"{path}: a cycle of defaults files: {' -> '.join(map(str, (*_seen, path)))}")
    data = _parse_file(path)
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: expected a mapping at the top level, got {describe(data)}")
    base_name = data.pop("defaults", None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise ConfigError("defaults", f"{path}: expected the path of a YAML file, got {describe(base_name)}")
    base_path = path.parent / base_name
    if not base_path.is_file():
        raise ConfigError("defaults", f"{path}: the base config {base_path} does not exist")
    return _merged(read_yaml(base_path, _seen=(*_seen, path)), data)


def _parse_file(path: Path) -> Any:
    if path.is_dir():
        raise ConfigError("", f"{path} is a directory, not a YAML file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"{path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError("", f"{path} cannot be read ({e.strerror or e})") from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: {yaml_error_line(e)}") from None


def _merged(base: Mapping, update: Mapping) -> dict:
    out = dict(base)
    for key, value in update.items():
        merge = isinstance(value, Mapping) and len(value) > 0 and isinstance(out.get(key), Mapping)
        out[key] = _merged(out[key], value) if merge else value
    return out


def yaml11_hint(value: Any) -> str:
    """What to write instead of a YAML 1.1 word or number that the loader reads as text."""
    if not isinstance(value, str) or not _YAML11_TEXT.match(value):
        return ""
    if value[-1].isdigit():
        return " (a leading 0 is not octal here: write the number without it, or 0o... for octal)"
    return " (YAML 1.1's yes/no/on/off are text here: write true or false)"
