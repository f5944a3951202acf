"""The rollout-engine protocol: what the trainer needs from an inference engine, and its results.

An engine samples ``n`` responses per prompt (``generate``), scores fixed sequences by teacher
forcing (``score``), takes new weights from the trainer between rollouts (``begin_weight_update``
-> ``update_weights`` per bucket -> ``finish_weight_update``) and, when colocated with training on
a GPU, frees its memory while the trainer runs (``sleep`` / ``wake_up``). Token ids are plain
Python ints and log-probs plain floats (natural log), so results cross process boundaries freely.

Pure Python and torch. ``rollout.engines.ENGINES`` names the implementations (``rollout.engine``
in a config).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from megatron_empg.config import SamplingConfig

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")  # what ``wake_up(tags)`` may bring back separately


@dataclass(frozen=True)
class Completion:
    """One sampled response.

    ``token_ids``: ``[T]`` ints, the generated tokens; the stop token is included when it was
    generated (an eos or a ``stop_token_ids`` entry), as vLLM returns them. ``logprobs``: ``[T]``
    floats, the sampler's natural-log probability of each generated token under the distribution it
    was drawn from (the engine documents which one). ``finish_reason``: ``"stop"`` (eos, stop token
    or stop string), ``"length"`` (``max_tokens`` or the engine's context length reached) or
    ``"abort"``. ``stop_reason``: the stop token id or stop string that ended the response; None
    for eos, length and abort.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | str | None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion: token_ids and logprobs must have the same length, got "
                f"{len(self.token_ids)} and {len(self.logprobs)}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )


class RolloutEngine(Protocol):
    """An inference engine that the trainer samples from and pushes its weights into.

    Weight updates: ``begin_weight_update()``, then ``update_weights(...)`` once per bucket until
    every tensor of the model was sent, then ``finish_weight_update(version)``. No ``generate`` /
    ``score`` in between. Tensors passed by reference belong to the engine until
    ``finish_weight_update`` returns (do not modify them earlier).
    """

    weight_version: str | None
    """The policy step the engine's weights come from (None: the weights it was started with)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Sample ``sampling.n`` responses to each prompt.

        ``prompts``: ``[P][L_p]`` token ids, each prompt non-empty, ids in ``[0, vocab_size)``.
        Returns ``[P][n]`` completions, in prompt order and sample order.
        """
        ...

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs: ``log p(x_t | x_<t)`` for ``t = 1 .. L-1`` of each sequence.

        ``sequences``: ``[S][L_s]`` token ids, each non-empty. Returns ``[S][L_s - 1]`` floats
        (natural log, temperature 1, no top-k/top-p: the model's own distribution).
        """
        ...

    def begin_weight_update(self) -> None:
        """Start a weight update; ``generate`` / ``score`` are refused until it is finished."""
        ...

    def update_weights(
        self,
        *,
        named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
        path: str | None = None,
    ) -> None:
        """Load one bucket of new weights: exactly one of the two arguments.

        ``named_tensors``: ``[(hf_name, tensor)]`` with Hugging Face parameter names and shapes
        (e.g. ``model.layers.0.self_attn.q_proj.weight``, ``[H * D, hidden]``), any float dtype
        (cast to the engine's). ``path``: a safetensors file of such tensors (an engine in another
        process); the caller deletes it after ``finish_weight_update``.
        """
        ...

    def finish_weight_update(self, version: str) -> None:
        """Finalize the update, drop cached KV of the old weights, record ``weight_version``."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release the engine's accelerator memory while training runs: level 1 keeps the weights
        in host memory and drops the KV cache, level 2 drops both (the next weight update must then
        write every tensor). No ``generate`` / ``score`` / weight update until ``wake_up``."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back after ``sleep``: all of it (``tags`` None), or part of it
        (``WAKE_TAGS``: ``["weights"]`` first, to load new weights before the KV cache is
        allocated, then ``["kv_cache"]``). ``generate`` / ``score`` need every part awake, a
        weight update the weights."""
        ...

    def shutdown(self) -> None:
        """Release the engine and its processes; it cannot be used afterwards."""
        ...


def check_token_sequences(
    sequences: Sequence[Sequence[int]], *, argument: str, vocab_size: int, max_length: int
) -> list[list[int]]:
    """``sequences`` as lists of ints, after checking them for an engine.

    Each sequence must be non-empty with at most ``max_length`` tokens, and every id an integer in
    ``[0, vocab_size)``. Errors name ``argument`` and the offending index.
    """
    if isinstance(sequences, (str, bytes, torch.Tensor)) or not isinstance(sequences, Sequence):
        raise TypeError(f"{argument}: expected a list of token-id lists, got {type(sequences).__name__}")
    if len(sequences) == 0:
        raise ValueError(f"{argument}: expected at least one sequence, got an empty list")
    checked = []
    for i, sequence in enumerate(sequences):
        if isinstance(sequence, (str, bytes, torch.Tensor)) or not isinstance(sequence, Sequence):
            raise TypeError(f"{argument}[{i}]: expected a list of token ids, got {type(sequence).__name__}")
        if len(sequence) == 0:
            raise ValueError(f"{argument}[{i}]: expected at least one token id, got an empty sequence")
        if len(sequence) > max_length:
            raise ValueError(
                f"{argument}[{i}]: {len(sequence)} tokens, more than the engine allows ({max_length})"
            )
        try:
            ids = [operator.index(token) for token in sequence]
        except TypeError as error:
            raise TypeError(f"{argument}[{i}]: token ids must be integers ({error})") from None
        bad = next((j for j, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{argument}[{i}][{bad}]: token id {ids[bad]} is outside [0, vocab_size={vocab_size})"
            )
        checked.append(ids)
    return checked
