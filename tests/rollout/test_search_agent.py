"""Multi-turn search-agent rollouts (``megatron_empg.rollout.search_agent``) with a scripted policy:
an engine whose responses are a function of the decoded context, stopping on stop strings and
``max_tokens`` as vLLM does, against the real retriever served on loopback over
``tests/data/search_corpus.jsonl``. Checks the exact token layout of episodes (generated tokens,
Search-R1's observations, masks, sampler log-probs), the turn logic, batching over live episodes,
the length limits, the EM/F1 reward of the answers and a retriever outage."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest

from megatron_empg.config import SamplingConfig, SearchAgentConfig
from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.engine import Completion
from megatron_empg.rollout.retriever.client import RetrieverClient, RetrieverUnavailable
from megatron_empg.rollout.search_agent import INVALID_ACTION, Episode, SearchAgent
from megatron_empg.tasks.search_qa import qa_em_reward, qa_f1_reward
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches
from tests.dist import free_port
from tests.rollout.retriever_service import serve_retriever
from tools.make_tiny_model import char_tokenizer

SEARCH_THEN_ANSWER = "<think>I need to look it up.</think>\n<search>capital of France</search> and more text"
ANSWER = "<answer>Paris</answer> trailing text"
PARIS_DOC = 'Doc 1(Title: "Paris") Paris is the capital and largest city of France, on the river Seine.\n'


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(128)


@pytest.fixture(scope="module")
def retriever_url(tmp_path_factory):
    with serve_retriever(tmp_path_factory.mktemp("search_agent")) as url:
        yield url


class ScriptedEngine:
    """A ``RolloutEngine``'s ``generate`` for a scripted policy: ``policy(context text)`` is the text
    the model would write. As vLLM, a response ends at the first stop string (included), else at
    ``max_tokens``, else with eos. Log-probs are ``-0.01 * (k + 1)`` for the k-th token of a call's
    response. ``calls`` records the number of prompts and the sampling of each call, ``seeds`` the
    request seeds of each call."""

    def __init__(self, tokenizer, policy: Callable[[str], str]) -> None:
        self.tokenizer, self.policy = tokenizer, policy
        self.calls: list[tuple[int, SamplingConfig]] = []
        self.seeds: list[list[int] | None] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *, seeds: Sequence[int] | None = None
    ) -> list[list[Completion]]:
        assert sampling.n == 1
        self.calls.append((len(prompts), sampling))
        self.seeds.append(None if seeds is None else list(seeds))
        out = []
        for prompt in prompts:
            text = self.policy(self.tokenizer.decode(prompt))
            ends = [(text.index(s) + len(s), s) for s in sampling.stop if s in text]
            stop_end, stop_string = min(ends) if ends else (None, None)
            if stop_end is not None and stop_end <= sampling.max_tokens:
                ids, finish, reason = self._encode(text[:stop_end]), "stop", stop_string
            else:
                ids = self._encode(text) + [self.tokenizer.eos_token_id]
                finish, reason = ("length", None) if len(ids) > sampling.max_tokens else ("stop", None)
                ids = ids[: sampling.max_tokens]
            out.append([Completion(ids, [-0.01 * (k + 1) for k in range(len(ids))], finish, reason)])
        return out

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def searches_then_answers(context: str) -> str:
    return ANSWER if "</information>" in context else SEARCH_THEN_ANSWER


def make_agent(tokenizer, url: str, *, max_length: int = 2000, **settings) -> SearchAgent:
    config = SearchAgentConfig(retriever_url=url, **{"topk": 3, "max_turns": 4, "max_obs_tokens": 500, **settings})
    client = RetrieverClient(url, timeout_s=config.timeout_s, retries=config.retries, backoff_s=0.05)
    return SearchAgent(config, tokenizer, client, max_length=max_length)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_parts(tokenizer, episode: Episode) -> list[tuple[bool, str]]:
    """The response as (generated?, text) runs."""
    parts: list[tuple[bool, list[int]]] = []
    for token, generated in zip(episode.response_ids, episode.response_mask):
        if parts and parts[-1][0] == generated:
            parts[-1][1].append(token)
        else:
            parts.append((generated, [token]))
    return [(generated, tokenizer.decode(ids)) for generated, ids in parts]


def test_search_then_answer_exact_episode(tokenizer, retriever_url):
    prompt = encode(tokenizer, "Question: What is the capital of France?\n")
    engine = ScriptedEngine(tokenizer, searches_then_answers)
    agent = make_agent(tokenizer, retriever_url)
    [[episode, second]] = agent.rollout(engine, [prompt], SamplingConfig(n=2, max_tokens=100, seed=7))

    hits = RetrieverClient(retriever_url).search(["capital of France"], 3)[0]
    assert hits[0].id == "0"  # the Paris passage
    docs = "".join(
        f"Doc {i}(Title: {h.contents.split(chr(10))[0]}) {h.contents.split(chr(10), 1)[1]}\n"
        for i, h in enumerate(hits, start=1)
    )
    assert docs.startswith(PARIS_DOC)
    first_turn = SEARCH_THEN_ANSWER[: SEARCH_THEN_ANSWER.index("</search>") + len("</search>")]
    assert decode_parts(tokenizer, episode) == [
        (True, first_turn),
        (False, f"\n\n<information>{docs.strip()}</information>\n\n"),
        (True, "<answer>Paris</answer>"),
    ]
    assert episode.response_ids[: len(encode(tokenizer, first_turn))] == encode(tokenizer, first_turn)
    generated = [i for i, m in enumerate(episode.response_mask) if m]
    first, last = len(first_turn), len("<answer>Paris</answer>")
    assert [episode.sampler_logprobs[i] for i in generated] == pytest.approx(
        [-0.01 * (k + 1) for k in range(first)] + [-0.01 * (k + 1) for k in range(last)]
    )
    assert all(episode.sampler_logprobs[i] == 0.0 for i, m in enumerate(episode.response_mask) if not m)
    assert (episode.turns, episode.searches, episode.answered, episode.finish_reason) == (2, 1, True, "stop")
    assert episode.queries == ["capital of France"]
    assert episode.stats() == {
        "turns": 2.0,
        "searches": 1.0,
        "answered": 1.0,
        "invalid_actions": 0.0,
        "observation_tokens": float(len(episode.response_mask) - sum(episode.response_mask)),
    }
    assert second.response_ids == episode.response_ids  # the scripted policy is deterministic

    # Two turns, each one generate call over both live episodes; episode j's turn t: seed s + j * T + t.
    turns = agent.turns_per_episode
    assert [(size, s.n, s.max_tokens) for size, s in engine.calls] == [(2, 1, 100), (2, 1, 100)]
    assert engine.seeds == [[7, 7 + turns], [8, 8 + turns]]
    assert engine.calls[0][1].stop == ["</search>", "</answer>"]


def test_reward_reads_only_the_generated_text(tokenizer, retriever_url):
    """EM and F1 of the answer against the gold answers; a passage's text never counts as an answer."""
    prompt = encode(tokenizer, "Q?\n")
    agent = make_agent(tokenizer, retriever_url)
    right = agent.rollout(ScriptedEngine(tokenizer, searches_then_answers), [prompt], SamplingConfig(n=1))[0][0]
    wrong = agent.rollout(
        ScriptedEngine(
            tokenizer, lambda c: "<answer>the Lyon city</answer>" if "</information>" in c else SEARCH_THEN_ANSWER
        ),
        [prompt],
        SamplingConfig(n=1),
    )[0][0]
    samples = [
        Sample(prompt, e.response_ids, e.sampler_logprobs, e.finish_reason, group=0, response_mask=e.response_mask)
        for e in (right, wrong)
    ]
    texts = [tokenizer.decode(s.generated_ids) for s in samples]
    assert "<information>" not in texts[0] and texts[0].endswith("<answer>Paris</answer>")
    examples = [PromptExample(prompt, ["Paris", "City of Light"], {})] * 2
    em, f1 = qa_em_reward(texts, examples), qa_f1_reward(texts, examples)
    assert em.scores == [1.0, 0.0] and em.correct == [True, False]
    # "lyon city" vs "city of light": 1 common token, precision 1/2, recall 1/3
    assert f1.scores == [1.0, pytest.approx(0.4)]
    f1_lyon = qa_f1_reward(texts[1:], [PromptExample(prompt, ["Lyon France"], {})])
    assert f1_lyon.scores == [pytest.approx(0.5)]  # "lyon city" vs "lyon france": precision = recall = 1/2


