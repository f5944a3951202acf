"""tools/plot_metrics.py: PNG curves of a JSONL metrics file, robust to missing and non-numeric
values, with errors that name the file and line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.plot_metrics import main, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"


def write_lines(path: Path, lines: list[object | str]) -> Path:
    """Each item a JSON value, or a str written verbatim."""
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines))
    return path


@pytest.fixture
def metrics_file(tmp_path) -> Path:
    return write_lines(
        tmp_path / "metrics.jsonl",
        [
            {"step": 0, "loss": 1.0, "reward": {"mean": 0.1, "max": 1}, "note": "start"},
            {"step": 1, "loss": 0.8, "reward": {"mean": 0.2}, "gate_ok": True},
            "",
            {"step": 2, "loss": "nan?", "reward": {"mean": 0.3}},  # a string: no point
            {"step": 3, "loss": None, "kl": float("nan")},  # null and NaN: no point
            {"step": 2, "loss": 0.5},  # a resumed run repeats step 2: the later line wins
            {"step": 4.0, "loss": 0.4, "kl": float("inf")},
        ],
    )


def test_read_metrics_keeps_finite_numbers_by_step(metrics_file):
    series = read_metrics(metrics_file)
    assert series == {
        "loss": {0.0: 1.0, 1.0: 0.8, 2.0: 0.5, 4.0: 0.4},
        "reward/mean": {0.0: 0.1, 1.0: 0.2, 2.0: 0.3},
        "reward/max": {0.0: 1.0},
    }


def test_every_numeric_metric_becomes_a_png(metrics_file, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main([str(metrics_file), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "reward_max.png", "reward_mean.png"]
    for png in out.iterdir():
        assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert "wrote 3 plots" in capsys.readouterr().out


def test_keys_select_metrics_and_a_missing_key_is_reported(metrics_file, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main([str(metrics_file), str(out), "--keys", "reward/mean, kl,absent"]) == 0
    assert [p.name for p in out.iterdir()] == ["reward_mean.png"]
    err = capsys.readouterr().err
    assert "no numeric values of 'kl'" in err and "no numeric values of 'absent'" in err
    assert main([str(metrics_file), str(out), "--keys", "absent"]) == 1
    assert "nothing to plot" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"step": 3, "loss": ', "invalid JSON: Expecting value"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"loss": 1.0}, "expected a finite number under 'step', got None"),
        ({"step": "3"}, "expected a finite number under 'step', got '3'"),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path, capsys, bad, message):
    path = write_lines(tmp_path / "m.jsonl", [{"step": 0, "loss": 1}, "", bad])
    assert main([str(path), str(tmp_path / "plots")]) == 1
    assert f"error: {path}:3: {message}" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()


def test_a_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "none.jsonl"), str(tmp_path / "plots")])
    assert exit_info.value.code == 2


def test_it_runs_as_a_script(metrics_file, tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), str(metrics_file), str(tmp_path / "plots"), "--keys", "loss"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plots" / "loss.png").read_bytes().startswith(PNG_SIGNATURE)
