"""The ``sdpa`` backend's CUDA paths at the 1.5B recipes' shapes (12 heads, 2 K/V groups, head dim
128, bf16): SDPA's fused kernels on padded rows and ``varlen_attn`` on packed rows, against the
unfused attention, both measured against an fp32 reference; the varlen path against the bucketed
SDPA path; and the two fusions without Transformer Engine (the compiled SwiGLU, the fp32-output
weight-gradient GEMM) against their unfused forms. With ``EMPG_GPU_RESULTS_DIR`` set, what this
torch offers (varlen_attn's form, whether it takes grouped K/V, the errors) goes to
``attention_gpu.json`` there. Skipped without CUDA (``benchmarks/gpu_smoke.sh`` runs it).
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("megatron_world"),
]

HEADS, GROUPS, DIM = 12, 2, 128
SEGMENTS = [1000, 600, 300, 140, 8]  # a packed row of 2048: four sequences and a padding segment
RESULTS: dict = {}


def _core_attentions(dtype: torch.dtype):
    """(UnfusedAttention, SdpaAttention) of one layer at the recipes' shapes, TP 1."""
    import torch.nn.functional as F

    from megatron_empg.mcore import cpu_shims

    cpu_shims.import_megatron()
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_empg.mcore.attention import SdpaAttention, UnfusedAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=1536,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        ffn_hidden_size=8960,
        gated_linear_unit=True,
        activation_func=F.silu,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    tp = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1, rank=lambda: 0))
    args = dict(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=tp
    )
    return UnfusedAttention(**args).cuda(), SdpaAttention(**args).cuda()


def _run(module, q, k, v, w, **kwargs):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    mask = None if kwargs else torch.ones(q.size(0), q.size(0), dtype=torch.bool, device=q.device).triu_(1)[None, None]
    out = module(q, k, v, mask, **kwargs)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    return [out.detach().float(), *(g.float() for g in grads)]


def _errors(results, reference):
    return [float((a - b).norm() / b.norm()) for a, b in zip(results, reference, strict=True)]


def _layout():
    from megatron_empg.mcore.thd import ThdLayout

    cu = torch.tensor([0, *SEGMENTS], device="cuda").cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n, device="cuda") for n in SEGMENTS])
    return ThdLayout(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max(SEGMENTS),
        max_seqlen_kv=max(SEGMENTS),
        positions=positions,
    )


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sdpa_is_as_close_to_fp32_as_unfused(packed):
    from megatron_empg.mcore.attention import varlen_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lead = (sum(SEGMENTS),) if packed else (2048, 1)
    q = torch.randn(*lead, HEADS, DIM, device="cuda", generator=g)
    k, v = (torch.randn(*lead, GROUPS, DIM, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(*lead, HEADS * DIM, device="cuda", generator=g)
    kwargs = {"packed_seq_params": _layout()} if packed else {}
    ref32, _ = _core_attentions(torch.float32)
    reference = _run(ref32, q, k, v, w, **kwargs)
    unfused, sdpa = _core_attentions(torch.bfloat16)
    bf16 = [x.bfloat16() for x in (q, k, v)]
    unfused_errors = _errors(_run(unfused, *bf16, w, **kwargs), reference)
    sdpa_errors = _errors(_run(sdpa, *bf16, w, **kwargs), reference)
    name = "packed" if packed else "padded"
    RESULTS[name] = {"relative_errors_out_dq_dk_dv": {"unfused_bf16": unfused_errors, "sdpa_bf16": sdpa_errors}}
    if packed:
        varlen = varlen_attention()
        RESULTS["varlen_attn"] = varlen.describe() if varlen else None
        if varlen is not None:
            from megatron_empg.mcore import attention

            RESULTS["varlen_native_gqa"] = varlen.takes_gqa or attention._varlen_native_gqa()
            # the bucketed SDPA path on the same row: what the varlen path replaces
            bucketed = _errors(
                _run(lambda *a, packed_seq_params: sdpa._buckets(*a[:3], packed_seq_params), *bf16, w, **kwargs),
                reference,
            )
            RESULTS[name]["relative_errors_out_dq_dk_dv"]["bucketed_sdpa_bf16"] = bucketed
    _write()
    for ours, theirs in zip(sdpa_errors, unfused_errors, strict=True):
        assert ours <= 2 * theirs + 1e-3, (sdpa_errors, unfused_errors)  # bf16 with fp32 accumulation either way


def test_fusions_without_te_on_cuda():
    """Megatron's compiled SwiGLU and our fp32-output weight-gradient GEMM against their unfused forms."""
    import torch.nn.functional as F

    from megatron_empg.mcore import cpu_shims
    from megatron_empg.mcore.fusions import WgradAccumulation

    cpu_shims.import_megatron()
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4096, 2 * 8960, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    upstream = torch.randn(4096, 8960, device="cuda", dtype=torch.bfloat16, generator=g)
    fused = bias_swiglu_impl(x, None)
    (fused_grad,) = torch.autograd.grad((fused * upstream).sum(), x)
    xf = x.detach().float().requires_grad_()
    ref = F.silu(xf.chunk(2, -1)[0]) * xf.chunk(2, -1)[1]
    (ref_grad,) = torch.autograd.grad((ref * upstream.float()).sum(), xf)
    swiglu = {
        "out": float((fused.float() - ref).norm() / ref.norm()),
        "grad": float((fused_grad.float() - ref_grad).norm() / ref_grad.norm()),
    }

    inputs = torch.randn(8192, 1536, device="cuda", dtype=torch.bfloat16, generator=g)
    grad_out = torch.randn(8192, 8960, device="cuda", dtype=torch.bfloat16, generator=g)
    start = torch.randn(8960, 1536, device="cuda", generator=g)
    exact = start.double() + grad_out.double().t() @ inputs.double()
    fused_acc = start.clone()
    WgradAccumulation.wgrad_gemm_accum_fp32(inputs, grad_out, fused_acc)
    unfused_acc = start + (grad_out.t() @ inputs).float()
    wgrad = {
        "fused": float((fused_acc.double() - exact).norm() / exact.norm()),
        "unfused": float((unfused_acc.double() - exact).norm() / exact.norm()),
    }
    RESULTS["fusions"] = {"swiglu_relative_error_vs_fp32": swiglu, "wgrad_relative_error_vs_fp64": wgrad}
    _write()
    assert swiglu["out"] < 1e-2 and swiglu["grad"] < 1e-2, swiglu
    assert wgrad["fused"] <= wgrad["unfused"] and wgrad["fused"] < 1e-5, wgrad


def _write() -> None:
    results = os.environ.get("EMPG_GPU_RESULTS_DIR")
    if results:
        device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
        Path(results, "attention_gpu.json").write_text(json.dumps({"device": device, **RESULTS}, indent=1))
