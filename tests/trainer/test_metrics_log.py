"""MetricsLogger: the JSONL file, the console (a bar on a terminal, else a line per step, and the
end-of-run summary), and Weights & Biases (a recording stand-in for the calls, and the real package
in offline mode for the files it writes)."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

from megatron_empg.config import RunConfig, from_dict
from megatron_empg.trainer.run.metrics_log import MetricsLogger, format_number, read_metrics


def _config(tmp_path, **logging) -> RunConfig:
    return from_dict(
        RunConfig,
        {
            "model": "tiny-qwen2",
            "tokenizer": "unused",
            "logging": {"dir": str(tmp_path / "run"), **logging},
            "checkpoint": {"dir": str(tmp_path / "run" / "checkpoints")},
        },
    )


@pytest.mark.parametrize("progress", ["auto", "rich", "tqdm", "none"])
def test_jsonl_has_every_step_with_non_finite_values_as_null(tmp_path, progress):
    logger = MetricsLogger(_config(tmp_path, progress=progress), total_steps=3)
    for step in (1, 2, 3):
        logger.log(step, {"reward/mean": 0.25 * step, "actor/kl": float("nan") if step == 2 else 0.5})
    logger.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 0.25, "actor/kl": 0.5},
        {"step": 2, "reward/mean": 0.5, "actor/kl": None},
        {"step": 3, "reward/mean": 0.75, "actor/kl": 0.5},
    ]


def test_a_resumed_run_replaces_the_records_of_the_steps_it_redoes(tmp_path):
    config = _config(tmp_path, progress="none")
    first = MetricsLogger(config, total_steps=5)
    for step in (1, 2, 3, 4):  # checkpointed at 2, crashed after 4
        first.log(step, {"reward/mean": float(step)})
    first.close()
    resumed = MetricsLogger(config, total_steps=5)
    for step in (3, 4, 5):
        resumed.log(step, {"reward/mean": 10.0 * step})
    resumed.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
    fresh = MetricsLogger(config, total_steps=1)  # a fresh run in the same directory starts over
    fresh.log(1, {"reward/mean": 0.5})
    fresh.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5}]


def test_interval_and_disabled_ranks_write_nothing_else(tmp_path):
    logger = MetricsLogger(_config(tmp_path, progress="none", interval=2), total_steps=4)
    for step in range(1, 5):
        logger.log(step, {"reward/mean": float(step)})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [2, 4]
    other = MetricsLogger(_config(tmp_path / "other", progress="rich"), total_steps=4, enabled=False)
    other.log(2, {"reward/mean": 1.0})
    other.close()
    assert not (tmp_path / "other").exists()


def _unset_wandb_env(monkeypatch) -> None:
    """No key and no mode, restored afterwards (the logger sets WANDB_MODE itself)."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.setenv(name, "")  # records the original value for the teardown
        monkeypatch.delenv(name)


def test_wandb_gets_the_config_and_finite_metrics_offline_without_a_key(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs, __import__("os").environ.get("WANDB_MODE")))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    _unset_wandb_env(monkeypatch)
    logger = MetricsLogger(_config(tmp_path, progress="none", wandb=True, wandb_run_name="r1"), total_steps=2)
    logger.log(1, {"reward/mean": 0.5, "actor/kl": float("inf")})
    logger.close()
    (_, kwargs, mode), log, finish = calls
    assert mode == "offline" and kwargs["name"] == "r1" and kwargs["project"] == "megatron-empg"
    assert kwargs["dir"] == str(tmp_path / "run") and kwargs["config"]["model"] == "tiny-qwen2"
    assert log == ("log", 1, {"reward/mean": 0.5}) and finish == ("finish",)


def test_real_wandb_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    _unset_wandb_env(monkeypatch)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(_config(tmp_path, progress="none", wandb=True), total_steps=2)
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.75})
    logger.close()
    [run_dir] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    [records] = run_dir.glob("*.wandb")
    assert records.stat().st_size > 0
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["reward/mean"] == 0.75


