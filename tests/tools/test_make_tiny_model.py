"""The character tokenizer of ``tools/make_tiny_model.py``: one token per character, any text of its
alphabet round-trips (spaces and runs of newlines included: the search agent's observations start
with two), also after ``save_tiny_hf_model`` and ``AutoTokenizer.from_pretrained``, which for a
Qwen2-family directory rebuilds the tokenizer as ``Qwen2Tokenizer`` from its vocabulary."""

from __future__ import annotations

import pytest

from megatron_empg.config import load_model_config
from tools.make_tiny_model import CHARACTERS, NUM_BASE_TOKENS, char_tokenizer, save_tiny_hf_model

TEXT = "".join(CHARACTERS) + "\n\n\nQuestion: what is it?\n<information>a\n\nb</information>\n\n"


def test_every_character_is_one_token_and_text_round_trips():
    tokenizer = char_tokenizer(128)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == TEXT
    assert ids[: len(CHARACTERS)] == list(range(2, NUM_BASE_TOKENS))
    assert tokenizer("12+34=46\n", add_special_tokens=False)["input_ids"] == [19, 20, 13, 21, 22, 31, 22, 24, 97]


@pytest.mark.parametrize("model", ["demo-qwen2", "tiny-qwen3", "tiny-llama"])
def test_the_saved_tokenizer_reloads_with_the_same_ids(model, tmp_path):
    from transformers import AutoTokenizer

    config = load_model_config(model)
    expected = char_tokenizer(config.vocab_size)(TEXT, add_special_tokens=False)["input_ids"]
    reloaded = AutoTokenizer.from_pretrained(save_tiny_hf_model(config, tmp_path))
    assert reloaded(TEXT, add_special_tokens=False)["input_ids"] == expected
    assert reloaded.decode(expected) == TEXT
    assert reloaded.eos_token_id == 0 and len(reloaded) == config.vocab_size
