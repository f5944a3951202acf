"""Where each step's metrics go (rank 0 only): ``<logging.dir>/metrics.jsonl`` (one JSON object per
step, with ``step``; a resumed run first drops the records of the steps it redoes), the console
(stdout), and Weights & Biases (offline mode when no ``WANDB_API_KEY`` is set; ``wandb`` is
imported only when enabled).

The console, by ``logging.progress``: where stdout is a terminal, a progress bar (rich's for
``auto`` and ``rich``, tqdm's for ``tqdm``) with the key metrics beside it; elsewhere (a Slurm log
file, a pipe), for those three, one line per logged step, flushed as it is written::

    step 12/480 | reward 0.412 acc 0.398 kl 1.2e-03 entropy 0.530 len 2311 | 95.2 s: rollout 60.1 train 30.0 sync 5.10

``train`` is the time of rewards, advantages, the old and anchor passes, the update and the EMA
update; ``sync`` the weight sync with its consistency gate; the total is that of the parts.
A metric a record lacks is left out. A validation pass after a step joins its line (``| val
reward 0.5 acc 0.45`` and ``val`` time); one of its own (before the first step) gets a line
``validation step 0/480 | reward 0.5 acc 0.45 | 3.21 s``. Numbers: ``format_number``. ``close``
prints a summary: the steps logged, the best and last ``reward/mean``, where the metrics file and
the checkpoints are and how to plot the metrics. ``none``: nothing on the console.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_empg.config import LoggingConfig, RunConfig, to_dict

# (label, metric) of a step line's metrics, and of its validation part
STEP_METRICS = (
    ("reward", "reward/mean"),
    ("acc", "reward/accuracy"),
    ("kl", "actor/kl"),
    ("distill", "distill/kl"),  # with algorithm.distill only
    ("entropy", "actor/entropy"),
    ("len", "response/length_mean"),
)
VALIDATION_METRICS = (("reward", "val/reward/mean"), ("acc", "val/reward/accuracy"))
# (label, the timings it adds up) of a line's time split: every time/ key of a step and a validation pass
TIME_PARTS = (
    ("rollout", ("time/rollout", "time/rollout_wait")),
    (
        "train",
        (
            "time/rewards",
            "time/advantages",
            "time/old_pass",
            "time/anchor_pass",
            "time/teacher_pass",
            "time/update",
            "time/ema_update",
        ),
    ),
    ("sync", ("time/weight_sync",)),
    ("val", ("time/validation",)),
)
PLOT_TOOL = "tools/plot_metrics.py"

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, config: RunConfig, total_steps: int, *, enabled: bool = True) -> None:
        self.settings: LoggingConfig = config.logging
        self.enabled = enabled
        self.total_steps = total_steps
        self.jsonl_path = Path(self.settings.dir) / "metrics.jsonl"
        self.checkpoint_dir = config.checkpoint.dir
        # "off", "bar" (a terminal) or "lines" (a log file, a pipe)
        self.console = (
            "off" if not enabled or self.settings.progress == "none" else ("bar" if sys.stdout.isatty() else "lines")
        )
        self._progress = None
        self._wandb_run = None
        self._rewound = False
        self._start = time.monotonic()
        self._steps: tuple[int, int] | None = None  # the first and last step logged (no validation pass of its own)
        self._best: tuple[int, float] | None = None  # (step, reward/mean) of the best finite reward/mean
        self._last: tuple[int, float] | None = None  # and of the last
        if not enabled:
            return
        Path(self.settings.dir).mkdir(parents=True, exist_ok=True)
        if self.console == "bar" and self.settings.progress == "tqdm":
            from tqdm import tqdm

            self._progress = tqdm(total=total_steps, desc="RL steps", dynamic_ncols=True, file=sys.stdout)
        elif self.console == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("RL step"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=total_steps)
        if self.settings.wandb:
            import wandb

            if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
                os.environ["WANDB_MODE"] = "offline"
            self._wandb_run = wandb.init(
                project=self.settings.wandb_project,
                name=self.settings.wandb_run_name,
                dir=self.settings.dir,
                config=to_dict(config),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or step % self.settings.interval:
            return
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        if self.settings.jsonl:
            if not self._rewound:
                self._rewind(step)
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **clean}) + "\n")
        if not _validation_only(metrics):
            self._steps = (step if self._steps is None else self._steps[0], step)
            if clean.get("reward/mean") is not None:
                self._last = step, clean["reward/mean"]
                if self._best is None or self._last[1] > self._best[1]:  # the first of equal ones
                    self._best = self._last
        if self.console == "lines":
            print(console_line(step, self.total_steps, metrics), flush=True)
        elif self.settings.progress == "tqdm" and self._progress is not None:
            self._progress.update(step - self._progress.n)
            self._progress.set_postfix_str(_metrics_text(metrics))
        elif self._progress is not None:
            self._progress.update(self._task, completed=step, description=_metrics_text(metrics))
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in clean.items() if v is not None}, step=step)

    def _rewind(self, step: int) -> None:
        """Before this run's first record: drop the file's records of ``step`` and later (a run
        resumed from an earlier checkpoint redoes them; a fresh run starts at step 1)."""
        self._rewound = True
        if not self.jsonl_path.is_file():
            return
        kept = [line for line, record in _read_lines(self.jsonl_path) if record["step"] < step]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.jsonl_path)

    def close(self) -> None:
        """Stop the bar, print the summary (unless the console is off), finish the wandb run."""
        if self._progress is not None:
            if self.settings.progress == "tqdm":
                self._progress.close()
            else:
                self._progress.stop()
        if self.console != "off":
            print(self.summary(), flush=True)
        if self._wandb_run is not None:
            self._wandb_run.finish()

    def summary(self) -> str:
        """The end-of-run summary: this run's logged steps and time, the best and last reward, the
        metrics file (with the command that plots it) and the checkpoint directory."""
        elapsed = _duration(time.monotonic() - self._start)
        if self._steps is not None:
            lines = [f"run summary: steps {self._steps[0]}..{self._steps[1]} of {self.total_steps}, {elapsed}"]
        else:
            lines = [f"run summary: no step logged, {elapsed}"]
        if self._best is not None and self._last is not None:
            lines.append(
                f"  reward/mean: best {format_number(self._best[1])} (step {self._best[0]}), "
                f"last {format_number(self._last[1])} (step {self._last[0]})"
            )
        if self.settings.jsonl:
            plots = Path(self.settings.dir) / "plots"
            lines.append(f"  metrics:     {self.jsonl_path}")
            lines.append(f"  plots:       python {PLOT_TOOL} {self.jsonl_path} {plots}")
        lines.append(f"  checkpoints: {self.checkpoint_dir}")
        return "\n".join(lines)


def format_number(value: float) -> str:
    """A metric for the console, readable at any magnitude: three significant digits in fixed
    point from 0.01 to 99999 (``0.0412``, ``0.530``, ``95.2``, ``2311``), else two in scientific
    notation (``1.2e-03``, ``-3.4e+06``); ``0``, ``nan``, ``inf``."""
    if not math.isfinite(value):
        return str(float(value))
    if value == 0:
        return "0"
    exponent = math.floor(math.log10(abs(value)))
    if -2 <= exponent <= 4:
        return f"{value:.{max(0, 2 - exponent)}f}"
    return f"{value:.1e}"


def console_line(step: int, total_steps: int, metrics: dict[str, float]) -> str:
    """The console line of a record (see the module docstring)."""
    seconds = {
        label: sum(metrics[k] for k in keys if k in metrics)
        for label, keys in TIME_PARTS
        if any(k in metrics for k in keys)
    }
    total = f"{format_number(sum(seconds.values()))} s" if seconds else ""
    if _validation_only(metrics):
        parts = [f"validation step {step}/{total_steps}", _labelled(metrics, VALIDATION_METRICS), total]
    else:
        split = " ".join(f"{label} {format_number(s)}" for label, s in seconds.items())
        parts = [f"step {step}/{total_steps}", _metrics_text(metrics), f"{total}: {split}" if seconds else ""]
    return " | ".join(p for p in parts if p)


def _metrics_text(metrics: dict[str, float]) -> str:
    """A record's key metrics (beside the bar, and in a step's line): the step's, then the
    validation pass's after ``val``."""
    shown = (_labelled(metrics, STEP_METRICS), _labelled(metrics, VALIDATION_METRICS, "val "))
    return " | ".join(p for p in shown if p)


def _labelled(metrics: dict[str, float], labels: tuple[tuple[str, str], ...], prefix: str = "") -> str:
    shown = [f"{label} {format_number(metrics[key])}" for label, key in labels if _is_number(metrics.get(key))]
    return prefix + " ".join(shown) if shown else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validation_only(metrics: dict[str, float]) -> bool:
    """A validation pass of its own (before the first step): only ``val/`` metrics and its time."""
    return bool(metrics) and all(k.startswith("val/") or k == "time/validation" for k in metrics)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole // 60 % 60:02d} min"


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` line other than the last is not a record."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A torn last line (a crash while it was written) is dropped
    with a warning; a bad line elsewhere is a ``MetricsFileError`` naming the file and the line."""
    return [record for _, record in _read_lines(Path(path))]


def _read_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    lines = path.read_text(errors="replace").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an integer step")
        except ValueError as error:
            if number == len(lines):
                log.warning(
                    "%s: dropping its last line %d, torn by a crash while it was written: %.80r", path, number, line
                )
                break
            raise MetricsFileError(f"{path}: line {number} is not a metrics record ({error}): {line[:80]!r}") from None
        records.append((line, record))
    return records