def test_live_episodes_are_batched_per_turn(tokenizer, retriever_url):
    """One generate call per turn over the live episodes only: prompt A answers at once, prompt B
    searches twice then answers."""

    def policy(context: str) -> str:
        if context.startswith("A"):
            return ANSWER
        return ANSWER if context.count("</information>") == 2 else SEARCH_THEN_ANSWER

    engine = ScriptedEngine(tokenizer, policy)
    agent = make_agent(tokenizer, retriever_url)
    episodes = agent.rollout(
        engine, [encode(tokenizer, "A: q\n"), encode(tokenizer, "B: q\n")], SamplingConfig(n=2, seed=0)
    )
    assert [size for size, _ in engine.calls] == [4, 2, 2]
    assert [e.turns for group in episodes for e in group] == [1, 1, 3, 3]
    assert [e.searches for group in episodes for e in group] == [0, 0, 2, 2]
    assert all(e.answered and e.finish_reason == "stop" for group in episodes for e in group)
    # Episode j's seed at turn t is j * T + t: B's episodes (2, 3) keep theirs when A's have ended.
    t = agent.turns_per_episode
    assert engine.seeds == [[0, t, 2 * t, 3 * t], [2 * t + 1, 3 * t + 1], [2 * t + 2, 3 * t + 2]]


