"""Search-R1's question answering: questions from data files (``data.source: files``, e.g. the
parquet files of ``tools/prepare_search_data.py``), answered in multi-turn search episodes when
the config sets ``rollout.search_agent`` (the agent, ``rollout.search_agent``, asks the retriever
of ``rollout.retriever``), and scored by the ``qa_em`` / ``qa_f1`` rewards.

The answer is the text of the response's last ``<answer>...</answer>`` (none: score 0), compared
with each gold answer after SQuAD normalization (lowercase, no punctuation, no articles, single
spaces): exact match (1/0) or token F1, the best over the gold answers (the records'
``data.answer_key``: a string or a list of them).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import RewardResult, check_batch, gold_answers
from megatron_empg.tasks.task import Task

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lowercase, drop punctuation, drop articles, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the normalized prediction equals any normalized gold answer."""
    normalized = normalize_answer(prediction)
    return any(normalized == normalize_answer(gold) for gold in golds)


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best SQuAD token F1 of ``prediction`` over ``golds``; an empty side scores 1 only against
    an empty side (SQuAD 2.0's rule)."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        expected = normalize_answer(gold).split()
        if not predicted or not expected:
            best = max(best, float(predicted == expected))
            continue
        num_same = sum((Counter(predicted) & Counter(expected)).values())
        if num_same:
            precision, recall = num_same / len(predicted), num_same / len(expected)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_tagged_answer(response: str) -> str | None:
    """The stripped text of the response's last ``<answer>...</answer>``, or None."""
    matches = _ANSWER_TAG.findall(response)
    return matches[-1].strip() if matches else None


def _qa_reward(responses: list[str], examples: list[PromptExample], score: Literal["em", "f1"]) -> RewardResult:
    check_batch(responses, examples)
    predictions = [extract_tagged_answer(response) for response in responses]
    ems, f1s = [], []
    for prediction, example in zip(predictions, examples):
        golds = gold_answers(example.answer)
        ems.append(prediction is not None and exact_match(prediction, golds))
        f1s.append(token_f1(prediction, golds) if prediction is not None else 0.0)
    metrics = {
        "no_answer": float(predictions.count(None)),
        "exact_match": float(sum(ems)),
        "f1": float(sum(f1s)),
    }
    scores = [float(em) for em in ems] if score == "em" else f1s
    return RewardResult(scores=scores, correct=ems, metrics=metrics)


def qa_em_reward(responses: list[str], examples: list[PromptExample]) -> RewardResult:
    """The ``qa_em`` reward: 1 if the tagged answer exactly matches a gold answer, else 0."""
    return _qa_reward(responses, examples, "em")


def qa_f1_reward(responses: list[str], examples: list[PromptExample]) -> RewardResult:
    """The ``qa_f1`` reward: the tagged answer's best token F1 (``correct``: exact match)."""
    return _qa_reward(responses, examples, "f1")


TASK = Task("search_qa", rewards={"qa_em": qa_em_reward, "qa_f1": qa_f1_reward})
