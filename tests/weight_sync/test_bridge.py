"""The Megatron -> engine bridge without vLLM: a recording receiver gets exactly the HF model's
tensors (bit-exact) from TP2, PP2 (tied embeddings across stages), PP2 x VPP2 and DP2 layouts,
in buckets of the configured size; the trainer's probe log-probs equal HF's; the gate passes on
them and names the tensor family of an injected layout bug. (vLLM end to end: test_vllm_sync.py.)"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import ParallelConfig, load_model_config
from megatron_empg.weight_sync import gate, mapping
from megatron_empg.weight_sync.bridge import SyncReport, buckets
from tests.dist import run_distributed

SEED = 1234
BUCKET_BYTES = 40_000  # tiny models are ~0.5 MB: several buckets, and tensors larger than a bucket
LAYOUTS = [  # (model, ParallelConfig) on 2 ranks
    ("tiny-qwen2", ParallelConfig(tensor_model_parallel_size=2)),
    ("tiny-llama", ParallelConfig(pipeline_model_parallel_size=2)),
    ("tiny-qwen2", ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    ("tiny-qwen3", ParallelConfig()),  # DP2: the second replica only waits
]


class RecordingReceiver:
    """Collects every update like an engine would (copies: the bridge may reuse buffers)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.bucket_sizes: list[tuple[int, int]] = []  # (bytes, tensors) per bucket
        self.version: str | None = None
        self.open = False

    def begin_weight_update(self) -> None:
        assert not self.open
        self.open = True

    def update_weights(self, *, named_tensors=None, path=None) -> None:
        assert self.open and path is None
        self.bucket_sizes.append((sum(t.numel() * t.element_size() for _, t in named_tensors), len(named_tensors)))
        for name, tensor in named_tensors:
            assert name not in self.tensors, f"{name} sent twice"
            self.tensors[name] = tensor.clone()

    def finish_weight_update(self, version: str) -> None:
        assert self.open
        self.open, self.version = False, version


def sync_groups(groups):
    from megatron_empg.weight_sync.bridge import SyncGroups

    return SyncGroups(tp_group=groups.tp_group, pp_group=groups.pp_group, is_sending_replica=groups.dp_rank == 0)


def single_engine(groups):
    """The placement of one engine on rank 0 (``rollout.engines: single``); every rank calls it."""
    from megatron_empg.parallel.placement import build_placement

    return build_placement(
        1, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank, dp_size=groups.dp_size
    )


def _sync_layouts(rank: int, world_size: int, layouts, hf_states: dict, probe: list) -> list:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.step import score_sequences
    from megatron_empg.mcore.weights import load_full_state_dict, named_weight_shards
    from megatron_empg.weight_sync.bridge import round_trip_errors, sync_weights
    from megatron_empg.weight_sync.transport import InProcessTransport

    results = []
    for name, parallel in layouts:
        model = load_model_config(name)
        groups = parallel_state.initialize_model_parallel(parallel, SEED)
        chunks = build_gpt_model(model, parallel)
        padded = parallel.padded_vocab_size(model.vocab_size)
        load_full_state_dict(chunks, mapping.to_megatron_state_dict(hf_states[name], model, padded))
        receiver = RecordingReceiver() if rank == 0 else None
        transport = InProcessTransport(receiver) if rank == 0 else None
        shards = named_weight_shards(chunks)
        report = sync_weights(
            shards,
            model,
            sync_groups(groups),
            transport,
            "step-7",
            bucket_bytes=BUCKET_BYTES,
            placement=single_engine(groups),
        )
        trainer_logprobs = score_sequences(chunks, probe, model.vocab_size, groups)
        results.append(
            {
                "report": report,
                "trainer_logprobs": trainer_logprobs,
                "round_trip_errors": round_trip_errors(shards, model, sync_groups(groups)),
                "received": receiver.tensors if receiver else None,
                "bucket_sizes": receiver.bucket_sizes if receiver else None,
                "version": receiver.version if receiver else None,
            }
        )
        parallel_state.destroy_model_parallel()
    return results


def _hf_reference(name: str, probe: list) -> tuple[dict, torch.Tensor]:
    from tools.make_tiny_model import tiny_hf_model

    hf = tiny_hf_model(load_model_config(name), seed=5)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        logits = hf(torch.tensor(probe)).logits.float()
    ids = torch.tensor(probe)
    logprobs = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return state, logprobs


