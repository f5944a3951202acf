"""What every reward is: responses and their examples' gold answers -> scores.

A reward has one signature, ``reward_fn(responses, examples) -> RewardResult``: ``responses[i]``
(text decoded without special tokens) answers ``examples[i]`` (the trainer repeats an example once
per sample). A ``WorkerReward`` (math-verify's, whose check of one answer has no bound but a
timeout) also takes ``RewardLimits``: its worker count, its per-sample timeout and the deadline of
the step's reward budget (``data.reward_*``); the others are linear in the text and score every
sample. The rewards themselves live with their tasks (``megatron_empg.tasks``), which name
them in ``tasks.registry.REWARDS``; this module holds what they share, and DAPO's overlong
penalty, which the trainer adds to any reward, and ``score_guarded``: a reward call that one bad
sample (an exception, a score that is not a finite number) does not stop. Standard library only.
"""

from __future__ import annotations

import math
import threading
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_empg.rollout.data import PromptExample


@dataclass(frozen=True)
class RewardResult:
    """Scores of a batch of responses.

    ``scores``: ``[N]`` floats, the reward of each response; ``correct``: ``[N]`` bools, whether it
    answered correctly; ``metrics``: counts and sums over the batch (e.g. ``no_answer``, ``timeouts``),
    so ranks can add them up.
    """

    scores: list[float]
    correct: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[list[str], list["PromptExample"]], RewardResult]


@dataclass(frozen=True)
class RewardLimits:
    """What a ``WorkerReward`` may spend on a batch: ``workers`` processes (``data.reward_workers``),
    at most ``timeout_s`` seconds a sample (``data.reward_timeout_s``; then it scores 0 and counts
    as a timeout), and nothing after ``deadline`` (``time.monotonic()`` seconds, None: no deadline;
    from ``data.reward_budget_s``): the samples not checked by then score 0 and count as ``unscored``."""

    workers: int
    timeout_s: float
    deadline: float | None = None


class WorkerReward(ABC):
    """A reward that checks answers in worker processes (``tasks.math``), called with the run's
    ``RewardLimits`` (None: its own defaults, no deadline); with a deadline its metrics count the
    ``unscored`` samples. ``close()`` stops its workers."""

    @abstractmethod
    def __call__(
        self, responses: list[str], examples: list[PromptExample], limits: RewardLimits | None = None
    ) -> RewardResult: ...

    @abstractmethod
    def close(self) -> None: ...


def check_batch(responses: Sequence[str], examples: Sequence[PromptExample]) -> None:
    """One str response per example, else a ``ValueError`` / ``TypeError`` naming the mismatch."""
    if len(responses) != len(examples):
        raise ValueError(f"reward: {len(responses)} responses for {len(examples)} examples; expected one each")
    for i, response in enumerate(responses):
        if not isinstance(response, str):
            raise TypeError(f"reward: responses[{i}] must be a str, got {type(response).__name__}")


def gold_answers(answer: str | list[str]) -> list[str]:
    """An example's answer as a list of acceptable gold answers."""
    return [answer] if isinstance(answer, str) else list(answer)


def overlong_penalty(length: int, *, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (<= 0): 0 up to ``max_length - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and below it beyond)."""
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)


class _TimedOut(Exception):
    """A reward call that ran past its timeout (its thread is abandoned)."""


def _call(reward: Callable, responses: list[str], examples: list, timeout_s: float | None) -> RewardResult:
    """``reward(responses, examples)``; with ``timeout_s``, in a daemon thread that is abandoned
    (``_TimedOut``) if it has not returned by then: Python cannot stop it, but the step goes on."""
    if timeout_s is None:
        return reward(responses, examples)
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", reward(responses, examples)))
        except BaseException as error:  # noqa: BLE001 (handed to the caller's thread)
            box.append(("error", error))

    thread = threading.Thread(target=run, name="empg-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not box:
        raise _TimedOut(f"ran past {timeout_s:g} s (data.reward_timeout_s)")
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def score_guarded(
    reward: Callable[[list[str], list[PromptExample]], RewardResult],
    responses: list[str],
    examples: list[PromptExample],
    timeout_s: float | None = None,
) -> tuple[RewardResult, str | None]:
    """``reward(responses, examples)``, where a bad sample scores 0 (incorrect) instead of stopping
    the run: if the call raises, each sample is scored alone and one whose call raises is bad; a
    score that is not a finite number is bad too. ``metrics["errors"]`` counts the bad samples (0
    if none: every rank has the key, whose sums are all-reduced). ``timeout_s`` (a reward that
    bounds no sample itself: not a ``WorkerReward``): the batch call, then each sample's, may take
    that long; a sample past it scores 0 and counts in ``metrics["timeouts"]`` (also always
    present). Returns the result and what to log of the first bad sample (its traceback; None:
    none was bad)."""
    first: str | None = None
    timeouts = 0
    try:
        result = _call(reward, responses, examples, timeout_s)
    except Exception:
        batch_error = traceback.format_exc()
        scores, correct, metrics = [], [], {}
        for i, (response, example) in enumerate(zip(responses, examples, strict=True)):
            try:
                one = _call(reward, [response], [example], timeout_s)
            except _TimedOut as error:
                first = first or f"reward: sample {i} of {len(responses)} {error}: scored 0"
                timeouts += 1
                scores.append(0.0)
                correct.append(False)
                continue
            except Exception:
                first = first or f"reward: sample {i} of {len(responses)} raised:\n{traceback.format_exc()}"
                scores.append(float("nan"))  # bad: 0 below
                correct.append(False)
                continue
            scores += one.scores
            correct += one.correct
            for key, value in one.metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value
        first = first or f"reward: the batch call raised, each sample alone did not:\n{batch_error}"
        result = RewardResult(scores, correct, metrics)
    errors = 0
    scores, correct = [], []
    for i, (score, right) in enumerate(zip(result.scores, result.correct, strict=True)):
        try:
            value = float(score)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            errors += 1
            first = first or f"reward: sample {i} of {len(responses)} scored {score!r}, not a finite number"
            value, right = 0.0, False
        scores.append(float(value))
        correct.append(bool(right))
    metrics = {**result.metrics, "errors": float(errors)}
    if timeout_s is not None:
        metrics["timeouts"] = metrics.get("timeouts", 0.0) + timeouts
    return RewardResult(scores, correct, metrics), first
