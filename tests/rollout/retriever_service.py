"""The local retriever as the tests run it: ``python -m megatron_empg.rollout.retriever serve`` in a
subprocess on a free loopback port, waited for through ``/health`` and stopped by its ``stop``
command (whose success the context manager checks)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_empg.rollout.retriever.client import RetrieverClient, RetrieverUnavailable
from tests.dist import free_port

CORPUS = Path(__file__).resolve().parents[1] / "data" / "search_corpus.jsonl"
START_TIMEOUT_S = 60.0
CLI = [sys.executable, "-m", "megatron_empg.rollout.retriever"]


@contextlib.contextmanager
def serve_retriever(work_dir: Path, *serve_args: str, corpus: Path = CORPUS) -> Iterator[str]:
    """The URL of a retriever serving ``corpus`` (``serve_args``: more ``serve`` flags) while the
    context is open; its PID file lives in ``work_dir``."""
    pid_file = work_dir / "retriever.pid"
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--corpus", str(corpus), "--port", str(port), "--pid-file", str(pid_file), *serve_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    client = RetrieverClient(url, timeout_s=2.0, retries=0)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"retriever exited {proc.returncode} at start:\n{proc.stdout.read()}")
            try:
                client.health()
                break
            except RetrieverUnavailable:
                if time.monotonic() > deadline:
                    pytest.fail(f"retriever not healthy {START_TIMEOUT_S} s after start")
                time.sleep(0.1)
        yield url
    finally:
        stop = subprocess.run([*CLI, "stop", "--pid-file", str(pid_file)], capture_output=True, text=True, timeout=30)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert stop.returncode == 0, stop.stderr
    assert proc.returncode == 0
    assert not pid_file.exists()
