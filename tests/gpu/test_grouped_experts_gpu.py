"""``GroupedExperts`` (``model.moe_experts: grouped``) on CUDA in bf16 through torch's grouped GEMM,
against Megatron's ``SequentialMLP`` (the sequential path) holding the same weights and against an
fp32 reference, at Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, expert FFN 768):
one packed 8k-token micro-batch routed top-8 (65,536 rows sorted by expert, uneven counts, 8
experts without a token). Outputs and the gradients of the input, the routing weights and both
stacked weights; an expert without tokens gets an exactly zero weight gradient. The grouped
module's forward and backward make no host sync (``torch.cuda.set_sync_debug_mode("error")``,
token counts on the device as the dispatcher hands them), nor does the whole MoE layer (router,
``LocalTokenDispatcher``, experts, combine) on an 8k micro-batch. Both modules are the layer-0 experts of
one-layer builds (``mcore.model.build_gpt_model``, the sdpa spec, CUDA's fusion plan: the grouped
module's compiled weighted SwiGLU, Megatron's fused one in SequentialMLP), as the trainer builds
them, except that ``gradient_accumulation_fusion`` is off: without DDP's fp32 ``main_grad`` buffers
Megatron's linears have nowhere to write, and so both modules give bf16 weight gradients here (in
training SequentialMLP's go straight into the fp32 buffer, GroupedExperts' are a bf16 ``.grad``
that DDP adds to it). With ``EMPG_GPU_RESULTS_DIR`` set, the errors and each module's forward + backward time go
to ``grouped_experts_gpu.json`` there. Skipped without CUDA (``benchmarks/gpu_smoke.sh`` runs it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("megatron_world"),
]

MODEL = "qwen3-30b-a3b"  # model_configs/qwen3-30b-a3b.yaml: E 128, top-8, h 2048, F 768
TOKENS = 8192  # one packed 8k micro-batch
EMPTY = (0, 17, 34, 51, 68, 85, 102, 127)  # experts that receive no token (the first and the last too)
# Tolerances. bf16 keeps 8 significant bits: a rounding is off by at most u = 2^-8 = 3.9e-3 of the
# value, ~u / sqrt(12) x 2 on average over a tensor. Both bf16 paths accumulate every GEMM in fp32
# and round its output once, then the SwiGLU's output once, then the second GEMM's (backward: the
# SwiGLU's input gradient, then dX and dW): three to four roundings in a row, each error relative
# to the tensor's own scale. So, against the fp32 reference computed from the same bf16 weights and
# inputs (the fp32 reference has no rounding of its own to speak of):
#   normwise  ||a - ref|| / ||ref|| <= 1e-2 (~2.5 u: three roundings' RMS errors add to ~1.5 u),
#   largest   max|a - ref| <= 2^-5 max|ref| (8 u of the tensor's largest element: no single element
#             off by more than a few of its own ulps plus the accumulated rounding),
# and grouped against sequential twice the normwise bound (each within it of the reference: the
# triangle inequality; each is ~1 u off in practice, bf16 on CPU measured 4.0e-3 normwise and 5.6e-3
# largest at this test's construction; a layout bug, a wrong expert's rows, gives errors of order 1).
# The grouped path must also be no worse than the sequential one: normwise at most 2x sequential's
# error + 1e-3.
NORMWISE = 1e-2
BETWEEN = 2 * NORMWISE
LARGEST = 2.0**-5
RESULTS: dict = {}
LAYER: dict = {}


def _counts(rows: int, experts: int) -> torch.Tensor:
    """Uneven rows per expert (log-normal weights, the realistic imbalance of a router early in
    training), zero for ``EMPTY``, summing to ``rows``."""
    g = torch.Generator().manual_seed(44)
    weights = torch.exp(0.6 * torch.randn(experts, generator=g))
    weights[list(EMPTY)] = 0
    counts = torch.floor(weights / weights.sum() * rows).long()
    live = [j for j in range(experts) if j not in EMPTY]
    for i in range(rows - int(counts.sum())):  # the remainder, one row each
        counts[live[i % len(live)]] += 1
    assert int(counts.sum()) == rows and all(counts[j] == 0 for j in EMPTY)
    return counts


@pytest.fixture(scope="module")
def experts():
    """(grouped, sequential): layer 0's experts of two one-layer bf16 builds on the sdpa spec with
    CUDA's fusions (gradient accumulation fusion off), the sequential one given the grouped one's
    weights."""
    from megatron.core import tensor_parallel

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.attention_backends import resolve_attention_backend
    from megatron_empg.mcore.fusions import FusionPlan, fusion_plan
    from megatron_empg.mcore.model import build_gpt_model

    attention = resolve_attention_backend("sdpa")
    plan = fusion_plan(attention, cuda=True)
    fusions = FusionPlan(
        {**plan.overrides, "gradient_accumulation_fusion": False},
        {**plan.reasons, "gradient_accumulation_fusion": "no DDP main_grad buffers in this test"},
    )
    built = {}
    for name in ("grouped", "sequential"):
        torch.manual_seed(3)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        (chunk,) = build_gpt_model(
            load_model_config(MODEL, ["num_layers=1", f"moe_experts={name}"]),
            ParallelConfig(),
            params_dtype=torch.bfloat16,
            attention_backend=attention.name,
            fusions=fusions,
        )
        built[name] = chunk.decoder.layers[0].mlp.experts
        if name == "grouped":
            LAYER["grouped"] = chunk.decoder.layers[0].mlp  # the whole MoE layer: router, dispatch, experts
        del chunk
    grouped, sequential = built["grouped"], built["sequential"]
    assert type(grouped).__name__ == "GroupedExperts" and type(sequential).__name__ == "SequentialMLP"
    with torch.no_grad():
        for j, expert in enumerate(sequential.local_experts):
            expert.linear_fc1.weight.copy_(grouped.linear_fc1.weight[j])
            expert.linear_fc2.weight.copy_(grouped.linear_fc2.weight[j])
    torch.cuda.empty_cache()
    yield grouped, sequential
    results = os.environ.get("EMPG_GPU_RESULTS_DIR")
    if results and RESULTS:
        device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
        Path(results, "grouped_experts_gpu.json").write_text(json.dumps({"device": device, **RESULTS}, indent=1))


@pytest.fixture(scope="module")
def inputs(experts):
    """x [M, h] bf16 sorted by expert, the counts (on the device), fp32 routing weights, the
    output's gradient; M = TOKENS x top-k."""
    grouped, _ = experts
    config = grouped.config
    rows = TOKENS * config.moe_router_topk
    counts = _counts(rows, grouped.num_local_experts)
    g = torch.Generator(device="cuda").manual_seed(45)
    x = torch.randn(rows, config.hidden_size, device="cuda", generator=g).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=g) * 0.5 + 0.01  # top-8 of a softmax: (0, 0.5]
    grad = torch.randn(rows, config.hidden_size, device="cuda", generator=g).bfloat16()
    return {"x": x, "counts": counts.cuda(), "counts_host": counts, "probs": probs, "grad": grad}


