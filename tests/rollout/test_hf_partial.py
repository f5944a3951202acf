"""Partial rollouts on the transformers engine: a weight update between decode steps, and the
responses in flight going on with the new weights (``HfEngine.generate(..., between_steps=)``)."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import load_model_config
from megatron_empg.rollout.hf_engine import HfEngine
from tests.rollout.test_hf_engine import ROLLOUT, TOLERANCE, hf_model, max_abs_diff, push, random_sequences, sampling

SWITCH = 3  # the update lands before decode step 3: tokens 0-2 by the old weights, 3 on by the new


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """An engine holding model A as ``step-0``, and the models A and B (other weights) in transformers."""
    from tools.make_tiny_model import save_tiny_hf_model

    config = load_model_config("tiny-qwen3")
    engine = HfEngine(str(save_tiny_hf_model(config, tmp_path_factory.mktemp("partial"), seed=0)), ROLLOUT)
    a, b = hf_model("tiny-qwen3", seed=0), hf_model("tiny-qwen3", seed=1)
    push(engine, named(a), "step-0")
    yield engine, a, b
    engine.shutdown()


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def update_at(engine: HfEngine, call: int, model: torch.nn.Module, version: str):
    """A ``between_steps`` that pushes ``model``'s weights as ``version`` at its ``call``-th call."""
    calls = []

    def between_steps() -> None:
        calls.append(engine.weight_version)
        if len(calls) == call:
            push(engine, named(model), version)

    return between_steps


def teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """``[T]`` log p(response_t | prompt, response_<t) under ``model`` (temperature 1, no top-k/p)."""
    ids = prompt + response
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(ids) - 1].gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_tokens_after_an_update_are_sampled_by_the_new_weights(rig):
    engine, a, b = rig
    prompts = random_sequences(engine.vocab_size, [4, 9], seed=3)
    settings = sampling(n=2, max_tokens=10)
    result = engine.generate(prompts, settings, between_steps=update_at(engine, SWITCH, b, "step-1"))
    push(engine, named(a), "step-0")
    only_a = engine.generate(prompts, settings)
    changed = 0
    for prompt, group, group_a in zip(prompts, result, only_a):
        for completion, completion_a in zip(group, group_a):
            assert completion.versions == ["step-0"] * SWITCH + ["step-1"] * (10 - SWITCH)
            assert completion.token_ids[:SWITCH] == completion_a.token_ids[:SWITCH]  # the same seeded draws
            # each token's sampler log-prob is the log-prob of the weights that sampled it, given
            # the whole prefix (B's KV recomputed, not A's reused)
            by_a = teacher_forced(a, prompt, completion.token_ids)
            by_b = teacher_forced(b, prompt, completion.token_ids)
            assert max_abs_diff(completion.logprobs[:SWITCH], by_a[:SWITCH]) < TOLERANCE
            assert max_abs_diff(completion.logprobs[SWITCH:], by_b[SWITCH:]) < TOLERANCE
            assert max_abs_diff(by_a[SWITCH:], by_b[SWITCH:]) > 1e-2  # A and B differ where it matters
            changed += completion.token_ids != completion_a.token_ids
    assert changed  # the new weights changed what was sampled after the switch


def test_an_update_to_the_same_weights_changes_no_token(rig):
    engine, a, _ = rig
    prompts = random_sequences(engine.vocab_size, [4, 9], seed=4)
    settings = sampling(n=2, max_tokens=10)
    plain = engine.generate(prompts, settings)
    assert all(c.versions is None for group in plain for c in group)
    # recomputing the KV of the same weights: what incremental decoding computed, to rounding
    again = engine.generate(prompts, settings, between_steps=update_at(engine, SWITCH, a, "step-1"))
    for group, group_plain in zip(again, plain):
        for completion, completion_plain in zip(group, group_plain):
            assert completion.token_ids == completion_plain.token_ids
            assert max_abs_diff(completion.logprobs, completion_plain.logprobs) < TOLERANCE
            assert completion.versions == ["step-0"] * SWITCH + ["step-1"] * (10 - SWITCH)
    push(engine, named(a), "step-0")


def test_responses_finished_before_the_update_keep_one_version(rig):
    engine, a, b = rig
    prompts = random_sequences(engine.vocab_size, [5], seed=5)
    settings = sampling(n=1, max_tokens=2)  # done before decode step 3
    ((completion,),) = engine.generate(prompts, settings, between_steps=update_at(engine, SWITCH, b, "step-1"))
    assert completion.versions == ["step-0", "step-0"] and engine.weight_version == "step-0"