def test_episodes_do_not_depend_on_the_other_prompts(tokenizer, retriever_url):
    """Prompt B alone, its seed offset by A's episodes, draws the seeds it draws beside A: what lets
    engines split a step's prompts."""
    engine = ScriptedEngine(tokenizer, lambda c: ANSWER if c.startswith("A") else SEARCH_THEN_ANSWER)
    agent = make_agent(tokenizer, retriever_url)
    both = agent.rollout(
        engine, [encode(tokenizer, "A: q\n"), encode(tokenizer, "B: q\n")], SamplingConfig(n=2, seed=5)
    )
    together = [seed for call in engine.seeds for seed in call if seed >= 5 + 2 * agent.turns_per_episode]
    engine.seeds.clear()
    alone = agent.rollout(
        engine, [encode(tokenizer, "B: q\n")], SamplingConfig(n=2, seed=5 + 2 * agent.turns_per_episode)
    )
    assert [seed for call in engine.seeds for seed in call] == together
    assert [e.trajectory() for e in alone[0]] == [e.trajectory() for e in both[1]]


def test_the_final_turn_cannot_search(tokenizer, retriever_url):
    engine = ScriptedEngine(tokenizer, lambda context: SEARCH_THEN_ANSWER)
    [[episode]] = make_agent(tokenizer, retriever_url, max_turns=2).rollout(
        engine, [encode(tokenizer, "Q\n")], SamplingConfig(n=1)
    )
    assert (episode.turns, episode.searches, episode.answered) == (3, 2, False)
    assert decode_parts(tokenizer, episode)[-1] == (
        True,
        SEARCH_THEN_ANSWER[: SEARCH_THEN_ANSWER.index("</search>") + 9],
    )
    assert episode.finish_reason == "stop"


def test_max_turns_zero_answers_without_searching(tokenizer, retriever_url):
    engine = ScriptedEngine(tokenizer, searches_then_answers)
    [[episode]] = make_agent(tokenizer, retriever_url, max_turns=0).rollout(
        engine, [encode(tokenizer, "Q\n")], SamplingConfig(n=1)
    )
    assert (episode.turns, episode.searches, len(engine.calls)) == (1, 0, 1)
    assert all(episode.response_mask)


def test_invalid_action_gets_search_r1s_message_then_continues(tokenizer, retriever_url):
    """A turn that reaches its token limit without a closed tag: the invalid-action message (masked)."""

    def policy(context: str) -> str:
        return ANSWER if "Let's try again." in context else "I will think about this for a very long time"

    engine = ScriptedEngine(tokenizer, policy)
    [[episode]] = make_agent(tokenizer, retriever_url).rollout(
        engine, [encode(tokenizer, "Q\n")], SamplingConfig(n=1, max_tokens=24)
    )
    assert decode_parts(tokenizer, episode) == [
        (True, "I will think about this "),
        (False, INVALID_ACTION),
        (True, "<answer>Paris</answer>"),
    ]
    assert (episode.invalid_actions, episode.turns, episode.answered) == (1, 2, True)


