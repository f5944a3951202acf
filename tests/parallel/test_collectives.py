"""collective_device: where host-side values are reduced, per backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_empg.parallel import collectives
from megatron_empg.parallel.collectives import collective_device


def test_gloo_reduces_cpu_tensors(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        device = collective_device()
        assert device == torch.device("cpu")
        flag = torch.tensor([3], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        assert flag.item() == 3
    finally:
        dist.destroy_process_group()


def test_nccl_reduces_tensors_on_the_current_cuda_device(monkeypatch):
    # NCCL rejects CPU tensors: flags and metric sums must be built on the rank's GPU
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 5)
    assert collective_device() == torch.device("cuda", 5)
