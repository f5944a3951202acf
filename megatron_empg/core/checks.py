"""Input validation shared by the math functions: errors name the offending argument.

Shape and choice checks are free. The finiteness check costs one host sync per call, so the
public functions take ``validate=True`` and callers on a hot path pass ``validate=False`` once
their inputs are trusted.
"""

from __future__ import annotations

from collections.abc import Collection

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
