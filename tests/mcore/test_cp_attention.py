"""Context parallelism through the ``sdpa`` backend (``mcore.cp_attention``), against the
one-process computation on the full packed row.

On gloo ranks with Megatron initialized with ``context_parallel_size`` (CP 2 and CP 4): the CP
core attention's output and q / k / v gradients on each rank equal the one-process
``SdpaAttention``'s on the full row at that rank's tokens; a whole tiny-qwen2 (GQA: 4 heads,
2 groups) gives each rank's local tokens the one-process logits, and every parameter's gradient
summed over the CP ranks is the one-process gradient (through the decoder's per-token RoPE hook,
at the tokens' global positions). Rows: sequences of different lengths and a padding segment,
the first a sequence of 13 tokens padded to a multiple of 2 * CP inside its last chunk; and a
row whose local length equals its longest segment (the RoPE hook must still gather).

In one process: the ``varlen_attn`` path after the gather (a CPU stand-in with flash attention's
bottom-right causal mask), and a stand-in aligned to the top left, which the probe detects and
the exact masked path replaces.

fp32; the paths differ by the order of their sums (observed ~1e-7): 2e-5.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

TOL = dict(rtol=2e-5, atol=2e-5)
# per CP size: rows of segments (multiples of 2 * CP), the last segment of the first row padding
ROWS = {
    2: [[16, 4, 8, 12], [8, 8]],
    4: [[16, 8, 24, 8, 8], [16, 16, 16, 16]],
}


def _batch(lengths: list[int], vocab_size: int, seed: int):
    from megatron_empg.core.microbatch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (1, sum(lengths)), generator=g)
    return MicroBatch(
        ids,
        torch.zeros_like(ids),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seqlens=torch.tensor([0, *lengths]).cumsum(0).to(torch.int32),
        max_seqlen=max(lengths),
    )


def _core_checks(ours, ref, full, local) -> dict:
    """One layer's core attentions on random q, k, v of the full row: the reference on the full row,
    ours (CP) on this rank's rows; outputs and q / k / v gradients at this rank's tokens."""
    from megatron_empg.mcore.thd import thd_layout
    from megatron_empg.parallel.context_parallel import CpChunks

    index = CpChunks.from_cu_seqlens(full.cu_seqlens, local.cp_size, local.cp_rank).local_index()
    s = full.shape[1]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(s, ours.heads, 16, generator=g)
    k, v = (torch.randn(s, ours.groups, 16, generator=g) for _ in range(2))
    w = torch.randn(s, ours.heads * 16, generator=g)
    results = []
    for module, rows, batch in ((ref, slice(None), full), (ours, index, local)):
        inputs = [x[rows].clone().requires_grad_() for x in (q, k, v)]
        y = module(*inputs, None, packed_seq_params=thd_layout(batch))
        grads = torch.autograd.grad((y * w[rows]).sum(), inputs)
        results.append([x[index] if module is ref else x for x in (y.detach(), *grads)])
    return {"reference": results[0], "cp": results[1]}


def _model_checks(cp_model, ref_model, full, local) -> dict:
    """Logits of this rank's tokens and every parameter gradient summed over the CP ranks."""
    import torch.distributed as dist

    from megatron_empg.mcore.step import _model_forward
    from megatron_empg.parallel.context_parallel import CpChunks

    index = CpChunks.from_cu_seqlens(full.cu_seqlens, local.cp_size, local.cp_rank).local_index()
    out = {}
    g = torch.Generator().manual_seed(5)
    w = None
    for name, model, batch, rows in (("reference", ref_model, full, slice(None)), ("cp", cp_model, local, index)):
        model.zero_grad()
        logits = _model_forward(model, batch)  # [1, s, V]
        if w is None:
            w = torch.randn(logits.shape, generator=g)
        (logits * w[:, rows]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if name == "cp":
            for grad in grads.values():
                dist.all_reduce(grad)  # the CP group is the world here
        out[name] = (logits.detach()[:, index] if name == "reference" else logits.detach(), grads)
    return out


def _cp_worker(rank: int, world_size: int, rows: list[list[int]]) -> dict:
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.parallel.context_parallel import split_microbatch

    initialize_model_parallel(ParallelConfig(context_parallel_size=world_size), seed=1234)
    try:
        cfg = load_model_config("tiny-qwen2")
        (cp_model,) = build_gpt_model(cfg, ParallelConfig(context_parallel_size=world_size), attention_backend="sdpa")
        (ref_model,) = build_gpt_model(cfg, ParallelConfig(), attention_backend="sdpa")  # no CP: the full row
        ref_model.load_state_dict(cp_model.state_dict())
        ours = cp_model.decoder.layers[0].self_attention.core_attention
        ref = ref_model.decoder.layers[0].self_attention.core_attention
        assert ours.cp_group is not None and ours.cp_group.size() == world_size and ref.cp_group is None
        results = {}
        for i, lengths in enumerate(rows):
            full = _batch(lengths, cfg.vocab_size, seed=i)
            local = split_microbatch(full, world_size, rank)
            results[i] = {
                "core": _core_checks(ours, ref, full, local),
                "model": _model_checks(cp_model, ref_model, full, local),
            }
        q = torch.zeros(8, 1, ours.heads, 16)
        try:  # padded rows are not split under CP
            ours(q, q[..., : ours.groups, :], q[..., : ours.groups, :], None)
        except ValueError as error:
            results["padded"] = str(error)
        return results
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_and_model_equal_the_full_row(cp):
    for rank_results in run_distributed(_cp_worker, cp, ROWS[cp], timeout=180):
        assert "takes packed THD rows" in rank_results.pop("padded")
        for row in rank_results.values():
            for ref, ours, what in zip(row["core"]["reference"], row["core"]["cp"], ("out", "dq", "dk", "dv")):
                torch.testing.assert_close(ours, ref, **TOL, msg=lambda m, w=what: f"core attention {w}: {m}")
            (ref_logits, ref_grads), (logits, grads) = row["model"]["reference"], row["model"]["cp"]
            torch.testing.assert_close(logits, ref_logits, **TOL)
            assert grads.keys() == ref_grads.keys()
            for name in ref_grads:
                torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# -------------------------------------------------------- the varlen path, with CPU stand-ins


def _fake_varlen(bottom_right: bool, calls: list):
    """``varlen_attn`` (2.12 signature) on CPU: segment i of the queries attends to segment i of the
    keys under a causal mask aligned to the bottom right (flash attention) or the top left."""

    def fn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        *,
        return_aux=None,
        scale=None,
        window_size=(-1, -1),
        enable_gqa=False,
        seqused_k=None,
        block_table=None,
        num_splits=None,
    ):
        assert tuple(window_size) == (-1, 0), "the glue must ask for causal attention"
        calls.append(len(cu_q) - 1)
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        assert max_q == max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
        assert max_k == max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
        parts = []
        for (a, b), (c, d) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:]), strict=True):
            offset = (d - c) - (b - a) if bottom_right else 0
            mask = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + offset
            parts.append(
                F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1),
                    k[c:d].transpose(0, 1),
                    v[c:d].transpose(0, 1),
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=enable_gqa,
                ).transpose(0, 1)
            )
        return torch.cat(parts)

    return fn


