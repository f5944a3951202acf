"""The validation pass (``validation`` section): its config checks, the validation sets by data
source, and the metrics of ``RolloutStage.validate`` with a scripted engine whose answers are
known, against counts made by hand. The pass inside a real run (synced weights, the search agent,
step-0 and interval records) is in ``test_search_agent_e2e.py``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest

from megatron_empg.config import ConfigError, DataConfig, RunConfig, SamplingConfig, from_dict
from megatron_empg.parallel.placement import EnginePlacement
from megatron_empg.rollout.data import DataError, load_validation_sets
from megatron_empg.rollout.engine import Completion
from megatron_empg.tasks.registry import REWARDS
from megatron_empg.trainer.engines.collect import Scorer
from megatron_empg.trainer.engines.rollout import RolloutStage
from megatron_empg.trainer.engines.sums import sample_means
from tools.make_tiny_model import char_tokenizer

QA = DataConfig(
    source="files",
    reward="qa_em",
    train_files=["unused.jsonl"],
    prompt_key="question",
    answer_key="golden_answers",
    apply_chat_template=False,
)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer(128)


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _question(country: str, source: str | None = None) -> dict:
    row = {"question": f"Capital of {country}?", "golden_answers": [CAPITALS[country]]}
    return row if source is None else {**row, "data_source": source}


CAPITALS = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid"}


def _run_config(validation: dict, **sections) -> RunConfig:
    return from_dict(RunConfig, {"model": "demo-qwen2", "tokenizer": "tok", "validation": validation, **sections})


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "validation, field, reason",
    [
        ({"interval": 5}, "validation.files", "a validation pass (interval > 0 or at_start) needs at least one file"),
        ({"at_start": True}, "validation.files", "needs at least one file"),
        ({"files": ["v.jsonl"]}, "validation.interval", "files are set but no pass is asked for"),
        ({"files": ["v.csv"], "interval": 5}, "validation.files[0]", "expected a .parquet or .jsonl file, got 'v.csv'"),
        ({"files": ["v.jsonl"], "interval": -1}, "validation.interval", "must be >= 0"),
        (
            {"files": ["v.jsonl"], "interval": 5, "max_prompts_per_source": 0},
            "validation.max_prompts_per_source",
            "must be >= 1 or null",
        ),
        ({"files": ["v.jsonl"], "interval": 5, "n": 0}, "validation.n", "must be >= 1"),
        ({"files": ["v.jsonl"], "interval": 5, "batch_size": 0}, "validation.batch_size", "must be >= 1"),
        ({"files": ["v.jsonl"], "interval": 5, "temperature": -0.5}, "validation.temperature", "must be >= 0"),
        ({"files": ["v.jsonl"], "interval": 5, "top_p": 0.0}, "validation.top_p", "must be in (0, 1]"),
        ({"files": ["v.jsonl"], "interval": 5, "top_k": 0}, "validation.top_k", "must be >= 1 or null"),
        ({"files": ["v.jsonl"], "interval": 5, "every": 3}, "validation.every", "unknown key"),
    ],
)
def test_bad_validation_settings_name_the_field(validation, field, reason):
    with pytest.raises(ConfigError) as error:
        _run_config(validation)
    assert error.value.field == field and reason in error.value.reason


def test_the_interval_must_be_a_multiple_of_the_logging_interval():
    with pytest.raises(ConfigError) as error:
        _run_config({"files": ["v.jsonl"], "interval": 5}, logging={"interval": 2})
    assert error.value.field == "validation.interval"
    assert error.value.reason == "must be a multiple of logging.interval=2, got 5"
    assert _run_config({"files": ["v.jsonl"], "interval": 4}, logging={"interval": 2}).validation.interval == 4


def test_validation_sampling_keeps_the_rollout_limits_and_changes_the_draw():
    rollout = SamplingConfig(n=8, temperature=1.0, top_p=0.95, top_k=50, max_tokens=77, stop=["</answer>"], seed=3)
    config = _run_config({"files": ["v.jsonl"], "interval": 1})
    assert config.validation.sampling(rollout) == SamplingConfig(
        n=1, temperature=0.0, top_p=1.0, top_k=None, max_tokens=77, stop=["</answer>"], seed=3
    )


# ------------------------------------------------------------------ validation sets


def test_validation_sets_by_data_source_in_file_order(tmp_path, tokenizer):
    mixed = _write(
        tmp_path / "test.jsonl",
        [
            _question("France", "nq"),
            _question("Germany", "hotpotqa"),
            _question("Japan", "nq"),
            _question("Italy", "nq"),
        ],
    )
    plain = _write(tmp_path / "bamboogle.jsonl", [_question("Spain"), _question("France")])
    sets = load_validation_sets(QA, [mixed, plain], tokenizer)
    assert list(sets) == ["nq", "hotpotqa", "bamboogle"]  # a data_source column, else the file's name
    assert [[e.answer[0] for e in examples] for examples in sets.values()] == [
        ["Paris", "Tokyo", "Rome"],
        ["Berlin"],
        ["Madrid", "Paris"],
    ]
    assert tokenizer.decode(sets["hotpotqa"][0].prompt_ids) == "Capital of Germany?"
    capped = load_validation_sets(QA, [mixed, plain], tokenizer, max_per_source=2)
    assert {source: [e.answer[0] for e in examples] for source, examples in capped.items()} == {
        "nq": ["Paris", "Tokyo"],
        "hotpotqa": ["Berlin"],
        "bamboogle": ["Madrid", "Paris"],
    }


def test_a_malformed_validation_record_names_its_file_and_row(tmp_path, tokenizer):
    path = _write(tmp_path / "v.jsonl", [_question("France"), {"question": "no answer"}])
    with pytest.raises(DataError) as error:
        load_validation_sets(QA, [path], tokenizer)
    assert error.value.file == path and error.value.row == 2 and "missing key 'golden_answers'" in error.value.reason


# ------------------------------------------------------------------ metrics


class CountryEngine:
    """A ``RolloutEngine`` that answers ``<answer>CITY</answer>`` for the countries in ``known``
    and ``<answer>Atlantis</answer>`` otherwise, ``n`` identical completions per prompt, with eos
    after the answer. Records each call's number of prompts."""

    def __init__(self, tokenizer, known: dict[str, str]) -> None:
        self.tokenizer, self.known, self.calls = tokenizer, known, []

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            country = self.tokenizer.decode(prompt).removeprefix("Capital of ").removesuffix("?")
            text = f"<answer>{self.known.get(country, 'Atlantis')}</answer>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append([Completion(ids, [-0.5] * len(ids), "stop", None) for _ in range(sampling.n)])
        return out