def _run(module, inputs) -> dict:
    """Forward and backward of the experts module: its output and every gradient (weights stacked
    [E, out, in] for both modules)."""
    x = inputs["x"].detach().clone().requires_grad_()
    probs = inputs["probs"].detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, inputs["counts"], probs)
    assert bias is None
    out.backward(inputs["grad"])
    if hasattr(module, "local_experts"):
        fc1 = torch.stack([e.linear_fc1.weight.grad for e in module.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.grad for e in module.local_experts])
    else:
        fc1, fc2 = module.linear_fc1.weight.grad, module.linear_fc2.weight.grad
    return {"out": out.detach(), "x": x.grad, "probs": probs.grad, "fc1": fc1, "fc2": fc2}


def _reference(grouped, inputs) -> dict:
    """The same forward and backward in fp32 (no TF32) from the bf16 weights and inputs: one
    matmul per expert, SwiGLU times the routing weight."""
    import torch.nn.functional as F

    x = inputs["x"].detach().to(torch.float32, copy=True).requires_grad_()
    probs = inputs["probs"].detach().clone().requires_grad_()
    w1 = grouped.linear_fc1.weight.detach().float().requires_grad_()
    w2 = grouped.linear_fc2.weight.detach().float().requires_grad_()
    outs, start = [], 0
    for j, n in enumerate(inputs["counts_host"].tolist()):
        h = x[start : start + n] @ w1[j].T
        gate, up = h.chunk(2, dim=-1)
        outs.append((F.silu(gate) * up * probs[start : start + n, None]) @ w2[j].T)
        start += n
    out = torch.cat(outs)
    out.backward(inputs["grad"].float())
    return {"out": out.detach(), "x": x.grad, "probs": probs.grad, "fc1": w1.grad, "fc2": w2.grad}


def _errors(a: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (a.float() - ref.float()).abs()
    scale = ref.float().abs().max()
    return {
        "normwise": float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref.float())),
        "largest": float(diff.max() / scale) if scale > 0 else float(diff.max()),
    }


