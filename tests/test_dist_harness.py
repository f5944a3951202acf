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
