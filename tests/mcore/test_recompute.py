"""Activation recompute (``train.recompute``) in a Megatron ``GPTModel`` on CPU: the same logits
and gradients as without it, and the recompute really happens: with ``full`` every transformer
layer runs again in the backward pass (twice in all), with ``selective`` only the core attention."""

from __future__ import annotations

import pytest

from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODES = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]


def _forward_backward(rank: int, world_size: int, modes: list) -> dict:
    import torch

    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model, recompute_overrides
    from megatron_empg.mcore.step import causal_mask

    model = load_model_config("tiny-qwen2")
    parallel = ParallelConfig()
    out = {}
    for mode, num_layers in modes:
        parallel_state.initialize_model_parallel(parallel, 7)  # the same initial weights for every mode
        (chunk,) = build_gpt_model(model, parallel, **recompute_overrides(mode, num_layers))
        calls = {"layer": 0, "core_attention": 0}
        for layer in chunk.decoder.layers:
            layer.register_forward_hook(lambda *_: calls.__setitem__("layer", calls["layer"] + 1))
            layer.self_attention.core_attention.register_forward_hook(
                lambda *_: calls.__setitem__("core_attention", calls["core_attention"] + 1)
            )
        ids = torch.randint(0, model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        logits = chunk(ids, torch.arange(24).expand_as(ids), causal_mask(24))
        forward_calls = dict(calls)
        logits.float().pow(2).mean().backward()
        grads = {name: p.grad.clone() for name, p in chunk.named_parameters()}
        out[(mode, num_layers)] = (logits.detach(), grads, forward_calls, dict(calls))
        parallel_state.destroy_model_parallel()
    return out


def test_recompute_gives_the_same_gradients_and_runs_again_in_backward():
    from megatron_empg.config import load_model_config

    layers = load_model_config("tiny-qwen2").num_layers
    (out,) = run_distributed(_forward_backward, 1, MODES, timeout=240)
    ref_logits, ref_grads, ref_forward, ref_total = out[("none", 1)]
    assert ref_forward == ref_total == {"layer": layers, "core_attention": layers}  # nothing recomputed
    for key in MODES[1:]:
        logits, grads, forward_calls, total = out[key]
        assert logits.equal(ref_logits) and grads.keys() == ref_grads.keys(), key
        for name, grad in grads.items():
            assert grad.equal(ref_grads[name]), (key, name)
        assert forward_calls == {"layer": layers, "core_attention": layers}, key
        if key[0] == "selective":
            assert total == {"layer": layers, "core_attention": 2 * layers}, total
        else:
            assert total == {"layer": 2 * layers, "core_attention": 2 * layers}, (key, total)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())


def test_unknown_recompute_mode_is_refused():
    from megatron_empg.mcore.model import recompute_overrides

    assert recompute_overrides("none") == {}
    assert recompute_overrides("full", 2)["recompute_num_layers"] == 2
    with pytest.raises(ValueError, match="expected none, selective or full"):
        recompute_overrides("partial")
