"""Prompt datasets (``megatron_empg.rollout.data``) and ``DataConfig``.

Real parquet (pyarrow) and JSONL files in tmp dirs, read with the character-level tokenizer of
tools/make_tiny_model.py and with a copy of it that has a chat template; expected token ids are
the tokenizer's encoding of hand-written texts. Malformed rows are errors naming the file and the
1-based row; a resumed iterator continues exactly like an uninterrupted one; data-parallel ranks
get disjoint blocks that together make up the global batch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megatron_empg.config import ConfigError, DataConfig, from_dict, to_dict
from megatron_empg.rollout import data
from megatron_empg.rollout.data import (
    DataError,
    PromptBatches,
    PromptDataset,
    PromptExample,
    check_records,
    load_prompt_dataset,
)
from tools.make_tiny_model import char_tokenizer

VOCAB = 128
# A template in the style of chat models: one block per message, then the assistant's header.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def plain_tokenizer():
    return char_tokenizer(VOCAB)


def chat_tokenizer():
    """The character tokenizer with a chat template set (a ``PreTrainedTokenizerFast``)."""
    tokenizer = char_tokenizer(VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_jsonl(path: Path, lines: list[object | str]) -> str:
    """Each item a JSON value, or a str written verbatim (to make a malformed line)."""
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def files_config(*files: str, **overrides) -> DataConfig:
    return DataConfig(source="files", reward="math", train_files=list(files), **overrides)


def numbered_dataset(n: int, *, shuffle: bool = True, seed: int = 0) -> PromptDataset:
    """``n`` examples whose answer is their index (as text)."""
    examples = [PromptExample(prompt_ids=[2 + i % 90], answer=str(i), meta={"index": i}) for i in range(n)]
    return PromptDataset(examples, shuffle=shuffle, seed=seed)


def answers(examples: list[PromptExample]) -> list[str]:
    return [e.answer for e in examples]


# --------------------------------------------------------------------------------------------
# Reading records.


def test_jsonl_records_become_examples_in_file_order(tmp_path):
    tokenizer = plain_tokenizer()
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "1+1=", "answer": "2", "source": "toy"},
            "",  # a blank line is skipped but counts for the row numbers (JSONL rows are lines)
            {"prompt": "What is 6*7?", "answer": 42},
            {"prompt": "Name a prime.", "answer": ["2", "3", "5"]},
        ],
    )
    dataset = load_prompt_dataset(files_config(path), tokenizer)
    assert len(dataset) == 3 and dataset.num_dropped_long == 0
    first, second, third = dataset.examples
    assert first.prompt_ids == tokenizer.encode("1+1=") == [19, 13, 19, 31]
    assert first.answer == "2" and second.answer == "42" and third.answer == ["2", "3", "5"]
    assert first.meta == {"file": path, "row": 1, "index": 0, "columns": {"source": "toy"}}
    assert second.meta["row"] == 3 and third.meta == {"file": path, "row": 4, "index": 2, "columns": {}}
    assert second.prompt_ids == tokenizer.encode("What is 6*7?")


def test_parquet_chat_messages_and_nested_answer_keys_with_a_chat_template(tmp_path):
    """verl's layout: prompt = list of messages, answer under reward_model.ground_truth."""
    tokenizer = chat_tokenizer()
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}, "idx": 7},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3?"}],
            "reward_model": {"ground_truth": "6"},
            "idx": 8,
        },
    ]
    path = write_parquet(tmp_path / "train.parquet", rows)
    dataset = load_prompt_dataset(files_config(path, answer_key="reward_model.ground_truth"), tokenizer)
    first, second = dataset.examples
    assert first.prompt_ids == tokenizer.encode("<|user|>2+2?\n<|assistant|>", add_special_tokens=False)
    assert second.prompt_ids == tokenizer.encode(
        "<|system|>Be brief.\n<|user|>3+3?\n<|assistant|>", add_special_tokens=False
    )
    assert (first.answer, second.answer) == ("4", "6")
    # a dotted answer key leaves its top-level column in the meta
    columns = {"reward_model": {"ground_truth": "4"}, "idx": 7}
    assert first.meta == {"file": path, "row": 1, "index": 0, "columns": columns}


