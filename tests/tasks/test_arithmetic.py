"""The synthetic arithmetic task (``megatron_empg.tasks.arithmetic``) and its reward.

Problems are checked against Python's own evaluation of their text; prompts against the
character tokenizer's encoding; the stream's cursor against an uninterrupted iterator; the reward
against hand-written responses.
"""

from __future__ import annotations

import pytest

from megatron_empg.config import DataConfig
from megatron_empg.rollout.data import PromptBatches, PromptExample
from megatron_empg.tasks.arithmetic import (
    ArithmeticProblem,
    ArithmeticTask,
    arithmetic_problem,
    arithmetic_reward,
    parse_integer_response,
)
from tests.rollout.test_data import chat_tokenizer, plain_tokenizer
from tools.make_tiny_model import CHARACTERS


@pytest.mark.parametrize(("digits", "ops"), [(1, ["+"]), (2, ["+", "-"]), (3, ["+", "-", "*"])])
def test_problems_are_deterministic_within_their_digits_and_ops(digits, ops):
    drawn = [arithmetic_problem(7, i, digits=digits, ops=ops) for i in range(300)]
    assert drawn == [arithmetic_problem(7, i, digits=digits, ops=ops) for i in range(300)]
    assert drawn != [arithmetic_problem(8, i, digits=digits, ops=ops) for i in range(300)]
    assert {p.op for p in drawn} == set(ops)
    for problem in drawn:
        assert 0 <= problem.left < 10**digits and 0 <= problem.right < 10**digits
        assert problem.answer == eval(problem.text[:-1]) >= 0  # noqa: S307 (digits and one operator)
        assert set(problem.text) <= set("0123456789+-*=") <= set(CHARACTERS)
    assert max(max(p.left, p.right) for p in drawn) >= 10 ** (digits - 1)  # the whole range is used


def test_problem_text_and_answer():
    assert (ArithmeticProblem(12, "+", 7).text, ArithmeticProblem(12, "+", 7).answer) == ("12+7=", 19)
    assert ArithmeticProblem(30, "-", 4).answer == 26 and ArithmeticProblem(11, "*", 12).answer == 132


def test_examples_are_prompts_in_the_character_alphabet():
    tokenizer = plain_tokenizer()
    task = ArithmeticTask(DataConfig(seed=3, arithmetic_ops=["+", "-", "*"]), tokenizer)
    for index in (0, 1, 1000, 10**9):
        example = task.example(index)
        problem = arithmetic_problem(3, index, digits=2, ops=["+", "-", "*"])
        assert example.prompt_ids == tokenizer.encode(problem.text)
        assert tokenizer.unk_token_id not in example.prompt_ids
        assert example.answer == str(problem.answer) and example.meta == {"index": index, "problem": problem.text}
    chat = chat_tokenizer()
    example = ArithmeticTask(DataConfig(seed=3), chat).example(0)
    text = arithmetic_problem(3, 0, digits=2, ops=["+", "-"]).text
    assert example.prompt_ids == chat.encode(f"<|user|>{text}\n<|assistant|>", add_special_tokens=False)


