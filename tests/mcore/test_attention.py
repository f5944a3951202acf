"""The ``sdpa`` core attention (``mcore.attention.SdpaAttention``) against the ``unfused`` reference
(Megatron's ``DotProductAttention``, ``mcore.attention.UnfusedAttention``): outputs and input
gradients of the core attention alone, then logits and every parameter gradient of whole models
with the same weights, at TP 1 and TP 2, on padded rows and on packed (THD) rows, with grouped K/V
heads (tiny-qwen2: 4 heads, 2 groups; tiny-qwen3 adds q/k norms and head_dim 32). And the
``varlen_attn`` glue (CUDA-only kernel, here a stand-in) for each signature torch has had.

fp32 throughout; the two paths differ by the order of their sums (observed ~1e-7): 2e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

TOL = dict(rtol=2e-5, atol=2e-5)
LENGTHS = [7, 1, 12, 9, 3]  # a packed row: five sequences (9 and 12 share a bucket, 1 is alone) ...
ROW = 36  # ... then a padding segment of 4
PAD_ID = 0


def _padded_and_packed(vocab_size: int):
    """The same sequences as right-padded rows and as one packed row (``core.microbatch``)."""
    from megatron_empg.core.microbatch import MicroBatch

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, vocab_size, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    padded = torch.full((len(seqs), width), PAD_ID)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    flat = torch.cat(seqs)
    packed_ids = torch.full((1, ROW), PAD_ID)
    packed_ids[0, : flat.numel()] = flat
    segments = [*LENGTHS, ROW - flat.numel()]
    cu = torch.tensor([0, *segments]).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in segments])[None]
    padded_mb = MicroBatch(padded, torch.zeros_like(padded))
    packed_mb = MicroBatch(
        packed_ids, torch.zeros_like(packed_ids), position_ids=positions, cu_seqlens=cu, max_seqlen=max(segments)
    )
    return padded_mb, packed_mb


def _models(model_name: str, tp: int):
    """The same weights (this rank's TP shard) under the unfused and the sdpa backends."""
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore.model import build_gpt_model

    cfg = load_model_config(model_name)
    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    (unfused,) = build_gpt_model(cfg, parallel, attention_backend="unfused")
    (sdpa,) = build_gpt_model(cfg, parallel, attention_backend="sdpa")
    sdpa.load_state_dict(unfused.state_dict())
    return cfg, unfused, sdpa


def _core_attention_checks(unfused, sdpa, packed_mb) -> dict:
    """One layer's core attentions on random q, k, v: padded [s, b, heads, dim] and packed
    [t, heads, dim]; outputs and the gradients of q, k and v."""
    from megatron_empg.mcore.thd import thd_layout

    ref = unfused.decoder.layers[0].self_attention.core_attention
    ours = sdpa.decoder.layers[0].self_attention.core_attention
    assert type(ours).__name__ == "SdpaAttention" and type(ref).__name__ == "UnfusedAttention"
    heads, groups, dim = ours.heads, ours.groups, ref.hidden_size_per_attention_head
    g = torch.Generator().manual_seed(11)
    out = {}
    for name, lead, extra in (
        ("padded", (13, 3), {}),
        ("packed", (ROW,), {"packed_seq_params": thd_layout(packed_mb)}),
    ):
        q = torch.randn(*lead, heads, dim, generator=g, requires_grad=True)
        k, v = (torch.randn(*lead, groups, dim, generator=g, requires_grad=True) for _ in range(2))
        w = torch.randn(*lead, heads * dim, generator=g)
        results = []
        for module in (ref, ours):
            mask = torch.ones(1, 1, 13, 13, dtype=torch.bool).triu_(1) if name == "padded" else None
            y = module(q, k, v, mask, **extra)
            grads = torch.autograd.grad((y * w).sum(), (q, k, v))
            results.append((y.detach(), *grads))
        out[name] = results
    return out


def _model_checks(model_name: str, tp: int) -> dict:
    from megatron_empg.mcore.step import _model_forward

    cfg, unfused, sdpa = _models(model_name, tp)
    padded_mb, packed_mb = _padded_and_packed(cfg.vocab_size)
    out = {"core": _core_attention_checks(unfused, sdpa, packed_mb)}
    g = torch.Generator().manual_seed(5)
    for name, mb in (("padded", padded_mb), ("packed", packed_mb)):
        results = []
        w = None
        for model in (unfused, sdpa):
            model.zero_grad()
            logits = _model_forward(model, mb)  # [b, s, V_local]
            if w is None:
                w = torch.randn(logits.shape, generator=g)
            (logits * w).sum().backward()
            results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        out[name] = results
    # per sequence, the packed row's sdpa logits are the padded rows' (RoPE restarts per sequence)
    out["packed_vs_padded"] = (out["packed"][1][0], out["padded"][1][0])
    return out


def _rank(rank: int, world_size: int, model_names: list[str]) -> dict:
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    results = {}
    for name in model_names:
        initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world_size), seed=1234)
        try:
            results[name] = _model_checks(name, world_size)
        finally:
            destroy_model_parallel()
    return results