def test_string_prompts_with_a_chat_template_and_a_system_prompt(tmp_path):
    tokenizer = chat_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "x"}])
    [example] = load_prompt_dataset(files_config(path, system_prompt="You add."), tokenizer).examples
    assert example.prompt_ids == tokenizer.encode("<|system|>You add.\n<|user|>hi\n<|assistant|>")
    # apply_chat_template: false -> plain text even though the tokenizer has a template
    [plain] = load_prompt_dataset(files_config(path, apply_chat_template=False), tokenizer).examples
    assert plain.prompt_ids == tokenizer.encode("hi")


def test_without_a_chat_template_prompts_are_plain_text(tmp_path):
    tokenizer = plain_tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "9-4=", "answer": "5"}])
    [example] = load_prompt_dataset(files_config(path, system_prompt="Compute."), tokenizer).examples
    assert example.prompt_ids == tokenizer.encode("Compute.\n9-4=")
    messages = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "9-4="}], "answer": "5"}])
    with pytest.raises(DataError, match=r"m\.jsonl: row 1: 'prompt': a list of chat messages needs a tokenizer"):
        load_prompt_dataset(files_config(messages), tokenizer)


def test_a_prompt_template_rewrites_string_prompts_and_the_last_user_message(tmp_path):
    template = "{prompt} Put the answer in \\boxed{{}}."
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "1+2?", "answer": "3"},
            {
                "prompt": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "2+2?"},
                ],
                "answer": "4",
            },
        ],
    )
    tokenizer = chat_tokenizer()
    first, second = load_prompt_dataset(files_config(path, prompt_template=template), tokenizer).examples
    assert first.prompt_ids == tokenizer.encode("<|user|>1+2? Put the answer in \\boxed{}.\n<|assistant|>")
    assert second.prompt_ids == tokenizer.encode(
        "<|user|>a\n<|assistant|>b\n<|user|>2+2? Put the answer in \\boxed{}.\n<|assistant|>"
    )
    strings = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2?", "answer": "3"}])
    [plain] = load_prompt_dataset(files_config(strings, prompt_template="Q: {prompt}\nA:"), plain_tokenizer()).examples
    assert plain.prompt_ids == plain_tokenizer().encode("Q: 1+2?\nA:")
    only_system = write_jsonl(tmp_path / "s.jsonl", [{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"row 1: 'prompt': data\.prompt_template is set but the messages have no user"):
        load_prompt_dataset(files_config(only_system, prompt_template=template), tokenizer)


def test_a_row_the_prompt_template_cannot_take_is_named_by_the_check_before_the_run(tmp_path):
    """``check_records`` (the bind step, no tokenizer) refuses it as the loader does."""
    template = "{prompt} Put the answer in \\boxed{{}}."
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, {"prompt": [{"role": "system", "content": "x"}], "answer": "1"}])
    config = files_config(path, prompt_template=template)
    message = rf"^{tmp_path}/t\.jsonl: row 2: 'prompt': data\.prompt_template is set but the messages have no user"
    with pytest.raises(DataError, match=message) as checked:
        check_records(path, config)
    assert (checked.value.file, checked.value.row) == (path, 2)
    with pytest.raises(DataError, match=message):
        load_prompt_dataset(config, chat_tokenizer())
    assert check_records(path, files_config(path)) == 2  # without the template the row is fine


def test_a_row_the_chat_template_refuses_is_named_with_the_templates_words(tmp_path):
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'assistant' %}"
        "{{ raise_exception('the first message must not be the assistant') }}{% endif %}" + CHAT_TEMPLATE
    )
    assistant_first = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "q"}]
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, GOOD, {"prompt": assistant_first, "answer": "1"}])
    with pytest.raises(
        DataError,
        match=rf"^{tmp_path}/t\.jsonl: row 3: 'prompt': the tokenizer's chat template failed "
        r"on it: TemplateError: the first message must not be the assistant$",
    ) as error:
        load_prompt_dataset(files_config(path), tokenizer)
    assert (error.value.file, error.value.row) == (path, 3)


