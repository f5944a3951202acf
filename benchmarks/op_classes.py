"""Where a step's time goes, by op class, from the torch profiler (``train_step.py --profile``).

Each stage of one profiled step (old pass, anchor pass, update with its optimizer step, EMA update)
runs under its own ``torch.profiler.profile``; the device's kernels (CUDA) or, on a CPU, the aten
ops' own CPU time are summed by class from their names:

    gemm               matmuls (cuBLAS / CUTLASS / nvjet kernels, aten mm / addmm / bmm)
    attention          flash / memory-efficient / cuDNN attention, sdpa, the unfused score ops
    vocab              the log-prob, lse, top-k and entropy kernels over the vocabulary
    optimizer          Adam, the gradient clip's norms, multi-tensor / foreach kernels (update stage)
    ema_update         every kernel of the EMA stage
    norms_elementwise  the rest: RMSNorm, RoPE, SwiGLU, adds, casts, copies
    host_idle          the stage's wall time less its kernels' (CUDA: the device waiting on the host)

The profiled step is an extra one after the timed repeats, so the profiler's overhead does not touch
the medians.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

CUDA = torch.cuda.is_available()
CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "scaled_dot_product", "cudnn", "baddbmm")),
    ("vocab", ("vocab", "logsumexp", "log_softmax", "topk", "cross_entropy", "_softmax", "entropy")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm", "clip_grad")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "aten::mm", "aten::addmm", "aten::bmm", "matmul")),
)


def op_class(name: str, stage: str) -> str:
    """The class of a kernel or aten op of ``name`` run in ``stage``."""
    if stage == "ema_update":
        return "ema_update"
    lowered = name.lower()
    for cls, keys in CLASSES:
        if any(key in lowered for key in keys):
            return cls
    return "norms_elementwise"


class OpProfile:
    """The per-stage breakdowns of one profiled step (``stage`` around each stage's call)."""

    def __init__(self) -> None:
        self.by_stage: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if CUDA else [])]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            yield
            if CUDA:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        self.by_stage[name] = _classify(prof, name, wall)

    def record(self) -> dict:
        totals: dict[str, float] = defaultdict(float)
        for stage in self.by_stage.values():
            for cls, seconds in stage.items():
                totals[cls] += seconds
        return {"time_by_op_class": dict(totals), "time_by_op_class_by_stage": self.by_stage}


def _classify(prof, stage: str, wall: float) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if CUDA:
            if evt.device_type != DeviceType.CUDA:
                continue
            us = evt.self_device_time_total
        else:
            if not evt.key.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        seconds[op_class(evt.key, stage)] += us / 1e6
    seconds["host_idle"] = max(wall - sum(seconds.values()), 0.0)
    return dict(seconds)
