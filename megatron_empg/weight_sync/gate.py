"""The consistency gate: after a weight sync, the trainer and the engine score one fixed probe
batch; the run stops if their per-token log-probs differ by more than a tolerance.

A mismatch means the engine does not run the policy that was trained (a wrong layout, a stale
prefix cache, a lost bucket, a dtype problem), so importance ratios and rewards would be silently
wrong. On a mismatch a diagnosis runs (``bridge.round_trip_errors``: every tensor converted back
and compared, and each bucketed tensor's name checked against its values), and the error names
the tensor family that was worst; when every family round-trips exactly it says so: then the
engine's loading, its numerics or its cache are the suspects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.config import SamplingConfig
from megatron_empg.parallel.placement import EnginePlacement


class ProbeEngine(Protocol):
    """What the gate needs from a rollout engine (``rollout.engine.RolloutEngine`` has it)."""

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]: ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list]: ...


class ConsistencyError(RuntimeError):
    """Trainer and engine log-probs disagree after a weight sync."""


def probe_batch(num_sequences: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_sequences`` fixed random token sequences of ``length`` ids in [0, vocab_size).

    Longer than one KV-cache block (128 tokens on CPU), so that a prefix cache not reset after an
    update would serve KV of the old weights and fail the gate.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_sequences, length), generator=generator).tolist()


def engine_probe(engine: ProbeEngine, probe: Sequence[Sequence[int]], continuation: int, seed: int):
    """The engine's side of the gate, through both of its paths.

    Scores the probe by teacher forcing, and samples ``continuation`` tokens after each probe
    sequence (temperature 1, fixed seed) with the sampler's log-probs: generation reads the prefix
    cache, so KV left from the old weights shows here even where scoring recomputes everything.

    Returns (sequences, logprobs): each probe sequence followed by its sampled tokens ``[N][L+C]``,
    and the engine's ``[N, L+C-1]`` float64 log-probs of tokens 1 .. L+C-1 (what the trainer's
    ``score_sequences`` of the same sequences must give).
    """
    scored = engine.score(probe)
    if continuation == 0:
        return [list(seq) for seq in probe], torch.tensor(scored, dtype=torch.float64)
    # ignore_eos and no min_tokens: min_tokens would mask eos and so change the sampler's log-probs.
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=continuation, ignore_eos=True, seed=seed)
    completions = [group[0] for group in engine.generate(probe, sampling)]
    short = [len(c.token_ids) for c in completions if len(c.token_ids) != continuation]
    if short:
        raise ValueError(f"the engine sampled {short} tokens instead of {continuation}: is the probe too long?")
    sequences = [list(seq) + list(c.token_ids) for seq, c in zip(probe, completions)]
    logprobs = [s + list(c.logprobs) for s, c in zip(scored, completions)]
    return sequences, torch.tensor(logprobs, dtype=torch.float64)


def max_difference(trainer_logprobs: Tensor, engine_logprobs: Tensor) -> tuple[float, int, int]:
    """(max |trainer - engine|, probe sequence, token index) of two [N, T] log-prob tensors (NaN
    counts as infinitely wrong)."""
    if trainer_logprobs.shape != engine_logprobs.shape:
        raise ValueError(
            f"trainer log-probs {tuple(trainer_logprobs.shape)} and engine log-probs "
            f"{tuple(engine_logprobs.shape)} must have the same shape"
        )
    diff = torch.nan_to_num((trainer_logprobs.double() - engine_logprobs.double()).abs(), nan=math.inf)
    if not diff.numel():
        return 0.0, 0, 0
    seq, pos = divmod(int(diff.argmax()), diff.size(1))
    return diff[seq, pos].item(), seq, pos + 1


def mismatch_message(
    version: str,
    where: tuple[float, int, int],
    tolerance: float,
    family_errors: dict[str, float] | None,
    engine: int | None = None,
) -> str:
    """The gate's error: where the log-probs differ most (in ``engine``, of several), and the
    suspect tensor family."""
    worst, seq, token = where
    families = sorted((family_errors or {}).items(), key=lambda kv: -kv[1])
    if family_errors is None:
        suspect = "no layout diagnosis was run"
    elif families and families[0][1] == math.inf:
        suspect = (
            f"worst tensor family: {families[0][0]} (a tensor of it changes shape in the Megatron -> HF -> "
            f"Megatron round trip, or reaches the bucket under another tensor's name, or not exactly once); "
            f"all: " + ", ".join(f"{f}={e:.3g}" for f, e in families)
        )
    elif families and families[0][1] > 0:
        suspect = (
            f"worst tensor family: {families[0][0]} (its Megatron -> HF -> Megatron round trip is off by "
            f"{families[0][1]:.3g}); all: " + ", ".join(f"{f}={e:.3g}" for f, e in families)
        )
    else:
        suspect = (
            "every tensor family round-trips exactly, so the engine's loading, numerics (dtype) or "
            "cache are the suspects"
        )
    which = "engine" if engine is None else f"engine {engine}"
    return (
        f"weight sync {version}: {which} and trainer log-probs differ by up to {worst:.3g} "
        f"(tolerance {tolerance:g}) at probe sequence {seq}, token {token}; {suspect}"
    )


def check_consistency(
    trainer_logprobs: Tensor,
    engine_logprobs: Tensor,
    tolerance: float,
    version: str,
    family_errors: dict[str, float] | None = None,
) -> float:
    """Max |trainer - engine| over the probe's tokens; ``ConsistencyError`` if above ``tolerance``.

    Args:
        trainer_logprobs: [N, T] float, log p(x_t | x_<t) of the probe under the trainer's policy.
        engine_logprobs: [N, T] float, the same from the engine (``engine_probe``).
        version: the synced version (for the message).
        family_errors: ``bridge.round_trip_errors`` (tensor family -> error), named in the message.
    """
    where = max_difference(trainer_logprobs, engine_logprobs)
    if not where[0] <= tolerance:
        raise ConsistencyError(mismatch_message(version, where, tolerance, family_errors))
    return where[0]


def verify_sync(
    engine: ProbeEngine | None,
    probe: Sequence[Sequence[int]],
    trainer_score: Callable[[list[list[int]]], Tensor],
    version: str,
    *,
    tolerance: float,
    continuation: int,
    seed: int,
    diagnose: Callable[[], dict[str, float]] | None = None,
    placement: EnginePlacement,
) -> float:
    """The gate across all ranks; every rank calls it after ``sync_weights``.

    Every engine's owner (``placement.owner``: ``engine`` given there, None elsewhere) runs
    ``engine_probe`` and shares the sequences inside its engine group (the world for one engine);
    every rank runs ``trainer_score(sequences)`` (a collective forward pass giving the [N, L+C-1]
    log-probs on every rank of a model replica, e.g. ``mcore.step.score_sequences``); the owner
    compares. One MAX all-reduce of an [E, 3] table of (difference, sequence, token) over the world
    gives every rank every engine's result. Above ``tolerance`` every rank runs ``diagnose()`` (a
    collective, e.g. ``bridge.round_trip_errors``) and raises the same ``ConsistencyError``, naming
    the worst engine when there are several. Returns the max difference over the engines.
    """
    is_engine_rank = placement.is_owner
    if is_engine_rank != (engine is not None):
        raise ValueError(f"rank {dist.get_rank()}: the engine rank {placement.owner}, and only it, passes the engine")
    sequences, engine_logprobs = engine_probe(engine, probe, continuation, seed) if is_engine_rank else (None, None)
    trainer_logprobs = trainer_score(placement.broadcast_from_owner(sequences))
    mine = max_difference(trainer_logprobs.cpu(), engine_logprobs) if is_engine_rank else None
    table = placement.engine_table(mine, 3, op=dist.ReduceOp.MAX)  # float64: the difference unrounded
    worst_engine = int(table[:, 0].argmax())
    diff, seq, token = table[worst_engine].tolist()
    where = (diff, int(seq), int(token))
    if not where[0] <= tolerance:
        family_errors = diagnose() if diagnose else None
        named = worst_engine if placement.num_engines > 1 else None
        raise ConsistencyError(mismatch_message(version, where, tolerance, family_errors, named))
    return where[0]


def verify_probes(
    probes: Sequence[tuple[list[list[int]], Tensor]],
    trainer_score: Callable[[list[list[int]]], Tensor],
    version: str,
    *,
    tolerance: float,
    diagnose: Callable[[], dict[str, float]] | None = None,
) -> float:
    """The gate of disaggregated engines, on the training ranks: ``probes[e]`` is engine e's
    ``engine_probe`` result (sequences, log-probs), the same on every training rank. Every rank
    scores every engine's sequences (``trainer_score``, a collective) and compares, so all reach
    the same verdict; above ``tolerance`` every rank runs ``diagnose()`` and raises the same
    ``ConsistencyError`` naming the worst engine. Returns the max difference over the engines."""
    results = [max_difference(trainer_score(sequences).cpu(), logprobs) for sequences, logprobs in probes]
    return _worst_engine(results, version, tolerance, diagnose, range(len(results)))


def _worst_engine(
    results: Sequence[tuple[float, int, int]],
    version: str,
    tolerance: float,
    diagnose: Callable[[], dict[str, float]] | None,
    names: Sequence[int],
) -> float:
    """The largest of the engines' ``max_difference`` results; above ``tolerance``, ``diagnose()``
    and a ``ConsistencyError`` naming the worst engine (``names[e]``: result e's engine)."""
    worst = max(range(len(results)), key=lambda e: results[e][0])
    if not results[worst][0] <= tolerance:
        family_errors = diagnose() if diagnose else None
        raise ConsistencyError(mismatch_message(version, results[worst], tolerance, family_errors, names[worst]))
    return results[worst][0]


def engine_self_check(
    engine: ProbeEngine, sequences: Sequence[Sequence[int]], logprobs: Tensor, probe_length: int
) -> float:
    """Largest |sampler - scoring| log-prob gap of the engine on the continuation it sampled after
    the probe (``engine_probe``'s ``sequences`` and ``logprobs``, whose tokens from
    ``probe_length`` on were sampled): generation reads the prefix cache, scoring recomputes, so
    KV left from older weights shows here. The engines' half of the gate when the training ranks
    can no longer score those weights (``verify_staged_probes``)."""
    if logprobs.size(1) <= probe_length - 1:
        return 0.0
    scored = torch.tensor(engine.score(sequences), dtype=torch.float64)
    return max_difference(scored[:, probe_length - 1 :], logprobs[:, probe_length - 1 :])[0]


def verify_staged_probes(
    probes: Sequence[tuple[list[list[int]], Tensor]],
    self_checks: Sequence[float],
    trainer_logprobs: Tensor,
    version: str,
    *,
    tolerance: float,
    diagnose: Callable[[], dict[str, float]] | None = None,
    engines: Sequence[int] | None = None,
) -> float:
    """The gate of engines that load pushed weights later (``rollout.max_staleness`` >= 1), on the
    training ranks, once the engines' probes of those weights arrive: ``trainer_logprobs`` [N, L-1]
    are the trainer's log-probs of the probe batch computed when it pushed ``version``; engine e's
    teacher-forced log-probs of the probe (the first L-1 of ``probes[e]``) must match them, and its
    ``self_checks[e]`` (``engine_self_check``) must be within ``tolerance`` too. Above it every
    rank runs ``diagnose()`` (on the trainer's current weights: a layout fault shows on any) and
    raises the same ``ConsistencyError`` naming the worst engine (``engines``: the indices of
    ``probes``' engines in the run, default 0, 1, ...) and ``version``. Returns the max difference."""
    width = trainer_logprobs.size(1)
    names = list(engines) if engines is not None else list(range(len(probes)))
    difference = _worst_engine(
        [max_difference(trainer_logprobs, logprobs[:, :width]) for _, logprobs in probes],
        version,
        tolerance,
        diagnose,
        names,
    )
    stale = max(range(len(self_checks)), key=lambda e: self_checks[e], default=None)
    if stale is not None and not self_checks[stale] <= tolerance:
        raise ConsistencyError(
            f"weight sync {version}: engine {names[stale]}'s sampler and its own scoring disagree by up to "
            f"{self_checks[stale]:.3g} (tolerance {tolerance:g}) on the continuation it sampled after the probe, "
            f"while its scoring matches the trainer: KV computed with older weights is the suspect (a prefix "
            f"cache not reset by the update)"
        )
    return max(difference, max(self_checks, default=0.0))
