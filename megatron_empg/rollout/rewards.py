"""Rewards: responses and their examples' gold answers -> scores.

Every reward has one signature, ``reward_fn(responses, examples) -> RewardResult``: ``responses[i]``
(text decoded without special tokens) answers ``examples[i]`` (the trainer repeats an example once
per sample). ``REWARDS`` names them (= ``config.REWARD_NAMES``):

* ``math``: the final answer of the response (after its last ``</think>``): the last
  ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces), else "#### X", else the last "Answer: X"
  (DAPO's prompt asks for it), else "the answer is X", else the last number; checked against the
  gold answer(s) by math-verify (symbolic and numeric equivalence: ``\\frac{1}{2}`` = ``0.5``) in
  a small process pool, each sample at most ``timeout_s`` seconds (a timeout scores 0 and is
  counted). Score 1 or 0, as rLLM's math reward.
* ``math_dapo``: the same check, scored +1 or -1 (DAPO's and RPG's ``math_dapo``).
* ``qa_em`` / ``qa_f1``: Search-R1's QA reward: the answer is the text of the response's last
  ``<answer>...</answer>`` (none: score 0), compared with each gold answer after SQuAD normalization
  (lowercase, no punctuation, no articles, single spaces); exact match (1/0) or token F1, the best
  over the gold answers.
* ``arithmetic``: ``rollout.tasks``' problems: the response's first line, stripped, must be an
  integer equal to the answer. Score 1 or 0.

``RewardResult.metrics`` holds counts and sums over the batch, so ranks can add them up.
math-verify is imported only inside the worker processes; this module needs only the standard library.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import select
import string
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from megatron_empg.rollout.data import PromptExample


@dataclass(frozen=True)
class RewardResult:
    """Scores of a batch of responses.

    ``scores``: ``[N]`` floats, the reward of each response; ``correct``: ``[N]`` bools, whether it
    answered correctly; ``metrics``: counts and sums over the batch (e.g. ``no_answer``, ``timeouts``).
    """

    scores: list[float]
    correct: list[bool]
    metrics: dict[str, float] = field(default_factory=dict)


RewardFn = Callable[[list[str], list["PromptExample"]], RewardResult]


def _check_batch(responses: Sequence[str], examples: Sequence[PromptExample]) -> None:
    if len(responses) != len(examples):
        raise ValueError(f"reward: {len(responses)} responses for {len(examples)} examples; expected one each")
    for i, response in enumerate(responses):
        if not isinstance(response, str):
            raise TypeError(f"reward: responses[{i}] must be a str, got {type(response).__name__}")


def gold_answers(answer: str | list[str]) -> list[str]:
    """An example's answer as a list of acceptable gold answers."""
    return [answer] if isinstance(answer, str) else list(answer)


# --------------------------------------------------------------------------------------------
# Math: answer extraction.

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


# --------------------------------------------------------------------------------------------
# Math: math-verify in worker processes.

VerifyOutcome = Literal["equal", "different", "timeout", "error"]
_READY = "ready"
_WORKER_MODULE = "megatron_empg.rollout.rewards"  # `python -m` of this file serves math-verify
_REPOSITORY_ROOT = str(Path(__file__).resolve().parents[2])


def _as_boxed(answer: str) -> str:
    """An extracted or gold answer as ``\\boxed{...}``, the form math-verify's LaTeX extraction reads
    best (bare ``\\frac12`` or ``\\sqrt{2}/2`` are not extracted); math delimiters are dropped."""
    text = answer.strip()
    if "\\boxed" in text:
        return text
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : len(text) - len(right)].strip()
            break
    return "\\boxed{" + text + "}"


