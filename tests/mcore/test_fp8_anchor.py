"""The FP8 anchor's storage kinds (``mcore.anchor.storage``) on one process: a bf16 Megatron policy
whose main parameters move three times, with a plain bf16 anchor, an emulated FP8 and a torch FP8
anchor (``torch._scaled_mm`` has a CPU kernel) following it, each chosen by its arguments alone.

Checked: every kind's float32 master is the same EMA bit for bit; the FP8 kinds store the decoder's
linear weights as float8_e4m3fn (and nothing else for them) with row scales ``amax / 448`` of the
master; emulated and torch give the same log-probs; those are near the bf16 anchor's and farther
from an anchor of another policy (the negative control); and an anchor rebuilt from a checkpointed
master mid-run (``full_master_state`` / ``load_full_master_state``) ends bit for bit where the
uninterrupted one does. The distributed layouts (TP, PP, the distributed optimizer's rows cut by a
rank's range) are ``test_anchor.py``'s, whose ``fp8`` anchor is the emulated kind. A mixture of
experts on grouped experts: their stacked weights are FP8 with a scale per expert row, and a layer's
experts equal the dense FP8 linear applied expert by expert (uneven counts, experts without tokens).
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import OptimizerConfig, ParallelConfig, load_model_config
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen2"
KINDS = {
    "bf16": dict(compute_dtype=torch.bfloat16),
    "emulated": dict(compute_dtype=torch.float8_e4m3fn, fp8="emulated"),
    "torch": dict(compute_dtype=torch.float8_e4m3fn, fp8="torch"),
    "torch_out": dict(compute_dtype=torch.float8_e4m3fn, fp8="torch", fp8_output_layer=True),
}
STEPS, RESUME_AT = 3, 2


def _probe(vocab: int):
    from megatron_empg.core.microbatch import MicroBatch

    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))
    ones = torch.ones_like(ids, dtype=torch.float32)
    return [MicroBatch(ids, ids, torch.ones_like(ids, dtype=torch.bool), ones, torch.zeros_like(ones))]


def _perturb(ddp, step: int) -> None:
    """Move the optimizer's main parameters as a training step would (deterministic per step)."""
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for module in ddp:
            for p in module.module.parameters():
                p.main_param.add_(torch.randn(p.shape, generator=g), alpha=2e-2)


def _worker(rank: int, world: int) -> dict:
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats

    cfg = load_model_config(MODEL)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    try:
        settings = OptimizerConfig(lr=1e-3)
        ddp = wrap_with_ddp(build_gpt_model(cfg, parallel, params_dtype=torch.bfloat16), settings)
        optimizer = build_optimizer(ddp, settings)

        def anchor(kind: str) -> EmaAnchor:
            return EmaAnchor.from_configs(cfg, parallel, ddp, optimizer, tau=0.5, period=1, **KINDS[kind])

        anchors = {kind: anchor(kind) for kind in KINDS}
        other = anchor("bf16")  # the negative control: stays at the initial policy
        resumed = None
        for step in range(1, STEPS + 1):
            _perturb(ddp, step)
            for a in anchors.values():
                a.update()
            if resumed is not None:
                resumed.update()
            if step == RESUME_AT:  # "save" the emulated anchor, "restart" it from the master
                saved, updates = anchors["emulated"].full_master_state(), anchors["emulated"].num_updates
                resumed = anchor("emulated")
                resumed.load_full_master_state(saved)
                resumed.num_updates = updates
        request = StatsRequest(vocab_size=cfg.vocab_size)
        probe = _probe(cfg.vocab_size)
        logprobs = {k: forward_stats(a.models, probe, request, groups)[0].logprobs for k, a in anchors.items()}
        logprobs["other"] = forward_stats(other.models, probe, request, groups)[0].logprobs
        logprobs["resumed"] = forward_stats(resumed.models, probe, request, groups)[0].logprobs
        out = {"logprobs": logprobs, "kinds": {k: a.storage.name for k, a in anchors.items()}}
        out["masters"] = {k: a.full_master_state() for k, a in anchors.items()}
        out["resumed_master"] = resumed.full_master_state()
        out["dtypes"] = {
            k: {f"{c}.{n}": p.dtype for c, m in enumerate(a.models) for n, p in m.named_parameters()}
            for k, a in anchors.items()
        }
        out["fp8"] = {k: anchors[k].fp8_weights() for k in ("emulated", "torch", "torch_out")}
        out["resumed_fp8"] = resumed.fp8_weights()
        out["params"] = {
            k: {f"{c}.{n}": p.detach().clone() for c, m in enumerate(a.models) for n, p in m.named_parameters()}
            for k, a in {"emulated": anchors["emulated"], "resumed": resumed}.items()
        }
        try:
            anchors["bf16"].fp8_weights()
        except RuntimeError as e:
            out["plain_fp8_error"] = str(e)
        return out
    finally:
        destroy_model_parallel()


