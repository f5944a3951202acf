"""The run's checkpoint saves (``checkpoint.async_save``): blocking, or with the files written in the
background while the next steps train (``mcore.checkpoint.async_save``), one save in flight at
most, committed at the end of the first step after every rank's writing is done. The last step's
save and a pre-emption's (SIGTERM, SIGUSR1) block, after the save in flight is committed: nothing is
left unwritten when the run returns. Metrics of the step records: ``checkpoint/blocking_s`` (what
the last save started cost the step), ``checkpoint/persist_s`` (the background writing of the
save just committed, this rank's), ``checkpoint/writing`` (1 while a step ran beside a write: a
step's slowdown is its time against the steps at 0)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_empg.config import to_yaml
from megatron_empg.trainer.run import watchdog
from megatron_empg.trainer.run.start import checkpoint_directory, old_module_names

if TYPE_CHECKING:
    from megatron_empg.mcore.checkpoint import HostStaging, PendingSave

log = logging.getLogger(__name__)


def async_saves(setting: bool | None) -> bool:
    """``checkpoint.async_save``: null means in the background on a GPU machine."""
    return torch.cuda.is_available() if setting is None else setting


class Checkpoints:
    """``start(staging)`` plans a save of the current state (``save.start_save``; staging None:
    written at once)."""

    def __init__(self, start: Callable[[HostStaging | None], PendingSave], *, background: bool) -> None:
        from megatron_empg.mcore.checkpoint import HostStaging

        self._start = start
        self._staging = HostStaging() if background else None
        self._pending: PendingSave | None = None
        self._metrics: dict[str, float] = {}

    def save(self, *, blocking: bool) -> Path | None:
        """Checkpoint now: the save in flight committed first; then this one, committed before
        returning (``blocking``, or saves not in the background) or later. Every rank."""
        self.finish()
        pending = self._start(None if blocking else self._staging)
        self._metrics["checkpoint/blocking_s"] = pending.blocking_s
        if pending.in_background:
            self._pending = pending
            return None
        return _finish(pending)

    def written(self) -> bool:
        """Whether a save is in flight and every rank has written it (every rank; one all-reduce
        while one is in flight, nothing otherwise): ``finish`` then commits it without waiting."""
        return self._pending is not None and self._pending.written_everywhere()

    def finish(self) -> Path | None:
        """Commit the save in flight, waiting for its writing (every rank); None if there is none."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        path = _finish(pending)
        self._metrics["checkpoint/persist_s"] = pending.persist_s
        return path

    def metrics(self) -> dict[str, float]:
        """This step's checkpoint metrics (then cleared): those of the saves started and committed
        since the last call, and whether a write is in flight."""
        out, self._metrics = self._metrics, {}
        if self._staging is not None:
            out["checkpoint/writing"] = float(self._pending is not None)
        return out


def _finish(pending: PendingSave) -> Path:
    from megatron_empg.mcore.checkpoint import finish_save

    return finish_save(pending)


