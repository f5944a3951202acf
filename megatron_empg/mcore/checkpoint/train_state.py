"""The training loop's state in a checkpoint, as one typed, versioned object: ``TrainState``.

``save_checkpoint`` stores ``state.to_saved()`` (plain data: builtins, with the owners' own
``state_dict``s inside; no class path, so moving or renaming this class never breaks a checkpoint)
in the checkpoint's common state under ``SAVED_KEY``, identical on every rank; ``load_checkpoint``
returns ``TrainState.from_saved(...)``. The per-rank RNG states are saved beside it, not in it
(``state.rng_sharded_object``).

Versions (``TRAIN_STATE_VERSION`` is the newest this code reads and the one it writes):

1. ``step``, ``optimizer_steps``, ``anchor_num_updates``, ``data``, ``engines``, ``config_yaml``
   and, since the bad-step guard, ``bad_steps``. The dicts saved before this class carry no
   ``version`` (read as 1) and may lack ``bad_steps`` (None: no history, as then). A model-only
   checkpoint (``mcore.convert``) holds none of them: every field but ``step`` takes its default.
   Keys no field reads (``pending_rollout``, saved before the engines' state) are ignored.

A newer version is refused with a ``CheckpointError`` naming the checkpoint. A later version adds
its fields with defaults (or converts in ``from_saved``) and bumps ``TRAIN_STATE_VERSION``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_empg.mcore.checkpoint.files import CheckpointError

TRAIN_STATE_VERSION = 1
SAVED_KEY = "extra_state"  # the common-state key (its name since before the typed state)


@dataclasses.dataclass(frozen=True)
class TrainState:
    """What the loop needs to go on from a checkpoint as the run would have gone on.

    Args:
        step: the steps done (the checkpoint is ``step_<step>``).
        optimizer_steps: the updates applied (a refused step is not one).
        anchor_num_updates: the EMA anchor's update count (its schedule); 0 without an anchor.
        bad_steps: ``trainer.run.bad_steps.BadSteps.state_dict()``; None: no history.
        data: the data cursor's ``state_dict()``; None: the checkpoint holds no loop state.
        engines: the rollout engines' ``state_dict()`` (rollouts drawn ahead of the step); None
            likewise.
        config_yaml: the run's config (``config.to_yaml``), for the record; not read on resume.
        version: the version it was saved at (``TRAIN_STATE_VERSION`` for one made here).
    """

    step: int
    optimizer_steps: int = 0
    anchor_num_updates: int = 0
    bad_steps: Mapping[str, Any] | None = None
    data: Mapping[str, Any] | None = None
    engines: Mapping[str, Any] | None = None
    config_yaml: str | None = None
    version: int = TRAIN_STATE_VERSION

    def __post_init__(self) -> None:
        for name in ("step", "optimizer_steps", "anchor_num_updates", "version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}, expected an int >= 0")
        for name in ("bad_steps", "data", "engines"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{name} is a {type(value).__name__}, expected a dict or None")
        if self.config_yaml is not None and not isinstance(self.config_yaml, str):
            raise ValueError(f"config_yaml is a {type(self.config_yaml).__name__}, expected a str or None")

    def _fields(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def to_saved(self) -> dict[str, Any]:
        """The plain dict a checkpoint stores, at ``TRAIN_STATE_VERSION``; fields that are None are
        left out (as before the typed state: ``bad_steps`` of older runs, a test's absent engines)."""
        saved = {name: value for name, value in self._fields().items() if value is not None}
        saved["version"] = TRAIN_STATE_VERSION
        return saved

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any] | None, *, step: int, source: str) -> TrainState:
        """The state of a checkpoint's saved dict (``to_saved``'s, or an older version's; None or
        empty: a checkpoint without loop state). ``step`` is the checkpoint's own (its manifest's;
        a ``step`` in ``saved`` is not read). ``source`` names the checkpoint in errors."""
        saved = dict(saved or {})
        version = saved.get("version", 1)  # the dicts of before the typed state: version 1
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CheckpointError(f"{source}: train state version {version!r}, expected an int >= 1")
        if version > TRAIN_STATE_VERSION:
            raise CheckpointError(
                f"{source}: train state version {version} is newer than this code reads "
                f"({TRAIN_STATE_VERSION}); load it with the megatron_empg that saved it or a newer one"
            )
        names = [field.name for field in dataclasses.fields(cls) if field.name not in ("step", "version")]
        try:
            return cls(step=step, version=version, **{name: saved[name] for name in names if name in saved})
        except ValueError as e:
            raise CheckpointError(f"{source}: train state field {e}") from None
