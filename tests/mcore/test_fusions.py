"""``mcore.fusions``: which fusion switches a model runs with (and why), and each fusion that needs
no Transformer Engine against the model without it: Megatron's SwiGLU fusion (``torch.compile``)
and the weight gradients accumulated straight into DDP's fp32 ``main_grad`` (``WgradAccumulation``
standing in for apex's kernel). Same weights, same packed micro-batch; logits and every
parameter's ``main_grad``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.mcore import fusions
from megatron_empg.mcore.attention_backends import AttentionChoice
from tests.dist import run_distributed

SDPA, UNFUSED, TE = (AttentionChoice(name, "configured") for name in ("sdpa", "unfused", "te"))


def test_cpu_plan_is_all_off():
    for attention in (SDPA, UNFUSED, TE):
        plan = fusions.fusion_plan(attention, cuda=False)
        assert not any(plan.overrides.values()), plan
        assert set(plan.overrides) == set(plan.reasons) == set(fusions.FUSIONS)


@pytest.mark.parametrize("apex", [False, True])
def test_cuda_plan(apex, monkeypatch):
    monkeypatch.setattr(fusions, "_apex_wgrad", lambda: apex)
    monkeypatch.setattr(fusions, "_softmax_extensions", lambda: apex)
    kernel = "apex's kernel" if apex else "a torch GEMM with fp32 output"
    sdpa, unfused, te = (fusions.fusion_plan(a, cuda=True) for a in (SDPA, UNFUSED, TE))
    for plan in (sdpa, unfused, te):
        assert plan.overrides["bias_activation_fusion"] and plan.overrides["gradient_accumulation_fusion"]
        assert not plan.overrides["persist_layer_norm"] and not plan.overrides["bias_dropout_fusion"]
    assert sdpa.reasons["gradient_accumulation_fusion"] == f"Megatron's linears through {kernel}"
    assert te.reasons["gradient_accumulation_fusion"] == f"TE's linears; the output layer through {kernel}"
    assert te.overrides["apply_rope_fusion"] and not sdpa.overrides["apply_rope_fusion"]
    assert sdpa.reasons["apply_rope_fusion"] == "needs Transformer Engine"
    assert te.overrides["masked_softmax_fusion"] and not sdpa.overrides["masked_softmax_fusion"]
    assert unfused.overrides["masked_softmax_fusion"] is apex
    assert "masked_softmax_fusion off (sdpa's kernels fuse the softmax)" in sdpa.describe()


def _step(model_name: str, dtype: torch.dtype, overrides: dict, state: dict | None):
    """Logits and every parameter's main_grad after one forward and backward of a packed row."""
    from megatron_empg.config import OptimizerConfig, ParallelConfig, load_model_config
    from megatron_empg.core.microbatch import MicroBatch
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import wrap_with_ddp
    from megatron_empg.mcore.step import _model_forward

    cfg = load_model_config(model_name)
    (chunk,) = build_gpt_model(cfg, ParallelConfig(), params_dtype=dtype, **overrides)
    if state is not None:
        chunk.load_state_dict(state)
    (ddp,) = wrap_with_ddp([chunk], OptimizerConfig())
    g = torch.Generator().manual_seed(4)
    lengths = [9, 4, 14, 5]  # then a padding segment of 4
    ids = torch.randint(0, cfg.vocab_size, (1, 36), generator=g)
    cu = torch.tensor([0, *lengths, 4]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in [*lengths, 4]])[None]
    mb = MicroBatch(ids, ids, position_ids=positions, cu_seqlens=cu, max_seqlen=14)
    ddp.zero_grad_buffer()
    logits = _model_forward(ddp, mb)
    (logits.float() * torch.randn(logits.shape, generator=g)).sum().backward()
    grads = {name: p.main_grad.clone() for name, p in chunk.named_parameters()}
    fused_wgrad = {name for name, p in chunk.named_parameters() if getattr(p, "grad_added_to_main_grad", False)}
    return (
        logits.detach().float(),
        grads,
        fused_wgrad,
        {k: v for k, v in chunk.state_dict().items() if torch.is_tensor(v)},
    )


def _rank(rank: int, world_size: int) -> dict:
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    out = {}
    cases = {
        "fp32_reference": ("tiny-qwen2", torch.float32, {}),
        "fp32_swiglu": ("tiny-qwen2", torch.float32, {"bias_activation_fusion": True}),
        "fp32_wgrad": ("tiny-qwen2", torch.float32, {"gradient_accumulation_fusion": True}),
        "bf16_reference": ("tiny-qwen2", torch.bfloat16, {}),
        "bf16_wgrad": ("tiny-qwen2", torch.bfloat16, {"gradient_accumulation_fusion": True}),
    }
    state = None
    for name, (model_name, dtype, overrides) in cases.items():
        initialize_model_parallel(ParallelConfig(), seed=1234)
        try:
            load = None if state is None else {k: v.to(dtype) for k, v in state.items()}
            logits, grads, fused, built = _step(model_name, dtype, overrides, load)
            state = state or built
            out[name] = (logits, grads, fused)
        finally:
            destroy_model_parallel()
    return out


@pytest.mark.dist
@pytest.mark.megatron
def test_fusions_equal_the_unfused_model():
    (out,) = run_distributed(_rank, 1)
    ref_logits, ref_grads, ref_fused = out["fp32_reference"]
    assert not ref_fused
    for name in ("fp32_swiglu", "fp32_wgrad"):
        logits, grads, fused = out[name]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        for param, grad in ref_grads.items():  # fp32, other orders of the same sums: 1e-5 of the scale
            torch.testing.assert_close(
                grads[param], grad, rtol=1e-4, atol=1e-5 * grad_scale(grad), msg=lambda m, p=param: f"{name} {p}: {m}"
            )
    # every linear's weight (QKV, projection, fc1, fc2, output layer) went through the fused path
    assert out["fp32_wgrad"][2] == {
        p
        for p in ref_grads
        if p.endswith(
            ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight", "output_layer.weight")
        )
    }
    # bf16: the fused path sums the exact products in fp32 (no bf16 gradient rounded before the
    # add), so it is at least as close to the fp32 model's gradient as the unfused bf16 path
    _, bf16_grads, _ = out["bf16_reference"]
    _, fused_grads, _ = out["bf16_wgrad"]
    for param in out["fp32_wgrad"][2]:
        unfused_error = (bf16_grads[param] - ref_grads[param]).norm()
        fused_error = (fused_grads[param] - ref_grads[param]).norm()
        assert fused_error <= 1.05 * unfused_error, (param, fused_error, unfused_error)
        torch.testing.assert_close(
            fused_grads[param], bf16_grads[param], rtol=0.05, atol=0.05 * grad_scale(ref_grads[param])
        )


def grad_scale(grad: torch.Tensor) -> float:
    return float(grad.abs().max())