def test_an_own_system_message_and_a_system_prompt_conflict(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}], "answer": "1"},
        ],
    )
    with pytest.raises(DataError, match=r"row 1: 'prompt': the prompt has its own system message"):
        load_prompt_dataset(files_config(path, system_prompt="B"), chat_tokenizer())


GOOD = {"prompt": "1+2=", "answer": "3"}
MALFORMED_JSONL = [
    ({"answer": "3"}, r"missing key 'prompt' \(data\.prompt_key\); the record's keys: \['answer'\]"),
    ({"prompt": "1+2="}, r"missing key 'answer' \(data\.answer_key\)"),
    ({"prompt": None, "answer": "3"}, r"missing key 'prompt'"),
    ({"prompt": 5, "answer": "3"}, r"'prompt': expected a string or a list of chat messages, got int 5"),
    ({"prompt": "  \n", "answer": "3"}, r"'prompt': empty prompt"),
    ({"prompt": [], "answer": "3"}, r"'prompt': empty prompt \(no messages\)"),
    ({"prompt": [{"content": "x"}], "answer": "3"}, r"'prompt': message 0: expected \{role: str, content: str\}"),
    ({"prompt": [{"role": "user", "content": ""}], "answer": "3"}, r"'prompt': empty prompt \(every message"),
    ({"prompt": "1+2=", "answer": 0.5}, r"'answer': expected a string, an int or a non-empty list"),
    ({"prompt": "1+2=", "answer": True}, r"'answer': expected a string, an int"),
    ({"prompt": "1+2=", "answer": ["a", 1]}, r"'answer': expected a string, an int"),
    ({"prompt": "1+2=", "answer": ""}, r"'answer': empty answer"),
    ('{"prompt": "1+2=", "answer": ', r"invalid JSON: Expecting value at column 30"),
    ("[1, 2]", r"expected a JSON object, got list"),
]


@pytest.mark.parametrize(("bad", "message"), MALFORMED_JSONL)
def test_a_malformed_jsonl_row_names_the_file_and_row(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError, match=rf"^{tmp_path}/bad\.jsonl: row 3: {message}") as error:
        load_prompt_dataset(files_config(path), plain_tokenizer())
    assert (error.value.file, error.value.row) == (path, 3)


@pytest.mark.parametrize(("bad", "message"), MALFORMED_JSONL)
def test_the_check_of_every_record_refuses_what_the_loader_refuses_in_its_words(tmp_path, bad, message):
    """``check_records`` (the bind step, no tokenizer) and the loader raise the same error."""
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as checked:
        check_records(path, files_config(path))
    with pytest.raises(DataError) as loaded:
        load_prompt_dataset(files_config(path), plain_tokenizer())
    assert str(checked.value) == str(loaded.value) and (checked.value.file, checked.value.row) == (path, 3)


def test_the_check_streams_parquet_batches_and_counts_the_records(tmp_path, monkeypatch):
    """Rows are numbered across batches and row groups; the check stops at the first bad row."""
    monkeypatch.setattr(data, "_PARQUET_BATCH_ROWS", 2)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(7)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    assert check_records(path, files_config(str(path))) == 7
    assert [(row, record["answer"]) for row, record in data.read_records(path)] == [
        (i + 1, str(i + 1)) for i in range(7)
    ]
    rows[5] = {"prompt": "6+1=", "answer": ""}
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    with pytest.raises(DataError, match=rf"^{path}: row 6: 'answer': empty answer$"):
        check_records(path, files_config(str(path)))
    nested = write_jsonl(tmp_path / "n.jsonl", [{"q": "a?", "rm": {"gt": ["x"]}}] * 3)
    assert check_records(nested, files_config(nested, prompt_key="q", answer_key="rm.gt")) == 3


