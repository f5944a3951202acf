"""The train state a checkpoint holds (``mcore.checkpoint.TrainState``): its saved form, the
checkpoints written before it (the loop's string-keyed ``extra_state`` dict, with and without
``bad_steps``) and a newer version than the code reads.

The fast tests check ``to_saved`` / ``from_saved`` on dicts. The dist test saves real checkpoints
whose ``extra_state`` is exactly the dict the loop wrote before the typed state, then loads them
through the loop's own ``Trainer._load_training_state`` (one gloo rank).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_empg.mcore.checkpoint import TRAIN_STATE_VERSION, CheckpointError, TrainState
from tests.dist import run_distributed

CONFIG_YAML = "train:\n  steps: 8\n"
BAD_STEPS = {"guard": {"history": [0.5, 0.75, 1.25]}, "in_a_row": ["step 2: grad norm 40.0 > 10 x 1.0"]}
ROLLOUTS = {"rollouts": [{"step": 4, "tokens": [1, 2, 3]}]}


def _old_extra(step: int, *, bad_steps: bool) -> dict:
    """``extra_state`` as ``Trainer._save`` wrote it before the typed state (``save_checkpoint``
    added ``step``); ``bad_steps`` is absent from the checkpoints of before the bad-step guard."""
    extra = {
        "optimizer_steps": step - 1,
        "anchor_num_updates": step - 1,
        "data": {"cursor": step, "epoch": 0},
        "config_yaml": CONFIG_YAML,
        "engines": ROLLOUTS,
        "step": step,
    }
    if bad_steps:
        extra["bad_steps"] = BAD_STEPS
    return extra


# --------------------------------------------------------------------------------------------
# Dicts.


def test_an_old_dict_with_bad_steps_reads_as_version_1():
    state = TrainState.from_saved(_old_extra(4, bad_steps=True), step=4, source="ckpt/step_00000004")
    assert state == TrainState(
        step=4,
        optimizer_steps=3,
        anchor_num_updates=3,
        bad_steps=BAD_STEPS,
        data={"cursor": 4, "epoch": 0},
        engines=ROLLOUTS,
        config_yaml=CONFIG_YAML,
        version=1,
    )


def test_an_old_dict_without_bad_steps_reads_as_none():
    state = TrainState.from_saved(_old_extra(4, bad_steps=False), step=4, source="ckpt/step_00000004")
    assert state.bad_steps is None and state.version == 1
    assert (state.optimizer_steps, state.anchor_num_updates, state.data) == (3, 3, {"cursor": 4, "epoch": 0})


def test_keys_no_field_reads_are_ignored():
    """``pending_rollout``: the one-step-off rollout, saved before the engines' state."""
    saved = {**_old_extra(2, bad_steps=True), "pending_rollout": [7, 8]}
    assert TrainState.from_saved(saved, step=2, source="c") == TrainState.from_saved(
        _old_extra(2, bad_steps=True), step=2, source="c"
    )


def test_a_checkpoint_without_loop_state_gets_the_defaults():
    """A model-only checkpoint (``mcore.convert``) saves no ``extra_state``."""
    for saved in (None, {}):
        state = TrainState.from_saved(saved, step=0, source="mg")
        assert (state.step, state.optimizer_steps, state.anchor_num_updates) == (0, 0, 0)
        assert (state.bad_steps, state.data, state.engines, state.config_yaml) == (None, None, None, None)


def test_to_saved_is_the_old_dict_plus_the_version():
    """What the loop saves now is what it saved before, with ``version``: older code reads it too."""
    old = _old_extra(6, bad_steps=True)
    state = TrainState(**old)
    assert state.to_saved() == {**old, "version": TRAIN_STATE_VERSION}
    assert TrainState.from_saved(state.to_saved(), step=6, source="c") == state
    assert "bad_steps" not in dataclasses.replace(state, bad_steps=None).to_saved()


def test_the_manifest_step_is_the_step():
    assert TrainState.from_saved({"step": 3, "optimizer_steps": 1}, step=5, source="c").step == 5


