"""``ConfigError``, the one error of a wrong configuration value, and how a value is described in
one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong. ``field`` is its dotted path ('' for the whole config)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}" if field else reason)


def describe(value: Any) -> str:
    """``value`` as an error message shows it: a mapping or a list by kind, anything else by a short repr."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list ({_short_repr(value)})"
    return _short_repr(value)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
