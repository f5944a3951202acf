"""Run a function on several CPU ranks (gloo, spawned processes) from inside a pytest test.

``run_distributed(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every rank and
returns the ranks' return values as a list indexed by rank. ``fn`` must be a module-level function
(``spawn`` pickles it by name); so must everything in ``args``. Compute oracles in the parent and
pass them in, or return what the ranks computed and compare in the parent.

Why ``spawn``: ``fork`` hangs when the parent has already run torch ops (live intra-op threads).
Start-up costs seconds per process (torch, and megatron.core if ``fn`` imports it), so run many
checks per call rather than one call per check.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240.0
_GRACE_S = 5.0  # how long the other ranks get to report their own error after one rank failed


class RankError(RuntimeError):
    """One or more ranks raised; the message holds each failed rank's traceback."""


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, timeout: float, out_dir: str, fn: Callable, args: tuple):
    out = Path(out_dir)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # CI boxes have few cores; more threads per rank thrash
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        torch.save(result, out / f"rank{rank}.tmp")
        os.replace(out / f"rank{rank}.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Raises ``RankError`` with the rank numbers and tracebacks if any rank raised, and fails the test
    (after killing every rank) if the ranks have not all finished within ``timeout`` seconds. A
    rendezvous port taken between ``free_port`` and rank 0's listen (another test's gloo sockets
    bind ephemeral ports too) is retried on a new port: ``fn`` had not started.
    """
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except RankError as error:
            taken = "EADDRINUSE" in str(error) and "init_process_group" in str(error)
            if not taken or attempt == _PORT_ATTEMPTS:
                raise


_PORT_ATTEMPTS = 3


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as out_dir:
        out = Path(out_dir)
        entry_args = (world_size, free_port(), timeout, out_dir, fn, args)
        procs = [ctx.Process(target=_entry, args=(r, *entry_args), name=f"rank{r}") for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):  # the others may hang in a collective
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        err_files = sorted(out.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)  # first failure first
        errors = {int(f.stem.removeprefix("rank")): f.read_text() for f in err_files}
        missing = [r for r in range(world_size) if not (out / f"rank{r}.pt").exists() and r not in errors]
        if errors:
            text = "".join(f"\n----- rank {r} -----\n{tb}" for r, tb in errors.items())
            killed = f"; rank(s) {missing} reported nothing and were killed" if missing else ""
            raise RankError(
                f"{fn.__name__}: rank(s) {list(errors)} of {world_size} raised{killed} (first failure first):{text}"
            )
        if missing:
            pytest.fail(
                f"{fn.__name__}: rank(s) {missing} of {world_size} gave no result within {timeout:.0f} s "
                f"(timed out and killed, or died without a traceback); exit codes "
                f"{[p.exitcode for p in procs]}",
                pytrace=False,
            )
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
