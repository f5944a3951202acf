"""``parallel.placement``: which rank owns which engine, which ranks it serves, and that the
owner's values reach exactly its group, on 4 gloo ranks in Megatron's rank order (TP fastest, then
DP, then PP), against the placement written out by hand; and the engine environment on CPU."""

from __future__ import annotations

import pytest

from megatron_empg.parallel.placement import EnginePlacement
from tests.dist import run_distributed

# (tp, pp, engines) on 4 ranks -> owners, members (by engine), feeding ranks
CASES = {
    "dp4-e4": ((1, 1, 4), (0, 1, 2, 3), ((0,), (1,), (2,), (3,)), {0, 1, 2, 3}),
    "dp4-e2": ((1, 1, 2), (0, 2), ((0, 1), (2, 3)), {0, 2}),
    "dp4-e1": ((1, 1, 1), (0,), ((0, 1, 2, 3),), {0}),
    "tp2-dp2-e2": ((2, 1, 2), (0, 2), ((0, 1), (2, 3)), {0, 1, 2, 3}),
    "pp2-dp2-e2": ((1, 2, 2), (0, 1), ((0, 2), (1, 3)), {0, 1, 2, 3}),
}


def _place(rank: int, world_size: int, cases: dict) -> dict:
    from megatron_empg.parallel.placement import build_placement

    out = {}
    for name, ((tp, pp, engines), _, _, _) in cases.items():
        dp = world_size // (tp * pp)
        coords = dict(tp_rank=rank % tp, dp_rank=(rank // tp) % dp, pp_rank=rank // (tp * dp))
        placement = build_placement(engines, dp_size=dp, **coords)
        token = placement.broadcast_from_owner(f"from {rank}")  # only the owner's value counts
        table = placement.engine_table([rank + 1.0, 2.0] if placement.is_owner else None, 2).tolist()
        out[name] = (
            placement.owners,
            placement.members,
            placement.feeds_engine,
            placement.owner,
            token,
            placement.engine,
            placement.node_slot,
            placement.node_slots,
            table,
        )
    return out


@pytest.mark.dist
def test_owners_groups_and_feeding_replicas_on_four_ranks():
    results = run_distributed(_place, 4, CASES, timeout=180)
    for name, (_, owners, members, feeding) in CASES.items():
        for rank, result in enumerate(results):
            got_owners, got_members, feeds, owner, token, engine, slot, slots, table = result[name]
            assert (got_owners, got_members) == (owners, members), name
            assert rank in members[engine] and owner == owners[engine], (name, rank)
            assert feeds == (rank in feeding), (name, rank)
            assert token == f"from {owner}", (name, rank)  # the owner's value, inside the group only
            assert (slot, slots) == (engine, len(owners)), (name, rank)  # one host: engines in order
            assert table == [[o + 1.0, 2.0] for o in owners], (name, rank)  # row e: engine e's owner's


def _placement(num_engines: int, engine: int, node_slot: int = 0, node_slots: int = 1) -> EnginePlacement:
    return EnginePlacement(
        num_engines=num_engines,
        engine=engine,
        owners=tuple(range(num_engines)),
        members=tuple((e,) for e in range(num_engines)),
        group=None,
        feeds_engine=True,
        rank=engine,
        node_slot=node_slot,
        node_slots=node_slots,
        local_rank=engine,
    )


def test_prompt_blocks_and_uneven_splits():
    assert [list(_placement(2, e).prompts(8)) for e in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(_placement(3, e).split(7)) for e in (0, 1, 2)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(_placement(4, e).split(2)) for e in range(4)] == [[0], [1], [], []]
    with pytest.raises(ValueError, match="6 prompts do not split over 4 engines"):
        _placement(4, 0).prompts(6)


def test_engines_on_one_node_bind_disjoint_cores(monkeypatch):
    from megatron_empg.trainer.engines.rollout import engine_environment

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    binds = [engine_environment(_placement(2, e, e, 2), engine_tp=1)["VLLM_CPU_OMP_THREADS_BIND"] for e in (0, 1)]
    assert binds == ["0,1,2,3", "4,5,6,7"]
    assert engine_environment(_placement(2, 1, 1, 2), engine_tp=2) == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}
    assert engine_environment(_placement(16, 9, 9, 16), engine_tp=1) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's choice stays
    assert engine_environment(_placement(2, 1, 1, 2), engine_tp=1) == {}


def test_engine_children_see_their_replicas_gpus(monkeypatch):
    from megatron_empg.trainer.engines.rollout import child_environment, engine_environment

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert engine_environment(_placement(4, 2), engine_tp=1) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert engine_environment(_placement(2, 0), engine_tp=2) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    with pytest.raises(RuntimeError, match="needs 2 GPUs from local rank 3"):
        engine_environment(_placement(4, 3), engine_tp=2)
    with child_environment({"CUDA_VISIBLE_DEVICES": "6"}):
        import os

        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
