"""The arguments of ``save_checkpoint`` and ``load_checkpoint`` beside the ``TrainState``: the
objects whose state a checkpoint holds (``CheckpointParts``), how a save is made (``SaveOptions``)
and what lets a checkpoint be read on its own (``ModelMetadata``). Plain data; no torch at import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from megatron_empg.config import OPTIMIZER_FORMATS  # noqa: F401 (exported: checkpoint.optimizer_format's choices)

if TYPE_CHECKING:
    import torch.nn
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_empg.config import ModelConfig
    from megatron_empg.mcore.anchor import EmaAnchor

# Distributed-optimizer checkpoint formats of megatron-core (``DistributedOptimizer.sharded_state_dict``)
# that a save writes. "fully_reshardable": per-parameter tensors in model space, loadable at any
# TP/PP/DP; the save all-gathers each model-parallel shard's optimizer state over DP.
# "dp_reshardable": each rank writes its own flat buffer, no exchange; loadable at another DP size
# only. ("fully_sharded_model_space", the no-exchange reshardable format, fails in 0.19.2:
# "ShardedTensor.flattened_range is not supported".) The non-distributed optimizer ignores this.
# The list is checkpoint.optimizer_format's Literal (config).
DEFAULT_OPTIMIZER_FORMAT = "fully_reshardable"


@dataclasses.dataclass(frozen=True)
class CheckpointParts:
    """This rank's objects a checkpoint is saved from or loaded into.

    Args:
        models: the policy's model chunks (Megatron DDP-wrapped or not).
        optimizer: the Megatron optimizer (``get_megatron_optimizer``), or None. One that has
            never stepped has no state; it is saved as fresh (recorded, not written).
        scheduler: the ``OptimizerParamScheduler``, or None.
        anchor: the EMA anchor, or None: any object with ``models``, ``full_master_state()`` and
            ``load_full_master_state(state)`` (the package docstring's "Anchor").
    """

    models: Sequence[torch.nn.Module]
    optimizer: MegatronOptimizer | None = None
    scheduler: OptimizerParamScheduler | None = None
    anchor: EmaAnchor | None = None


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How ``save_checkpoint`` saves (checked there: ``ValueError`` naming the field).

    Args:
        keep_last: keep only this many newest complete checkpoints (the new one always stays);
            also removes ``*.tmp-*``/``*.trash-*`` leftovers of interrupted saves. None keeps all.
        checksums: record every file's CRC32 in the manifest (the shards': computed while they
            are written), for ``find_verified_checkpoint``. False: sizes only.
        optimizer_format: the distributed optimizer's format, one of ``OPTIMIZER_FORMATS``.
    """

    keep_last: int | None = None
    checksums: bool = True
    optimizer_format: str = DEFAULT_OPTIMIZER_FORMAT


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """What ``save_checkpoint`` records of the model beside its tensors.

    Args:
        name: recorded in ``empg_checkpoint.json`` and checked by ``load_checkpoint(model_name=)``
            (default: ``config.name``).
        config: stored as ``model_config.yaml`` (``read_model_config``), so that
            tools/convert_megatron_to_hf.py can convert the checkpoint on its own.
        hf_assets: a HF model directory whose config and tokenizer files (no weights) are copied
            into ``hf/`` (``files.copy_hf_assets``).
        base: a LoRA policy's base, ``{"path": ..., "fingerprint": ...}`` (``mcore.lora.base``),
            recorded as ``lora_base`` in ``empg_checkpoint.json``: the checkpoint holds the adapters
            only, and a resume checks that its base is the same.
    """

    name: str | None = None
    config: ModelConfig | None = None
    hf_assets: str | os.PathLike | None = None
    base: Mapping[str, str] | None = None

    @property
    def model_name(self) -> str | None:
        """``name``, or the config's."""
        if self.name is None and self.config is not None:
            return self.config.name
        return self.name
