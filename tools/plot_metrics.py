"""Plot the metrics of a training run's JSONL file over ``step``, one PNG per metric.

    python tools/plot_metrics.py METRICS.jsonl OUT_DIR [--keys reward/mean,kl/mean,...]

METRICS.jsonl holds one JSON object per line with a numeric ``step``; nested objects are flattened
with "/" (``{"reward": {"mean": 0.5}}`` is ``reward/mean``). A metric's curve has a point at every
line where it is a finite number: missing keys, strings, bools, null, NaN and infinities are
skipped, and where a step appears on several lines (a resumed run) the last one wins. Without
``--keys`` every metric with a numeric value is plotted; a requested key without one is reported
and skipped. OUT_DIR/<metric>.png is written for each (characters other than letters, digits,
"." and "-" become "_"). Blank lines are skipped.

Exit status: 0 when something was plotted; 1 for a malformed line (the message names the file and
line) or nothing to plot; 2 for a usage error (e.g. METRICS.jsonl does not exist).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Series = dict[str, dict[float, float]]  # metric -> {step: value}


class MetricsFileError(ValueError):
    """A line of a metrics file is malformed; the message starts with ``file:line:``."""


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(path: str | Path) -> Series:
    """Every metric of a JSONL metrics file with its finite numeric values by step."""
    series: Series = {}
    with Path(path).open(encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise MetricsFileError(f"{where}: invalid JSON: {error.msg} at column {error.colno}") from None
            if not isinstance(record, dict):
                raise MetricsFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
            step = record.get("step")
            if not _is_number(step):
                raise MetricsFileError(f"{where}: expected a finite number under 'step', got {step!r}")
            for key, value in _flatten(record).items():
                if key != "step" and _is_number(value):
                    series.setdefault(key, {})[float(step)] = float(value)
    return series


def _file_names(keys: list[str]) -> dict[str, str]:
    """A distinct PNG file name for each metric."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        stem = re.sub(r"[^A-Za-z0-9.\-]", "_", key)
        name, suffix = f"{stem}.png", 2
        while name in taken:
            name, suffix = f"{stem}-{suffix}.png", suffix + 1
        taken.add(name)
        names[key] = name
    return names


def plot_metrics(series: Series, out_dir: str | Path, *, title: str = "") -> list[Path]:
    """Write one PNG curve per metric of ``series`` (value over step) into ``out_dir``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name in _file_names(list(series)).items():
        steps = sorted(series[key])
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(steps, [series[key][s] for s in steps], marker="o" if len(steps) <= 50 else None, markersize=3)
        axes.set_xlabel("step")
        axes.set_ylabel(key)
        axes.set_title(f"{title}: {key}" if title else key)
        axes.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(out / name, dpi=100)
        plt.close(figure)
        written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="JSONL file: one JSON object with a 'step' per line")
    parser.add_argument("out_dir", type=Path, help="directory for the PNG files (created if missing)")
    parser.add_argument("--keys", help="comma-separated metrics to plot (default: every numeric one)")
    args = parser.parse_args(argv)
    if not args.metrics.is_file():
        parser.error(f"METRICS: no such file: {args.metrics}")
    try:
        series = read_metrics(args.metrics)
    except MetricsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.keys is not None:
        keys = [key.strip() for key in args.keys.split(",") if key.strip()]
        for key in keys:
            if key not in series:
                print(f"warning: no numeric values of {key!r} in {args.metrics}; skipped", file=sys.stderr)
        series = {key: series[key] for key in keys if key in series}
    if not series:
        print(f"error: nothing to plot from {args.metrics}", file=sys.stderr)
        return 1
    written = plot_metrics(series, args.out_dir, title=args.metrics.stem)
    print(f"wrote {len(written)} plots to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
