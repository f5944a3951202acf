"""Megatron's model-parallel process groups, set up once and read from one place.

``initialize_model_parallel(parallel, seed)`` (in every rank, after
``torch.distributed.init_process_group``) installs the CPU shims, creates Megatron's groups for
``parallel`` (TP, PP, VPP; the rest of the world is data parallel), seeds the RNGs and returns a
frozen ``ParallelGroups``. Code below mcore gets its groups from that object (or
``current_groups()``), never from ``megatron.core.parallel_state`` directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_empg.config import ParallelConfig
from megatron_empg.mcore import cpu_shims

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _megatron_parallel_state():
    cpu_shims.install_pre_import()
    from megatron.core import parallel_state

    return parallel_state


@dataclasses.dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the TP x PP x DP grid and the groups for each dimension."""

    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup  # the replicas of the data (not the CP ranks of one replica)
    mp_group: ProcessGroup  # TP x PP: all ranks holding one copy of the model's weights
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    vpp_size: int | None  # model chunks per pipeline rank (None: no interleaving)
    rank: int
    world_size: int
    cp_group: ProcessGroup | None = None  # the context-parallel ranks sharing each row (None: CP 1)
    cp_rank: int = 0
    cp_size: int = 1
    dp_cp_group: ProcessGroup | None = None  # DP x CP: the ranks whose gradients (and sums) add up
    # The expert grid (a mixture of experts): EP ranks hold different experts, each split over ETP.
    ep_group: ProcessGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: ProcessGroup | None = None
    etp_rank: int = 0
    etp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        """First pipeline stage (holds the embedding; with VPP, in its first model chunk)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Last pipeline stage (holds the output layer; with VPP, in its last model chunk)."""
        return self.pp_rank == self.pp_size - 1

    @property
    def num_model_chunks(self) -> int:
        return self.vpp_size or 1

    @property
    def sum_group(self) -> ProcessGroup:
        """The group over which per-token sums and counts add up (DP x CP; DP without CP)."""
        return self.dp_cp_group if self.dp_cp_group is not None else self.dp_group

    @property
    def sum_size(self) -> int:
        return self.dp_size * self.cp_size


def current_groups() -> ParallelGroups:
    """The groups of the model parallelism currently initialized in Megatron."""
    ps = _megatron_parallel_state()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("model parallelism is not initialized; call initialize_model_parallel first")
    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        cp_group=ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None,
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep_group=ps.get_expert_model_parallel_group(check_initialized=False),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_group=ps.get_expert_tensor_parallel_group(check_initialized=False),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )


def seed_everything(seed: int, pp_rank: int = 0) -> None:
    """Megatron-LM's seeding: ``seed + 100 * pp_rank`` for python/torch (the CPU generator builds the
    weights under ``use_cpu_initialization``, the same on every TP rank of a stage), then Megatron's
    tracked model-parallel RNG states."""
    cpu_shims.install_pre_import()
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Inside the block, random draws (building a second model: the anchor, a teacher) leave the
    run's streams as they were: torch's CPU and CUDA generators and Megatron's tracked states."""
    cpu_shims.install_pre_import()
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            tracker.set_states(states)


def initialize_model_parallel(parallel: ParallelConfig, seed: int = 1234, **megatron_kwargs: Any) -> ParallelGroups:
    """Create Megatron's groups for ``parallel`` over the current world and seed the RNGs.

    ``torch.distributed`` must be initialized. ``megatron_kwargs`` go to Megatron's
    ``parallel_state.initialize_model_parallel`` (e.g. ``create_gloo_process_groups``).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
    parallel.validate()
    parallel.validate_world_size(dist.get_world_size())
    ps = _megatron_parallel_state()
    cpu_shims.install_post_import()
    if ps.model_parallel_is_initialized():
        raise RuntimeError("model parallelism is already initialized; call destroy_model_parallel first")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp_size,
        **megatron_kwargs,
    )
    groups = current_groups()
    seed_everything(seed, groups.pp_rank)
    return groups


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups (the default process group stays). Idempotent."""
    ps = _megatron_parallel_state()
    ps.destroy_model_parallel()
    # Megatron 0.19's teardown misses some globals (``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
    # and its gloo twin). A group kept alive past ``destroy_process_group`` is freed during
    # interpreter teardown, where its gloo threads can abort the process (std::terminate).
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    # RotaryEmbedding.forward is an lru_cache keyed by (self, ..., cp_group): it holds every model
    # built in this process, and their groups.
    rotary = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rotary is not None:
        rotary.RotaryEmbedding.forward.cache_clear()
