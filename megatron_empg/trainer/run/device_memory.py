"""The device memory a step's phases reach (``memory/peak_gib/<phase>`` in the step records): the
CUDA allocator's peak of allocated bytes inside each phase (``torch.cuda.max_memory_allocated``
after a reset at the phase's start; host-side counters, no device sync), what ``empg plan``'s
per-phase peaks predict. Nothing on a machine without CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def peak_memory(peaks: dict[str, int], name: str) -> Iterator[None]:
    """``peaks[name]``: the allocator's peak bytes during the block (CUDA only)."""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())


def peak_metrics(peaks: dict[str, int]) -> dict[str, float]:
    return {f"memory/peak_gib/{name}": value / 2**30 for name, value in peaks.items()}
