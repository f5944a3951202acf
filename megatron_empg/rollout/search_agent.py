"""Multi-turn search-agent rollouts (Search-R1's protocol) on any ``RolloutEngine``.

An episode is a prompt and the turns that follow it. In each turn the policy generates until it
closes a tag (``</search>`` or ``</answer>``, stop strings of the engine), eos, or the turn's token
limit (``rollout.sampling.max_tokens``); then the environment reacts:

* ``<answer>...</answer>``, eos (or a stop string of ``rollout.sampling.stop``): the episode ends.
* ``<search>query</search>`` in one of the first ``max_turns`` turns: the retriever's ``topk``
  passages are appended as ``\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n`` (Search-R1's
  format, the passages cut to ``max_obs_tokens`` tokens with the tags) and the policy continues.
* anything else (the turn's token limit without a closed tag, an empty query): Search-R1's
  "My previous action is invalid..." message is appended and the policy continues.
* after turn ``max_turns`` (0-based: the ``max_turns + 1``-th turn) the episode ends whatever the
  policy wrote: the final turn may answer but not search.
* an episode whose next turn would have no room within ``max_length`` tokens (prompt and response)
  ends with ``finish_reason="length"``; so does one cut there.

Token in, token out: the engine continues the exact token ids of the episode so far (observations
are tokenized on their own and appended), so the trainer scores the very sequence that was
sampled, with no re-tokenization. Each turn is one ``engine.generate`` call over all live
episodes, and each turn's searches are one retriever request. ``Episode.response_mask`` is True
on the tokens the policy generated and False on observation tokens: the trainer's loss mask (no
loss, no KL, no entropy on retrieved text).

Pure Python over the engine protocol and a retriever with ``search(queries, topk)``
(``rollout.retriever.client.RetrieverClient``); a retriever outage raises its ``RetrieverUnavailable``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Protocol

from megatron_empg.config import SamplingConfig, SearchAgentConfig
from megatron_empg.rollout.engine import Completion, RolloutEngine
from megatron_empg.rollout.retriever.client import Passage
from megatron_empg.rollout.trajectory import Trajectory

SEARCH_STOP = "</search>"
ANSWER_STOP = "</answer>"
# Search-R1's (search_r1/llm_agent/generation.py) action pattern and invalid-action message.
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
INVALID_ACTION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and "
    "</answer>. Let's try again.\n"
)
INFORMATION_OPEN = "\n\n<information>"
INFORMATION_CLOSE = "</information>\n\n"


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Passage]]: ...


@dataclasses.dataclass
class Episode:
    """One multi-turn response to a prompt.

    ``response_ids``: ``[T]`` ints after the prompt, generated and observation tokens in order;
    ``sampler_logprobs``: ``[T]`` floats, the engine's log-prob of each generated token, 0.0 on
    observation tokens; ``response_mask``: ``[T]`` bools, True where the policy generated the
    token. ``finish_reason``: ``"stop"`` or ``"length"`` (see the module docstring).
    """

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    sampler_logprobs: list[float] = dataclasses.field(default_factory=list)
    response_mask: list[bool] = dataclasses.field(default_factory=list)
    finish_reason: str = "stop"
    done: bool = False
    turns: int = 0
    invalid_actions: int = 0
    answered: bool = False
    queries: list[str] = dataclasses.field(default_factory=list)  # one per search, in order

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def searches(self) -> int:
        return len(self.queries)

    def append_generated(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        self.response_ids.extend(token_ids)
        self.sampler_logprobs.extend(logprobs)
        self.response_mask.extend([True] * len(token_ids))

    def append_observation(self, token_ids: Sequence[int]) -> None:
        self.response_ids.extend(token_ids)
        self.sampler_logprobs.extend([0.0] * len(token_ids))
        self.response_mask.extend([False] * len(token_ids))

    def end(self, finish_reason: str) -> None:
        self.done, self.finish_reason = True, finish_reason

    def trajectory(self) -> Trajectory:
        return Trajectory(
            self.response_ids, self.sampler_logprobs, self.finish_reason, self.response_mask, self.stats()
        )

    def stats(self) -> dict[str, float]:
        """Per-episode counts for the step's metrics (summed over samples, then averaged)."""
        observed = len(self.response_mask) - sum(self.response_mask)
        return {
            "turns": float(self.turns),
            "searches": float(self.searches),
            "answered": float(self.answered),
            "invalid_actions": float(self.invalid_actions),
            "observation_tokens": float(observed),
        }


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's ``_passages2string``: ``"Doc i(Title: <first line>) <rest>\\n"`` per passage."""
    lines = []
    for i, passage in enumerate(passages, start=1):
        title, _, text = passage.contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