def _serve_math_verify() -> None:
    """The worker loop (``python -m megatron_empg.rollout.rewards``), one JSON value per line:
    writes "ready" (or an error message), then reads ``[golds, prediction]`` and answers an outcome
    until stdin closes. Its stdout is reserved for the protocol (prints go to stderr).

    math-verify's own timeouts (``signal.alarm``) are off: the parent kills a worker that overruns.
    SIGUSR1 is ignored. On Linux the worker is also killed when the parent dies (``PR_SET_PDEATHSIG``), so a crashed
    trainer leaves no worker stuck on an expression.
    """
    import signal

    # torchrun and Slurm send SIGUSR1 (pre-emption: "checkpoint after this step") to the whole process
    # group; the trainer finishes the step in flight, which needs its verifiers alive
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(message: str) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    try:
        from math_verify import parse, verify
    except ImportError as error:
        send(f"the math reward needs the math-verify package (pip install math-verify): {error}")
        return
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warnings
    send(_READY)
    for line in sys.stdin:
        golds, prediction = json.loads(line)
        try:
            target = parse(_as_boxed(prediction), parsing_timeout=None)
            equal = bool(target) and any(
                verify(parse(_as_boxed(gold), parsing_timeout=None), target, timeout_seconds=None) for gold in golds
            )
            send("equal" if equal else "different")
        except Exception:  # noqa: BLE001 (a math-verify bug on one odd expression scores that sample 0)
            send("error")


@dataclass
class _Worker:
    process: subprocess.Popen
    started: float  # time.monotonic() at start
    ready: bool = False
    task: int | None = None  # index of the task it works on
    deadline: float = 0.0  # time.monotonic() by which the task must be done


