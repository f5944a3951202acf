"""HfEngine against plain ``transformers`` (tiny-qwen2 and tiny-qwen3, float32, CPU).

Every number is checked against an independent reference, to 1e-5 on log-probs: ``score`` against
the log-softmax of a teacher-forced forward, greedy decoding against ``model.generate``, sampled
log-probs against the processed distribution (temperature, top-k, top-p, min_tokens masking)
recomputed here from a teacher-forced forward over prompt + response, weight updates against the
forward of the model whose weights were sent. Tied embeddings use tiny-llama.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from megatron_empg.config import RolloutConfig, SamplingConfig, load_model_config
from megatron_empg.rollout.engine import Completion
from megatron_empg.rollout.hf_engine import HfEngine
from tests.rollout.engine_protocol import assert_update_protocol_enforced

TOLERANCE = 1e-5
ROLLOUT = RolloutConfig(dtype="float32")
EOS = 0  # tools/make_tiny_model.py: <|endoftext|>
NUM_CHARACTER_IDS = 98  # ids 0 .. 97: eos, unk and the characters; above: special filler tokens


def random_sequences(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_model(name: str, seed: int) -> torch.nn.Module:
    from tools.make_tiny_model import tiny_hf_model

    return tiny_hf_model(load_model_config(name), seed=seed)


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[L, V]`` float64 next-token logits of ``ids`` (float32 forward, no padding)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def hf_score(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """``[L - 1]`` teacher-forced log-probs ``log p(x_t | x_<t)``."""
    logprobs = hf_logits(model, ids).log_softmax(-1)[:-1]
    return logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def sampler_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float, banned: list[int] = ()
) -> torch.Tensor:
    """``[T, V]`` log-probs of the distribution sampled from (written independently of the engine):
    ``banned`` ids masked, logits / temperature (none when greedy), the ``top_k`` largest kept,
    then the smallest set of the most likely tokens whose mass reaches ``top_p``."""
    z = logits.clone()
    z[:, list(banned)] = -torch.inf
    if temperature > 0:
        z = z / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], -torch.inf)
    if top_p < 1:
        probs, order = z.softmax(-1).sort(-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        z = z.masked_fill(torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, mass_before >= top_p), -torch.inf)
    return z.log_softmax(-1)


def reference_logprobs(model, prompt: list[int], completion: Completion, **processing) -> torch.Tensor:
    """``[T]`` log-probs of the completion's tokens under ``sampler_logprobs(**processing)``."""
    sequence = prompt + completion.token_ids
    logits = hf_logits(model, sequence)[len(prompt) - 1 : len(sequence) - 1]
    return sampler_logprobs(logits, **processing).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate``'s greedy response, cut after the first eos (its generation config's)."""
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    out = model.generate(torch.tensor([prompt]), attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens)
    ids = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    ends = [k for k, token in enumerate(ids) if token in (eos if isinstance(eos, list) else [eos])]
    return ids[: ends[0] + 1] if ends else ids


def max_abs_diff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


def assert_scores_equal(actual: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(s) for s in actual] == [len(s) for s in expected]
    assert max_abs_diff(sum(actual, []), sum(expected, [])) < TOLERANCE


def sampling(**overrides) -> SamplingConfig:
    defaults = dict(n=4, max_tokens=10, ignore_eos=True, seed=0)
    return SamplingConfig(**{**defaults, **overrides})


def push(engine: HfEngine, named_tensors: list[tuple[str, torch.Tensor]], version: str, buckets: int = 3) -> None:
    engine.begin_weight_update()
    for bucket in range(buckets):
        engine.update_weights(named_tensors=named_tensors[bucket::buckets])
    engine.finish_weight_update(version)


@dataclasses.dataclass
class Rig:
    """A tiny model on disk, a shared engine over it, and the same weights in ``transformers``."""

    name: str
    model_dir: str
    engine: HfEngine
    reference: torch.nn.Module
    prompts: list[list[int]]
    probes: list[list[int]]  # for score(); length 1 has no log-prob


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-qwen3"])
def rig(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tools.make_tiny_model import save_tiny_hf_model

    name = request.param
    model_dir = str(save_tiny_hf_model(load_model_config(name), tmp_path_factory.mktemp(name), seed=0))
    engine = HfEngine(model_dir, ROLLOUT)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = engine.vocab_size
    yield Rig(
        name,
        model_dir,
        engine,
        reference,
        random_sequences(vocab, [1, 5, 12], seed=1),
        random_sequences(vocab, [1, 2, 7, 40], seed=2),
    )
    engine.shutdown()


def greedy(rig: Rig, prompt: list[int], max_tokens: int = 24) -> list[int]:
    ((completion,),) = rig.engine.generate([prompt], sampling(n=1, temperature=0.0, max_tokens=max_tokens))
    return completion.token_ids


def greedy_with_a_new_token(rig: Rig, start: int) -> tuple[list[int], list[int], int]:
    """A prompt, its greedy response (24 tokens, eos ignored) and the index ``k >= start`` of its
    first token that does not occur earlier in the response (greedy decoding may loop)."""
    for prompt in reversed(rig.prompts):
        ids = greedy(rig, prompt)
        k = next((k for k in range(start, len(ids)) if ids[k] not in ids[:k]), None)
        if k is not None:
            return prompt, ids, k
    raise AssertionError("every greedy response repeats its first tokens")


# --------------------------------------------------------------------------------------------
# Scoring and sampling.


def test_score_equals_a_transformers_forward(rig):
    scores = rig.engine.score(rig.probes)
    assert [len(s) for s in scores] == [0, 1, 6, 39]
    assert_scores_equal(scores, [hf_score(rig.reference, p) for p in rig.probes])
    assert rig.engine.vocab_size == rig.reference.config.vocab_size and rig.engine.max_model_len == 256


def test_score_topk_equals_the_top_k_of_a_transformers_forward(rig):
    k = 7
    scores = rig.engine.score_topk(rig.probes, k)
    assert [s.ids.shape for s in scores] == [(0, k), (1, k), (6, k), (39, k)]
    for probe, got in zip(rig.probes, scores):
        logprobs = hf_logits(rig.reference, probe).log_softmax(-1)[:-1]  # [L - 1, V] float64
        order = logprobs.argsort(-1, descending=True)[:, :k]
        assert torch.equal(got.ids, order)  # random tiny weights: no ties in the head
        assert max_abs_diff(got.logprobs.flatten().tolist(), logprobs.gather(-1, order).flatten().tolist()) < TOLERANCE
        assert max_abs_diff(got.target.tolist(), hf_score(rig.reference, probe)) < TOLERANCE
    assert [s.target.tolist() for s in scores] == rig.engine.score(rig.probes)
    with pytest.raises(ValueError, match=r"score_topk: k must be in \[1, vocab_size"):
        rig.engine.score_topk(rig.probes, rig.engine.vocab_size + 1)


def test_greedy_equals_transformers_generate_with_log_softmax_logprobs(rig):
    config = sampling(n=1, temperature=0.0, max_tokens=16, ignore_eos=False)
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):  # as in vLLM
        rig.engine.generate(rig.prompts, dataclasses.replace(config, n=2))
    out = rig.engine.generate(rig.prompts, config)
    for prompt, (completion,) in zip(rig.prompts, out):
        expected = hf_greedy(rig.reference, prompt, 16)
        assert completion.token_ids == expected
        finish = ("stop", None) if expected[-1] == EOS else ("length", None)
        assert (completion.finish_reason, completion.stop_reason) == finish
        reference = reference_logprobs(rig.reference, prompt, completion, temperature=0.0, top_k=None, top_p=1.0)
        assert max_abs_diff(completion.logprobs, reference) < TOLERANCE


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.7, 20, 0.9), (0.7, None, 0.5), (1.5, 5, 1.0), (1.0, None, 0.01)],
)
def test_sampled_logprobs_are_those_of_the_processed_distribution(rig, temperature, top_k, top_p):
    out = rig.engine.generate(rig.prompts, sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=3))
    assert [len(group) for group in out] == [4, 4, 4]
    largest_change = 0.0
    for prompt, group in zip(rig.prompts, out):
        if top_p > 0.1:  # (top_p 0.01 keeps only the most likely token)
            assert len({tuple(c.token_ids) for c in group}) > 1  # n independent samples
        for completion in group:
            assert (len(completion.token_ids), completion.finish_reason, completion.stop_reason) == (10, "length", None)
            processing = dict(temperature=temperature, top_k=top_k, top_p=top_p)
            expected = reference_logprobs(rig.reference, prompt, completion, **processing)
            assert torch.isfinite(expected).all()  # every sampled token lies in the kept set
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
            raw = reference_logprobs(rig.reference, prompt, completion, temperature=1.0, top_k=None, top_p=1.0)
            largest_change = max(largest_change, max_abs_diff(completion.logprobs, raw))
    processed = (temperature, top_k, top_p) != (1.0, None, 1.0)
    assert (largest_change > 0.1) == processed  # processed log-probs, not the raw ones


def test_a_seed_gives_each_response_its_own_generator(rig):
    config = sampling(n=3, temperature=1.0, seed=7)
    batch = rig.engine.generate(rig.prompts, config)
    assert batch == rig.engine.generate(rig.prompts, config)
    for i, prompt in enumerate(rig.prompts):  # prompt i of a batch is seeded s + i * n
        (alone,) = rig.engine.generate([prompt], dataclasses.replace(config, seed=7 + i * 3))
        assert [c.token_ids for c in alone] == [c.token_ids for c in batch[i]]
        # the log-probs only to rounding: a batch of other shapes sums in another order
        assert max_abs_diff(sum((c.logprobs for c in alone), []), sum((c.logprobs for c in batch[i]), [])) < TOLERANCE
    # the same prompt twice in a batch: different seeds, different samples
    twice = rig.engine.generate([rig.prompts[1]] * 2, config)
    assert {tuple(c.token_ids) for c in twice[0]}.isdisjoint(tuple(c.token_ids) for c in twice[1])
    unseeded = dataclasses.replace(config, seed=None)
    assert rig.engine.generate(rig.prompts, unseeded) != rig.engine.generate(rig.prompts, unseeded)


# --------------------------------------------------------------------------------------------
# How responses end.


def test_eos_ids_of_the_generation_config_end_a_response(rig, tmp_path):
    """Greedy with the tokenizer's eos (0) and another eos id ``x`` in generation_config.json
    stops where ``model.generate`` stops; like vLLM, ``x`` is reported as a stop token id."""
    from transformers import AutoModelForCausalLM

    prompt, unstopped, k = greedy_with_a_new_token(rig, 3)
    x = unstopped[k]
    model_dir = shutil.copytree(rig.model_dir, tmp_path / "model")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [EOS, x]}))
    engine = HfEngine(model_dir, ROLLOUT)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = hf_greedy(reference, prompt, 24)
    assert expected == unstopped[: k + 1]
    config = sampling(n=1, temperature=0.0, max_tokens=24, ignore_eos=False)
    ((completion,),) = engine.generate([prompt], config)
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == (expected, "stop", x)
    ((ignoring,),) = engine.generate([prompt], dataclasses.replace(config, ignore_eos=True))
    assert (ignoring.token_ids, ignoring.finish_reason) == (unstopped, "length")


def test_eos_ends_a_response_without_a_stop_reason(rig):
    out = rig.engine.generate([rig.prompts[0]], sampling(n=16, max_tokens=64, ignore_eos=False, seed=2))
    ended_by_eos = [c for c in out[0] if EOS in c.token_ids]
    assert ended_by_eos  # p(eos) ~ 1/V per token: most seeds give some
    for completion in out[0]:
        if completion in ended_by_eos:
            assert completion.token_ids.index(EOS) == len(completion.token_ids) - 1
            assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
        else:
            assert (completion.finish_reason, len(completion.token_ids)) == ("length", 64)


def test_stop_token_ids_end_a_response_with_the_stop_token(rig):
    prompt, unstopped, k = greedy_with_a_new_token(rig, 2)
    stop = unstopped[k]
    for max_tokens in (24, k + 1):  # a stop token on the last allowed step still stops
        config = sampling(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[stop])
        ((completion,),) = rig.engine.generate([prompt], config)
        assert completion.token_ids == unstopped[: k + 1]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_stop_strings_end_a_response_at_their_first_occurrence(rig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rig.model_dir)
    unstopped = greedy(rig, rig.prompts[2], max_tokens=60)
    text = tokenizer.decode(unstopped, skip_special_tokens=True)
    assert len(text) >= 4
    stop = text[2:4]
    texts = [tokenizer.decode(unstopped[:k], skip_special_tokens=True) for k in range(len(unstopped) + 1)]
    end = next(k for k, prefix in enumerate(texts) if stop in prefix)  # the first token completing it
    config = sampling(n=1, temperature=0.0, max_tokens=60, stop=["never in the text: \u00e9", stop])
    ((completion,),) = rig.engine.generate([rig.prompts[2]], config)
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == (unstopped[:end], "stop", stop)
    decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert decoded.endswith(stop) and decoded.find(stop) == len(decoded) - len(stop)
    ((capped,),) = rig.engine.generate([rig.prompts[2]], dataclasses.replace(config, max_tokens=end))
    assert (capped.finish_reason, capped.stop_reason) == ("stop", stop)  # the stop string wins over length


def test_the_text_of_the_first_min_tokens_tokens_cannot_complete_a_stop_string(rig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rig.model_dir)
    m = 8
    config = sampling(n=1, temperature=0.0, max_tokens=60, min_tokens=m)
    ((unstopped,),) = rig.engine.generate([rig.prompts[2]], config)
    texts = [tokenizer.decode(unstopped.token_ids[:k], skip_special_tokens=True) for k in range(61)]
    early = texts[m]  # a character of it that occurs again later stops the response there
    stop = next(c for c in early if c in texts[-1][len(early) :])
    end = next(k for k in range(m + 1, 61) if stop in texts[k][len(early) :])
    ((completion,),) = rig.engine.generate([rig.prompts[2]], dataclasses.replace(config, stop=[stop]))
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == (
        unstopped.token_ids[:end],
        "stop",
        stop,
    )


def test_min_tokens_masks_the_stop_tokens(rig):
    """Every special filler id stops a response (about 60 % of the mass), but not during the first
    3 tokens, where they and eos (even with ignore_eos, as in vLLM) are masked and the log-probs
    renormalised over the rest."""
    stop_ids = list(range(NUM_CHARACTER_IDS, rig.engine.vocab_size))
    config = sampling(n=8, max_tokens=8, min_tokens=3, stop_token_ids=stop_ids, seed=5)
    out = rig.engine.generate(rig.prompts, config)
    lengths = []
    for prompt, group in zip(rig.prompts, out):
        for completion in group:
            ids = completion.token_ids
            lengths.append(len(ids))
            assert not {EOS, *stop_ids} & set(ids[:3])
            if completion.finish_reason == "stop":
                assert ids[-1] in stop_ids and completion.stop_reason == ids[-1] and len(ids) > 3
            else:
                assert (completion.finish_reason, len(ids)) == ("length", 8)
            logits = hf_logits(rig.reference, prompt + ids)[len(prompt) - 1 : -1]
            masked = sampler_logprobs(logits[:3], 1.0, None, 1.0, banned=[EOS, *stop_ids])
            free = sampler_logprobs(logits[3:], 1.0, None, 1.0)
            expected = torch.cat([masked, free]).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
    assert 4 in lengths
    unmasked = rig.engine.generate(rig.prompts, dataclasses.replace(config, min_tokens=0))
    assert min(len(c.token_ids) for group in unmasked for c in group) < 4


def test_max_tokens_and_max_model_len_end_a_response_with_length(rig):
    for group in rig.engine.generate(rig.prompts, sampling(max_tokens=5)):
        assert [(len(c.token_ids), c.finish_reason, c.stop_reason) for c in group] == [(5, "length", None)] * 4
    engine = HfEngine(rig.model_dir, dataclasses.replace(ROLLOUT, max_model_len=16))
    assert engine.max_model_len == 16
    prompts = random_sequences(engine.vocab_size, [10, 15], seed=4)
    out = engine.generate(prompts, sampling(n=2, max_tokens=50))
    assert [[(len(c.token_ids), c.finish_reason) for c in group] for group in out] == [
        [(6, "length")] * 2,
        [(1, "length")] * 2,
    ]
    for call in (lambda: engine.generate([[1] * 16], sampling()), lambda: engine.score([[1] * 16])):
        with pytest.raises(ValueError, match=r"16 tokens, more than the engine allows \(15\)"):
            call()


@pytest.mark.parametrize(
    ("sequences", "error", "message"),
    [
        ([], ValueError, ": expected at least one sequence"),
        ([[1], []], ValueError, r"\[1\]: expected at least one"),
        ([[1, 10_000]], ValueError, r"\[0\]\[1\]: token id 10000 is outside"),
        ("ab", TypeError, ": expected a list"),
    ],
)
def test_bad_arguments_raise(rig, sequences, error, message):
    with pytest.raises(error, match="prompts" + message):
        rig.engine.generate(sequences, sampling())
    with pytest.raises(error, match="sequences" + message):
        rig.engine.score(sequences)
    with pytest.raises(TypeError, match="sampling: expected a SamplingConfig, got dict"):
        rig.engine.generate(rig.prompts, {"n": 2})
    with pytest.raises(ValueError, match=rf"sampling.stop_token_ids: \[{rig.engine.vocab_size}\] outside"):
        rig.engine.generate(rig.prompts, sampling(stop_token_ids=[3, rig.engine.vocab_size]))


# --------------------------------------------------------------------------------------------
# Weight updates.


def test_weight_updates_by_tensors_and_by_file(rig, tmp_path):
    from safetensors.torch import save_file

    engine = HfEngine(rig.model_dir, ROLLOUT, load_format="dummy")
    assert engine.weight_version is None
    expected = [hf_score(rig.reference, p) for p in rig.probes]
    assert max_abs_diff(sum(engine.score(rig.probes), []), sum(expected, [])) > 0.1  # random weights
    push(engine, [(n, t.double()) for n, t in rig.reference.state_dict().items()], "v1")  # any float dtype
    assert_scores_equal(engine.score(rig.probes), expected)
    assert engine.weight_version == "v1"

    other = hf_model(rig.name, seed=1)
    items = list(other.state_dict().items())
    engine.begin_weight_update()
    for i in range(2):
        save_file({n: t.contiguous() for n, t in items[i::2]}, tmp_path / f"bucket{i}.safetensors")
        engine.update_weights(path=tmp_path / f"bucket{i}.safetensors")
    engine.finish_weight_update("v2")
    assert_scores_equal(engine.score(rig.probes), [hf_score(other, p) for p in rig.probes])
    (group,) = engine.generate([rig.prompts[2]], sampling(n=2))  # generation uses them too
    for completion in group:
        expected = reference_logprobs(other, rig.prompts[2], completion, temperature=1.0, top_k=None, top_p=1.0)
        assert max_abs_diff(completion.logprobs, expected) < TOLERANCE
    assert engine.weight_version == "v2"


@pytest.mark.parametrize(
    ("named_tensors", "error", "message"),
    [
        ([("model.nope.weight", torch.zeros(2))], ValueError, "'model.nope.weight' is not a parameter of the model"),
        ([("model.norm.weight", torch.zeros(3))], ValueError, r"'model.norm.weight' has shape \[3\], the model's"),
        ([("model.norm.weight", torch.zeros(64, dtype=torch.long))], TypeError, "'model.norm.weight' has dtype"),
    ],
)
def test_a_bad_tensor_fails_the_update_and_disables_the_engine(rig, named_tensors, error, message):
    engine = HfEngine(rig.model_dir, ROLLOUT)
    engine.begin_weight_update()
    with pytest.raises(error, match="update_weights: " + message):
        engine.update_weights(named_tensors=named_tensors)
    with pytest.raises(RuntimeError, match="generate: a weight update failed .* shut it down"):
        engine.generate(rig.prompts, sampling())
    engine.shutdown()


def test_weight_update_protocol_is_enforced(rig):
    engine = HfEngine(rig.model_dir, ROLLOUT)
    assert_update_protocol_enforced(engine, rig.prompts, rig.probes, sampling())
    engine.finish_weight_update("v")  # an update that sent nothing keeps the weights (no level-2 sleep)
    assert_scores_equal(engine.score(rig.probes), [hf_score(rig.reference, p) for p in rig.probes])


def test_after_a_level_2_sleep_an_update_must_write_every_parameter(rig):
    other = hf_model(rig.name, seed=1)
    items = list(other.state_dict().items())
    engine = HfEngine(rig.model_dir, ROLLOUT)
    engine.sleep(level=1)
    engine.wake_up()
    push(engine, items[:2], "partial", buckets=1)  # allowed: the other weights were kept
    assert engine.weight_version == "partial"

    engine = HfEngine(rig.model_dir, ROLLOUT)
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    engine.begin_weight_update()
    engine.update_weights(named_tensors=items[3:])
    missing = ", ".join(sorted(name for name, _ in items[:3]))
    with pytest.raises(RuntimeError, match=rf"finish_weight_update: .*level 2.* 3 were not written: {missing}$"):
        engine.finish_weight_update("v")
    with pytest.raises(RuntimeError, match="score: a weight update failed"):
        engine.score(rig.probes)

    engine = HfEngine(rig.model_dir, ROLLOUT)
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    push(engine, items, "full")
    engine.wake_up(["kv_cache"])
    assert_scores_equal(engine.score(rig.probes), [hf_score(other, p) for p in rig.probes])


def test_tied_embeddings_stay_tied_through_updates(tmp_path):
    """tiny-llama ties the LM head to the embedding: ``lm_head.weight`` may be sent or not (skipped,
    as in vLLM), the head follows the embedding, and a full update need not send it."""
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config("tiny-llama"), tmp_path, seed=0)
    engine = HfEngine(model_dir, ROLLOUT)
    probes = random_sequences(engine.vocab_size, [3, 20], seed=2)
    first, second = hf_model("tiny-llama", seed=1), hf_model("tiny-llama", seed=2)
    assert "lm_head.weight" in first.state_dict()
    push(engine, list(first.state_dict().items()), "v1")
    assert_scores_equal(engine.score(probes), [hf_score(first, p) for p in probes])
    engine.sleep(level=2)
    engine.wake_up()
    push(engine, [(n, t) for n, t in second.state_dict().items() if n != "lm_head.weight"], "v2")
    assert_scores_equal(engine.score(probes), [hf_score(second, p) for p in probes])


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_the_cuda_sleep_path_frees_and_restores_the_parameters(name, tmp_path, monkeypatch):
    """The memory handling of sleep / wake_up, which runs on CUDA only, run on CPU: level 1 keeps
    the values, level 2 frees every parameter (tied ones included) until a full update."""
    from tools.make_tiny_model import save_tiny_hf_model

    model_dir = save_tiny_hf_model(load_model_config(name), tmp_path, seed=0)
    engine = HfEngine(model_dir, ROLLOUT)
    monkeypatch.setattr(engine, "_offloads", True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    probes = random_sequences(engine.vocab_size, [3, 20], seed=2)
    before = engine.score(probes)
    engine.sleep(level=1)
    engine.wake_up()
    assert engine.score(probes) == before
    engine.sleep(level=2)
    model = engine._model
    assert all(p.numel() == 0 for p in model.parameters())
    engine.wake_up(["weights"])
    assert all(p.numel() > 0 for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "tiny-llama")
    other = hf_model(name, seed=1)
    push(engine, list(other.state_dict().items()), "v1")
    engine.wake_up(["kv_cache"])
    assert_scores_equal(engine.score(probes), [hf_score(other, p) for p in probes])


# --------------------------------------------------------------------------------------------
# Sleep, shutdown, construction.


def test_sleep_and_wake_up_track_the_state_on_cpu(rig):
    engine = HfEngine(rig.model_dir, ROLLOUT)
    with pytest.raises(RuntimeError, match=r"wake_up: \['kv_cache', 'weights'\] not asleep"):
        engine.wake_up()
    with pytest.raises(ValueError, match="sleep: level must be 1 or 2"):
        engine.sleep(level=3)
    engine.sleep()
    for method, call in [
        ("generate", lambda: engine.generate(rig.prompts, sampling())),
        ("score", lambda: engine.score(rig.probes)),
        ("sleep", engine.sleep),
        ("begin_weight_update", engine.begin_weight_update),
    ]:
        with pytest.raises(RuntimeError, match=f"{method}: the engine is asleep"):
            call()
    with pytest.raises(ValueError, match=r"wake_up: unknown tags \['kv'\]"):
        engine.wake_up(["kv"])
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match=r"wake_up: \['weights'\] not asleep"):
        engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match=r"score: the engine is asleep \(kv_cache\)"):
        engine.score(rig.probes)
    push(engine, list(rig.reference.state_dict().items()), "v1")  # a weight update needs only the weights
    engine.wake_up(["kv_cache"])
    assert_scores_equal(engine.score(rig.probes), [hf_score(rig.reference, p) for p in rig.probes])


def test_shutdown_ends_the_engine(rig):
    engine = HfEngine(rig.model_dir, ROLLOUT)
    engine.shutdown()
    engine.shutdown()  # idempotent
    calls = {
        "generate": lambda: engine.generate(rig.prompts, sampling()),
        "score": lambda: engine.score(rig.probes),
        "begin_weight_update": engine.begin_weight_update,
        "update_weights": lambda: engine.update_weights(path="x"),
        "finish_weight_update": lambda: engine.finish_weight_update("v"),
        "sleep": engine.sleep,
        "wake_up": engine.wake_up,
    }
    for method, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{method}: the engine was shut down"):
            call()


def test_bad_construction_arguments_raise(rig, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2: HfEngine runs on one device"):
        HfEngine(rig.model_dir, dataclasses.replace(ROLLOUT, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="load_format: expected one of"):
        HfEngine(rig.model_dir, ROLLOUT, load_format="pt")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        HfEngine(tmp_path / "missing", ROLLOUT)
    with pytest.raises(TypeError, match="rollout: expected a RolloutConfig, got dict"):
        HfEngine(rig.model_dir, {})
