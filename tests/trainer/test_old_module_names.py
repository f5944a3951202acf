"""Checkpoints written before the trainer's modules moved into groups still unpickle: the rollouts
drawn ahead that a checkpoint holds (``StepRollout`` of ``Sample``s) name their classes' old modules
(``trainer.run.start.old_module_names``)."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_empg.trainer.batching.batch import Sample
from megatron_empg.trainer.engines.collect import StepRollout
from megatron_empg.trainer.run.start import RENAMED_MODULES, old_module_names


def _as_written_before_the_move(obj) -> bytes:
    """``obj`` pickled as ``torch.save`` pickles a checkpoint's common state (protocol 2, whose
    GLOBAL opcode names a class as ``module\\nname\\n``; the legacy container, not the zip one,
    whose CRCs a renaming would break), its modules renamed back to the old names."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    for old, new in RENAMED_MODULES.items():
        assert f"c{new}\n".encode() in data or new.encode() not in data
        data = data.replace(f"{new}\n".encode(), f"{old}\n".encode())
    return data


def _rollout() -> StepRollout:
    sample = Sample([1, 2], [3, 4, 5], [-0.5, -0.25, -1.0], "stop", group=0, reward=1.0, correct=True, version=2)
    return StepRollout([[sample]], [{"samples": 1.0}], {"engines/count": 1.0}, version=2, data_state={"cursor": 3})


def test_a_rollout_pickled_under_the_old_module_names_loads_equal():
    rollout = _rollout()
    data = _as_written_before_the_move({"rollouts": [rollout]})
    assert b"megatron_empg.trainer.collect\n" in data and b"megatron_empg.trainer.batch\n" in data
    with pytest.raises(ModuleNotFoundError, match="megatron_empg.trainer.collect"):
        torch.load(io.BytesIO(data), weights_only=False)
    with old_module_names():
        loaded = torch.load(io.BytesIO(data), weights_only=False)
    assert loaded == {"rollouts": [rollout]}
    assert type(loaded["rollouts"][0].replicas[0][0]) is Sample


def test_the_old_names_are_gone_after_loading():
    import sys

    with old_module_names():
        assert all(old in sys.modules for old in RENAMED_MODULES)
    assert not any(old in sys.modules for old in RENAMED_MODULES)
