"""tools/prepare_search_data.py: FlashRAG QA rows -> the search recipes' JSONL prompt file.

Fixture rows are written in tmp_path in FlashRAG's format (``id``, ``question``, ``golden_answers``,
extra fields). Checked: the exact output rows (Search-R1's question normalisation, ids
``NAME/SPLIT/ROW_ID`` unique across datasets whose row ids collide), the seeded per-file
``--limit``, the atomic write (a failed run leaves an existing OUT untouched, no temp file), the
error messages (file, line, field; exit code 1) and the usage errors (exit code 2); and that the
output loads through the trainer's data loader with the recipe's data settings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.prepare_search_data import main, normalize_question

REPO = Path(__file__).resolve().parents[2]

NQ = [
    {
        "id": "train_0",
        "question": "  who got the first nobel prize in physics ",
        "golden_answers": ["Wilhelm Conrad Röntgen"],
    },
    {
        "id": "train_1",
        "question": "when is the next deadpool movie being released?",
        "golden_answers": ["May 18, 2018", "2018"],
        "metadata": {"x": 1},
    },
    {
        "id": "train_2",
        "question": "where is the tv show the curse of oak island filmed",
        "golden_answers": ["Oak Island"],
    },
]
HOTPOT = [  # the same row ids as NQ's: Search-R1's merged index collides here, ours must not
    {
        "id": "train_0",
        "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
        "golden_answers": ["Arthur's Magazine"],
    },
    {
        "id": "train_1",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality",
        "golden_answers": ["yes"],
    },
]


def write_jsonl(path: Path, rows: list, *, raw_lines: dict[int, str] | None = None) -> Path:
    """``rows`` as JSONL; ``raw_lines`` {0-based position: text} inserts literal lines."""
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    for position, text in sorted((raw_lines or {}).items()):
        lines.insert(position, text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def flashrag(tmp_path):
    return (
        write_jsonl(tmp_path / "nq" / "train.jsonl", NQ),
        write_jsonl(tmp_path / "hotpotqa" / "train.jsonl", HOTPOT),
    )


def test_rows_are_normalized_and_ids_are_unique_across_datasets(tmp_path, flashrag, capsys):
    nq, hotpot = flashrag
    out = tmp_path / "data" / "search" / "train.jsonl"
    assert main(["--out", str(out), f"nq={nq}", f"hotpotqa={hotpot}"]) == 0
    assert read_jsonl(out) == [
        {
            "question": "who got the first nobel prize in physics?",
            "golden_answers": ["Wilhelm Conrad Röntgen"],
            "data_source": "nq",
            "id": "nq/train/train_0",
        },
        {
            "question": "when is the next deadpool movie being released?",
            "golden_answers": ["May 18, 2018", "2018"],
            "data_source": "nq",
            "id": "nq/train/train_1",
        },
        {
            "question": "where is the tv show the curse of oak island filmed?",
            "golden_answers": ["Oak Island"],
            "data_source": "nq",
            "id": "nq/train/train_2",
        },
        {
            "question": "Which magazine was started first, Arthur's Magazine or First for Women?",
            "golden_answers": ["Arthur's Magazine"],
            "data_source": "hotpotqa",
            "id": "hotpotqa/train/train_0",
        },
        {
            "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
            "golden_answers": ["yes"],
            "data_source": "hotpotqa",
            "id": "hotpotqa/train/train_1",
        },
    ]
    assert "Röntgen" in out.read_text(encoding="utf-8")  # UTF-8, not \u escapes
    assert capsys.readouterr().out == f"wrote 5 rows to {out} (nq 3, hotpotqa 2)\n"
    assert [p.name for p in out.parent.iterdir()] == ["train.jsonl"]  # no temp file left


def test_question_normalisation_is_search_r1s():
    assert normalize_question(" what is x ") == "what is x?"
    assert normalize_question("what is x?\n") == "what is x?"
    assert normalize_question("Name the capital.") == "Name the capital.?"  # Search-R1 appends to any other end


def test_test_splits_take_the_file_name_and_int_ids(tmp_path):
    bamboogle = write_jsonl(
        tmp_path / "bamboogle" / "test.jsonl",
        [
            {
                "id": 7,
                "question": "Who was president when the first Star Wars was released?",
                "golden_answers": ["Jimmy Carter"],
            },
        ],
    )
    hotpot_dev = write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", [HOTPOT[1]])
    out = tmp_path / "test.jsonl"
    assert main(["--out", str(out), f"bamboogle={bamboogle}", f"hotpotqa={hotpot_dev}"]) == 0
    assert [(r["id"], r["data_source"]) for r in read_jsonl(out)] == [
        ("bamboogle/test/7", "bamboogle"),
        ("hotpotqa/dev/train_1", "hotpotqa"),
    ]


def test_limit_draws_per_file_with_the_seed_in_file_order(tmp_path):
    rows = [{"id": f"r{i}", "question": f"q{i}?", "golden_answers": [f"a{i}"]} for i in range(10)]
    big = write_jsonl(tmp_path / "nq" / "train.jsonl", rows)
    small = write_jsonl(tmp_path / "hotpotqa" / "train.jsonl", HOTPOT)
    out = tmp_path / "out.jsonl"
    assert main(["--out", str(out), "--limit", "3", "--seed", "0", f"nq={big}", f"hotpotqa={small}"]) == 0
    ids = [r["id"] for r in read_jsonl(out)]
    # random.Random(0).sample(range(10), 3) = [6, 9, 0] -> file order 0, 6, 9; the 2-row file is kept whole
    assert ids == ["nq/train/r0", "nq/train/r6", "nq/train/r9", "hotpotqa/train/train_0", "hotpotqa/train/train_1"]
    assert main(["--out", str(out), "--limit", "3", "--seed", "1", f"nq={big}"]) == 0
    assert [r["id"] for r in read_jsonl(out)] == ["nq/train/r1", "nq/train/r2", "nq/train/r4"]  # sample: [2, 1, 4]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "x", "golden_answers": ["a"]}, "field 'question' is missing (the row has ['golden_answers', 'id'])"),
        (
            {"id": "x", "question": "   ", "golden_answers": ["a"]},
            "field 'question': expected a non-empty string, got '   '",
        ),
        ({"id": "x", "question": 3, "golden_answers": ["a"]}, "field 'question': expected a non-empty string, got 3"),
        (
            {"id": "x", "question": "q?", "golden_answers": "Paris"},
            "field 'golden_answers': expected a non-empty list of non-empty strings, got 'Paris'",
        ),
        (
            {"id": "x", "question": "q?", "golden_answers": []},
            "field 'golden_answers': expected a non-empty list of non-empty strings, got []",
        ),
        (
            {"id": "x", "question": "q?", "golden_answers": ["a", 2]},
            "field 'golden_answers': expected a non-empty list of non-empty strings, got ['a', 2]",
        ),
        (
            {"question": "q?", "golden_answers": ["a"]},
            "field 'id' is missing (the row has ['golden_answers', 'question'])",
        ),
        (
            {"id": None, "question": "q?", "golden_answers": ["a"]},
            "field 'id': expected a non-empty string or an int, got None",
        ),
        (["not", "an", "object"], "expected a JSON object, got list"),
    ],
)
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, capsys, row, message):
    # line 1 good, line 2 blank (skipped, still counted), line 3 the bad row
    path = write_jsonl(tmp_path / "nq" / "train.jsonl", [NQ[0], row], raw_lines={1: ""})
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    assert main(["--out", str(out), f"nq={path}"]) == 1
    assert capsys.readouterr().err == f"prepare_search_data.py: error: {path}:3: {message}\n"
    assert out.read_text() == "previous\n"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nq", "out.jsonl"]


def test_invalid_json_and_empty_files_and_repeated_ids_are_errors(tmp_path, capsys):
    bad_json = write_jsonl(tmp_path / "a" / "train.jsonl", [NQ[0]], raw_lines={1: '{"id": "y", "question": '})
    out = tmp_path / "out.jsonl"
    assert main(["--out", str(out), f"nq={bad_json}"]) == 1
    assert capsys.readouterr().err == (
        f"prepare_search_data.py: error: {bad_json}:2: invalid JSON (Expecting value at column 25)\n"
    )
    empty = tmp_path / "b" / "train.jsonl"
    empty.parent.mkdir()
    empty.write_text("\n\n")
    assert main(["--out", str(out), f"nq={empty}"]) == 1
    assert capsys.readouterr().err == f"prepare_search_data.py: error: {empty}: no rows\n"
    twice = write_jsonl(tmp_path / "c" / "train.jsonl", [NQ[0], NQ[1], {**NQ[2], "id": "train_0"}])
    assert main(["--out", str(out), f"nq={twice}"]) == 1
    assert capsys.readouterr().err == (
        f"prepare_search_data.py: error: {twice}:3: field 'id': the id 'nq/train/train_0' repeats that of {twice}:1\n"
    )
    # the same file under the same name twice: every id repeats
    nq = write_jsonl(tmp_path / "nq" / "train.jsonl", NQ)
    assert main(["--out", str(out), f"nq={nq}", f"nq={nq}"]) == 1
    assert f"{nq}:1: field 'id': the id 'nq/train/train_0' repeats that of {nq}:1" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nq"], "expected NAME=PATH (e.g. nq=nq/train.jsonl), got 'nq'"),
        (["nq="], "expected NAME=PATH (e.g. nq=nq/train.jsonl), got 'nq='"),
        (["n/q={nq}"], "NAME must be letters, digits, '_', '.' or '-' (it goes into the ids), got 'n/q'"),
        (["nq={missing}"], "no such file: {missing}"),
        (["--limit", "0", "nq={nq}"], "argument --limit: expected a positive integer, got 0"),
        (["--out", "{tmp}", "nq={nq}"], "--out {tmp} is a directory"),
        (["--out", "{nq}", "nq={nq}"], "--out {nq} is one of the inputs"),
    ],
)
def test_usage_errors_exit_2(tmp_path, flashrag, capsys, args, message):
    nq, _ = flashrag
    values = {"nq": nq, "missing": tmp_path / "missing.jsonl", "tmp": tmp_path}
    args = [a.format(**values) for a in args]
    if "--out" not in args:
        args = ["--out", str(tmp_path / "out.jsonl"), *args]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message.format(**values) in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_runs_as_a_script(tmp_path, flashrag):
    nq, hotpot = flashrag
    out = tmp_path / "train.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "prepare_search_data.py"),
            "--out",
            str(out),
            f"nq={nq}",
            f"hotpotqa={hotpot}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote 5 rows to {out} (nq 3, hotpotqa 2)\n"
    assert len(read_jsonl(out)) == 5


class _PlainTokenizer:
    """A whitespace tokenizer without a chat template (enough for the loader's checks)."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[len(word) for word in text.split()] for text in texts]}

    def apply_chat_template(self, *args, **kwargs):  # pragma: no cover - never called without a template
        raise AssertionError("no chat template")


def test_the_output_loads_with_the_recipes_data_settings(tmp_path, flashrag):
    from megatron_empg.config import RunConfig, load_config
    from megatron_empg.rollout.data import load_prompt_dataset

    nq, hotpot = flashrag
    out = tmp_path / "train.jsonl"
    assert main(["--out", str(out), f"nq={nq}", f"hotpotqa={hotpot}"]) == 0
    recipe = load_config(RunConfig, REPO / "recipes" / "qwen2.5_3b_search_ema_pg.yaml", [f"data.train_files=[{out}]"])
    dataset = load_prompt_dataset(recipe.data, _PlainTokenizer())
    assert len(dataset) == 5
    example = dataset.examples[3]
    assert example.answer == ["Arthur's Magazine"]
    assert example.meta["columns"] == {"data_source": "hotpotqa", "id": "hotpotqa/train/train_0"}
