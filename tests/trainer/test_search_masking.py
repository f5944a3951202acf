"""Retrieved tokens get no gradient: multi-turn samples (generated runs with observation runs between
them, ``Sample.response_mask``) laid out by ``trainer.batching.batch.micro_batches`` (padded and packed) and
put through the update pass's objective (``parallel.rl_loss``: policy loss + KL + entropy bonus). The gradient of the loss with
respect to the logits is exactly zero at every position that predicts an observation token (and at
the prompt and padding), and nonzero at every position that predicts a generated token."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.parallel.rl_loss import rl_loss
from megatron_empg.trainer.batching.batch import MicroBatchPlan, Sample, micro_batches

V = 32
K = 4


def multi_turn_samples() -> list[Sample]:
    """Two samples: generated (G) and observation (O) runs, ``G3 O5 G2 O4 G3`` and ``G4 O6 G1``."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for group, (prompt_length, runs) in enumerate(
        [(5, [(3, 1), (5, 0), (2, 1), (4, 0), (3, 1)]), (7, [(4, 1), (6, 0), (1, 1)])]
    ):
        mask = [bool(generated) for length, generated in runs for _ in range(length)]
        ids = torch.randint(2, V, (prompt_length + len(mask),), generator=generator).tolist()
        logprobs = [-0.5 if m else 0.0 for m in mask]
        samples.append(
            Sample(ids[:prompt_length], ids[prompt_length:], logprobs, "stop", group=group, response_mask=mask)
        )
    return samples


@pytest.mark.parametrize(
    "kl, kl_args",
    [
        ("topk", {"direction": "reverse"}),
        ("topk", {"direction": "forward"}),
        ("k3", {}),
        ("k1", {"importance_weight": True}),
    ],
)
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("packing", [False, True])
def test_no_observation_token_gets_gradient(kl, kl_args, agg_mode, packing):
    samples = multi_turn_samples()
    (batch,) = micro_batches(samples, [1.0, -0.7], MicroBatchPlan(packing=packing, micro_batch_size=2))
    b, s = batch.input_ids.shape
    torch.manual_seed(1)
    logits = torch.randn(b, s, V, requires_grad=True)
    with torch.no_grad():  # old policy and anchor: perturbed copies; the Top-k set from the anchor
        old = torch.log_softmax(logits + 0.1 * torch.randn(b, s, V), -1)
        anchor = torch.log_softmax(logits + 0.3 * torch.randn(b, s, V), -1)
        topk_ids = anchor.topk(K, dim=-1).indices
    batch.old_logprobs = old.gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)
    batch.anchor_logprobs = anchor.gather(-1, batch.target_ids.unsqueeze(-1)).squeeze(-1)
    batch.topk_ids, batch.topk_anchor_logprobs = topk_ids, anchor.gather(-1, topk_ids)
    out = rl_loss(
        logits,
        batch,
        vocab_start=0,
        vocab_size=V,
        tp_group=None,
        kl=kl,
        kl_coef=0.5,
        kl_args=kl_args,
        entropy_coef=0.01,
        agg_mode=agg_mode,
    )
    out.loss.loss_sum.backward()
    per_position = logits.grad.abs().sum(-1)  # [B, S]

    generated = sum(sum(sample.response_mask) for sample in samples)
    assert int(batch.loss_mask.sum()) == generated == 13
    assert torch.all(per_position[~batch.loss_mask] == 0)
    assert torch.all(per_position[batch.loss_mask] > 0)
    for i, sample in enumerate(samples):  # the observation positions by name, not through loss_mask
        row, first = (0, int(batch.cu_seqlens[i])) if packing else (i, 0)
        p = first + len(sample.prompt_ids)
        observed = [p - 1 + j for j, m in enumerate(sample.response_mask) if not m]
        assert observed and torch.all(per_position[row, observed] == 0)
    if agg_mode == "token-mean":
        assert int(out.loss.count) == generated
