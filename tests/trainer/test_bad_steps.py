"""``trainer.run.bad_steps.BadSteps``: the refusals in a row (a step's optimizer steps in order, an
applied one ends the run of them), the limit, the state a checkpoint holds (an older checkpoint
without it loads as none), and the saved batch with its ``BadStepsError``. End to end:
``test_bad_steps_e2e.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_empg.config import TrainConfig
from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.run.bad_steps import BadSteps, BadStepsError


def test_refusals_in_a_row_count_until_an_applied_step_and_stop_at_the_limit():
    bad = BadSteps(TrainConfig(max_consecutive_skips=3))
    assert bad.record(1, [None, "non-finite loss (nan)"]) == 1 and bad.in_a_row == ["step 1: non-finite loss (nan)"]
    assert bad.record(2, ["x", None]) == 1 and bad.in_a_row == []  # the step's last optimizer step applied
    assert bad.record(3, ["a", "b"]) == 2 and not bad.exhausted
    # the third refusal in a row reaches the limit: what follows in the step does not undo it
    assert bad.record(4, ["c", None]) == 1 and bad.exhausted
    assert bad.in_a_row == ["step 3: a", "step 3: b", "step 4: c"]


def test_the_state_round_trips_and_an_older_checkpoint_has_none():
    bad = BadSteps(TrainConfig(max_consecutive_skips=2))
    for norm in (1.0, 2.0, 3.0):
        bad.guard.record(norm)
    bad.record(5, ["non-finite gradient norm (inf)"])
    state = bad.state_dict()
    restored = BadSteps(TrainConfig(max_consecutive_skips=2))
    restored.load_state_dict(state)
    assert restored.guard.history == [1.0, 2.0, 3.0] and restored.in_a_row == ["step 5: non-finite gradient norm (inf)"]
    restored.record(6, ["non-finite loss (nan)"])
    assert restored.exhausted and not bad.exhausted  # a copy, not the saved lists
    restored.load_state_dict(None)
    assert restored.guard.history == [] and restored.in_a_row == []


def test_the_limit_saves_the_steps_samples_and_names_field_step_reasons_and_path(tmp_path):
    bad = BadSteps(TrainConfig(max_consecutive_skips=1))
    bad.record(7, ["non-finite loss (nan)"])
    samples = [
        Sample([1, 2], [3, 4, 5], [0.0] * 3, "stop", group=0, reward=1.0, correct=True, version=6),
        Sample([1, 2], [6], [0.0], "length", group=0, version=6),
    ]
    lead = SimpleNamespace(tp_rank=0, pp_rank=0, cp_rank=0, dp_rank=1)
    error = bad.stop(7, samples, torch.tensor([0.5, -0.5]), tmp_path, lead)
    path = tmp_path / "bad_step_7"
    assert isinstance(error, BadStepsError) and (error.step, error.path) == (7, path)
    assert str(error) == (
        f"train.max_consecutive_skips=1: 1 optimizer steps in a row were refused, the last at step 7 "
        f"(step 7: non-finite loss (nan)); the samples of step 7 are in {path}"
    )
    records = [json.loads(line) for line in (path / "samples_dp1.jsonl").read_text().splitlines()]
    assert [(r["response_ids"], r["reward"], r["correct"], r["advantage"], r["version"]) for r in records] == [
        ([3, 4, 5], 1.0, True, 0.5, 6),
        ([6], 0.0, False, -0.5, 6),
    ]
    assert json.loads((path / "reason.json").read_text())["refused"] == ["step 7: non-finite loss (nan)"]
    # a rank that is not its replica's first tensor-parallel rank writes no samples
    second_tp_rank = SimpleNamespace(tp_rank=1, pp_rank=0, cp_rank=0, dp_rank=0)
    bad.stop(7, samples, torch.tensor([0.5, -0.5]), tmp_path, second_tp_rank)
    assert sorted(p.name for p in path.iterdir()) == ["reason.json", "samples_dp1.jsonl"]
    with pytest.raises(ValueError):  # one advantage per sample
        bad.stop(7, samples, torch.tensor([0.5]), tmp_path, lead)