# A step's metrics as Trainer.step returns them (a long-context GRPO step on GPUs)
STEP = {
    "reward/mean": 0.41234,
    "reward/std": 0.49,
    "reward/accuracy": 0.398,
    "reward/malformed": 0.0125,
    "response/length_mean": 2311.4,
    "response/truncated_fraction": 0.031,
    "response/loss_tokens_mean": 2311.4,
    "perf/tokens_per_second": 12468.0,
    "time/rollout": 60.13,
    "time/rewards": 0.84,
    "time/advantages": 0.012,
    "time/old_pass": 9.02,
    "time/anchor_pass": 8.11,
    "time/update": 11.9,
    "time/ema_update": 0.21,
    "time/weight_sync": 5.104,
    "actor/loss": -0.0213,
    "actor/policy_loss": -0.0214,
    "actor/kl": 0.0012345,
    "actor/entropy": 0.5301,
    "actor/grad_norm": 0.173,
    "actor/lr": 1e-06,
    "actor/ratio": 1.0002,
    "train/skipped_steps": 0.0,
    "sync/seconds": 3.9,
    "sync/gbytes": 3.09,
    "sync/gate_max_logprob_diff": 2.4e-05,
    "anchor/updates": 1.0,
}
VALIDATION = {"val/reward/mean": 0.5, "val/reward/accuracy": 0.45, "val/math/reward/mean": 0.5, "time/validation": 3.21}
TRAIN_TIMES = ("time/rewards", "time/advantages", "time/old_pass", "time/anchor_pass", "time/update", "time/ema_update")


def _console(config, total_steps, monkeypatch, *, tty: bool, records, enabled: bool = True) -> MetricsLogger:
    """A logger on a stdout that is (``tty``) or is not a terminal, given ``records``, closed."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    logger = MetricsLogger(config, total_steps, enabled=enabled)
    for step, metrics in records:
        logger.log(step, metrics)
    logger.close()
    return logger


def _pairs(text: str) -> dict[str, str]:
    """``label number`` pairs of a line's part."""
    return dict(re.findall(r"([a-z]+) (-?[0-9][0-9.e+-]*|nan|-?inf)", text))


def test_without_a_terminal_a_line_per_step_names_each_metric_formatted(tmp_path, capsys, monkeypatch):
    config = _config(tmp_path)  # progress: auto
    _console(config, 480, monkeypatch, tty=False, records=[(12, STEP)])
    line = capsys.readouterr().out.splitlines()[0]
    assert line == (
        "step 12/480 | reward 0.412 acc 0.398 kl 1.2e-03 entropy 0.530 len 2311 | "
        "95.3 s: rollout 60.1 train 30.1 sync 5.10"
    )
    head, metrics, times = line.split(" | ")
    assert head == "step 12/480"
    names = {
        "reward": "reward/mean",
        "acc": "reward/accuracy",
        "kl": "actor/kl",
        "entropy": "actor/entropy",
        "len": "response/length_mean",
    }
    assert _pairs(metrics) == {label: format_number(STEP[key]) for label, key in names.items()}
    total, split = times.split(" s: ")
    step_seconds = sum(v for k, v in STEP.items() if k.startswith("time/"))
    assert total == format_number(step_seconds)
    assert _pairs(split) == {
        "rollout": format_number(STEP["time/rollout"]),
        "train": format_number(sum(STEP[k] for k in TRAIN_TIMES)),
        "sync": format_number(STEP["time/weight_sync"]),
    }
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"step": 12, **STEP}]


def test_a_distillation_run_shows_its_kl_to_the_teacher_and_its_pass_in_train(tmp_path, capsys, monkeypatch):
    step = {**STEP, "distill/kl": 0.0731, "time/teacher_pass": 4.5}
    _console(_config(tmp_path), 480, monkeypatch, tty=False, records=[(12, step)])
    _, metrics, times = capsys.readouterr().out.splitlines()[0].split(" | ")
    assert _pairs(metrics)["distill"] == "0.0731" and "kl 1.2e-03 distill" in metrics
    assert _pairs(times.split(" s: ")[1])["train"] == format_number(sum(STEP[k] for k in TRAIN_TIMES) + 4.5)