@pytest.mark.dist
@pytest.mark.megatron
def test_sync_sends_exactly_the_hf_tensors_from_every_layout():
    probe = gate.probe_batch(2, 20, 250, seed=0)
    names = sorted({name for name, _ in LAYOUTS})
    refs = {name: _hf_reference(name, probe) for name in names}
    hf_states = {name: refs[name][0] for name in names}
    per_rank = run_distributed(_sync_layouts, 2, LAYOUTS, hf_states, probe, timeout=240)
    for i, (name, parallel) in enumerate(LAYOUTS):
        model = load_model_config(name)
        got = per_rank[0][i]
        expected = {
            k: v for k, v in hf_states[name].items() if not (model.tie_word_embeddings and k == "lm_head.weight")
        }
        assert sorted(got["received"]) == sorted(expected), (name, parallel)
        for key, tensor in expected.items():
            assert torch.equal(got["received"][key], tensor), (name, parallel, key)
        assert got["version"] == "step-7"
        assert len(got["bucket_sizes"]) > 1
        # A bucket exceeds the limit only when it is one tensor larger than the limit.
        assert all(size <= BUCKET_BYTES or count == 1 for size, count in got["bucket_sizes"])
        assert any(count > 1 for _, count in got["bucket_sizes"])
        report: SyncReport = got["report"]
        assert per_rank[1][i]["report"] == report  # every rank returns the engine rank's report
        assert report.num_tensors == len(expected) and report.num_buckets == len(got["bucket_sizes"])
        assert report.num_bytes == sum(t.numel() * t.element_size() for t in expected.values())
        for r in range(2):  # the diagnosis: every family round-trips exactly, on every rank
            errors = per_rank[r][i]["round_trip_errors"]
            assert set(errors) >= {"attention.qkv", "mlp.gate_up", "embedding", "norm"}
            assert all(error == 0.0 for error in errors.values()), errors
        # The trainer's probe log-probs (every rank) equal the HF model's.
        for r in range(2):
            torch.testing.assert_close(per_rank[r][i]["trainer_logprobs"], refs[name][1], rtol=1e-5, atol=1e-5)
        assert gate.check_consistency(got["trainer_logprobs"], refs[name][1], 1e-4, report.version) < 1e-4


def test_buckets_keep_order_and_size():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 1, 1])]
    groups = list(buckets(tensors, 80))  # 80 bytes = 20 floats
    assert [[n for n, _ in b] for b in groups] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert list(buckets([], 80)) == []


def test_gate_names_the_worst_family_or_blames_the_engine():
    trainer = torch.zeros(2, 5)
    engine = trainer.clone()
    engine[1, 3] = 0.5
    errors = {"attention.qkv": 2.5, "norm": 0.0, "mlp.gate_up": 0.1}
    assert gate.check_consistency(trainer, trainer + 1e-6, 1e-4, "step-3", errors) <= 1e-4
    with pytest.raises(
        gate.ConsistencyError, match=r"step-3.*0\.5.*sequence 1, token 4.*worst tensor family: attention\.qkv"
    ):
        gate.check_consistency(trainer, engine, 1e-4, "step-3", errors)
    with pytest.raises(gate.ConsistencyError, match="round-trips exactly"):
        gate.check_consistency(trainer, engine, 1e-4, "step-4", {"attention.qkv": 0.0})
    with pytest.raises(gate.ConsistencyError, match="no layout diagnosis"):
        gate.check_consistency(trainer, engine, 1e-4, "step-4")
    with pytest.raises(gate.ConsistencyError, match="up to inf"):
        gate.check_consistency(trainer, torch.full_like(trainer, float("nan")), 1e-4, "step-5")
    with pytest.raises(ValueError, match="same shape"):
        gate.check_consistency(trainer, trainer[:, :4], 1e-4, "step-6")
    probe = gate.probe_batch(3, 160, 250, seed=0)
    assert len(probe) == 3 and all(len(p) == 160 and 0 <= min(p) and max(p) < 250 for p in probe)
    assert probe == gate.probe_batch(3, 160, 250, seed=0) != gate.probe_batch(3, 160, 250, seed=1)


def naive_split_qkv(fused, model):
    """The classic bug: q, k, v taken as consecutive row blocks instead of per query group."""
    q_rows = model.num_attention_heads * model.kv_channels
    kv_rows = model.num_query_groups * model.kv_channels
    return fused[:q_rows], fused[q_rows : q_rows + kv_rows], fused[q_rows + kv_rows :]


def swapped_gate_up(fc1, model, **_):
    up, gate = fc1.chunk(2)
    return gate, up


@pytest.mark.parametrize("bug,family", [(naive_split_qkv, "attention.qkv"), (swapped_gate_up, "mlp.gate_up")])
def test_round_trip_check_finds_a_layout_bug(monkeypatch, bug, family):
    from megatron_empg.weight_sync.bridge import SyncGroups, WeightShard, stage_hf_tensors

    model = load_model_config("tiny-qwen2")
    g = torch.Generator().manual_seed(0)
    state = mapping.to_megatron_state_dict(
        {n: torch.randn(*shape, generator=g) for n, shape in _hf_shapes(model)}, model, 256
    )
    shards = [(name, tensor, None) for name, tensor in state.items()]
    monkeypatch.setattr(mapping, "split_qkv" if family == "attention.qkv" else "split_gate_up", bug)
    errors: dict[str, float] = {}
    sent = dict(stage_hf_tensors([WeightShard(*s) for s in shards], model, SyncGroups(None, None, True), errors))
    assert len(sent) == len(mapping.hf_tensor_names(model))
    assert max(errors, key=errors.get) == family and errors[family] > 0.1
    assert all(error == 0 for f, error in errors.items() if f != family)


def _hf_shapes(model):
    from tools.make_tiny_model import tiny_hf_model

    return [(name, tuple(t.shape)) for name, t in tiny_hf_model(model).state_dict().items()]