def test_the_check_names_unreadable_and_empty_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    with pytest.raises(DataError, match=r"empty\.parquet: no records$"):
        check_records(empty, files_config(str(empty)))
    blank = write_jsonl(tmp_path / "blank.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"blank\.jsonl: no records$"):
        check_records(blank, files_config(blank))
    good = write_parquet(tmp_path / "good.parquet", [GOOD] * 50)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(Path(good).read_bytes()[:-40])  # the footer cut
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    for path in (truncated, garbage):
        with pytest.raises(DataError, match=rf"^{path}: cannot read it as parquet: "):
            check_records(path, files_config(str(path)))
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        check_records(tmp_path / "missing.jsonl", files_config(str(tmp_path / "missing.jsonl")))


def test_a_malformed_parquet_row_names_the_file_and_row(tmp_path):
    rows = [GOOD, GOOD, GOOD, {"prompt": None, "answer": "3"}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad\.parquet: row 4: missing key 'prompt'"):
        load_prompt_dataset(files_config(path), plain_tokenizer())
    path = write_parquet(tmp_path / "empty.parquet", [GOOD, {"prompt": "", "answer": "3"}])
    with pytest.raises(DataError, match=r"empty\.parquet: row 2: 'prompt': empty prompt"):
        load_prompt_dataset(files_config(path), plain_tokenizer())


def test_file_level_errors_name_the_file(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_prompt_dataset(files_config(good, str(tmp_path / "missing.jsonl")), plain_tokenizer())
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match=r"empty\.jsonl: no records"):
        load_prompt_dataset(files_config(good, empty), plain_tokenizer())
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError, match=r"corrupt\.parquet: cannot read it as parquet"):
        load_prompt_dataset(files_config(str(corrupt)), plain_tokenizer())
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: row 2: not UTF-8 text"):
        load_prompt_dataset(files_config(str(latin1)), plain_tokenizer())


def test_several_files_are_concatenated_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    b = write_parquet(tmp_path / "b.parquet", [{"prompt": "c", "answer": "3"}])
    dataset = load_prompt_dataset(files_config(a, b), plain_tokenizer())
    assert answers(dataset.examples) == ["1", "2", "3"]
    where = [(e.meta["file"], e.meta["row"], e.meta["index"]) for e in dataset.examples]
    assert where == [(a, 1, 0), (a, 2, 1), (b, 1, 2)]


def test_long_prompts_are_an_error_naming_the_row_or_dropped_and_counted(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            {"prompt": "12345", "answer": "1"},
            {"prompt": "123456", "answer": "2"},  # 6 characters = 6 tokens
            {"prompt": "1234", "answer": "3"},
            {"prompt": "1234567", "answer": "4"},
        ],
    )
    message = r"t\.jsonl: row 2: the prompt has 6 tokens, more than data\.max_prompt_tokens=5"
    with pytest.raises(DataError, match=message):
        load_prompt_dataset(files_config(path, max_prompt_tokens=5), plain_tokenizer())
    config = files_config(path, max_prompt_tokens=5, drop_long_prompts=True)
    with caplog.at_level(logging.WARNING, logger="megatron_empg.rollout.data"):
        dataset = load_prompt_dataset(config, plain_tokenizer())
    assert answers(dataset.examples) == ["1", "3"] and dataset.num_dropped_long == 2
    assert [e.meta["index"] for e in dataset.examples] == [0, 1]
    assert "dropped 2 of 4 prompts longer than data.max_prompt_tokens=5" in caplog.text
    with pytest.raises(DataError, match=r"every prompt is longer than data\.max_prompt_tokens"):
        load_prompt_dataset(files_config(path, max_prompt_tokens=3, drop_long_prompts=True), plain_tokenizer())


# --------------------------------------------------------------------------------------------
# DataConfig.


