"""Where each step's metrics go (rank 0 only): ``<logging.dir>/metrics.jsonl`` (one JSON object per
step, with ``step``; a resumed run first drops the records of the steps it redoes), a console
progress line with the key metrics (rich, tqdm or none), and Weights & Biases (offline mode when no
``WANDB_API_KEY`` is set; ``wandb`` is imported only when enabled)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from megatron_empg.config import LoggingConfig, RunConfig, to_dict

KEY_METRICS = ("reward/mean", "reward/accuracy", "actor/kl", "actor/entropy", "response/length_mean")


class MetricsLogger:
    def __init__(self, config: RunConfig, total_steps: int, *, enabled: bool = True) -> None:
        self.settings: LoggingConfig = config.logging
        self.enabled = enabled
        self.jsonl_path = Path(self.settings.dir) / "metrics.jsonl"
        self._progress = None
        self._wandb_run = None
        self._rewound = False
        if not enabled:
            return
        Path(self.settings.dir).mkdir(parents=True, exist_ok=True)
        if self.settings.progress == "tqdm":
            from tqdm import tqdm

            self._progress = tqdm(total=total_steps, desc="RL steps", dynamic_ncols=True)
        elif self.settings.progress == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("RL step"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                      TextColumn("{task.description}"))  # fmt: skip
            self._progress.start()
            self._task = self._progress.add_task("", total=total_steps)
        if self.settings.wandb:
            import wandb

            if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
                os.environ["WANDB_MODE"] = "offline"
            self._wandb_run = wandb.init(project=self.settings.wandb_project, name=self.settings.wandb_run_name,
                                         dir=self.settings.dir, config=to_dict(config))  # fmt: skip

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or step % self.settings.interval:
            return
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}
        if self.settings.jsonl:
            if not self._rewound:
                self._rewind(step)
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, **clean}) + "\n")
        summary = "  ".join(f"{k.split('/')[-1]} {metrics[k]:.4g}" for k in KEY_METRICS if k in metrics)
        if self.settings.progress == "tqdm" and self._progress is not None:
            self._progress.update(step - self._progress.n)
            self._progress.set_postfix_str(summary)
        elif self.settings.progress == "rich" and self._progress is not None:
            self._progress.update(self._task, completed=step, description=summary)
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in clean.items() if v is not None}, step=step)

    def _rewind(self, step: int) -> None:
        """Before this run's first record: drop the file's records of ``step`` and later (a run
        resumed from an earlier checkpoint redoes them; a fresh run starts at step 1)."""
        self._rewound = True
        if not self.jsonl_path.is_file():
            return
        lines = [line for line in self.jsonl_path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] < step]
        tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.jsonl_path)

    def close(self) -> None:
        if self._progress is not None:
            if self.settings.progress == "rich":
                self._progress.stop()
            else:
                self._progress.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The JSONL file's records, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