@pytest.mark.parametrize("bottom_right", [True, False], ids=["bottom_right", "top_left"])
@pytest.mark.parametrize("cp", [2, 4])
def test_varlen_path_after_the_gather(cp, bottom_right):
    from megatron_empg.mcore import attention, cp_attention
    from megatron_empg.parallel.context_parallel import CpChunks

    calls: list[int] = []
    fn = _fake_varlen(bottom_right, calls)
    varlen = attention._Varlen(fn, inspect.signature(fn).parameters)
    assert cp_attention._bottom_right_causal(varlen, torch.device("cpu")) is bottom_right
    lengths = [u * 2 * cp for u in (5, 1, 3, 2)]
    s = sum(lengths)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(s, 4, 16, generator=g)
    k, v = (torch.randn(s, 2, 16, generator=g) for _ in range(2))
    scale = 1 / math.sqrt(16)
    expected, start = [], 0
    for n in lengths:  # per sequence, SDPA's own causal attention
        part = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        expected.append(F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True).transpose(0, 1))
        start += n
    expected = torch.cat(expected).reshape(s, -1)
    for rank in range(cp):
        chunks = CpChunks(tuple(lengths), cp, rank)
        calls.clear()
        out = cp_attention.attend_gathered(q[chunks.local_index()], k, v, chunks, scale, varlen)
        # bottom right: one varlen call over the rank's 2 chunks per segment; top left: masked SDPA
        assert calls == ([2 * len(lengths)] if bottom_right else [])
        torch.testing.assert_close(out, expected[chunks.local_index()], **TOL)


def test_a_cp_share_has_no_whole_row_length_buckets():
    from megatron_empg.mcore.thd import thd_layout
    from megatron_empg.parallel.context_parallel import split_microbatch

    layout = thd_layout(split_microbatch(_batch([8, 4], 100, seed=0), 2, 1))
    assert (layout.cp_chunks.cp_size, layout.cp_chunks.cp_rank, layout.max_seqlen_q) == (2, 1, 8)
    with pytest.raises(ValueError, match="CP rank's share"):
        layout.buckets()