class SearchAgent:
    """Runs episodes of ``config`` against ``retriever`` (see the module docstring).

    ``tokenizer``: the policy's (``__call__`` and ``decode`` of ``transformers``). ``max_length``:
    the most tokens of an episode, prompt included (``min(train.max_seq_len, engine max_model_len)``).
    """

    def __init__(self, config: SearchAgentConfig, tokenizer: Any, retriever: Retriever, *, max_length: int) -> None:
        self.config, self.tokenizer, self.retriever, self.max_length = config, tokenizer, retriever, max_length
        self._invalid_ids = self._encode(INVALID_ACTION)
        self._open_ids, self._close_ids = self._encode(INFORMATION_OPEN), self._encode(INFORMATION_CLOSE)
        if len(self._open_ids) + len(self._close_ids) >= config.max_obs_tokens:
            raise ValueError(
                f"rollout.search_agent.max_obs_tokens={config.max_obs_tokens} leaves no room for passages between "
                f"the {len(self._open_ids) + len(self._close_ids)} tokens of the <information> tags"
            )

    @property
    def turns_per_episode(self) -> int:
        """The most ``generate`` calls an episode takes (``SearchAgentConfig.turns_per_episode``)."""
        return self.config.turns_per_episode

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def rollout(
        self, engine: RolloutEngine, prompts: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[list[Episode]]:
        """``sampling.n`` episodes per prompt: ``[P][n]``, in prompt and sample order.

        ``sampling.seed`` s (or None): episode ``j`` (``i * n + k``: prompt i, sample k) draws turn t
        from seed ``s + j * turns_per_episode + t``, whichever episodes are still live, so the seeds
        of a call are ``[s, s + P * n * turns_per_episode)`` and a prompt's episodes do not depend
        on the other prompts of the call: splitting the prompts over engines, with ``s`` offset by
        the first prompt's ``i * n * turns_per_episode``, gives the same episodes.
        """
        episodes = [Episode(list(prompt)) for prompt in prompts for _ in range(sampling.n)]
        for episode in episodes:  # later turns end an episode whenever no room is left (_take_turn, _observe)
            if episode.length >= self.max_length:
                episode.end("length")
        stop = list(dict.fromkeys([*sampling.stop, SEARCH_STOP, ANSWER_STOP]))
        turns = self.turns_per_episode
        for turn in range(turns):
            live = [j for j, e in enumerate(episodes) if not e.done]
            if not live:
                break
            turn_sampling = dataclasses.replace(
                sampling,
                n=1,
                stop=stop,
                seed=None,
                max_tokens=min(sampling.max_tokens, max(self.max_length - episodes[j].length for j in live)),
            )
            seeds = None if sampling.seed is None else [sampling.seed + j * turns + turn for j in live]
            live = [episodes[j] for j in live]
            completions = engine.generate([e.prompt_ids + e.response_ids for e in live], turn_sampling, seeds=seeds)
            searching: list[tuple[Episode, str]] = []
            for episode, [completion] in zip(live, completions):
                query = self._take_turn(episode, completion, final=turn == self.config.max_turns)
                if query is not None:
                    searching.append((episode, query))
            if searching:
                results = self.retriever.search([q for _, q in searching], self.config.topk)
                for (episode, query), passages in zip(searching, results):
                    episode.queries.append(query)
                    self._observe(episode, self._information_ids(passages))
        return [episodes[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def _take_turn(self, episode: Episode, completion: Completion, *, final: bool) -> str | None:
        """Append the turn's tokens; end the episode or return its search query (None: no search)."""
        room = self.max_length - episode.length
        token_ids, logprobs = completion.token_ids[:room], completion.logprobs[:room]
        episode.append_generated(token_ids, logprobs)
        episode.turns += 1
        if len(completion.token_ids) > room:
            episode.end("length")
            return None
        action = _ACTION.search(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        if action is not None and action.group(1) == "answer":
            episode.answered = True
            episode.end("stop")
            return None
        if completion.finish_reason == "stop" and completion.stop_reason not in (SEARCH_STOP, ANSWER_STOP):
            episode.end("stop")  # eos, a stop token or a stop string of rollout.sampling.stop
            return None
        if final:
            episode.end(completion.finish_reason)
            return None
        if action is not None and action.group(2).strip():
            return action.group(2).strip()
        episode.invalid_actions += 1
        self._observe(episode, self._invalid_ids)
        return None

    def _information_ids(self, passages: Sequence[Passage]) -> list[int]:
        room = self.config.max_obs_tokens - len(self._open_ids) - len(self._close_ids)
        return self._open_ids + self._encode(format_passages(passages).strip())[:room] + self._close_ids

    def _observe(self, episode: Episode, token_ids: list[int]) -> None:
        """Append an observation, or end the episode when no token could be generated after it."""
        if episode.length + len(token_ids) >= self.max_length:
            episode.end("length")
        else:
            episode.append_observation(token_ids)
