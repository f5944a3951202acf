"""``parallel.link``: the training and engine worlds of a disaggregated job and the link between
them, on 3 gloo processes (2 training ranks, 1 engine rank), and the weight push over it
(``weight_sync.transport.LinkTransport`` -> ``receive_weights``), bit for bit."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.dist import free_port

TIMEOUT_S = 120


def _bucket(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g)),
        ("lm_head.weight", torch.randn(3, 5, generator=g).to(torch.float16)),
        ("model.layers.0.mlp.up_proj.weight", torch.randint(-9, 9, (2, 3), generator=g, dtype=torch.int64)),
    ]


class _Recorder:
    """A transport that keeps what reaches the engine."""

    def __init__(self) -> None:
        self.calls: list = []

    def begin(self) -> None:
        self.calls.append("begin")

    def send(self, bucket) -> None:
        self.calls.append([(name, t.clone()) for name, t in bucket])

    def finish(self, version: str) -> None:
        self.calls.append(("finish", version))


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_empg.parallel.link import LEAD, TRAINER, start_worlds
    from megatron_empg.weight_sync.transport import LinkTransport, receive_weights

    os.environ.update(
        RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    role = start_worlds(1, datetime.timedelta(seconds=TIMEOUT_S))
    result = {
        "is_engine": role.is_engine,
        "rank": role.rank,
        "world": dist.get_world_size(),
        "on_link": role.link is not None,
    }
    # each world's own collective: 1 + 2 on the training ranks, 10 on the engine rank alone
    value = torch.tensor([10.0 if role.is_engine else rank + 1.0])
    dist.all_reduce(value)
    result["world_sum"] = value.item()
    link = role.link
    if link is not None:
        result["link_rank"] = link.rank
        result["start"] = link.broadcast_object({"step": 3} if link.rank == TRAINER else None, src=TRAINER)
        if link.rank == LEAD:
            link.send_object(("rollout", [1, 2, 3]), dst=TRAINER)
        else:
            result["received"] = link.recv_object(src=LEAD)
        if link.rank == TRAINER:
            transport = LinkTransport(link)
            transport.begin()
            for seed in (0, 1):
                transport.send(_bucket(seed))
            transport.finish("step-3")
        else:
            assert link.broadcast_object(src=TRAINER) == ("weights",)
            recorder = _Recorder()
            result["version"], result["bytes"] = receive_weights(link, recorder)
            result["calls"] = recorder.calls
        link.shutdown()
    dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_worlds_and_a_link(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=3, start_method="spawn", join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]

    assert [(r["is_engine"], r["rank"], r["world"]) for r in results] == [(False, 0, 2), (False, 1, 2), (True, 0, 1)]
    assert [r["world_sum"] for r in results] == [3.0, 3.0, 10.0]  # the worlds do not mix
    assert [r["on_link"] for r in results] == [True, False, True]
    trainer, engine = results[0], results[2]
    assert (trainer["link_rank"], engine["link_rank"]) == (0, 1)
    assert engine["start"] == {"step": 3} and trainer["received"] == ("rollout", [1, 2, 3])

    calls = engine["calls"]
    assert calls[0] == "begin" and calls[-1] == ("finish", "step-3") and len(calls) == 4
    for seed, got in zip((0, 1), calls[1:3]):
        want = _bucket(seed)
        assert [name for name, _ in got] == [name for name, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)  # bit for bit
    assert engine["version"] == "step-3"
    from megatron_empg.weight_sync.transport import pack_bucket

    assert engine["bytes"] == sum(pack_bucket(_bucket(seed))[1].numel() for seed in (0, 1))  # 16-byte aligned
