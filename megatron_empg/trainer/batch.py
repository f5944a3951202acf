"""Rollout samples -> the padded [b, s] tensors the Megatron passes take.

A sample is a prompt and one sampled response. Its tokens are ``prompt + response``; position t
predicts token t + 1, so the response's log-probs sit at positions ``len(prompt) - 1 ..
len(prompt) + len(response) - 2``: that is where ``loss_mask`` is True, except at the response
tokens the policy did not generate (a multi-turn response's observations: ``response_mask``
False), which get no loss, KL or entropy term. Sequences are right-padded
to one length for the whole step (Megatron's schedule takes one ``seq_length`` per call), rounded
up to a multiple of ``pad_multiple``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

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

    def micro_batches(self, size: int) -> list[dict[str, Tensor]]:
        """Consecutive slices of ``size`` samples as dicts (``input_ids``, ``target_ids``, ``loss_mask``)."""
        total = self.input_ids.size(0)
        if total % size:
            raise ValueError(f"{total} samples do not split into micro-batches of {size}")
        return [
            {"input_ids": self.input_ids[i : i + size], "target_ids": self.target_ids[i : i + size],
             "loss_mask": self.loss_mask[i : i + size]}
            for i in range(0, total, size)
        ]  # fmt: skip


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