def test_data_config_defaults_to_the_arithmetic_task_and_round_trips():
    cfg = DataConfig()
    assert (cfg.source, cfg.reward, cfg.train_files) == ("arithmetic", "arithmetic", [])
    assert (cfg.reward_workers, cfg.reward_timeout_s, cfg.reward_budget_s) == (2, 5.0, None)
    data = {
        "source": "files",
        "reward": "qa_em",
        "train_files": ["a.parquet", "b.jsonl"],
        "answer_key": "reward_model.ground_truth.target",
        "system_prompt": "Answer.",
        "max_prompt_tokens": 64,
    }
    cfg = from_dict(DataConfig, data)
    assert from_dict(DataConfig, to_dict(cfg)) == cfg and cfg.train_files == ["a.parquet", "b.jsonl"]


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"source": "files"}, "train_files", "needs at least one .parquet or .jsonl file"),
        ({"source": "files", "train_files": ["a.csv"]}, "train_files[0]", "expected a .parquet or .jsonl file"),
        ({"train_files": ["a.jsonl"]}, "train_files", "source 'arithmetic' generates its prompts"),
        ({"reward": "math"}, "reward", "source 'arithmetic' needs reward 'arithmetic'"),
        ({"source": "hub"}, "source", "expected one of 'files', 'arithmetic'"),
        ({"prompt_key": ""}, "prompt_key", "expected a non-empty str, got ''"),
        ({"system_prompt": "  "}, "system_prompt", "must be null or non-empty text"),
        ({"prompt_template": "no field"}, "prompt_template", "must contain the field {prompt}"),
        ({"prompt_template": "{question}"}, "prompt_template", "whose only field is {prompt}"),
        ({"prompt_template": "{prompt} \\boxed{}"}, "prompt_template", "whose only field is {prompt}"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens", "must be >= 1"),
        ({"seed": -1}, "seed", "must be >= 0"),
        ({"arithmetic_digits": 0}, "arithmetic_digits", "must be in [1, 9]"),
        ({"arithmetic_ops": []}, "arithmetic_ops", "expected distinct operators"),
        ({"arithmetic_ops": ["+", "+"]}, "arithmetic_ops", "expected distinct operators"),
        ({"arithmetic_ops": ["/"]}, "arithmetic_ops[0]", "expected one of '+', '-', '*'"),
        ({"shuffle": "yes"}, "shuffle", "expected bool"),
        ({"reward_workers": 0}, "reward_workers", "expected a number of processes >= 1, got 0"),
        ({"reward_workers": 1.5}, "reward_workers", "expected int"),
        ({"reward_timeout_s": 0}, "reward_timeout_s", "expected seconds > 0 and <= 1e+09, got 0.0"),
        ({"reward_timeout_s": float("inf")}, "reward_timeout_s", "expected a finite number, got inf"),
        (
            {"reward_budget_s": -1},
            "reward_budget_s",
            "expected seconds (or null for no budget) > 0 and <= 1e+09, got -1.0",
        ),
        ({"train_file": ["a.jsonl"]}, "train_file", "unknown key"),
    ],
)
def test_data_config_errors_name_the_field(data, field, words):
    with pytest.raises(ConfigError) as error:
        from_dict(DataConfig, data)
    assert error.value.field == field and words in error.value.reason, error.value


# --------------------------------------------------------------------------------------------
# Batches: epochs, resume, data-parallel shards.


def test_epochs_are_seeded_permutations_and_batches_stay_inside_an_epoch():
    dataset = numbered_dataset(10, seed=3)
    batches = PromptBatches(dataset, batch_size=4)
    served = [answers(next(batches)) for _ in range(6)]  # 2 batches per epoch (10 // 4), 3 epochs
    for epoch in range(3):
        epoch_answers = served[2 * epoch] + served[2 * epoch + 1]
        assert len(set(epoch_answers)) == 8  # no repeat inside an epoch
        assert epoch_answers == [str(i) for i in dataset.epoch_order(epoch)[:8]]
    assert sorted(dataset.epoch_order(0)) == list(range(10)) and dataset.epoch_order(0) != dataset.epoch_order(1)
    again = PromptBatches(numbered_dataset(10, seed=3), batch_size=4)
    assert [answers(next(again)) for _ in range(6)] == served  # deterministic
    other_seed = PromptBatches(numbered_dataset(10, seed=4), batch_size=4)
    assert [answers(next(other_seed)) for _ in range(6)] != served
    in_order = PromptBatches(numbered_dataset(10, shuffle=False), batch_size=4)
    assert [answers(next(in_order)) for _ in range(3)] == [list("0123"), list("4567"), list("0123")]


