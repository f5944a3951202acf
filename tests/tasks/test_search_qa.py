"""The search QA task (``megatron_empg.tasks.search_qa``): SQuAD/Search-R1 exact match and F1
against hand-computed values, and the tagged answer the rewards score.
"""

from __future__ import annotations

import pytest

from megatron_empg.rollout.data import PromptExample
from megatron_empg.tasks.search_qa import (
    exact_match,
    extract_tagged_answer,
    normalize_answer,
    qa_em_reward,
    qa_f1_reward,
    token_f1,
)


def examples(*answers: str | list[str]) -> list[PromptExample]:
    return [PromptExample(prompt_ids=[2], answer=answer, meta={}) for answer in answers]


def test_normalize_answer_is_squads():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert normalize_answer("U.S.A.") == "usa"


def test_exact_match_and_f1_against_hand_computed_values():
    assert exact_match("the Eiffel Tower.", ["Eiffel tower"]) and not exact_match("Eiffel", ["Eiffel tower"])
    assert exact_match("Paris", ["London", "paris"])
    # "cat sat on mat" vs "cat sat on red mat": 4 common tokens, P = 4/4, R = 4/5, F1 = 8/9
    assert token_f1("the cat sat on mat", ["a cat sat on the red mat"]) == pytest.approx(8 / 9)
    # repeated tokens: "x x y" and "x y y" share one x and one y, P = R = 2/3
    assert token_f1("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert token_f1("red mat", ["blue car", "red car"]) == pytest.approx(0.5)  # the best gold
    assert token_f1("the", ["a"]) == 1.0 and token_f1("the", ["cat"]) == 0.0  # empty after normalization
    assert token_f1("dog", ["cat"]) == 0.0


def test_tagged_answer_is_the_last_one():
    assert extract_tagged_answer("<answer>a</answer> then <answer> b \n</answer>") == "b"
    assert extract_tagged_answer("<answer>\nmulti\nline</answer>") == "multi\nline"
    assert extract_tagged_answer("the answer is b") is None and extract_tagged_answer("<answer>b") is None


def test_qa_rewards_score_the_tagged_answer():
    responses = [
        "<search>q</search><answer>The Eiffel Tower</answer>",
        "<answer>eiffel</answer>",
        "Eiffel Tower",  # no tag: 0
        "<answer>Lyon</answer> <answer>paris</answer>",
    ]
    golds = examples(["Eiffel Tower"], ["Eiffel Tower", "tower of Eiffel"], "Eiffel Tower", ["Paris", "Lutetia"])
    em = qa_em_reward(responses, golds)
    assert em.scores == [1.0, 0.0, 0.0, 1.0] and em.correct == [True, False, False, True]
    # F1 of "eiffel": vs "eiffel tower" P=1 R=1/2 -> 2/3; vs "tower of eiffel" P=1 R=1/3 -> 1/2
    f1 = qa_f1_reward(responses, golds)
    assert f1.scores == pytest.approx([1.0, 2 / 3, 0.0, 1.0]) and f1.correct == em.correct
    assert em.metrics == f1.metrics == pytest.approx({"no_answer": 1.0, "exact_match": 2.0, "f1": 2 + 2 / 3})