def _timed(module, inputs, repeats: int) -> float:
    """Median seconds of the module's forward + backward (CUDA events; the stream drained first)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _run(module, inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def test_grouped_mm_matches_sequential_and_fp32(experts, inputs):
    from megatron_empg.mcore.moe import gemm

    grouped, sequential = experts
    assert gemm.gemm_path(inputs["x"], grouped.linear_fc1.weight) == "grouped_mm"  # the fast path, not the fallback
    assert grouped.fused_swiglu  # CUDA's fusion plan: the compiled weighted SwiGLU, as in training
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference
    try:
        reference = _reference(grouped, inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    runs = {"grouped": _run(grouped, inputs), "sequential": _run(sequential, inputs)}
    errors = {
        f"{a}_vs_{b}": {k: _errors(runs[a][k], reference[k] if b == "fp32" else runs[b][k]) for k in reference}
        for a, b in (("grouped", "fp32"), ("sequential", "fp32"), ("grouped", "sequential"))
    }
    counts = inputs["counts_host"]
    RESULTS["shape"] = {
        "experts": grouped.num_local_experts,
        "hidden": grouped.config.hidden_size,
        "moe_ffn": grouped.config.moe_ffn_hidden_size,
        "top_k": grouped.config.moe_router_topk,
        "tokens": TOKENS,
        "rows": int(counts.sum()),
        "rows_per_expert_min_max": [int(counts[counts > 0].min()), int(counts.max())],
        "empty_experts": list(EMPTY),
    }
    RESULTS["tolerance"] = {"normwise": NORMWISE, "between_paths": BETWEEN, "largest_relative_to_max": LARGEST}
    RESULTS["errors"] = errors
    for name in reference:
        for pair, bound in (("grouped_vs_fp32", NORMWISE), ("grouped_vs_sequential", BETWEEN)):
            e = errors[pair][name]
            assert e["normwise"] <= bound, (pair, name, e)
        assert errors["grouped_vs_fp32"][name]["largest"] <= LARGEST, (name, errors["grouped_vs_fp32"][name])
        assert (
            errors["grouped_vs_fp32"][name]["normwise"] <= 2 * errors["sequential_vs_fp32"][name]["normwise"] + 1e-3
        ), (name, errors)
    for run in runs.values():  # an expert without tokens: exactly zero weight gradients
        for j in EMPTY:
            assert torch.count_nonzero(run["fc1"][j]) == 0 and torch.count_nonzero(run["fc2"][j]) == 0, j
    assert torch.isfinite(runs["grouped"]["out"]).all()


def test_grouped_experts_make_no_host_sync(experts, inputs):
    grouped, _ = experts
    _run(grouped, inputs)  # warm: the compiled SwiGLU's first call compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run = _run(grouped, inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert run["x"] is not None and run["fc1"] is not None
    RESULTS["host_sync_free"] = True


def test_grouped_moe_layer_makes_no_host_sync(experts):
    """The whole MoE layer at EP 1 (router in fp32, ``LocalTokenDispatcher``'s permutation, the
    experts, the combine), forward and backward on one 8k micro-batch."""
    layer = LAYER["grouped"]
    assert type(layer.token_dispatcher).__name__ == "LocalTokenDispatcher"
    g = torch.Generator(device="cuda").manual_seed(46)
    x = torch.randn(TOKENS, 1, layer.config.hidden_size, device="cuda", generator=g).bfloat16()

    def step():
        inp = x.detach().clone().requires_grad_()
        out, _ = layer(inp)
        out.float().square().mean().backward()
        return inp.grad

    step()  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grad = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(grad).all()
    RESULTS["moe_layer_host_sync_free"] = True


def test_time_grouped_against_sequential(experts, inputs):
    """Not a goal: the two modules' forward + backward at this shape, recorded for the smoke kit
    (``benchmarks/train_step.py`` measures the MoE blocks inside the step)."""
    grouped, sequential = experts
    counts = inputs["counts_host"]
    config = grouped.config
    flops = 3 * 2 * int(counts.sum()) * 3 * config.hidden_size * config.moe_ffn_hidden_size  # fwd + 2x bwd
    _run(sequential, inputs)  # warm
    times = {"grouped": _timed(grouped, inputs, 5), "sequential": _timed(sequential, inputs, 3)}
    RESULTS["forward_backward"] = {name: {"seconds": t, "tflops": flops / t / 1e12} for name, t in times.items()} | {
        "grouped_speedup": times["sequential"] / times["grouped"],
        "flops": flops,
    }
    assert times["grouped"] > 0