def _assert_equal(results: dict) -> None:
    for name in ("padded", "packed"):
        ref, ours = results["core"][name]
        for a, b in zip(ref, ours, strict=True):
            torch.testing.assert_close(b, a, **TOL)
        (ref_logits, ref_grads), (logits, grads) = results[name]
        torch.testing.assert_close(logits, ref_logits, **TOL)
        assert grads.keys() == ref_grads.keys()
        for param in ref_grads:
            torch.testing.assert_close(grads[param], ref_grads[param], **TOL, msg=lambda m, p=param: f"{p}: {m}")
    packed, padded = results["packed_vs_padded"]
    start = 0
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(packed[0, start : start + n], padded[i, :n], **TOL)
        start += n


@pytest.mark.parametrize("world_size", [1, 2], ids=["tp1", "tp2"])
def test_sdpa_equals_unfused(world_size):
    models = ["tiny-qwen2", "tiny-qwen3"] if world_size == 1 else ["tiny-qwen2"]
    for rank_results in run_distributed(_rank, world_size, models):
        for results in rank_results.values():
            _assert_equal(results)


# ---------------------------------------------------------------------------- varlen_attn glue


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal: bool, scale=None, enable_gqa=False):
    """A CPU stand-in with varlen_attn's contract: attention within each cu_seqlens segment."""
    assert causal, "the glue must ask for causal attention"
    assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    assert enable_gqa or k.size(1) == q.size(1), "fewer K/V heads than query heads without enable_gqa"
    cu = cu_q.tolist()
    parts = [
        F.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=enable_gqa
        ).transpose(0, 1)
        for a, b in zip(cu[:-1], cu[1:])
    ]
    return torch.cat(parts)


def _fake(signature: str):
    """A function with the keyword arguments of varlen_attn in a torch release."""
    if signature == "2.9":

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None):
            return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=is_causal)
    elif signature == "2.10":

        def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
            return _reference_varlen(
                q, k, v, cu_q, cu_k, max_q, max_k, causal=tuple(window_size) == (-1, 0), scale=scale
            )
    else:

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
            return _reference_varlen(
                q,
                k,
                v,
                cu_q,
                cu_k,
                max_q,
                max_k,
                causal=tuple(window_size) == (-1, 0),
                scale=scale,
                enable_gqa=enable_gqa,
            )

    return fn


@pytest.mark.parametrize("signature", ["2.9", "2.10", "2.12"])
@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_varlen_glue_equals_bucketed_sdpa(signature, native_gqa, scale, monkeypatch):
    import inspect

    from megatron_empg.mcore import attention
    from megatron_empg.mcore.thd import ThdLayout

    fn = _fake(signature)
    if native_gqa and signature != "2.12":  # a kernel under the wrapper that takes fewer K/V heads
        monkeypatch.setattr(attention, "_varlen_native_gqa", lambda: True)
        inner = fn

        def fn(q, k, v, *args, **kwargs):  # noqa: F811
            repeat = q.size(1) // k.size(1)
            return inner(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), *args, **kwargs)

        fn.__signature__ = inspect.signature(inner)
    else:
        monkeypatch.setattr(attention, "_varlen_native_gqa", lambda: False)
    varlen = attention._Varlen(fn, inspect.signature(fn).parameters)
    segments = [*LENGTHS, 4]
    cu = torch.tensor([0, *segments]).cumsum(0).to(torch.int32)
    layout = ThdLayout(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(segments), max_seqlen_kv=max(segments)
    )
    g = torch.Generator().manual_seed(2)
    q = torch.randn(ROW, 4, 16, generator=g)
    k, v = (torch.randn(ROW, 2, 16, generator=g) for _ in range(2))
    softmax_scale = scale if scale is not None else 1 / math.sqrt(16)
    out = varlen(q, k, v, layout, softmax_scale)
    expected = torch.empty(ROW, 64)
    for bucket in layout.buckets():  # the bucketed SDPA path, independently of the glue
        qb, kb, vb = (bucket.unpack(x).transpose(1, 2) for x in (q, k, v))
        ctx = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=softmax_scale, enable_gqa=True)
        bucket.pack_(expected, ctx.transpose(1, 2))
    torch.testing.assert_close(out, expected, **TOL)