class TrainerCheckpoints:
    """The ``Trainer``'s saves and loads (its base class: the loop's state it reads and restores
    is the trainer's ``step_index``, ``optimizer_steps``, ``bad_steps``, ``batches``, ``engines``,
    models, optimizer, scheduler, anchor and ``checkpoints``)."""

    def save(self, *, blocking: bool = True) -> Path | None:
        """Checkpoint this step (``trainer.run.checkpoints``): the committed directory, or None while
        its files are written in the background (``checkpoint.async_save``, not ``blocking``)."""
        with watchdog.phase("checkpoint", self.step_index):
            return self.checkpoints.save(blocking=blocking)

    def _start_save(self, staging):
        from megatron_empg.mcore.checkpoint import ModelMetadata, SaveOptions, TrainState, start_save

        cfg = self.config.checkpoint
        engines = self.engines.state_dict()  # first: receiving rollouts drawn ahead moves the data cursor
        state = TrainState(
            step=self.step_index,
            optimizer_steps=self.optimizer_steps,
            anchor_num_updates=self.anchor.num_updates if self.anchor is not None else 0,
            bad_steps=self.bad_steps.state_dict(),  # the gradient-norm history: a resume refuses alike
            data=self.batches.state_dict(),
            engines=engines,  # e.g. rollouts drawn ahead: trained on resume, not drawn again
            config_yaml=to_yaml(self.config),
        )
        return start_save(
            cfg.dir,
            state,
            self._checkpoint_parts(),
            self.groups,
            staging=staging,
            options=SaveOptions(
                keep_last=cfg.keep_last, checksums=cfg.verify == "checksum", optimizer_format=cfg.optimizer_format
            ),
            model=ModelMetadata(config=self.model, hf_assets=self.engines.hf_assets(), base=self.lora_base),
        )

    def _checkpoint_parts(self):
        """The policy's chunks, optimizer, scheduler and anchor, as a checkpoint saves and loads them."""
        from megatron_empg.mcore.checkpoint import CheckpointParts

        return CheckpointParts(self.models, optimizer=self.optimizer, scheduler=self.scheduler, anchor=self.anchor)

    def resume(self) -> bool:
        """Load the newest intact checkpoint of ``checkpoint.dir`` (a damaged one is named and skipped:
        ``mcore.checkpoint.find_verified_checkpoint``, every rank); False if there is none."""
        from megatron_empg.mcore.checkpoint import CheckpointError, find_verified_checkpoint

        checkpoint = self.config.checkpoint
        found = find_verified_checkpoint(checkpoint.dir, checksums=checkpoint.verify == "checksum")
        if found is None:
            log.info("no checkpoint in %s to resume from", checkpoint.dir)
            return False
        state = self._load_training_state(found.path)
        if state.data is None or state.engines is None:
            raise CheckpointError(
                f"{found.path} holds no training-loop state (data cursor, engines' state): "
                "not a checkpoint of a training run (start from its weights with checkpoint.init_from)"
            )
        self.batches.load_state_dict(state.data)
        self.engines.load_state_dict(state.engines)
        log.info("resumed from %s at step %d", found.path, self.step_index)
        return True

    def continue_from(self, path: str | Path) -> None:
        """Start from an earlier stage's checkpoint (``path``: a ``step_N`` directory or a checkpoint
        root, whose newest is taken): its training state, and this run's data order from its step."""
        from megatron_empg.mcore.checkpoint import CheckpointError, verify_checkpoint

        directory = checkpoint_directory(path)
        problems = verify_checkpoint(directory, checksums=self.config.checkpoint.verify == "checksum")
        if problems:
            raise CheckpointError(f"checkpoint.continue_from={path}: {directory} is damaged: {'; '.join(problems[:3])}")
        self._load_training_state(directory)
        self.batches.cursor = self.step_index
        log.info("continuing from %s at step %d (data: this run's order)", directory, self.step_index)

    def _load_training_state(self, directory: Path):
        """Policy, optimizer, scheduler, anchor and step counters from ``directory``; its ``TrainState``.
        A LoRA policy's checkpoint must have been trained on this run's base (``checkpoint.init_from``)."""
        from megatron_empg.mcore.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_info

        saved_base = read_checkpoint_info(directory).get("lora_base")
        if saved_base is not None and self.lora_base is not None:
            if saved_base["fingerprint"] != self.lora_base["fingerprint"]:
                raise CheckpointError(
                    f"checkpoint.init_from: {self.lora_base['path']} is not the base the adapters of {directory} "
                    f"were trained on ({saved_base['path']}, another fingerprint)"
                )

        with old_module_names():  # a checkpoint of before the trainer's groups
            state = load_checkpoint(directory, self._checkpoint_parts(), self.groups, model_name=self.model.name)
        self.step_index = state.step
        self.optimizer_steps = state.optimizer_steps
        self.bad_steps.load_state_dict(state.bad_steps)  # None: a checkpoint of before the history
        if self.anchor is not None:
            self.anchor.num_updates = state.anchor_num_updates
        return state
