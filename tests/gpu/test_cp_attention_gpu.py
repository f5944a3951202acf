"""The context-parallel attention's CUDA path (``mcore.cp_attention.attend_gathered`` on
``varlen_attn``) at the 1.5B recipes' shapes (12 heads, 2 K/V groups, head dim 128, bf16), on ONE
GPU: each CP rank of CP 2 and CP 4 is simulated in turn, the all-gather replaced by what it
returns (the simulated ranks' local K / V concatenated in rank order, then ``full_order``), and
the gradient of every rank's local K / V summed over the simulated ranks (what the reduce-scatter
gives). Output and q / k / v gradients, put back in full-row order, against ``SdpaAttention`` on
the full row (``varlen_attn`` without CP), both measured against the fp32 unfused reference.

Also what the varlen path rests on: that ``varlen_attn``'s causal mask is aligned to the bottom
right for a query segment shorter than its key segment (``_bottom_right_causal``; otherwise the
CP attention falls back to masked SDPA, exact but slow). With ``EMPG_GPU_RESULTS_DIR`` set, the
errors go to ``cp_attention_gpu.json`` there. Skipped without CUDA.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.gpu.test_attention_gpu import DIM, GROUPS, HEADS, _core_attentions, _errors, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("megatron_world"),
]

# a packed row of 8192: four sequences and a padding segment, every length a multiple of 2 * 4
SEGMENTS = [4096, 2048, 1024, 520, 504]
RESULTS: dict = {}


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


def _simulated_cp(q, k, v, w, cp: int, varlen, scale: float) -> list[torch.Tensor]:
    """[out, dq, dk, dv] of the full row (fp32, full-row order) computed as ``cp`` CP ranks would."""
    from megatron_empg.mcore.cp_attention import attend_gathered
    from megatron_empg.parallel.context_parallel import CpChunks

    chunks = [CpChunks(tuple(SEGMENTS), cp, rank) for rank in range(cp)]
    index = [c.local_index(q.device) for c in chunks]
    order = chunks[0].full_order(q.device)
    qs, ks, vs = ([x[i].detach().requires_grad_() for i in index] for x in (q, k, v))
    results = [torch.empty(q.size(0), HEADS * DIM, device=q.device)]
    results += [torch.empty(x.shape, device=q.device) for x in (q, k, v)]
    for rank in range(cp):
        key, value = torch.cat(ks)[order], torch.cat(vs)[order]  # what gather_from_cp returns
        out = attend_gathered(qs[rank], key, value, chunks[rank], scale, varlen)
        (out.float() * w[index[rank]]).sum().backward()
        results[0][index[rank]] = out.detach().float()
    for rank in range(cp):  # each local K / V gradient has accumulated every simulated rank's part
        for result, leaves in zip(results[1:], (qs, ks, vs)):
            result[index[rank]] = leaves[rank].grad.float()
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_varlen_path_equals_the_full_row(cp):
    from megatron_empg.mcore import cp_attention
    from megatron_empg.mcore.attention import varlen_attention

    varlen = varlen_attention()
    if varlen is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn")
    bottom_right = cp_attention._bottom_right_causal(varlen, torch.device("cuda", torch.cuda.current_device()))
    g = torch.Generator(device="cuda").manual_seed(0)
    s = sum(SEGMENTS)
    q = torch.randn(s, HEADS, DIM, device="cuda", generator=g)
    k, v = (torch.randn(s, GROUPS, DIM, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(s, HEADS * DIM, device="cuda", generator=g)
    layout = _layout()
    ref32, _ = _core_attentions(torch.float32)
    reference = _run(ref32, q, k, v, w, packed_seq_params=layout)
    _, sdpa = _core_attentions(torch.bfloat16)
    bf16 = [x.bfloat16() for x in (q, k, v)]
    full_row = _run(sdpa, *bf16, w, packed_seq_params=layout)
    split = _simulated_cp(*bf16, w, cp, varlen, 1 / math.sqrt(DIM))
    RESULTS["varlen_attn"] = varlen.describe()
    RESULTS["varlen_causal_bottom_right"] = bottom_right
    cp_errors, full_errors = _errors(split, reference), _errors(full_row, reference)
    RESULTS[f"cp{cp}"] = {
        "relative_errors_out_dq_dk_dv": {"cp_bf16": cp_errors, "full_row_sdpa_bf16": full_errors},
        "relative_difference_cp_vs_full_row_bf16": _errors(split, full_row),
    }
    _write()
    assert bottom_right, "varlen_attn's causal mask is not aligned to the bottom right: CP runs masked SDPA"
    for ours, theirs in zip(cp_errors, full_errors, strict=True):
        assert ours <= 2 * theirs + 1e-3, (cp_errors, full_errors)  # bf16 with fp32 accumulation either way


def _write() -> None:
    results = os.environ.get("EMPG_GPU_RESULTS_DIR")
    if results:
        device = {"name": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
        Path(results, "cp_attention_gpu.json").write_text(json.dumps({"device": device, **RESULTS}, indent=1))
