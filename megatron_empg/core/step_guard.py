"""Which optimizer steps are refused: the decision, made from the step's global loss and gradient
norm before the parameters change (``mcore.step.train_step`` applies it; ``trainer.run.bad_steps``
counts the refusals and stops the run after too many in a row).

A step is refused when its loss or its gradient norm is not finite (always), or when its gradient
norm exceeds ``factor`` x the median norm of the last ``HISTORY`` applied steps (``train.
skip_grad_norm_factor``; None: no such check), once ``MIN_HISTORY`` applied steps make a median.
Only applied steps enter the history: a refused spike does not raise the bar for the next one.

The reasons are ordered by severity, so that ranks which disagree (a norm a rounding error either
side of the threshold) all take the most severe one after an all-reduce with MAX of its code.
The history is part of a checkpoint (``state_dict``): a resumed run refuses what the
uninterrupted run refuses. Plain Python: no tensors, no communication.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

HISTORY = 20  # applied steps whose gradient norms make the median
MIN_HISTORY = 5  # no spike check before this many: the first steps' norms say little


class SkipReason(enum.IntEnum):
    """Why a step is refused (0: it is not); a larger code is a more severe reason."""

    NONE = 0
    GRAD_NORM_SPIKE = 1
    NON_FINITE_GRAD_NORM = 2
    NON_FINITE_LOSS = 3


@dataclass
class GradNormGuard:
    """The refusal rule and the gradient norms of the last ``HISTORY`` applied steps (oldest first).

    ``factor``: ``train.skip_grad_norm_factor`` (> 1), or None for no spike check.
    """

    factor: float | None = 10.0
    history: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.factor is not None and not 1.0 < self.factor < math.inf:
            raise ValueError(f"GradNormGuard: factor must be a finite number > 1 or None, got {self.factor!r}")

    def threshold(self) -> float | None:
        """The gradient norm above which a finite step is refused; None: no spike check yet."""
        if self.factor is None or len(self.history) < MIN_HISTORY:
            return None
        return self.factor * statistics.median(self.history)

    def decide(self, loss: float, grad_norm: float) -> SkipReason:
        """The reason to refuse a step of global ``loss`` and gradient norm ``grad_norm`` (NONE: apply it)."""
        if not math.isfinite(loss):
            return SkipReason.NON_FINITE_LOSS
        if not math.isfinite(grad_norm):
            return SkipReason.NON_FINITE_GRAD_NORM
        threshold = self.threshold()
        if threshold is not None and grad_norm > threshold:
            return SkipReason.GRAD_NORM_SPIKE
        return SkipReason.NONE

    def describe(self, reason: SkipReason, loss: float, grad_norm: float, threshold: float | None) -> str:
        """``reason`` in words, with the numbers it was taken on (``threshold``: the spike check's,
        the largest of the ranks')."""
        if reason == SkipReason.NON_FINITE_LOSS:
            return f"non-finite loss ({loss})"
        if reason == SkipReason.NON_FINITE_GRAD_NORM:
            return f"non-finite gradient norm ({grad_norm})"
        if reason == SkipReason.GRAD_NORM_SPIKE:
            return (
                f"gradient norm {grad_norm:.4g} > {threshold:.4g} (train.skip_grad_norm_factor={self.factor:g} "
                f"x the median of the last applied steps' norms)"
            )
        raise ValueError(f"describe: {reason!r} is not a reason to refuse a step")

    def record(self, grad_norm: float) -> None:
        """An applied step's (finite) gradient norm joins the history; the oldest leaves past ``HISTORY``."""
        self.history.append(float(grad_norm))
        del self.history[:-HISTORY]

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [float(x) for x in state["history"]][-HISTORY:]
