"""The character tokenizer of ``tools/make_tiny_model.py``: one token per character, any text of its
alphabet round-trips (runs of newlines included: observations of the search agent start with two)."""

from __future__ import annotations

from tools.make_tiny_model import CHARACTERS, NUM_BASE_TOKENS, char_tokenizer


def test_every_character_is_one_token_and_text_round_trips():
    tokenizer = char_tokenizer(128)
    text = "".join(CHARACTERS) + "\n\n\n<information>a\n\nb</information>\n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    assert ids[: len(CHARACTERS)] == list(range(2, NUM_BASE_TOKENS))
