"""How long each phase may last before the watchdog declares a hang: learned from the run itself.

A phase's limit, in order of precedence:

1. ``supervisor.phase_timeout_s.<phase>`` where the config sets it (explicit values always win);
2. learned, once the phase was seen ``supervisor.learn_after`` times (in this attempt or earlier
   ones): ``max(supervisor.learned_floor_s, supervisor.safety_factor x the slowest time seen)``,
   the slowest time scaled by the step's token bound (prompts x samples x max_model_len) for the
   phases whose work grows with it, should a restart change the bound (as NVIDIA's fault-tolerance
   launcher learns its heartbeat and section timeouts);
3. else the fixed default of ``AUTO_TIMEOUTS`` (a floor plus seconds per token of the bound).

The times seen are kept in ``<logging.dir>/phase-times/rank<R>.json`` (each process its own file,
written by its watchdog thread; every process reads all of them when it starts), not in the
checkpoint: a restart after a hang resumes from a checkpoint older than the times seen since (and
a first attempt may hang before its first checkpoint), engine ranks write no checkpoint but time
their phases too, and the times describe this run's machines, which a ``continue_from`` on other
hardware must not inherit. ``--overwrite`` deletes them with the earlier run's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from megatron_empg.config import RunConfig

PHASE_TIMES = "phase-times"

# The phase deadlines until a phase's limit is learned: a floor in seconds, plus seconds per token
# of the step's upper bound (prompts x samples x max_model_len) at pessimistic rates (500 tokens/s
# for the rollout, 2,000 per forward pass, 700 for the update), so that a large recipe gets room in
# proportion and a small one is still caught within minutes. A phase with a per-token rate has its
# learned time scaled by the bound too.
AUTO_TIMEOUTS: dict[str, tuple[float, float]] = {
    "start": (3600.0, 0.0),  # models loaded, engines started, the first weight sync
    "step": (600.0, 0.0),  # a step's time outside its other phases (metrics, logging, the stop vote)
    "rollout": (1200.0, 2e-3),
    "advantages": (600.0, 0.0),
    "batching": (600.0, 0.0),
    "old_pass": (600.0, 5e-4),
    "anchor_pass": (600.0, 5e-4),
    "teacher_pass": (600.0, 5e-4),
    "update": (900.0, 1.5e-3),
    "ema_update": (600.0, 0.0),
    "weight_sync": (1200.0, 0.0),
    "validation": (1800.0, 2e-3),
    "checkpoint": (3600.0, 0.0),
    "draw": (1200.0, 2e-3),  # an engine rank generating a rollout
    "load": (1200.0, 0.0),  # an engine rank loading pushed weights
}


def token_bound(config: RunConfig) -> int:
    """The step's upper bound in tokens (``rollout.max_model_len`` null: the model's context, as
    the engine takes it)."""
    max_model_len = config.rollout.max_model_len or config.model_config().max_position_embeddings
    return config.train.prompts_per_step * config.rollout.sampling.n * max_model_len


def phase_timeouts(config: RunConfig) -> dict[str, float]:
    """Seconds each phase may last before anything is learned: ``supervisor.phase_timeout_s``
    where set, else ``AUTO_TIMEOUTS``."""
    tokens = token_bound(config)
    timeouts = {name: floor + per_token * tokens for name, (floor, per_token) in AUTO_TIMEOUTS.items()}
    timeouts.update(explicit_timeouts(config))
    return timeouts


def explicit_timeouts(config: RunConfig) -> dict[str, float]:
    return {k: v for k, v in dataclasses.asdict(config.supervisor.phase_timeout_s).items() if v is not None}


@dataclasses.dataclass
class Seen:
    """A phase's history: how many times it ended, the slowest (seconds) and the token bound then."""

    count: int = 0
    slowest: float = 0.0
    tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Learning:
    """``supervisor``'s learning settings (``learn_after`` 0: nothing is learned)."""

    learn_after: int = 3
    safety_factor: float = 5.0
    floor_s: float = 60.0


