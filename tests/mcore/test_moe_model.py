"""tiny-qwen3-moe on Megatron: the converted model gives transformers' logits, and three RL steps
at expert parallelism give the EP 1 run's losses, gradient norms and parameters.

The reference process (one rank) converts a random HF Qwen3-MoE (``save_pretrained`` safetensors ->
``mapping.to_megatron_state_dict`` -> ``load_full_state_dict``), compares logits, then trains at EP 1
with ``tests/mcore/test_train_step.py``'s harness (``_train``: old pass, PPO + Top-k KL + entropy,
Adam with warmup and clipping; the model's aux loss, coefficient 1e-3, is on). The layouts load the
same weights and run the same steps on the same micro-batches: the global batch of 8 rows in
micro-batches of 2 rows, 4 at EP 1 (one rank), 2 per rank on two ranks, 1 per rank on four. (The
load-balancing loss is a function of each micro-batch's routing, so the layouts keep the split.)

    ep2              world 2: EP 2, alltoall (each rank 4 experts; dense weights DP 2, experts
                     expert-DP 1)
    ep2_dp2_distopt  world 4: EP 2, alltoall, distributed optimizer (expert-DP 2: the expert
                     gradients reduced and their optimizer state sharded over 2 ranks, dense over 4)
    ep2_etp2         world 4: EP 2 x expert-TP 2, alltoall (and again with the allgather dispatcher)
    pp2              world 2: PP 2 (a layer per stage: the router losses' scale set on the first
                     stage too, the moe/* metrics reduced over the stages)

After the steps each layout also checks Megatron DDP's grouping of the expert gradients and the EMA
anchor on the trained weights (``mcore.anchor``; sharded like the optimizer).

EP 2 x TP 2 is not trainable on CPU: Megatron's MoELayer refuses MoE with TP > 1 in training
without sequence parallelism, which needs Transformer Engine's norms. Expert TP 2 runs with TP 1
instead (the experts split over 2 ranks as under TP 2; the alltoall dispatcher's uneven gathers
over the expert-TP group run through ``cpu_shims``' uneven_split_collectives).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed
from tests.mcore.test_train_step import _assert_same_history, _assert_same_params, _train

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.layout]

MODEL = "tiny-qwen3-moe"
LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)
# (name, micro-batches per rank, distributed optimizer, ParallelConfig fields)
LAYOUTS_2 = [
    ("ep2", 2, False, dict(expert_model_parallel_size=2)),
    ("pp2", 4, False, dict(pipeline_model_parallel_size=2)),
]
LAYOUTS_4 = [
    ("ep2_dp2_distopt", 1, True, dict(expert_model_parallel_size=2)),
    ("ep2_etp2", 1, False, dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2)),
    (
        "ep2_etp2_allgather",
        1,
        False,
        dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2, moe_token_dispatcher_type="allgather"),
    ),
]


def _hf_logits_and_state(model_cfg, out_dir: str) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """A random HF Qwen3-MoE saved with ``save_pretrained``: (input ids [2, 16], its safetensors
    tensors, its fp32 logits [2, 16, V])."""
    from safetensors.torch import load_file

    from tools.make_tiny_model import tiny_hf_model

    hf = tiny_hf_model(model_cfg, seed=3)
    hf.save_pretrained(out_dir)
    ids = torch.randint(0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logits = hf(ids).logits
    return ids, load_file(f"{out_dir}/model.safetensors"), logits


def _reference_worker(rank: int, world_size: int, out_dir: str) -> dict:
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import model as mcore_model
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import causal_mask
    from megatron_empg.weight_sync import mapping

    model_cfg = load_model_config(MODEL)
    parallel = ParallelConfig()
    ids, hf_tensors, hf_logits = _hf_logits_and_state(model_cfg, out_dir)
    full = mapping.to_megatron_state_dict(hf_tensors, model_cfg, parallel.padded_vocab_size(model_cfg.vocab_size))
    initialize_model_parallel(parallel, seed=1)
    try:
        chunks = mcore_model.build_gpt_model(model_cfg, parallel)
        mcore_weights.load_full_state_dict(chunks, full)
        chunks[0].eval()
        with torch.no_grad():
            b, s = ids.shape
            logits = chunks[0](ids, torch.arange(s).expand(b, s), causal_mask(s))
            logits = mcore_weights.gather_logits(logits, model_cfg.vocab_size)
    finally:
        destroy_model_parallel()
    trained = _train(1, 1, False, full, num_microbatches=4, model=MODEL)
    return {"hf_logits": hf_logits, "logits": logits, "hf_names": sorted(hf_tensors), "full": full, "trained": trained}


def _expert_grid(*, ddp, optimizer, groups, model_cfg, parallel) -> dict:
    """How Megatron DDP reduces each parameter's gradient: the ``allreduce`` attribute of the expert
    and dense parameters and the size of the data-parallel group of each kind of grad buffer. And
    the EMA anchor on these weights: its largest error after a load of master = policy + 1 and
    one EMA update (tau 0.5: policy + 0.5), in its weights and in its gathered master."""
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.moe.layout import is_expert_parameter

    module = ddp[0]
    flags = {name: getattr(p, "allreduce", True) for name, p in module.module.named_parameters()}
    anchor = EmaAnchor.from_configs(model_cfg, parallel, ddp, optimizer, tau=0.5, period=1, compute_dtype=torch.float32)
    policy = {f"0.{n}": p.detach() for n, p in module.module.named_parameters()}
    anchor.load_full_master_state({k: v + 1 for k, v in policy.items()})
    anchor.update()
    weights = dict(anchor.models[0].named_parameters())
    return {
        "expert_allreduce": {flags[n] for n in flags if is_expert_parameter(n)},
        "dense_allreduce": {flags[n] for n in flags if not is_expert_parameter(n)},
        "expert_buffer_dp": [b.data_parallel_group.size() for b in module.expert_parallel_buffers],
        "dense_buffer_dp": [b.data_parallel_group.size() for b in module.buffers],
        "ep": groups.ep_size,
        "anchor_sharded": anchor.sharded,
        "anchor_weight_error": max((weights[k[2:]] - v - 0.5).abs().max().item() for k, v in policy.items()),
        "anchor_master_error": max(
            (m - policy[k] - 0.5).abs().max().item() for k, m in anchor.full_master_state().items()
        ),
    }


def _layouts_worker(rank: int, world_size: int, layouts: list, full: dict) -> dict:
    out = {}
    for name, num_mb, distopt, fields in layouts:
        fields = dict(fields)
        pp = fields.pop("pipeline_model_parallel_size", 1)
        out[name] = _train(1, pp, distopt, full, num_mb, model=MODEL, inspect=_expert_grid, **fields)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_distributed(_reference_worker, 1, str(tmp_path_factory.mktemp("hf_moe")), timeout=240)[0]


@pytest.fixture(scope="module")
def layouts(reference) -> dict:
    out = {}
    for world, specs in ((2, LAYOUTS_2), (4, LAYOUTS_4)):
        ranks = run_distributed(_layouts_worker, world, specs, reference["full"], timeout=300)
        out.update({name: [r[name] for r in ranks] for name, _, _, _ in specs})
    return out


def test_converted_model_gives_transformers_logits(reference):
    # the per-expert names save_pretrained writes, which the mapping reads
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in reference["hf_names"]
    assert reference["logits"].shape == reference["hf_logits"].shape
    torch.testing.assert_close(reference["logits"], reference["hf_logits"], **LOGITS_TOL)


def test_reference_trains(reference):
    trained = reference["trained"]
    assert all(h["grad_norm"] > 0 for h in trained["history"])
    moved = [n for n, (p, _) in trained["params"].items() if not torch.equal(p, reference["full"][n])]
    assert any(".mlp.experts." in n for n in moved) and any(".mlp.router." in n for n in moved)


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS_2 + LAYOUTS_4])
def test_expert_parallel_layout_equals_ep1(reference, layouts, name):
    ref = reference["trained"]
    experts_seen = set()
    for rank, result in enumerate(layouts[name]):
        _assert_same_history(result["history"], ref["history"], f"{name} rank {rank}")
        _assert_same_params(result, ref, f"{name} rank {rank}")
        experts_seen |= {n for n in result["params"] if ".mlp.experts." in n}
    # the ranks' experts, by their global names, are all of the model's
    assert experts_seen == {n for n in ref["params"] if ".mlp.experts." in n}


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS_2 + LAYOUTS_4])
def test_ddp_reduces_expert_gradients_over_expert_data_parallel(layouts, name):
    world = len(layouts[name])
    _, _, distopt, fields = next(layout for layout in LAYOUTS_2 + LAYOUTS_4 if layout[0] == name)
    pp, ep = fields.get("pipeline_model_parallel_size", 1), fields.get("expert_model_parallel_size", 1)
    expert_grid = ep * fields.get("expert_tensor_parallel_size", 1) * pp
    for result in layouts[name]:
        grid = result["inspected"]
        assert grid["ep"] == ep
        assert grid["expert_allreduce"] == {False} and grid["dense_allreduce"] == {True}
        assert grid["expert_buffer_dp"] == [world // expert_grid]  # expert-DP, not the dense DP
        assert grid["dense_buffer_dp"] == [world // pp]  # TP 1: the dense data-parallel replicas
        # the anchor covers the experts (distributed optimizer: gathered over expert-DP, not DP)
        assert grid["anchor_sharded"] == distopt
        assert grid["anchor_weight_error"] < 1e-6 and grid["anchor_master_error"] < 1e-6
