"""``vocab_parallel_logprobs`` against Megatron-Core's ``tensor_parallel.vocab_parallel_cross_entropy``.

At TP=2 on gloo, with the CPU shims and ``parallel_state.initialize_model_parallel``, Megatron's
cross-entropy of [S, B, V_local] logits at the labels must equal minus our log-prob at the same
ids, in value and in the gradient of each rank's shard, for a random non-uniform upstream
gradient. Megatron does not mask padded vocabulary columns, so the vocabulary here is divisible by
TP (no padding); the padded case is covered against the core references in test_vocab_parallel.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import Tensor

from tests.dist import run_distributed

pytestmark = [
    pytest.mark.dist,
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

S, B, V, TP = 5, 3, 32, 2


def _megatron_and_ours(rank: int, world_size: int, logits: Tensor, labels: Tensor, upstream: Tensor) -> dict:
    from megatron_empg.mcore import cpu_shims

    cpu_shims.install_pre_import()
    from megatron.core import parallel_state, tensor_parallel

    from megatron_empg.parallel.vocab_parallel import vocab_parallel_logprobs

    cpu_shims.install_post_import()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        width = V // TP
        shard = logits[..., tp_rank * width : (tp_rank + 1) * width]  # [S, B, V_local]

        megatron_leaf = shard.clone().requires_grad_(True)
        # Megatron subtracts the max from its fp32 input in place: hand it a copy of the leaf.
        megatron_loss = tensor_parallel.vocab_parallel_cross_entropy(megatron_leaf.clone(), labels)  # [S, B]
        (megatron_grad,) = torch.autograd.grad(megatron_loss, megatron_leaf, upstream)

        leaf = shard.clone().requires_grad_(True)
        logprobs, _ = vocab_parallel_logprobs(
            leaf.reshape(S * B, width),  # [T, V_local]
            labels.reshape(S * B, 1),  # [T, 1]
            vocab_start=tp_rank * width,
            vocab_size=V,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
        loss = -logprobs[:, 0].reshape(S, B)  # [S, B]
        (grad,) = torch.autograd.grad(loss, leaf, upstream)
        return {
            "tp_rank": tp_rank,
            "megatron_loss": megatron_loss.detach(),
            "loss": loss.detach(),
            "megatron_grad": megatron_grad,
            "grad": grad,
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_vocab_parallel_logprobs_equals_megatron_vocab_parallel_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(S, B, V, generator=g)  # fp32
    labels = torch.randint(0, V, (S, B), generator=g)
    upstream = torch.randn(S, B, generator=g)  # random, non-uniform upstream gradient
    results = run_distributed(_megatron_and_ours, TP, logits, labels, upstream, timeout=180)
    assert sorted(r["tp_rank"] for r in results) == list(range(TP))
    for r in results:
        what = f"tp_rank {r['tp_rank']}"
        # Both fp32: Megatron computes log(sum exp(z - max)) - (z_y - max), we z_y - lse(z), the
        # per-rank pieces combined differently: a few ulps (1.2e-6 seen on a gradient of 2).
        tol = {"rtol": 1e-6, "atol": 1e-6}
        torch.testing.assert_close(r["loss"], r["megatron_loss"], **tol, msg=lambda m: f"{what} loss: {m}")
        torch.testing.assert_close(r["grad"], r["megatron_grad"], **tol, msg=lambda m: f"{what} grad: {m}")
        assert r["megatron_grad"].abs().sum() > 0
    torch.testing.assert_close(results[0]["loss"], results[1]["loss"], rtol=0, atol=0)  # replicated
