"""What only the machine a run starts on can tell, checked before its engine starts (the config is
``trainer.bind.build``'s): room in ``weight_sync.shm_dir`` for a weight-sync bucket file, a GPU with
Transformer Engine for a TE FP8 anchor, an engine that returns its routing on this device for router
replay, the memory plan against this GPU.
"""

from __future__ import annotations

import torch

from megatron_empg.config import ConfigError, ModelConfig, RunConfig
from megatron_empg.trainer.bind.anchor_kind import fp8_matmul_possible, te_fp8_possible
from megatron_empg.trainer.bind.memory_terms import bucket_file_bytes


def check_machine(config: RunConfig, model: ModelConfig, *, engine_rank: bool) -> None:
    """``ConfigError`` naming the field this machine cannot serve: a TE FP8 anchor without a GPU
    and Transformer Engine; router replay with an engine that returns no routing on this device (vLLM
    without a GPU refuses ``enable_return_routed_experts`` only once it starts); on an engine's owner
    (``engine_rank``) with ``shm_file``, a ``weight_sync.shm_dir`` without room for one bucket file,
    and ``cuda_ipc`` without a GPU."""
    if config.algorithm.router_replay == "rollout":
        from megatron_empg.rollout.engines import ENGINES

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ENGINES[config.rollout.engine].routes_on:
            able = sorted(n for n, kind in ENGINES.items() if device in kind.routes_on)
            raise ConfigError(
                "algorithm.router_replay",
                f"rollout needs an engine that returns its routed experts "
                f"on {device} ({able}); rollout.engine {config.rollout.engine!r} returns them on "
                f"{list(ENGINES[config.rollout.engine].routes_on)} only",
            )
    if config.algorithm.anchor.fp8 == "te" and not te_fp8_possible():
        raise ConfigError(
            "algorithm.anchor.fp8",
            "te needs a GPU and Transformer Engine (the NGC container); use fp8: emulated or auto elsewhere",
        )
    if config.algorithm.anchor.fp8 == "torch" and torch.cuda.is_available() and not fp8_matmul_possible():
        major, minor = torch.cuda.get_device_capability()
        raise ConfigError(
            "algorithm.anchor.fp8",
            f"torch multiplies in FP8 (torch._scaled_mm), which this GPU (sm{major}{minor}) cannot: it needs sm89 or "
            "newer (Ada, Hopper, Blackwell); use fp8: emulated or auto",
        )
    if engine_rank and config.weight_sync.transport == "cuda_ipc" and not torch.cuda.is_available():
        raise ConfigError(
            "weight_sync.transport",
            "cuda_ipc hands the engine CUDA IPC handles and needs a GPU on "
            "every engine's owner; use shm_file without GPUs",
        )
    if engine_rank and config.weight_sync.transport == "shm_file":
        from megatron_empg.weight_sync.transport import check_free_space

        check_free_space(config.weight_sync.shm_dir, bucket_file_bytes(config, model))


def check_memory_here(components) -> None:
    """On a GPU: the run's memory plan against this GPU's memory (``trainer.bind.memory_fixes.check_memory``:
    a ``ConfigError`` with the changes that fit, or a warning with ``train.memory_check: warn``)."""
    if not torch.cuda.is_available():
        return
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_fixes import check_memory

    device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    check_memory(components, components.layout.world_size, device, bind=bind)
