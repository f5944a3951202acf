"""The bridge on a mixture of experts: from expert-parallel layouts a recording receiver gets the
HF model's per-expert tensors exactly once each, bit-exact, and every family round-trips exactly.

Layouts on 2 ranks: EP2 (the EP group spans both data-parallel replicas: the second replica,
which sends nothing of its own, must hand over its experts), TP2 with ETP1 x EP2 (experts not
TP-split although the rest is), TP2 = ETP2 (experts split over ETP), and EP2 with an engine per
replica (two leaders in one EP group: each engine gets every tensor once); on 4 ranks TP2 x EP2
(ETP2, two EP groups across the two replicas). Otherwise rank 0 (TP 0 of replica 0) holds the one
engine.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import ParallelConfig, load_model_config
from megatron_empg.weight_sync import mapping
from tests.dist import run_distributed
from tests.weight_sync.test_bridge import RecordingReceiver

SEED = 1234
BUCKET_BYTES = 20_000
MODEL = "tiny-qwen3-moe"


def moe_parallel(**kwargs) -> ParallelConfig:
    return ParallelConfig(moe_token_dispatcher_type="allgather", **kwargs)


def per_expert_state(hf_model, model) -> dict[str, torch.Tensor]:
    """A transformers Qwen3-MoE state dict with the in-memory fused experts split into the
    per-expert tensors of a checkpoint on disk (``mlp.experts.{e}.gate_proj.weight`` ...)."""
    out = {}
    for key, tensor in hf_model.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, H]: gate rows, then up
            prefix = key.removesuffix("gate_up_proj")
            for e in range(model.num_experts):
                gate, up = tensor[e].chunk(2)
                out[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{e}.up_proj.weight"] = up.clone()
        elif key.endswith("mlp.experts.down_proj"):  # [E, H, F]
            prefix = key.removesuffix("down_proj")
            out.update({f"{prefix}{e}.down_proj.weight": tensor[e].clone() for e in range(model.num_experts)})
        else:
            out[key] = tensor.clone()
    return out


def swap_experts(bucket, a: int, b: int) -> list:
    """``bucket`` with expert ``a``'s and ``b``'s tensors of the same layer and kind traded (names kept)."""
    bucket = list(bucket)
    index = {name: i for i, (name, _) in enumerate(bucket)}
    for name, i in index.items():
        other = name.replace(f".experts.{a}.", f".experts.{b}.")
        if other != name and other in index:
            j = index[other]
            bucket[i], bucket[j] = (name, bucket[j][1]), (other, bucket[i][1])
    return bucket


def sync_groups(groups, placement):
    from megatron_empg.weight_sync.bridge import SyncGroups

    return SyncGroups(
        groups.tp_group, groups.pp_group, placement.feeds_engine, ep_group=groups.ep_group, etp_group=groups.etp_group
    )


def _sync_layouts(rank: int, world_size: int, layouts, hf_state: dict) -> list:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import load_full_state_dict, named_weight_shards
    from megatron_empg.parallel.placement import build_placement
    from megatron_empg.weight_sync.bridge import round_trip_errors, sync_weights
    from megatron_empg.weight_sync.transport import InProcessTransport

    model = load_model_config(MODEL)
    results = []
    for parallel, engines in layouts:
        groups = parallel_state.initialize_model_parallel(parallel, SEED)
        placement = build_placement(
            engines, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank, dp_size=groups.dp_size
        )
        chunks = build_gpt_model(model, parallel)
        padded = parallel.padded_vocab_size(model.vocab_size)
        load_full_state_dict(chunks, mapping.to_megatron_state_dict(hf_state, model, padded))
        receiver = RecordingReceiver() if placement.is_owner else None
        shards = named_weight_shards(chunks)
        report = sync_weights(
            shards,
            model,
            sync_groups(groups, placement),
            InProcessTransport(receiver) if receiver else None,
            "step-3",
            bucket_bytes=BUCKET_BYTES,
            placement=placement,
        )
        results.append(
            {
                "report": report,
                "received": receiver.tensors if receiver else None,
                "local_experts": sorted(
                    {n.split(".local_experts.")[1].split(".")[0] for n, _, _ in shards if ".local_experts." in n},
                    key=int,
                ),
                "round_trip_errors": round_trip_errors(
                    shards, model, sync_groups(groups, placement), bucket_bytes=BUCKET_BYTES
                ),
            }
        )
        parallel_state.destroy_model_parallel()
    return results


def _check(per_rank, layouts, hf_state):
    for i, (parallel, engines) in enumerate(layouts):
        owners = [r for r in range(len(per_rank)) if per_rank[r][i]["received"] is not None]
        assert len(owners) == engines and owners[0] == 0, (parallel, owners)
        for owner in owners:  # each engine gets every tensor once
            got = per_rank[owner][i]
            assert sorted(got["received"]) == sorted(hf_state), (parallel, owner)
            for key, tensor in hf_state.items():
                assert torch.equal(got["received"][key], tensor), (parallel, owner, key)
            assert got["report"].num_tensors == len(hf_state)
        got = per_rank[0][i]
        ep = parallel.expert_model_parallel_size
        # Rank 0 holds only its own experts: the others came from the other EP ranks.
        assert got["local_experts"] == [str(e) for e in range(8 // ep)], (parallel, got["local_experts"])
        for r in range(len(per_rank)):
            assert per_rank[r][i]["report"].num_tensors == got["report"].num_tensors
            errors = per_rank[r][i]["round_trip_errors"]
            assert set(errors) >= {"moe.router", "moe.experts.gate_up", "moe.experts.down", "attention.qkv"}, errors
            assert all(error == 0.0 for error in errors.values()), errors


@pytest.fixture(scope="module")
def hf_state():
    from tools.make_tiny_model import tiny_hf_model

    model = load_model_config(MODEL)
    state = per_expert_state(tiny_hf_model(model, seed=5), model)
    assert sorted(state) == sorted(mapping.hf_tensor_names(model))
    return state


@pytest.mark.dist
@pytest.mark.megatron
def test_expert_parallel_sync_sends_every_hf_tensor_once(hf_state):
    layouts = [  # (parallel, engines)
        (moe_parallel(expert_model_parallel_size=2), 1),
        (moe_parallel(expert_model_parallel_size=2), 2),  # both replicas feed an engine: one EP group, two leaders
        (moe_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1), 1),
        (moe_parallel(tensor_model_parallel_size=2), 1),
    ]
    _check(run_distributed(_sync_layouts, 2, layouts, hf_state, timeout=240), layouts, hf_state)


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.slow
def test_tp2_x_ep2_sync_on_four_ranks(hf_state):
    layouts = [(moe_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2), 1)]
    _check(run_distributed(_sync_layouts, 4, layouts, hf_state, timeout=240), layouts, hf_state)


def test_the_name_check_finds_experts_exchanged_in_a_bucket(hf_state, monkeypatch):
    """One process, no expert parallelism: the diagnosis of a bucketing bug that exchanges two
    experts' tensors (their round trips are exact) names the expert families and nothing else."""
    from megatron_empg.weight_sync import bridge

    model = load_model_config(MODEL)
    state = mapping.to_megatron_state_dict(hf_state, model, 384)
    shards = [(name, tensor, None) for name, tensor in state.items()]
    groups = bridge.SyncGroups(None, None, True)
    assert all(e == 0 for e in bridge.round_trip_errors(shards, model, groups, bucket_bytes=BUCKET_BYTES).values())
    buckets = bridge.buckets
    monkeypatch.setattr(bridge, "buckets", lambda *args: (swap_experts(b, 1, 6) for b in buckets(*args)))
    errors = bridge.round_trip_errors(shards, model, groups, bucket_bytes=10**9)  # one bucket: every pair swapped
    assert {f for f, e in errors.items() if e} == {"moe.experts.gate_up", "moe.experts.down"}, errors
    assert errors["moe.experts.down"] == float("inf")