def test_resuming_from_a_state_continues_like_an_uninterrupted_iterator():
    uninterrupted = PromptBatches(numbered_dataset(11, seed=5), batch_size=3)
    expected = [answers(next(uninterrupted)) for _ in range(9)]  # crosses two epoch boundaries
    first = PromptBatches(numbered_dataset(11, seed=5), batch_size=3)
    head = [answers(next(first)) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert state == {"cursor": 4, "batch_size": 3, "source": "files", "num_examples": 11, "shuffle": True, "seed": 5}
    resumed = PromptBatches(numbered_dataset(11, seed=5), batch_size=3)
    resumed.load_state_dict(state)
    assert head + [answers(next(resumed)) for _ in range(5)] == expected


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_ranks_get_disjoint_blocks_that_make_up_the_global_batch(world_size):
    single = PromptBatches(numbered_dataset(20, seed=1), batch_size=8)
    ranks = [
        PromptBatches(numbered_dataset(20, seed=1), batch_size=8, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for _ in range(5):
        global_batch = answers(next(single))
        shards = [answers(next(r)) for r in ranks]
        assert all(len(shard) == 8 // world_size for shard in shards)
        assert sum(shards, []) == global_batch  # disjoint (the batch has no repeats) and covering
        assert len(set(global_batch)) == 8


def test_a_checkpoint_resumes_at_another_world_size():
    before = PromptBatches(numbered_dataset(20), batch_size=8, rank=1, world_size=2)
    for _ in range(3):
        next(before)
    reference = PromptBatches(numbered_dataset(20), batch_size=8)
    reference.load_state_dict(before.state_dict())
    after = [PromptBatches(numbered_dataset(20), batch_size=8, rank=r, world_size=4) for r in range(4)]
    for shard in after:
        shard.load_state_dict(before.state_dict())
    assert sum((answers(next(s)) for s in after), []) == answers(next(reference))


def test_a_state_of_other_batches_is_refused():
    state = PromptBatches(numbered_dataset(10, seed=1), batch_size=2).state_dict()
    for batches, key in [
        (PromptBatches(numbered_dataset(10, seed=2), batch_size=2), "seed"),
        (PromptBatches(numbered_dataset(12, seed=1), batch_size=2), "num_examples"),
        (PromptBatches(numbered_dataset(10, seed=1), batch_size=4), "batch_size"),
        (PromptBatches(numbered_dataset(10, seed=1, shuffle=False), batch_size=2), "shuffle"),
    ]:
        with pytest.raises(ValueError, match=rf"^data state: {key} is .* in the checkpoint but"):
            batches.load_state_dict(state)
    batches = PromptBatches(numbered_dataset(10, seed=1), batch_size=2)
    with pytest.raises(ValueError, match=r"data state: cursor must be an int >= 0, got -1"):
        batches.load_state_dict({**state, "cursor": -1})
    with pytest.raises(ValueError, match=r"data state: extra is 1 in the checkpoint but '\(absent\)' here"):
        batches.load_state_dict({**state, "extra": 1})


def test_batch_arguments_are_checked():
    dataset = numbered_dataset(6)
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by world_size=4"):
        PromptBatches(dataset, batch_size=6, world_size=4)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size=2\), got 2"):
        PromptBatches(dataset, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        PromptBatches(dataset, batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size=8 is larger than the dataset \(6 prompts\)"):
        next(PromptBatches(dataset, batch_size=8))