class MathVerifierPool:
    """``num_workers`` math-verify processes, each sample given at most ``timeout_s`` seconds.

    Workers are plain subprocesses (``python -m megatron_empg.rollout.rewards``: no fork of the
    trainer's threads, no re-import of its main script), started at the first ``check`` (importing
    sympy takes about a second) and stopped by ``close()`` or when their stdin closes. A worker
    that overruns a sample is killed and replaced, so even a C-level sympy loop cannot hang the
    step; the sample's outcome is ``"timeout"``.
    """

    def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"MathVerifierPool: num_workers must be an int >= 1, got {num_workers!r}")
        for name, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if not value > 0:
                raise ValueError(f"MathVerifierPool: {name} must be > 0, got {value!r}")
        self.num_workers, self.timeout_s, self.startup_timeout_s = num_workers, timeout_s, startup_timeout_s
        self._workers: list[_Worker] = []

    @staticmethod
    def _start() -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPOSITORY_ROOT, env.get("PYTHONPATH")]))
        process = subprocess.Popen(
            [sys.executable, "-m", _WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, encoding="utf-8", env=env,
        )  # fmt: skip
        return _Worker(process, started=time.monotonic())

    @staticmethod
    def _stop(worker: _Worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.process.stdin.close()
        worker.process.stdout.close()

    def check(self, tasks: Sequence[tuple[Sequence[str], str]]) -> list[VerifyOutcome]:
        """Outcome of each ``(gold answers, prediction)``: ``equal`` if the prediction equals any gold."""
        if not tasks:
            return []
        if not self._workers:
            if importlib.util.find_spec("math_verify") is None:
                raise ImportError("the math reward needs the math-verify package: pip install math-verify")
            self._workers = [self._start() for _ in range(self.num_workers)]
        try:
            return self._run(tasks)
        except BaseException:  # a worker may still owe an answer: start afresh next time
            self.close()
            raise

    def _run(self, tasks: Sequence[tuple[Sequence[str], str]]) -> list[VerifyOutcome]:
        outcomes: list[VerifyOutcome | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        while queue or any(w.task is not None for w in self._workers):
            for worker in list(self._workers):
                if worker.ready and worker.task is None and queue:
                    golds, prediction = tasks[queue[0]]
                    try:
                        worker.process.stdin.write(json.dumps([list(golds), prediction]) + "\n")
                        worker.process.stdin.flush()
                    except BrokenPipeError:  # it died while idle: the task waits for its replacement
                        self._replace(worker)
                        continue
                    worker.task = queue.popleft()
                    worker.deadline = time.monotonic() + self.timeout_s
            waiting = [w for w in self._workers if not w.ready or w.task is not None]
            deadlines = [w.deadline if w.ready else w.started + self.startup_timeout_s for w in waiting]
            wait_s = max(0.0, min(deadlines) - time.monotonic())
            readable, _, _ = select.select([w.process.stdout for w in waiting], [], [], wait_s)
            for worker, deadline in zip(waiting, deadlines):
                if worker.process.stdout in readable:
                    self._receive(worker, outcomes)
                elif time.monotonic() >= deadline:
                    if not worker.ready:
                        raise RuntimeError(f"a math-verify worker did not start within {self.startup_timeout_s} s")
                    outcomes[worker.task] = "timeout"
                    self._replace(worker)
        return outcomes  # type: ignore[return-value] (every task has its outcome)

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers[self._workers.index(worker)] = self._start()

    def _receive(self, worker: _Worker, outcomes: list[VerifyOutcome | None]) -> None:
        """Read the one line a worker has written (each request gets one answer, so no line waits
        in the pipe's buffer unseen by ``select``)."""
        line = worker.process.stdout.readline()
        if not line:  # the worker died
            if not worker.ready:
                raise RuntimeError(
                    f"a math-verify worker exited while starting (exit code {worker.process.wait()}); "
                    "its error is on stderr above"
                )
            outcomes[worker.task] = "error"
            self._replace(worker)
            return
        message = json.loads(line)
        if not worker.ready:
            if message != _READY:
                raise ImportError(message)
            worker.ready = True
            return
        outcomes[worker.task] = message
        worker.task = None

    def close(self) -> None:
        """Stop the workers (a later ``check`` starts new ones)."""
        for worker in self._workers:
            worker.process.stdin.close()  # the worker's loop ends
            try:
                worker.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.process.stdout.close()
        self._workers = []


class MathReward:
    """The ``math`` reward (see the module docstring); a ``RewardFn`` that owns a ``MathVerifierPool``.

    metrics: ``no_answer`` (nothing extracted), ``timeouts``, ``verify_errors`` (math-verify
    raised, or its worker died).
    """

    def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, incorrect_score: float = 0.0) -> None:
        self.pool = MathVerifierPool(num_workers=num_workers, timeout_s=timeout_s)
        self.incorrect_score = incorrect_score  # a correct answer scores 1

    def __call__(self, responses: list[str], examples: list[PromptExample]) -> RewardResult:
        _check_batch(responses, examples)
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
        outcomes = self.pool.check(tasks)
        for i, outcome in zip(pending, outcomes):
            correct[i] = outcome == "equal"
        metrics = {
            "no_answer": float(no_answer),
            "timeouts": float(outcomes.count("timeout")),
            "verify_errors": float(outcomes.count("error")),
        }
        scores = [1.0 if c else self.incorrect_score for c in correct]
        return RewardResult(scores=scores, correct=correct, metrics=metrics)

    def close(self) -> None:
        self.pool.close()


# --------------------------------------------------------------------------------------------
# QA: exact match and F1 (SQuAD normalization, Search-R1's answer tags).

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
    _check_batch(responses, examples)
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


# --------------------------------------------------------------------------------------------
# Arithmetic (rollout.tasks).

_INTEGER = re.compile(r"-?\d+")


def parse_integer_response(response: str) -> int | None:
    """The integer a response states on its first line (surrounding spaces allowed), or None."""
    text = response.split("\n", 1)[0].strip()
    return int(text) if _INTEGER.fullmatch(text) else None


def arithmetic_reward(responses: list[str], examples: list[PromptExample]) -> RewardResult:
    """The ``arithmetic`` reward: 1 if the first line is the answer's integer, else 0.

    metrics: ``malformed`` (first line not an integer).
    """
    _check_batch(responses, examples)
    values = [parse_integer_response(r) for r in responses]
    correct = []
    for i, (value, example) in enumerate(zip(values, examples)):
        golds = gold_answers(example.answer)
        if not all(_INTEGER.fullmatch(gold.strip()) for gold in golds):
            raise ValueError(f"arithmetic reward: examples[{i}].answer must be an integer, got {example.answer!r}")
        correct.append(value is not None and any(value == int(gold) for gold in golds))
    metrics = {"malformed": float(values.count(None))}
    return RewardResult(scores=[float(c) for c in correct], correct=correct, metrics=metrics)


def overlong_penalty(length: int, *, max_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment (<= 0): 0 up to ``max_length - buffer`` tokens, then falling
    linearly to ``-factor`` at ``max_length`` (and below it beyond)."""
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)


REWARDS: dict[str, RewardFn] = {
    "math": MathReward(),
    "math_dapo": MathReward(incorrect_score=-1.0),
    "qa_em": qa_em_reward,
    "qa_f1": qa_f1_reward,
    "arithmetic": arithmetic_reward,
}


if __name__ == "__main__":
    _serve_math_verify()
