"""The consistency gate: after a weight sync, the trainer and the engine score one fixed probe
batch; the run stops if their per-token log-probs differ by more than a tolerance.

A mismatch means the engine does not run the policy that was trained (a wrong layout, a stale
prefix cache, a lost bucket, a dtype problem), so importance ratios and rewards would be silently
wrong. The error names the tensor family whose Megatron -> HF -> Megatron round trip was worst
during the sync (``SyncReport.round_trip_error``); when every family round-trips exactly it says
so: then the engine's loading, its numerics or its cache are the suspects.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_empg.weight_sync.bridge import SyncReport


class ConsistencyError(RuntimeError):
    """Trainer and engine log-probs disagree after a weight sync."""


def probe_batch(num_sequences: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_sequences`` fixed random token sequences of ``length`` ids in [0, vocab_size).

    Longer than one KV-cache block (128 tokens on CPU), so that a prefix cache not reset after an
    update would serve KV of the old weights and fail the gate.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_sequences, length), generator=generator).tolist()


def check_consistency(
    trainer_logprobs: Tensor, engine_logprobs: Tensor, tolerance: float, report: SyncReport
) -> float:
    """Max |trainer - engine| over the probe's tokens; ``ConsistencyError`` if above ``tolerance``.

    Args:
        trainer_logprobs: [N, L-1] float, log p(x_t | x_<t) of the probe under the trainer's policy.
        engine_logprobs: [N, L-1] float, the same from the engine (``RolloutEngine.score``).
        report: the sync's report (version and round-trip errors per tensor family).
    """
    if trainer_logprobs.shape != engine_logprobs.shape:
        raise ValueError(
            f"trainer log-probs {tuple(trainer_logprobs.shape)} and engine log-probs "
            f"{tuple(engine_logprobs.shape)} must have the same shape"
        )
    diff = (trainer_logprobs.double() - engine_logprobs.double()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    if not worst <= tolerance:  # NaN fails too
        seq, pos = divmod(int(torch.nan_to_num(diff, nan=float("inf")).argmax()), diff.size(1))
        families = sorted(report.round_trip_error.items(), key=lambda kv: -kv[1])
        if families and families[0][1] > 0:
            suspect = (
                f"worst tensor family: {families[0][0]} (its Megatron -> HF -> Megatron round trip is off by "
                f"{families[0][1]:.3g}); all: " + ", ".join(f"{f}={e:.3g}" for f, e in families)
            )
        else:
            suspect = (
                "every tensor family round-trips exactly, so the engine's loading, numerics (dtype) or "
                "cache are the suspects"
            )
        raise ConsistencyError(
            f"weight sync {report.version}: engine and trainer log-probs differ by up to {worst:.3g} "
            f"(tolerance {tolerance:g}) at probe sequence {seq}, token {pos + 1}; {suspect}"
        )
    return worst
