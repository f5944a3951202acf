"""Rollout samples -> the padded [b, s] tensors the Megatron passes take.

A sample is a prompt and one sampled response. Its tokens are ``prompt + response``; position t
predicts token t + 1, so the response's log-probs sit at positions ``len(prompt) - 1 ..
len(prompt) + len(response) - 2``: that is where ``loss_mask`` is True, except at the response
tokens the policy did not generate (a multi-turn response's observations: ``response_mask``
False), which get no loss, KL or entropy term. Sequences are right-padded
to one length for the whole step (Megatron's schedule takes one ``seq_length`` per call), rounded
up to a multiple of ``pad_multiple``.

``training_micro_batches`` cuts the padded batch into what the Megatron passes take: mini-batches
of micro-batches, without the samples that carry no loss (a truncated response under
``algorithm.mask_truncated``: its old, anchor and update passes would compute a zero loss), on the
model's device. The loss is unchanged: a sample without loss tokens adds 0 to every (sum, count).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from megatron_empg.core.advantages import token_advantages
from megatron_empg.rollout.trajectory import Trajectory

import torch
from torch import Tensor


@dataclasses.dataclass
class Sample:
    """One response to one prompt, with everything the step computes about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    sampler_logprobs: list[float]  # [len(response_ids)] from the engine
    finish_reason: str
    group: int  # prompt index within the step (GRPO group)
    example: Any = None  # the rollout.data.PromptExample (its gold answer for the reward)
    response_mask: list[bool] | None = None  # [len(response_ids)], True: generated; None: all generated
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # rollout counts (turns, searches)
    reward: float = 0.0
    correct: bool = False

    @classmethod
    def from_trajectory(cls, example, group: int, trajectory: Trajectory) -> Sample:
        """The sample of ``trajectory``, a response to ``example`` (a ``PromptExample``), in ``group``."""
        return cls(example.prompt_ids, trajectory.token_ids, trajectory.logprobs, trajectory.finish_reason, group=group,
                   example=example, response_mask=trajectory.response_mask, stats=dict(trajectory.stats))  # fmt: skip

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def generated_ids(self) -> list[int]:
        """The response tokens the policy generated (what the reward reads)."""
        if self.response_mask is None:
            return self.response_ids
        return [token for token, generated in zip(self.response_ids, self.response_mask) if generated]


@dataclasses.dataclass
class PackedBatch:
    """``input_ids``/``target_ids`` [B, S] int64, ``loss_mask`` [B, S] bool, ``sampler_logprobs``
    [B, S] float32 (0 off the mask), for B samples in their given order."""

    input_ids: Tensor
    target_ids: Tensor
    loss_mask: Tensor
    sampler_logprobs: Tensor


def pack(samples: Sequence[Sample], *, pad_id: int, pad_multiple: int = 8, max_len: int | None = None) -> PackedBatch:
    """Right-padded tensors of ``samples`` (see the module docstring). ``max_len``: refuse longer."""
    if not samples:
        raise ValueError("pack: no samples")
    longest = max(s.length for s in samples)
    if max_len is not None and longest > max_len:
        raise ValueError(f"a sample has {longest} tokens, more than train.max_seq_len={max_len}")
    width = -(-longest // pad_multiple) * pad_multiple
    if max_len is not None:
        width = min(width, max_len)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    target_ids = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    sampler = torch.zeros((b, width), dtype=torch.float32)
    for i, s in enumerate(samples):
        tokens = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n, p, r = tokens.numel(), len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :n] = tokens
        target_ids[i, : n - 1] = tokens[1:]
        if r:
            generated = torch.ones(r, dtype=torch.bool) if s.response_mask is None else torch.tensor(s.response_mask)
            if generated.shape != (r,):
                raise ValueError(f"sample {i}: response_mask has {generated.numel()} entries for {r} response tokens")
            loss_mask[i, p - 1 : p - 1 + r] = generated
            logprobs = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
            sampler[i, p - 1 : p - 1 + r] = torch.where(generated, logprobs, 0.0)
    return PackedBatch(input_ids, target_ids, loss_mask, sampler)


def training_micro_batches(
    batch: PackedBatch,
    advantages: Tensor,
    *,
    micro_batch_size: int,
    mini_batches: int,
    device: torch.device,
    pad_multiple: int = 8,
) -> list[list[dict[str, Tensor]]]:
    """``[mini_batches][m]`` micro-batches (dicts of ``input_ids``, ``target_ids``, ``loss_mask``
    [b, s] and ``advantages`` [b, s] float32, on ``device``) of ``batch``'s B samples and their
    ``advantages`` [B].

    Mini-batch j is samples ``[j * B / mini_batches, (j + 1) * B / mini_batches)`` (as sampled),
    less those without a loss token, in micro-batches of ``micro_batch_size`` samples; a last
    partial micro-batch is filled with loss-free samples of the same mini-batch, and a mini-batch
    with no loss token keeps one micro-batch (every replica takes part in each optimizer step, and
    pipeline stages exchange equal shapes). The width is cut to the kept samples' last loss token
    (rounded up to ``pad_multiple``): positions after it cannot change the log-probs before it.
    """
    total = batch.input_ids.size(0)
    if total % mini_batches or (total // mini_batches) % micro_batch_size:
        raise ValueError(
            f"{total} samples do not split into {mini_batches} mini-batches of micro-batches of {micro_batch_size}"
        )
    per_mini = total // mini_batches
    trains = batch.loss_mask.any(dim=-1).tolist()
    plan = []
    for j in range(mini_batches):
        members = range(j * per_mini, (j + 1) * per_mini)
        kept = [i for i in members if trains[i]]
        fill = -len(kept) % micro_batch_size if kept else micro_batch_size
        plan.append(kept + [i for i in members if not trains[i]][:fill])
    used = [i for indices in plan for i in indices]
    positions = batch.loss_mask[used].any(dim=0).nonzero()
    last = int(positions.max()) + 1 if positions.numel() else 1
    width = min(-(-last // pad_multiple) * pad_multiple, batch.input_ids.size(1))
    out = []
    for indices in plan:
        minis = []
        for first in range(0, len(indices), micro_batch_size):
            rows = torch.tensor(indices[first : first + micro_batch_size])
            loss_mask = batch.loss_mask[rows, :width]
            micro = {
                "input_ids": batch.input_ids[rows, :width], "target_ids": batch.target_ids[rows, :width],
                "loss_mask": loss_mask, "advantages": token_advantages(advantages[rows], loss_mask),
            }  # fmt: skip
            minis.append({name: tensor.to(device) for name, tensor in micro.items()})
        out.append(minis)
    return out