def test_the_stream_resumes_and_shards_like_a_file_dataset():
    config = DataConfig(seed=11, arithmetic_digits=3)
    uninterrupted = PromptBatches(ArithmeticTask(config, plain_tokenizer()), batch_size=4)
    expected = [[e.meta["index"] for e in next(uninterrupted)] for _ in range(5)]
    assert expected == [list(range(4 * s, 4 * s + 4)) for s in range(5)]
    first = PromptBatches(ArithmeticTask(config, plain_tokenizer()), batch_size=4)
    head = [[e.meta["problem"] for e in next(first)] for _ in range(2)]
    state = first.state_dict()
    assert state == {"cursor": 2, "batch_size": 4, "source": "arithmetic", "seed": 11, "digits": 3, "ops": "+-"}
    resumed = PromptBatches(ArithmeticTask(config, plain_tokenizer()), batch_size=4)
    resumed.load_state_dict(state)
    again = PromptBatches(ArithmeticTask(config, plain_tokenizer()), batch_size=4)
    assert head + [[e.meta["problem"] for e in next(resumed)] for _ in range(3)] == [
        [e.meta["problem"] for e in next(again)] for _ in range(5)
    ]
    ranks = [
        PromptBatches(ArithmeticTask(config, plain_tokenizer()), batch_size=4, rank=r, world_size=2) for r in range(2)
    ]
    for step in range(3):
        assert sum(([e.meta["index"] for e in next(r)] for r in ranks), []) == expected[step]
    other = PromptBatches(ArithmeticTask(DataConfig(seed=12, arithmetic_digits=3), plain_tokenizer()), batch_size=4)
    with pytest.raises(ValueError, match=r"data state: seed is 11 in the checkpoint but 12 here"):
        other.load_state_dict(state)


def test_a_prompt_over_max_prompt_tokens_is_an_error():
    task = ArithmeticTask(DataConfig(max_prompt_tokens=3), plain_tokenizer())
    with pytest.raises(
        ValueError,
        match=r"arithmetic problem 0 \('\d+[+-]\d+='\) has \d prompt tokens, more than "
        r"data\.max_prompt_tokens=3",
    ):
        task.example(0)
    with pytest.raises(ValueError, match=r"index must be an int >= 0, got -1"):
        task.example(-1)


def _example(answer: str) -> PromptExample:
    return PromptExample(prompt_ids=[2], answer=answer, meta={})


def test_arithmetic_reward_is_an_exact_integer_match_of_the_first_line():
    cases = [  # response, answer, correct, malformed
        ("19", "19", True, False),
        (" 19 \n12+7=19", "19", True, False),  # the first line only, spaces stripped
        ("019", "19", True, False),  # the integer's value counts
        ("18", "19", False, False),
        ("-3", "-3", True, False),
        ("19.0", "19", False, True),
        ("19 apples", "19", False, True),
        ("\n19", "19", False, True),  # nothing before the first newline
        ("", "19", False, True),
    ]
    result = arithmetic_reward([c[0] for c in cases], [_example(c[1]) for c in cases])
    assert result.correct == [c[2] for c in cases]
    assert result.scores == [float(c[2]) for c in cases]
    assert result.metrics == {"malformed": float(sum(c[3] for c in cases))}
    assert [parse_integer_response(c[0]) for c in cases[:3]] == ["19", "19", "19"]


def test_an_answer_of_5000_digits_scores_0_instead_of_raising():
    """Past Python's 4,300-digit limit of int(str): compared as canonical decimal text."""
    huge = "9" * 5000
    result = arithmetic_reward(
        [huge, huge, "-0", "-" + "0" * 5000 + "7"], [_example(a) for a in ("19", huge, "0", "-7")]
    )
    assert result.scores == [0.0, 1.0, 1.0, 1.0] and result.metrics == {"malformed": 0.0}
    assert parse_integer_response("0" * 5000 + "x") is None


def test_arithmetic_reward_rejects_non_integer_answers_and_mismatched_batches():
    with pytest.raises(ValueError, match=r"examples\[0\]\.answer must be an integer, got 'x'"):
        arithmetic_reward(["1"], [_example("x")])
    with pytest.raises(ValueError, match=r"2 responses for 1 examples"):
        arithmetic_reward(["1", "2"], [_example("1")])


def test_the_task_solved_by_its_own_answers_scores_one():
    task = ArithmeticTask(DataConfig(seed=5, arithmetic_ops=["+", "-", "*"]), plain_tokenizer())
    examples = next(PromptBatches(task, batch_size=16))
    assert arithmetic_reward([e.answer for e in examples], examples).scores == [1.0] * 16
    assert arithmetic_reward([str(int(e.answer) + 1) for e in examples], examples).scores == [0.0] * 16
