"""Math word problems from data files (``data.source: files``), scored by a final answer that
math-verify checks: the ``math`` and ``math_dapo`` rewards.

* ``math``: the final answer of the response (after its last ``</think>``): the last
  ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces), else "#### X", else the last "Answer: X"
  (DAPO's prompt asks for it), else "the answer is X", else the last number; checked against the
  gold answer(s) by math-verify (symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5``) in
  a small process pool (``tasks.math_verifier``; ``data.reward_workers`` processes), each sample at
  most ``data.reward_timeout_s`` seconds (a timeout scores 0 and is counted); past the deadline of
  ``data.reward_budget_s`` the answers not yet checked score 0 and count as ``unscored``. Score 1
  or 0, as rLLM's math reward.
* ``math_dapo``: the same check, scored +1 or -1 (DAPO's and RPG's ``math_dapo``).

The records' ``data.answer_key`` holds the gold answer (verl's ``reward_model.ground_truth``).
"""

from __future__ import annotations

import re

from megatron_empg.rollout.data import PromptExample
from megatron_empg.rollout.rewards import RewardLimits, RewardResult, WorkerReward, check_batch, gold_answers
from megatron_empg.tasks.math_verifier import MathVerifierPool
from megatron_empg.tasks.task import Task

_BOXED = re.compile(r"\\(?:boxed|fbox)")
_HASHES = re.compile(r"####\s*(.+)")
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)  # DAPO's prompt: "Answer: $Answer"
_ANSWER_IS = re.compile(r"answer is\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (nested braces; an
    escaped ``\\{`` does not count), or of ``\\boxed X`` up to the next "$" or line end; None if
    there is none or the last one is not closed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    if not rest.startswith("{"):
        if not rest.startswith(" "):
            return None
        content = rest.split("$", 1)[0].split("\n", 1)[0].strip()
        return content or None
    depth, i = 0, 0
    while i < len(rest):
        char = rest[i]
        if char == "\\":
            i += 2  # an escaped character (\{, \}, \\) or a command's first letter
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i].strip() or None
        i += 1
    return None


def _clean_inline_answer(text: str) -> str:
    """ "$\\frac{1}{2}$." -> "\\frac{1}{2}": drop surrounding spaces, a final period and math dollars."""
    return text.strip().rstrip(".").strip().strip("$").strip()


def extract_math_answer(response: str) -> str | None:
    """The final answer of a math response, or None: see the module docstring for the order of forms."""
    text = response.rsplit("</think>", 1)[-1]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_LINE, _ANSWER_IS):
        matches = pattern.findall(text)
        if matches and (answer := _clean_inline_answer(matches[-1])):
            return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _compact(text: str) -> str:
    return "".join(text.split()).strip("$")


class MathReward(WorkerReward):
    """The ``math`` reward (see the module docstring); a ``WorkerReward`` that owns a ``MathVerifierPool``
    of ``num_workers`` processes and ``timeout_s`` seconds a sample, or of what ``limits`` say.

    metrics: ``no_answer`` (nothing extracted), ``timeouts``, ``verify_errors`` (math-verify
    raised, or its worker died), with a deadline ``unscored`` (not checked by then: score 0, not
    ``incorrect_score``). An exact text match and no answer at all need no worker: always scored.
    """

    def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, incorrect_score: float = 0.0) -> None:
        self.pool = MathVerifierPool(num_workers=num_workers, timeout_s=timeout_s)
        self.incorrect_score = incorrect_score  # a correct answer scores 1

    def __call__(
        self, responses: list[str], examples: list[PromptExample], limits: RewardLimits | None = None
    ) -> RewardResult:
        check_batch(responses, examples)
        if limits is not None and (limits.workers, limits.timeout_s) != (self.pool.num_workers, self.pool.timeout_s):
            self.pool.close()
            self.pool = MathVerifierPool(num_workers=limits.workers, timeout_s=limits.timeout_s)
        deadline = None if limits is None else limits.deadline
        correct = [False] * len(responses)
        pending: list[int] = []  # samples that need math-verify
        tasks: list[tuple[list[str], str]] = []
        no_answer = 0
        for i, (response, example) in enumerate(zip(responses, examples)):
            prediction = extract_math_answer(response)
            golds = gold_answers(example.answer)
            if prediction is None:
                no_answer += 1
            elif any(_compact(prediction) == _compact(gold) for gold in golds):
                correct[i] = True  # the same text: no need to ask math-verify
            else:
                pending.append(i)
                tasks.append((golds, prediction))
        outcomes = self.pool.check(tasks, deadline=deadline)
        scores = [1.0 if c else self.incorrect_score for c in correct]
        for i, outcome in zip(pending, outcomes):
            correct[i] = outcome == "equal"
            scores[i] = 1.0 if correct[i] else 0.0 if outcome == "unscored" else self.incorrect_score
        metrics = {
            "no_answer": float(no_answer),
            "timeouts": float(outcomes.count("timeout")),
            "verify_errors": float(outcomes.count("error")),
        }
        if deadline is not None:
            metrics["unscored"] = float(outcomes.count("unscored"))
        return RewardResult(scores=scores, correct=correct, metrics=metrics)

    def close(self) -> None:
        self.pool.close()


TASK = Task("math", rewards={"math": MathReward(), "math_dapo": MathReward(incorrect_score=-1.0)})