def _moe_worker() -> dict:
    """A mixture of experts on grouped experts: the FP8 anchor's stacked expert weights and one
    layer's experts against the dense FP8 linear applied expert by expert."""
    from megatron_empg.core import fp8
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.moe import gemm
    from megatron_empg.mcore.optimizer import build_optimizer, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats

    cfg = load_model_config("tiny-qwen3-moe")
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    try:
        settings = OptimizerConfig(lr=1e-3)
        build = dict(params_dtype=torch.bfloat16, moe_experts="grouped")
        ddp = wrap_with_ddp(build_gpt_model(cfg, parallel, **build), settings)
        optimizer = build_optimizer(ddp, settings)
        anchors = {
            k: EmaAnchor.from_configs(
                cfg, parallel, ddp, optimizer, tau=0.5, period=1, moe_experts="grouped", **KINDS[k]
            )
            for k in ("bf16", "emulated")
        }
        _perturb(ddp, 1)
        for a in anchors.values():
            a.update()
        probe = _probe(cfg.vocab_size)
        request = StatsRequest(vocab_size=cfg.vocab_size)
        out = {k: forward_stats(a.models, probe, request, groups)[0].logprobs for k, a in anchors.items()}
        experts = anchors["emulated"].models[0].decoder.layers[0].mlp.experts
        fc1, fc2 = experts.linear_fc1.weight, experts.linear_fc2.weight
        scales = anchors["emulated"].fp8_weights()
        s1 = scales["0.decoder.layers.0.mlp.experts.linear_fc1.weight"][1].view(fc1.shape[:2])
        s2 = scales["0.decoder.layers.0.mlp.experts.linear_fc2.weight"][1].view(fc2.shape[:2])
        g = torch.Generator().manual_seed(3)
        counts = torch.tensor([5, 0, 3, 9, 1, 0, 6, 2])  # uneven, two experts without a token
        x = torch.randn(int(counts.sum()), cfg.hidden_size, generator=g).bfloat16()
        probs = torch.rand(x.shape[0], generator=g)
        with torch.no_grad():
            grouped = experts(x, counts, probs)[0]
            ends = counts.cumsum(0).tolist()
            pieces = [
                fp8.fp8_linear(x[e - n : e], fc1[j], s1[j], None, fp8.scaled_mm_emulated)
                for j, (n, e) in enumerate(zip(counts.tolist(), ends, strict=True))
            ]
            hidden = gemm.weighted_swiglu(torch.cat(pieces), probs, fused=experts.fused_swiglu)
            pieces = [
                fp8.fp8_linear(hidden[e - n : e], fc2[j], s2[j], None, fp8.scaled_mm_emulated)
                for j, (n, e) in enumerate(zip(counts.tolist(), ends, strict=True))
            ]
        out["grouped"], out["per_expert"] = grouped, torch.cat(pieces)
        out["expert_dtypes"] = (fc1.dtype, fc2.dtype, tuple(fc1.shape), s1.shape)
        return out
    finally:
        destroy_model_parallel()


def _both(rank: int, world: int) -> dict:
    return {"dense": _worker(rank, world), "moe": _moe_worker()}


@pytest.fixture(scope="module")
def both() -> dict:
    return run_distributed(_both, 1)[0]


@pytest.fixture(scope="module")
def run(both) -> dict:
    return both["dense"]


