"""Fixtures shared by the test packages: the CPU demo's warm start, built once per session (trainer and
launcher tests)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory) -> Path:
    """A short version of the demo's warm start (tools/make_demo_model.py, 300 steps instead of
    ~3700, without the restating habit: a few percent of its samples are correct, which the tests'
    few steps of 4 prompts need to see rewards): the model, tokenizer and files ``make demo``
    builds, in about 15 s."""
    from tools.make_demo_model import make_demo_model

    out = tmp_path_factory.mktemp("demo") / "warm_start"
    make_demo_model(out, steps=300, stop_accuracy=0.0, eval_problems=16, restate_fraction=0.0, log=lambda _: None)
    return out
