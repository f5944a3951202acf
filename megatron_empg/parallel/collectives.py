"""Small helpers for collectives on host-side values (flags, metric sums)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of the tensors ``group``'s backend reduces: the current CUDA device under NCCL
    (which rejects CPU tensors), else the CPU (gloo). Host-side values such as stop flags and metric
    sums are built there, reduced, and read back with ``.item()`` / ``.tolist()``."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
