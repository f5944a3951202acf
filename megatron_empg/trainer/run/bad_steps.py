"""A run's refused optimizer steps (``core.step_guard``: a non-finite loss or gradient norm, or a
gradient-norm spike over ``train.skip_grad_norm_factor`` x the recent median): the refusal rule
and its gradient-norm history, the refusals in a row, both checkpointed; after
``train.max_consecutive_skips`` in a row, the step's samples saved for inspection and a
``BadStepsError``.

    bad = BadSteps(config.train)
    result = train_step(..., guard=bad.guard)             # each optimizer step (mini-batch) of a step
    skipped = bad.record(step, [result.skipped, ...])       # train/skipped_steps
    if bad.exhausted:
        raise bad.stop(step, samples, advantages, run_dir, groups)

The decisions are the same on every rank (``mcore.step.train_step`` agrees on them), so every
rank stops at the same step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_empg.config import TrainConfig
from megatron_empg.core.step_guard import GradNormGuard

if TYPE_CHECKING:
    from megatron_empg.mcore.parallel_state import ParallelGroups
    from megatron_empg.trainer.batching.batch import Sample

log = logging.getLogger(__name__)


class BadStepsError(RuntimeError):
    """``train.max_consecutive_skips`` optimizer steps in a row were refused. ``step``: the step
    that reached the limit; ``reasons``: each refusal's; ``path``: the directory of its samples."""

    def __init__(self, limit: int, step: int, reasons: list[str], path: Path) -> None:
        self.limit, self.step, self.reasons, self.path = limit, step, reasons, path
        super().__init__(
            f"train.max_consecutive_skips={limit}: {len(reasons)} optimizer steps in a row were refused, "
            f"the last at step {step} ({'; '.join(reasons)}); the samples of step {step} are in {path}"
        )


class BadSteps:
    """The run's ``guard`` (``train.skip_grad_norm_factor``) and the refused optimizer steps since
    the last applied one (``in_a_row``: ``"step <s>: <reason>"`` each), up to ``train.max_consecutive_skips``."""

    def __init__(self, train: TrainConfig) -> None:
        self.limit = train.max_consecutive_skips
        self.guard = GradNormGuard(train.skip_grad_norm_factor)
        self.in_a_row: list[str] = []

    def record(self, step: int, skipped: list[str | None]) -> int:
        """Step ``step``'s optimizer steps in order (``StepResult.skipped``: a reason, or None if
        applied); how many were refused. Once the limit is reached, the run of refusals is kept as
        it is (``exhausted``), whatever follows in the step."""
        for reason in skipped:
            if self.exhausted:
                break
            if reason is None:
                self.in_a_row.clear()
                continue
            self.in_a_row.append(f"step {step}: {reason}")
            log.warning(
                "step %d: optimizer step refused (%d in a row, train.max_consecutive_skips=%d): %s",
                step,
                len(self.in_a_row),
                self.limit,
                reason,
            )
        return sum(reason is not None for reason in skipped)

    @property
    def exhausted(self) -> bool:
        """``train.max_consecutive_skips`` refusals in a row: the run must stop."""
        return len(self.in_a_row) >= self.limit

    def stop(
        self, step: int, samples: list[Sample], advantages: torch.Tensor, run_dir: Path, groups: ParallelGroups
    ) -> BadStepsError:
        """Save step ``step``'s samples in ``run_dir / bad_step_<step>``: each data-parallel
        replica's ``samples`` and their [B] float32 ``advantages`` in ``samples_dp<replica>.jsonl``
        (written by its first tensor-, pipeline- and context-parallel rank), and ``reason.json``
        (rank 0); every rank waits for the files (a barrier), then gets the error to raise."""
        path = Path(run_dir) / f"bad_step_{step}"
        if groups.tp_rank == groups.pp_rank == groups.cp_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps(sample_record(s, a)) for s, a in zip(samples, advantages.tolist(), strict=True)]
            (path / f"samples_dp{groups.dp_rank}.jsonl").write_text("".join(line + "\n" for line in lines))
        if not dist.is_initialized() or dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            reason = {
                "field": "train.max_consecutive_skips",
                "limit": self.limit,
                "step": step,
                "refused": list(self.in_a_row),
            }
            (path / "reason.json").write_text(json.dumps(reason, indent=1) + "\n")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        return BadStepsError(self.limit, step, list(self.in_a_row), path)

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), "in_a_row": list(self.in_a_row)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """``state_dict``'s; None (a checkpoint of before this state): no history, no refusals."""
        state = state or {"guard": {"history": []}, "in_a_row": []}
        self.guard.load_state_dict(state["guard"])
        self.in_a_row = list(state["in_a_row"])


def sample_record(sample: Sample, advantage: float) -> dict[str, Any]:
    """What a saved bad step holds of a sample: its tokens, reward, advantage and weight versions."""
    return {
        "group": sample.group,
        "prompt_ids": sample.prompt_ids,
        "response_ids": sample.response_ids,
        "response_mask": sample.response_mask,
        "finish_reason": sample.finish_reason,
        "answer": getattr(sample.example, "answer", None),
        "reward": sample.reward,
        "correct": sample.correct,
        "advantage": advantage,
        "trains": sample.trains,
        "version": sample.version,
        "token_versions": sample.token_versions,
    }
