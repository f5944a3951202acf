"""The CPU demo's task: small synthetic arithmetic problems ("12+7=" -> "19") and the ``arithmetic`` reward.

Problem ``index`` of seed ``s`` is drawn from its own ``random.Random(f"arithmetic:{s}:{index}")``,
so any problem is regenerated from (seed, index) alone, in any order and on any rank: the stream is
infinite, global batch ``step`` holds problems ``[step * B, (step + 1) * B)``, and
``rollout.data.PromptBatches`` serves it with the same cursor as a file dataset. Each operand is
uniform in ``[0, 10**digits)``; the operator is uniform over ``ops``; "-" puts the larger operand
first, so answers are never negative. Prompts and answers are digits and "+-*=", all in the
character-level tokenizer's alphabet (``tools/make_tiny_model.py``).

The ``arithmetic`` reward: the response's first line, stripped, must be an integer equal to the
answer (compared as decimal text: a 5,000-digit response is wrong, not past Python's limit on
``int(str)``). Score 1 or 0. ``data.source: arithmetic`` (``DataConfig`` checks at load time that it comes
with this reward and no files) uses ``data.seed``, ``arithmetic_digits`` and ``arithmetic_ops``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from megatron_empg.config import DataConfig
from megatron_empg.rollout.data import PromptExample, PromptFormatter
from megatron_empg.rollout.rewards import RewardResult, check_batch, gold_answers
from megatron_empg.tasks.task import Task


@dataclass(frozen=True)
class ArithmeticProblem:
    """``left op right``, e.g. ``ArithmeticProblem(12, "+", 7)``: text "12+7=", answer 19."""

    left: int
    op: str
    right: int

    @property
    def text(self) -> str:
        return f"{self.left}{self.op}{self.right}="

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.left + self.right
        if self.op == "-":
            return self.left - self.right
        return self.left * self.right


def arithmetic_problem(seed: int, index: int, *, digits: int, ops: list[str]) -> ArithmeticProblem:
    """Problem ``index`` of the stream of ``seed``: operands of up to ``digits`` digits, an op of ``ops``."""
    rng = random.Random(f"arithmetic:{seed}:{index}")
    left, right = rng.randrange(10**digits), rng.randrange(10**digits)
    op = rng.choice(ops)
    if op == "-" and left < right:
        left, right = right, left
    return ArithmeticProblem(left, op, right)


class ArithmeticTask:
    """The infinite stream of arithmetic prompts of a ``DataConfig`` (a ``rollout.data.PromptSource``).

    Uses ``seed``, ``arithmetic_digits``, ``arithmetic_ops``, and renders prompts like a file dataset
    (``system_prompt``, ``apply_chat_template``); a prompt over ``max_prompt_tokens`` is an error.
    """

    def __init__(self, config: DataConfig, tokenizer: Any) -> None:
        self.config = config
        self.formatter = PromptFormatter(
            tokenizer,
            system_prompt=config.system_prompt,
            prompt_template=config.prompt_template,
            apply_chat_template=config.apply_chat_template,
        )

    def problem(self, index: int) -> ArithmeticProblem:
        return arithmetic_problem(
            self.config.seed, index, digits=self.config.arithmetic_digits, ops=self.config.arithmetic_ops
        )

    def example(self, index: int) -> PromptExample:
        """Problem ``index`` as a prompt: answer the decimal string, meta ``{"index", "problem"}``."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"ArithmeticTask.example: index must be an int >= 0, got {index!r}")
        problem = self.problem(index)
        [prompt_ids] = self.formatter.encode([self.formatter.render(problem.text)])
        if len(prompt_ids) > self.config.max_prompt_tokens:
            raise ValueError(
                f"arithmetic problem {index} ({problem.text!r}) has {len(prompt_ids)} prompt tokens, more than "
                f"data.max_prompt_tokens={self.config.max_prompt_tokens}"
            )
        return PromptExample(
            prompt_ids=prompt_ids, answer=str(problem.answer), meta={"index": index, "problem": problem.text}
        )

    def batch_indices(self, step: int, batch_size: int) -> list[int]:
        return list(range(step * batch_size, (step + 1) * batch_size))

    def fingerprint(self) -> dict[str, Any]:
        return {
            "source": "arithmetic",
            "seed": self.config.seed,
            "digits": self.config.arithmetic_digits,
            "ops": "".join(self.config.arithmetic_ops),
        }


_INTEGER = re.compile(r"-?\d+")


def canonical_integer(text: str) -> str | None:
    """``text`` if it is an integer, in its canonical decimal form ("019" -> "19", "-0" -> "0"), else None.

    Text, not ``int``: Python refuses ``int()`` of over 4,300 digits, and a response may have more."""
    if not _INTEGER.fullmatch(text):
        return None
    digits = text.lstrip("-").lstrip("0")
    return "-" + digits if digits and text.startswith("-") else digits or "0"


def parse_integer_response(response: str) -> str | None:
    """The integer a response states on its first line (surrounding spaces allowed), as
    ``canonical_integer`` text, or None."""
    return canonical_integer(response.split("\n", 1)[0].strip())


def arithmetic_reward(responses: list[str], examples: list[PromptExample]) -> RewardResult:
    """The ``arithmetic`` reward: 1 if the first line is the answer's integer, else 0.

    metrics: ``malformed`` (first line not an integer).
    """
    check_batch(responses, examples)
    values = [parse_integer_response(r) for r in responses]
    correct = []
    for i, (value, example) in enumerate(zip(values, examples)):
        golds = [canonical_integer(gold.strip()) for gold in gold_answers(example.answer)]
        if None in golds:
            raise ValueError(f"arithmetic reward: examples[{i}].answer must be an integer, got {example.answer!r}")
        correct.append(value is not None and value in golds)
    metrics = {"malformed": float(values.count(None))}
    return RewardResult(scores=[float(c) for c in correct], correct=correct, metrics=metrics)


TASK = Task("arithmetic", rewards={"arithmetic": arithmetic_reward}, source="arithmetic", build_source=ArithmeticTask)
