"""The Triton kernels in tests: compiled on CUDA, else under Triton's interpreter on CPU tensors, so
that plain ``pytest`` (``make test``, CI) runs them. triton reads TRITON_INTERPRET=1 when a function
is decorated (its own ``tl.max`` etc. when triton is imported, ours when a kernel module is) and at
each launch: ``import_kernels`` imports both with it set (and puts the environment back), and the
test modules set it around each test. Where triton was imported before without it, ``MARKS`` skips
(run ``pytest tests/kernels`` alone)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def env(name: str, value: str):
    """os.environ[name] = value inside the block (also in spawned ranks, which have no monkeypatch)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def import_kernels():
    """(triton, ``kernels.topk_triton``, ``kernels.vocab_logprob_triton``), imported under the
    interpreter without CUDA; the calling module is skipped where triton is missing."""
    with env("TRITON_INTERPRET", "1") if DEVICE == "cpu" else contextlib.nullcontext():
        triton = pytest.importorskip("triton")
        from megatron_empg.kernels import topk_triton, vocab_logprob_triton
    return triton, topk_triton, vocab_logprob_triton


def _interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def marks(triton, *kernels) -> list:
    """A test module's ``pytestmark``: skip where the kernels run neither compiled nor interpreted."""
    return [
        pytest.mark.skipif(
            DEVICE == "cpu" and not all(_interpreted(f) for f in (triton.language.standard.max, *kernels)),
            reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 was set: run pytest tests/kernels alone",
        ),
        # the interpreter computes with numpy: log(0) = -inf is the lse of a shard of padding only
        pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
    ]
