"""``Completion.routed_experts`` from the transformers engine (tiny Qwen3-MoE, float32, CPU): batched,
left-padded, cached decoding returns, for every token but the last, the experts transformers' own
router picks for it in one teacher-forced forward of the whole sequence (``output_router_logits``:
top-k of the float32 softmax), as vLLM lays them out ([prompt + response - 1, layers, k])."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import RolloutConfig, SamplingConfig, load_model_config
from megatron_empg.rollout.engine import Completion
from megatron_empg.rollout.hf_engine import HfEngine

MODEL = "tiny-qwen3-moe"


def test_hf_engine_returns_the_routing_of_a_teacher_forced_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    from tools.make_tiny_model import save_tiny_hf_model

    model = load_model_config(MODEL)
    model_dir = save_tiny_hf_model(model, tmp_path, seed=1)
    engine = HfEngine(model_dir, RolloutConfig(dtype="float32"), routed_experts=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [40], [50, 51, 52]]  # left padding of 6, 0 and 4 tokens
    completions = engine.generate(prompts, SamplingConfig(n=2, max_tokens=9, temperature=1.0, seed=4))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    checked = 0
    for prompt, group in zip(prompts, completions):
        for c in group:
            ids = prompt + c.token_ids
            assert c.routed_experts.dtype == torch.int16
            assert c.routed_experts.shape == (len(ids) - 1, model.num_layers, model.moe_router_topk)
            with torch.no_grad():
                logits = reference(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
            expected = torch.stack(
                [layer.float().softmax(-1).topk(model.moe_router_topk).indices for layer in logits], 1
            )
            assert torch.equal(c.routed_experts.long(), expected)
            checked += len(ids) - 1
    assert checked > 30
    plain = HfEngine(model_dir, RolloutConfig(dtype="float32")).generate(prompts[:1], SamplingConfig(max_tokens=2))
    assert plain[0][0].routed_experts is None


def test_routing_is_refused_without_experts_or_in_a_wrong_layout(tmp_path):
    from tools.make_tiny_model import save_tiny_hf_model

    with pytest.raises(ValueError, match="routed_experts: the model .* has no experts"):
        HfEngine(save_tiny_hf_model(load_model_config("tiny-qwen3"), tmp_path), RolloutConfig(), routed_experts=True)
    ok = torch.zeros(4, 2, 2, dtype=torch.int16)
    assert Completion([1, 2, 3], [0.0] * 3, "stop", None, routed_experts=ok).routed_experts is ok
    for routed, words in [
        (ok.int(), "int16 .* got torch.int32"),
        (ok[0], r"shape \[2, 2\]"),
        (ok[:2], "covers 2 tokens, fewer than"),
    ]:
        with pytest.raises(ValueError, match=words):
            Completion([1, 2, 3], [0.0] * 3, "stop", None, routed_experts=routed)
