"""tools/prepare_dapo_math.py: DAPO-Math-17k's repeated rows kept once per problem, the Chinese
problems dropped, the instruction cut off (the recipes' prompt_template puts it back, so the
prompt the engine sees is DAPO's), validation sets in the same schema; bad rows named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_empg.config import RunConfig, load_config
from tools.prepare_dapo_math import DAPO_PREFIX, DAPO_SUFFIX, main


def _dapo_row(problem: str, answer: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
    }


def test_train_and_validation_sets(tmp_path, capsys):
    rows = [
        _dapo_row("What is $1+1$?", "2"),
        _dapo_row("求 $2+2$ 的值。", "4"),
        _dapo_row("What is $1+1$?", "2"),
        _dapo_row("Find $x$ if $2x = 6$.", "3"),
    ]
    pq.write_table(pa.Table.from_pylist(rows * 3), tmp_path / "dapo.parquet")
    (tmp_path / "amc.jsonl").write_text(json.dumps({"question": "How many?", "answer": 27.0}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"problem": " Find N. ", "answer": 204}]), tmp_path / "aime24.parquet")
    out = tmp_path / "out"
    code = main(
        [
            "--out",
            str(out),
            "--train",
            str(tmp_path / "dapo.parquet"),
            f"aime24={tmp_path / 'aime24.parquet'}",
            f"amc23={tmp_path / 'amc.jsonl'}:question",
        ]
    )
    assert code == 0
    assert "2 problems (12 rows, 3 distinct problems, 1 Chinese dropped)" in capsys.readouterr().out
    assert pq.read_table(out / "dapo_math_17k_en.parquet").to_pylist() == [
        {"problem": "What is $1+1$?", "answer": "2", "data_source": "dapo_math_17k_en"},
        {"problem": "Find $x$ if $2x = 6$.", "answer": "3", "data_source": "dapo_math_17k_en"},
    ]
    assert pq.read_table(out / "aime24.parquet").to_pylist() == [
        {"problem": "Find N.", "answer": "204", "data_source": "aime24"}
    ]
    assert pq.read_table(out / "amc23.parquet").to_pylist() == [
        {"problem": "How many?", "answer": "27", "data_source": "amc23"}
    ]
    # the recipes' template rebuilds DAPO's prompt exactly
    template = load_config(RunConfig, "recipes/qwen3_4b_dapo_math_rpg_urkl.yaml").data.prompt_template
    assert template.format(prompt="What is $1+1$?") == rows[0]["prompt"][0]["content"]


def test_bad_rows_and_usage(tmp_path, capsys):
    bad = _dapo_row("What?", "1")
    bad["prompt"][0]["content"] = "Just: What?"
    pq.write_table(pa.Table.from_pylist([_dapo_row("Fine?", "1"), bad]), tmp_path / "dapo.parquet")
    assert main(["--out", str(tmp_path / "o"), "--train", str(tmp_path / "dapo.parquet")]) == 1
    assert "dapo.parquet: row 2: prompt: not DAPO's instruction" in capsys.readouterr().err
    (tmp_path / "v.jsonl").write_text(json.dumps({"problem": "P", "answer": ""}) + "\n")
    assert main(["--out", str(tmp_path / "o"), f"v={tmp_path / 'v.jsonl'}"]) == 1
    assert "v.jsonl: row 1: answer: expected an answer" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "o"), f"v={tmp_path / 'missing.jsonl'}"]) == 2
    assert main(["--out", str(tmp_path / "o")]) == 2
    assert main(["--out", str(tmp_path / "o"), "no-equals-sign"]) == 2