def test_validation_gets_a_line_of_its_own_or_joins_its_step(tmp_path, capsys, monkeypatch):
    partial = {"reward/mean": 0.0234, "actor/kl": -0.0001023, "time/rollout": 0.21, "time/weight_sync": 0.047}
    _console(
        _config(tmp_path),
        3,
        monkeypatch,
        tty=False,
        records=[(0, VALIDATION), (1, partial), (2, {**STEP, **VALIDATION})],
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "validation step 0/3 | reward 0.500 acc 0.450 | 3.21 s"
    assert lines[1] == "step 1/3 | reward 0.0234 kl -1.0e-04 | 0.257 s: rollout 0.210 sync 0.0470"  # no others
    assert lines[2] == (
        "step 2/3 | reward 0.412 acc 0.398 kl 1.2e-03 entropy 0.530 len 2311 | val reward 0.500 "
        "acc 0.450 | 98.5 s: rollout 60.1 train 30.1 sync 5.10 val 3.21"
    )
    assert lines[3].startswith("run summary: steps 1..2 of 3, ")  # the validation pass is no step


@pytest.mark.parametrize("progress", ["auto", "rich", "tqdm"])
def test_a_terminal_gets_a_bar_and_no_step_lines(tmp_path, capsys, monkeypatch, progress):
    from rich.progress import Progress
    from tqdm import tqdm

    logger = _console(_config(tmp_path, progress=progress), 2, monkeypatch, tty=True, records=[(1, STEP), (2, STEP)])
    assert isinstance(logger._progress, tqdm if progress == "tqdm" else Progress)
    out = capsys.readouterr().out
    assert not re.search(r"^step \d", out, re.MULTILINE)
    assert "reward 0.412 acc 0.398" in out  # the key metrics beside the bar
    assert "run summary: steps 1..2 of 2" in out
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 2


@pytest.mark.parametrize("tty", [True, False])
def test_progress_none_and_other_ranks_print_nothing(tmp_path, capsys, monkeypatch, tty):
    records = [(0, VALIDATION), (1, STEP)]
    none = _console(_config(tmp_path, progress="none"), 2, monkeypatch, tty=tty, records=records)
    _console(_config(tmp_path / "other"), 2, monkeypatch, tty=tty, records=records, enabled=False)
    assert capsys.readouterr() == ("", "")
    assert none._progress is None
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_the_summary_names_the_steps_rewards_and_where_everything_is(tmp_path, capsys, monkeypatch):
    rewards = {3: 0.25, 4: 0.5, 5: float("nan"), 6: 0.5, 7: 0.375}  # a resumed run: steps 3..7 of 10
    records = [(step, {**STEP, "reward/mean": reward}) for step, reward in rewards.items()]
    _console(_config(tmp_path), 10, monkeypatch, tty=False, records=records)
    run = tmp_path / "run"
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 + 5
    assert re.fullmatch(r"run summary: steps 3\.\.7 of 10, \d+ s", out[5])
    assert out[6:] == [
        "  reward/mean: best 0.500 (step 4), last 0.375 (step 7)",  # the first of equal bests; NaN skipped
        f"  metrics:     {run / 'metrics.jsonl'}",
        f"  plots:       python tools/plot_metrics.py {run / 'metrics.jsonl'} {run / 'plots'}",
        f"  checkpoints: {run / 'checkpoints'}",
    ]


def test_the_summary_of_a_run_without_steps_or_metrics_file(tmp_path, capsys, monkeypatch):
    _console(_config(tmp_path, jsonl=False), 10, monkeypatch, tty=False, records=[])
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"run summary: no step logged, \d+ s", out[0])
    assert out[1:] == [f"  checkpoints: {tmp_path / 'run' / 'checkpoints'}"]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (0.412345, "0.412"),
        (-0.0001023, "-1.0e-04"),
        (0.0125, "0.0125"),
        (0.00999, "1.0e-02"),
        (5.104, "5.10"),
        (95.26, "95.3"),
        (2311.4, "2311"),
        (99999.4, "99999"),
        (123456.0, "1.2e+05"),
        (3e-9, "3.0e-09"),
        (float("nan"), "nan"),
        (float("-inf"), "-inf"),
    ],
)
def test_numbers_keep_three_significant_digits_over_orders_of_magnitude(value, text):
    assert format_number(value) == text


def test_a_torn_last_line_is_dropped_and_a_bad_line_elsewhere_names_the_file_and_line(tmp_path, caplog):
    from megatron_empg.trainer.run.metrics_log import MetricsFileError

    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    records = [json.dumps({"step": s, "reward/mean": s / 10}) for s in (1, 2, 3)]
    path.write_text("\n".join(records) + '\n{"step": 4, "reward/me')  # a crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert "dropping its last line 4, torn by a crash" in caplog.text
    resumed = MetricsLogger(_config(tmp_path, progress="none"), total_steps=4)  # resumed from step 2's checkpoint
    resumed.log(3, {"reward/mean": 3.5})
    resumed.close()
    assert path.read_text() == "\n".join(records[:2]) + '\n{"step": 3, "reward/mean": 3.5}\n'

    path.write_text(records[0] + "\n{oops\n" + records[2] + "\n")
    with pytest.raises(MetricsFileError, match=rf"{re.escape(str(path))}: line 2 is not a metrics record"):
        read_metrics(path)
    with pytest.raises(MetricsFileError, match="line 2"):
        MetricsLogger(_config(tmp_path, progress="none"), total_steps=4).log(2, {"reward/mean": 1.0})