def test_validation_metrics_per_source_and_overall(tmp_path, tokenizer):
    path = _write(
        tmp_path / "test.jsonl",
        [
            _question("France", "nq"),
            _question("Japan", "nq"),
            _question("Italy", "nq"),
            _question("Germany", "hotpotqa"),
            _question("Spain", "hotpotqa"),
        ],
    )
    config = _run_config({"files": [path], "interval": 1, "n": 2, "batch_size": 2})
    engine = CountryEngine(tokenizer, {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin"})
    stage = RolloutStage.__new__(RolloutStage)  # one engine, no process group: what validate reads
    stage.config, stage.engine, stage.agent = config, engine, None
    stage.placement = EnginePlacement(
        num_engines=1,
        engine=0,
        owners=(0,),
        members=((0,),),
        group=None,
        feeds_engine=True,
        rank=0,
        node_slot=0,
        node_slots=1,
        local_rank=0,
    )
    metrics = stage.validate(
        load_validation_sets(QA, [path], tokenizer), Scorer(config, tokenizer, REWARDS["qa_em"]), step=7
    )

    assert engine.calls == [2, 1, 2]  # batch_size prompts per call, source by source
    assert metrics["val/nq/reward/accuracy"] == pytest.approx(2 / 3)  # Paris, Tokyo right; Atlantis wrong
    assert metrics["val/hotpotqa/reward/accuracy"] == pytest.approx(1 / 2)
    assert metrics["val/reward/accuracy"] == pytest.approx(3 / 5)  # over all 10 samples
    assert metrics["val/nq/reward/exact_match"] == pytest.approx(2 / 3) and metrics["val/reward/f1"] == pytest.approx(
        3 / 5
    )
    assert metrics["val/nq/reward/mean"] == pytest.approx(2 / 3)
    assert metrics["val/reward/std"] == pytest.approx(math.sqrt(3 / 5 * 2 / 5))
    lengths = {c: len(f"<answer>{c}</answer>") + 1 for c in ("Paris", "Tokyo", "Atlantis", "Berlin")}  # + eos
    assert metrics["val/nq/response/length_mean"] == pytest.approx(
        (lengths["Paris"] + lengths["Tokyo"] + lengths["Atlantis"]) / 3
    )
    assert metrics["val/response/length_mean"] == pytest.approx(
        (lengths["Paris"] + lengths["Tokyo"] + 2 * lengths["Atlantis"] + lengths["Berlin"]) / 5
    )
    assert metrics["val/response/truncated_fraction"] == 0.0 and metrics["time/validation"] >= 0
    per_source = {k for k in metrics if k.startswith("val/nq/")}
    assert {k.replace("val/nq/", "val/hotpotqa/") for k in per_source} <= set(metrics)


def test_sample_means_of_summed_counts():
    totals = {
        "reward_sum": 3.0,
        "reward_sq_sum": 5.0,
        "correct": 2,
        "samples": 4,
        "response_tokens": 40,
        "truncated": 1,
        "rollout/searches": 6,
        "reward/f1": 2.5,
    }
    assert sample_means(totals) == {
        "reward/mean": 0.75,
        "reward/std": math.sqrt(5 / 4 - 0.75**2),
        "reward/accuracy": 0.5,
        "response/length_mean": 10.0,
        "response/truncated_fraction": 0.25,
        "rollout/searches_mean": 1.5,
        "reward/f1": 0.625,
    }