class PhaseLimits:
    """The limit of each phase (module docstring), and the history it learns from.

    ``fixed``: the limits until learned (``phase_timeouts``); ``explicit``: the names the config
    sets (never learned); ``learning``: None learns nothing; ``tokens``: this run's token bound;
    ``seen``: the history so far."""

    def __init__(
        self,
        fixed: Mapping[str, float],
        *,
        explicit: frozenset[str] = frozenset(),
        learning: Learning | None = None,
        tokens: int = 0,
        seen: Mapping[str, Seen] | None = None,
    ) -> None:
        self.fixed, self.explicit, self.tokens = dict(fixed), explicit, tokens
        self.learning = learning or Learning(learn_after=0)  # none given: the fixed limits only
        self.seen = dict(seen or {})
        self._lock = threading.Lock()
        self._dirty = False

    @classmethod
    def for_run(cls, config: RunConfig, run_dir: Path) -> PhaseLimits:
        """The run's limits, with the history earlier attempts left in ``run_dir``."""
        supervisor, tokens = config.supervisor, token_bound(config)
        learning = Learning(supervisor.learn_after, supervisor.safety_factor, supervisor.learned_floor_s)
        explicit = frozenset(explicit_timeouts(config))
        return cls(
            phase_timeouts(config), explicit=explicit, learning=learning, tokens=tokens, seen=read_seen(run_dir, tokens)
        )

    def __contains__(self, phase: str) -> bool:
        return phase in self.fixed

    def names(self) -> list[str]:
        return sorted(self.fixed)

    def limit(self, phase: str) -> float:
        return self.explain(phase)[0]

    def explain(self, phase: str) -> tuple[float, str]:
        """(the limit of ``phase`` in seconds, where it comes from: the config key or the history)."""
        if phase in self.explicit:
            return self.fixed[phase], f"supervisor.phase_timeout_s.{phase}"
        learning = self.learning
        with self._lock:
            seen = self.seen.get(phase)
            slowest = _scaled(phase, seen, self.tokens) if seen else 0.0
        if not learning.learn_after or seen is None or seen.count < learning.learn_after:
            return self.fixed[phase], f"the default of supervisor.phase_timeout_s.{phase} (not learned yet)"
        limit = max(learning.floor_s, learning.safety_factor * slowest)
        return limit, (
            f"learned: max({learning.floor_s:g} s, {learning.safety_factor:g} x the slowest {slowest:.3g} s "
            f"of {seen.count}); supervisor.phase_timeout_s.{phase} sets it"
        )

    def observe(self, phase: str, seconds: float) -> None:
        """``phase`` ended normally after ``seconds``."""
        with self._lock:
            seen = self.seen.setdefault(phase, Seen(tokens=self.tokens))
            seen.slowest = max(_scaled(phase, seen, self.tokens), seconds)
            seen.count, seen.tokens = seen.count + 1, self.tokens
            self._dirty = True

    def save(self, run_dir: Path, rank: int) -> None:
        """This process's history into ``run_dir`` if it changed (atomically: a reader never sees
        half a file)."""
        with self._lock:
            if not self._dirty:
                return
            data = {name: dataclasses.asdict(seen) for name, seen in self.seen.items()}
            self._dirty = False
        path = Path(run_dir) / PHASE_TIMES / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


def _scaled(phase: str, seen: Seen, tokens: int) -> float:
    """``seen.slowest`` at a token bound of ``tokens`` (for the phases whose work grows with it)."""
    if AUTO_TIMEOUTS.get(phase, (0.0, 0.0))[1] and seen.tokens and tokens:
        return seen.slowest * tokens / seen.tokens
    return seen.slowest


def read_seen(run_dir: Path, tokens: int) -> dict[str, Seen]:
    """Every process's history in ``run_dir``, merged: per phase the slowest time (at ``tokens``)
    and the most times any one process saw it (each file carries the history its process started
    from, so counts are not added up)."""
    merged: dict[str, Seen] = {}
    for path in sorted((Path(run_dir) / PHASE_TIMES).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for name, fields in json.loads(path.read_text()).items():
                seen = Seen(**fields)
                into = merged.setdefault(name, Seen(tokens=tokens))
                into.slowest = max(into.slowest, _scaled(name, seen, tokens))
                into.count = max(into.count, seen.count)
    return merged
