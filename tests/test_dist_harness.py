"""tests/dist.py itself: results come back per rank, a rank's exception names the rank, a hang times out."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import RankError, run_distributed


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> int:
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    return int(value.item())


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from the test")


def _hang(rank: int, world_size: int) -> None:
    time.sleep(60)


@pytest.mark.dist
def test_results_errors_and_timeout():
    assert run_distributed(_sum_of_ranks, 2, 10) == [21, 21]  # (0 + 10) + (1 + 10)
    with pytest.raises(RankError, match=r"(?s)rank 1.*ValueError: boom from the test"):
        run_distributed(_fail_on_rank_one, 2)
    with pytest.raises(pytest.fail.Exception, match="timed out|timeout"):
        run_distributed(_hang, 2, timeout=8)


@pytest.mark.dist
def test_a_rendezvous_port_taken_meanwhile_is_retried_on_a_new_one(monkeypatch):
    """free_port's port can be bound by another process before rank 0 listens on it: the first
    attempt fails at the rendezvous (EADDRINUSE), the second runs on a new port."""
    import socket

    from tests import dist as harness

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real, attempts = harness.free_port, []
        monkeypatch.setattr(harness, "free_port", lambda: ports.pop() if ports else real())
        once = harness._run_once
        monkeypatch.setattr(harness, "_run_once", lambda *a: attempts.append(1) or once(*a))
        assert run_distributed(_sum_of_ranks, 2, 0) == [1, 1]
        assert ports == [] and len(attempts) == 2  # the taken port first, then a free one