def test_a_newer_version_is_refused_naming_the_checkpoint():
    saved = {**TrainState(7).to_saved(), "version": TRAIN_STATE_VERSION + 1}
    with pytest.raises(CheckpointError) as error:
        TrainState.from_saved(saved, step=7, source="checkpoint /ckpt/step_00000007")
    message = str(error.value)
    assert "/ckpt/step_00000007" in message and f"version {TRAIN_STATE_VERSION + 1}" in message
    assert f"({TRAIN_STATE_VERSION})" in message


@pytest.mark.parametrize(
    ("saved", "field"),
    [
        ({"version": 0}, "version"),
        ({"version": "1"}, "version"),
        ({"optimizer_steps": 2.5}, "optimizer_steps"),
        ({"anchor_num_updates": -1}, "anchor_num_updates"),
        ({"data": [1, 2]}, "data"),
        ({"engines": "x"}, "engines"),
        ({"config_yaml": 3}, "config_yaml"),
    ],
)
def test_a_bad_field_is_an_error_naming_it_and_the_checkpoint(saved, field):
    with pytest.raises(CheckpointError, match=rf"^ckpt/step_00000001: train state .*{field}"):
        TrainState.from_saved(saved, step=1, source="ckpt/step_00000001")


def test_a_train_state_checks_its_fields():
    with pytest.raises(ValueError, match="step=-1"):
        TrainState(-1)
    with pytest.raises(ValueError, match="bad_steps is a list"):
        TrainState(1, bad_steps=[])


# --------------------------------------------------------------------------------------------
# Checkpoints written before the typed state, loaded by the loop.


@dataclasses.dataclass(frozen=True)
class _OldFormat(TrainState):
    """Saves ``extra`` as the checkpoint's ``extra_state``: the dict of the code before."""

    extra: dict | None = None

    def to_saved(self) -> dict:
        return dict(self.extra)


def _save_old_and_load(rank: int, world_size: int, root: str) -> dict:
    from types import SimpleNamespace

    from megatron_empg.config import TrainConfig
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.trainer.loop import Trainer
    from megatron_empg.trainer.run.bad_steps import BadSteps
    from tests.mcore.test_checkpoint import _Run

    run = _Run(1, False)
    out = {}
    try:
        for step, bad_steps in ((1, False), (2, True)):
            run.step()
            extra = _old_extra(step, bad_steps=bad_steps)
            path = ckpt.save_checkpoint(
                os.path.join(root, f"bad_steps_{bad_steps}"), _OldFormat(step, extra=extra), run.parts(), run.groups
            )
            run.anchor.num_updates = 99  # what the load must overwrite
            trainer = SimpleNamespace(
                models=run.ddp,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                anchor=run.anchor,
                groups=run.groups,
                model=SimpleNamespace(name=None),
                bad_steps=BadSteps(TrainConfig()),
                step_index=0,
                optimizer_steps=0,
            )
            trainer._checkpoint_parts = lambda trainer=trainer: Trainer._checkpoint_parts(trainer)
            trainer.bad_steps.in_a_row = ["left from before the load"]
            state = Trainer._load_training_state(trainer, path)
            out[bad_steps] = {
                "state": state,
                "loop": (trainer.step_index, trainer.optimizer_steps, run.anchor.num_updates),
                "bad_steps": trainer.bad_steps.state_dict(),
            }
    finally:
        run.close()
    return out


@pytest.mark.dist
@pytest.mark.megatron
def test_checkpoints_of_before_the_typed_state_load_into_the_loop(tmp_path):
    (out,) = run_distributed(_save_old_and_load, 1, str(tmp_path), timeout=240)
    without, with_ = out[False], out[True]
    assert without["state"] == TrainState.from_saved(_old_extra(1, bad_steps=False), step=1, source="")
    assert without["loop"] == (1, 0, 0)
    assert without["bad_steps"] == {"guard": {"history": []}, "in_a_row": []}  # absent: no history
    assert with_["state"] == TrainState.from_saved(_old_extra(2, bad_steps=True), step=2, source="")
    assert with_["state"].bad_steps == BAD_STEPS and with_["state"].engines == ROLLOUTS
    assert with_["loop"] == (2, 1, 1)
    assert with_["bad_steps"] == BAD_STEPS