def _linear(key: str) -> bool:
    return ".decoder." in f".{key}" and key.endswith("weight") and ("linear_" in key) and "layer_norm" not in key


def test_kinds_are_chosen_by_arguments_and_share_the_master(run):
    assert run["kinds"] == {"bf16": "plain", "emulated": "emulated", "torch": "torch", "torch_out": "torch"}
    masters = run["masters"]
    for kind in ("emulated", "torch", "torch_out"):
        assert masters[kind].keys() == masters["bf16"].keys()
        assert all(torch.equal(masters[kind][k], masters["bf16"][k]) for k in masters["bf16"])
    assert "for row-wise FP8 storage; this anchor's is 'plain'" in run["plain_fp8_error"]


def test_linear_weights_are_stored_as_fp8_with_row_scales_of_the_master(run):
    master = run["masters"]["emulated"]
    for kind in ("emulated", "torch", "torch_out"):
        dtypes, fp8 = run["dtypes"][kind], run["fp8"][kind]
        linear = [k for k in dtypes if _linear(k) or (kind == "torch_out" and k == "0.output_layer.weight")]
        assert len(linear) == 4 * 4 + (kind == "torch_out")  # qkv, proj, fc1, fc2 per layer; the output layer
        for key, dtype in dtypes.items():
            assert dtype == (torch.float8_e4m3fn if key in linear else torch.bfloat16), key
            q, scale_inv = fp8[key]
            assert (q is not None) == (key in linear), key
            rows = master[key].reshape(scale_inv.numel(), -1)
            amax = rows.abs().amax(dim=1)
            expected = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
            torch.testing.assert_close(scale_inv, expected, rtol=2e-7, atol=0)
            if q is not None:  # e4m3: within half a step (2^-4 relative; 2^-10 x scale_inv subnormal)
                err = (q.float().reshape(rows.shape) * scale_inv[:, None] - rows).abs()
                bound = torch.maximum(rows.abs() * 2.0**-4, 2.0**-10 * scale_inv[:, None])
                assert (err <= bound * (1 + 1e-5)).all(), key
                assert err.max() > 0, key  # quantized, not a copy


def test_emulated_computes_what_torch_computes(run):
    lp = run["logprobs"]
    torch.testing.assert_close(lp["emulated"], lp["torch"], rtol=0, atol=1e-5)


def test_fp8_logprobs_near_the_bf16_anchor_and_a_negative_control(run):
    lp = run["logprobs"]
    fp8_err = (lp["torch"] - lp["bf16"]).abs()
    out_err = (lp["torch_out"] - lp["bf16"]).abs()  # the output layer's rounding on top
    control = (lp["other"] - lp["bf16"]).abs()
    assert 0 < fp8_err.mean() < out_err.mean() < 0.5 * control.mean(), (fp8_err.mean(), out_err.mean(), control.mean())
    assert fp8_err.max() < 0.1 and out_err.max() < 0.15


def test_resume_from_the_master_equals_the_uninterrupted_anchor(run):
    assert all(torch.equal(run["resumed_master"][k], v) for k, v in run["masters"]["emulated"].items())
    for key, (q, scale_inv) in run["fp8"]["emulated"].items():
        rq, rscale = run["resumed_fp8"][key]
        assert torch.equal(rscale, scale_inv), key
        assert (q is None and rq is None) or torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), key
    for key, p in run["params"]["emulated"].items():
        assert torch.equal(p.view(torch.uint8), run["params"]["resumed"][key].view(torch.uint8)), key
    assert torch.equal(run["logprobs"]["resumed"], run["logprobs"]["emulated"])


def test_grouped_experts_multiply_in_fp8_as_the_dense_linear_does_per_expert(both):
    moe = both["moe"]
    dtype1, dtype2, shape, scale_shape = moe["expert_dtypes"]
    assert dtype1 == dtype2 == torch.float8_e4m3fn and scale_shape == shape[:2]  # a scale per expert row
    assert torch.equal(moe["grouped"], moe["per_expert"])
    err = (moe["emulated"] - moe["bf16"]).abs()
    assert 0 < err.mean() < 0.05 and err.max() < 0.2, (err.mean(), err.max())