def test_eos_without_action_ends_the_episode(tokenizer, retriever_url):
    engine = ScriptedEngine(tokenizer, lambda context: "Paris.")
    [[episode]] = make_agent(tokenizer, retriever_url).rollout(engine, [encode(tokenizer, "Q\n")], SamplingConfig(n=1))
    assert tokenizer.decode(episode.response_ids) == "Paris.<|endoftext|>"
    assert (episode.turns, episode.answered, episode.finish_reason) == (1, False, "stop")


def test_observations_are_cut_to_max_obs_tokens_with_their_tags(tokenizer, retriever_url):
    engine = ScriptedEngine(tokenizer, searches_then_answers)
    [[episode]] = make_agent(tokenizer, retriever_url, max_obs_tokens=60).rollout(
        engine, [encode(tokenizer, "Q\n")], SamplingConfig(n=1)
    )
    observation = decode_parts(tokenizer, episode)[1]
    # the tags take 15 + 16 tokens of the 60
    assert observation == (False, "\n\n<information>" + PARIS_DOC[: 60 - 31] + "</information>\n\n")
    assert len(encode(tokenizer, observation[1])) == 60


def test_episode_length_is_bounded_by_max_length(tokenizer, retriever_url):
    prompt = encode(tokenizer, "Q\n")
    engine = ScriptedEngine(tokenizer, searches_then_answers)
    # room for the first turn (60 tokens) and a cut observation-free second turn: the observation
    # (~300 tokens) does not fit, so the episode ends when it would be appended
    [[episode]] = make_agent(tokenizer, retriever_url, max_length=200).rollout(engine, [prompt], SamplingConfig(n=1))
    assert episode.finish_reason == "length" and episode.searches == 1 and all(episode.response_mask)
    # a cut generation: the response is filled up to max_length exactly
    [[cut]] = make_agent(tokenizer, retriever_url, max_length=30).rollout(engine, [prompt], SamplingConfig(n=1))
    assert (cut.length, cut.finish_reason, cut.turns) == (30, "length", 1)
    assert [s.max_tokens for _, s in engine.calls[-1:]] == [28]


def test_a_retriever_outage_fails_the_rollout(tokenizer):
    url = f"http://127.0.0.1:{free_port()}"
    agent = make_agent(tokenizer, url, retries=1, timeout_s=1.0)
    with pytest.raises(RetrieverUnavailable, match=f"retriever at {url}/retrieve unavailable after 2 attempt"):
        agent.rollout(ScriptedEngine(tokenizer, searches_then_answers), [encode(tokenizer, "Q\n")], SamplingConfig(n=1))


def test_pack_puts_the_loss_mask_on_generated_tokens_only(tokenizer, retriever_url):
    prompt = encode(tokenizer, "Question: capital of France?\n")
    [[episode]] = make_agent(tokenizer, retriever_url).rollout(
        ScriptedEngine(tokenizer, searches_then_answers), [prompt], SamplingConfig(n=1)
    )
    sample = Sample(
        prompt,
        episode.response_ids,
        episode.sampler_logprobs,
        episode.finish_reason,
        group=0,
        response_mask=episode.response_mask,
    )
    (batch,) = micro_batches([sample], [1.0], MicroBatchPlan(packing=False))
    p = len(prompt)
    # position p - 1 + j predicts response token j
    assert batch.loss_mask[0, p - 1 : p - 1 + len(episode.response_ids)].tolist() == episode.response_mask
    assert int(batch.loss_mask.sum()) == sum(episode.response_mask)
    targets = batch.target_ids[0][batch.loss_mask[0]].tolist()
    assert targets == sample.generated_ids
    assert batch.sampler_logprobs[0][~batch.loss_mask[0]].abs().sum() == 0
    with pytest.raises(ValueError, match="response_mask has 3 entries"):
        micro_batches([dataclasses.replace(sample, response_mask=[True] * 3)], [1.0], MicroBatchPlan())


def test_max_obs_tokens_must_leave_room_for_passages(tokenizer):
    with pytest.raises(ValueError, match="max_obs_tokens=31 leaves no room"):
        make_agent(tokenizer, "http://127.0.0.1:1", max_obs_tokens=31)
