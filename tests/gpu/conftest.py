"""Fixtures of the GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def megatron_world():
    """A process group of one and Megatron's parallel state (the unfused attention's buffers), for
    a module's tests (``pytest.mark.usefixtures("megatron_world")``)."""
    import torch.distributed as dist

    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from tests.dist import free_port

    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    initialize_model_parallel(ParallelConfig(), seed=0)
    yield
    destroy_model_parallel()
    dist.destroy_process_group()
