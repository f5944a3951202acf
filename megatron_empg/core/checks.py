"""Input validation shared by the math functions: errors name the offending argument.

Shape and choice checks are free. The finiteness check costs one host sync per call, so the
public functions take ``validate=True`` and callers on a hot path pass ``validate=False`` once
their inputs are trusted.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping

import torch
from torch import Tensor


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {sorted(map(str, choices))}")


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise ValueError unless all given (non-None) tensors have the shape of the first one."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has shape {tuple(first.shape)}; they must match"
            )


def check_bool(name: str, mask: Tensor) -> None:
    """Raise ValueError unless ``mask`` is a bool tensor."""
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}")


def check_finite(**tensors: Tensor | None) -> None:
    """Raise ValueError naming the first tensor that holds a NaN or an infinity (one host sync)."""
    items = [(name, t) for name, t in tensors.items() if t is not None and t.is_floating_point()]
    if not items:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in items]).tolist()
    for (name, _), ok in zip(items, finite):
        if not ok:
            raise ValueError(f"{name} contains NaN or infinite values")


class ArgumentError(ValueError):
    """A bad keyword-argument dict: ``argument`` is the key at fault, or None for the dict as a
    whole (a missing or unknown key); ``reason`` says what was expected."""

    def __init__(self, argument: str | None, reason: str) -> None:
        self.argument, self.reason = argument, reason
        super().__init__(f"{argument}: {reason}" if argument else reason)


def check_keywords(fn: Callable, args: Mapping[str, object], reserved: Collection[str], *, positional: int) -> None:
    """Raise ``ArgumentError`` unless ``args`` are keyword arguments of ``fn`` after its
    ``positional`` leading inputs, none of them one its caller passes itself (``reserved``)."""
    taken = sorted(set(args) & set(reserved))
    if taken:
        raise ArgumentError(taken[0], "is set by the trainer, not by the config")
    signature = inspect.signature(fn)
    keywords = {name for name, p in signature.parameters.items() if p.kind == p.KEYWORD_ONLY}
    try:
        signature.bind(*([None] * positional), **dict.fromkeys(set(reserved) & keywords), **args)
    except TypeError as error:
        names = ", ".join(sorted(keywords - set(reserved)))
        name = getattr(fn, "func", fn).__name__  # a functools.partial names its function
        raise ArgumentError(None, f"{error}; expected arguments of {name}: {names}") from None
