"""The rollout-engine protocol: what the trainer needs from an inference engine, and its results.

An engine samples ``n`` responses per prompt (``generate``), scores fixed sequences by teacher
forcing (``score``; ``score_topk`` with the top-k of every position, a distillation teacher's), takes new weights from the trainer between rollouts (``begin_weight_update``
-> ``update_weights`` per bucket -> ``finish_weight_update``) and, when colocated with training on
a GPU, frees its memory while the trainer runs (``sleep`` / ``wake_up``). Token ids are plain
Python ints and log-probs plain floats (natural log), so results cross process boundaries freely.

Pure Python and torch. ``rollout.engines.ENGINES`` names the implementations (``rollout.engine``
in a config).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from megatron_empg.config import SamplingConfig

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
WAKE_TAGS: tuple[str, ...] = ("weights", "kv_cache")  # what ``wake_up(tags)`` may bring back separately
ROUTED_EXPERT_DTYPE = torch.int16  # ``Completion.routed_experts``: expert ids of at most ROUTED_EXPERT_LIMIT experts
ROUTED_EXPERT_LIMIT = 2**15


@dataclass(frozen=True)
class Completion:
    """One sampled response.

    ``token_ids``: ``[T]`` ints, the generated tokens; the stop token is included when it was
    generated (an eos or a ``stop_token_ids`` entry), as vLLM returns them. ``logprobs``: ``[T]``
    floats, the sampler's natural-log probability of each generated token under the distribution it
    was drawn from (the engine documents which one). ``finish_reason``: ``"stop"`` (eos, stop token
    or stop string), ``"length"`` (``max_tokens`` or the engine's context length reached) or
    ``"abort"``. ``stop_reason``: the stop token id or stop string that ended the response; None
    for eos, length and abort. ``versions``: ``[T]``, the ``weight_version`` that sampled each
    token, when the weights may change inside ``generate`` (``between_steps``); None: every token
    was sampled by the weights of the call's start. ``routed_experts``: ``[P + T - 1, layers,
    top_k]`` ``ROUTED_EXPERT_DTYPE`` (int16), the experts the engine's router sent each token of
    prompt (P tokens) + response to in each MoE layer, in the router's top-k order (vLLM's
    ``CompletionOutput.routed_experts`` layout), for an engine started with ``routed_experts=True``;
    the last response token has none (the engine never ran it). None: not asked.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | str | None
    versions: list[str | None] | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion: token_ids and logprobs must have the same length, got "
                f"{len(self.token_ids)} and {len(self.logprobs)}"
            )
        check_routed_experts(self.routed_experts, len(self.token_ids), "Completion")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"Completion: {len(self.token_ids)} token ids but {len(self.versions)} versions")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}")


def check_routed_experts(routed: torch.Tensor | None, response_tokens: int, owner: str) -> None:
    """``routed`` (a ``Completion.routed_experts``) is None or an int16 [P + T - 1, layers, top_k]
    tensor with P >= 1 prompt tokens for ``response_tokens`` = T."""
    if routed is None:
        return
    if not isinstance(routed, torch.Tensor) or routed.dtype != ROUTED_EXPERT_DTYPE or routed.dim() != 3:
        what = (
            f"{routed.dtype} tensor of shape {list(routed.shape)}"
            if isinstance(routed, torch.Tensor)
            else type(routed).__name__
        )
        raise ValueError(f"{owner}: routed_experts must be an int16 [tokens, layers, top_k] tensor, got {what}")
    if routed.shape[0] < response_tokens:
        raise ValueError(
            f"{owner}: routed_experts covers {routed.shape[0]} tokens, fewer than the prompt's and "
            f"the {response_tokens} response tokens' but the last"
        )


@dataclass(frozen=True)
class TopkScores:
    """One sequence's teacher-forced scores with the top-k of each position (``score_topk``), for
    the ``T = L - 1`` positions that predict tokens ``1 .. L-1`` of a sequence of ``L`` tokens.

    ``ids``: ``[T, k]`` int64, the k most likely ids at each position, descending.
    ``logprobs``: ``[T, k]`` float32, their log-probs. ``target``: ``[T]`` float32,
    ``log p(x_t | x_<t)`` of the sequence's own next token (exact, in the top-k or not). CPU
    tensors, natural log, temperature 1, no top-k/top-p masking of the distribution.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    target: torch.Tensor

    def __post_init__(self) -> None:
        t, k = self.ids.shape if self.ids.dim() == 2 else (-1, -1)
        if self.ids.dtype != torch.int64 or k < 1:
            raise ValueError(
                f"TopkScores.ids: expected an int64 [T, k] tensor, got {self.ids.dtype} {list(self.ids.shape)}"
            )
        if self.logprobs.shape != (t, k) or self.target.shape != (t,):
            raise ValueError(
                f"TopkScores: ids {list(self.ids.shape)}, logprobs {list(self.logprobs.shape)} and target "
                f"{list(self.target.shape)} do not agree (expected [T, k], [T, k], [T])"
            )

    @classmethod
    def from_logprobs(cls, logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> TopkScores:
        """From ``logprobs`` (``[T, V]`` float log-softmax) and ``targets`` (``[T]`` int64 ids)."""
        top = logprobs.topk(k, dim=-1)
        target = logprobs.gather(-1, targets[:, None])[:, 0]
        return cls(top.indices.cpu(), top.values.float().cpu(), target.float().cpu())


class RolloutEngine(Protocol):
    """An inference engine that the trainer samples from and pushes its weights into.

    Weight updates: ``begin_weight_update()``, then ``update_weights(...)`` once per bucket until
    every tensor of the model was sent, then ``finish_weight_update(version)``. No ``generate`` /
    ``score`` in between. Tensors passed by reference belong to the engine until
    ``finish_weight_update`` returns (do not modify them earlier).
    """

    weight_version: str | None
    """The policy step the engine's weights come from (None: the weights it was started with)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``sampling.n`` responses to each prompt.

        ``prompts``: ``[P][L_p]`` token ids, each prompt non-empty, ids in ``[0, vocab_size)``.
        Seeds: prompt ``i``'s request seed is ``seeds[i]`` (``[P]`` ints) if given, else
        ``sampling.seed + i * n`` (None: unseeded); its sample ``j`` draws from request seed + ``j``.
        Returns ``[P][n]`` completions, in prompt order and sample order. ``between_steps``
        (engines whose ``rollout.engines.EngineKind.updates_mid_generation``: both shipped): called between
        decode steps, it may run a weight update that the unfinished responses continue with;
        the completions then carry ``versions``.
        """
        ...

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs: ``log p(x_t | x_<t)`` for ``t = 1 .. L-1`` of each sequence.

        ``sequences``: ``[S][L_s]`` token ids, each non-empty. Returns ``[S][L_s - 1]`` floats
        (natural log, temperature 1, no top-k/top-p: the model's own distribution).
        """
        ...

    def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopkScores]:
        """``score`` with the top-k of every position: ``[S]`` ``TopkScores`` of ``T = L_s - 1``
        positions each (``1 <= k <=`` the vocabulary; an engine may allow less: vLLM's
        ``max_logprobs``, which it is started with)."""
        ...

    def begin_weight_update(self) -> None:
        """Start a weight update; ``generate`` / ``score`` are refused until it is finished."""
        ...

    def update_weights(
        self,
        *,
        named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
        path: str | None = None,
        ipc: dict | None = None,
    ) -> None:
        """Load one bucket of new weights: exactly one of the three arguments.

        ``named_tensors``: ``[(hf_name, tensor)]`` with Hugging Face parameter names and shapes
        (e.g. ``model.layers.0.self_attn.q_proj.weight``, ``[H * D, hidden]``), any float dtype
        (cast to the engine's). ``path``: a safetensors file of such tensors (an engine in another
        process); the caller deletes it after ``finish_weight_update``. ``ipc``: such tensors in a
        CUDA buffer of the trainer's, described as ``parallel.cuda_ipc`` says (an engine in
        another process on the same GPU); copied out before this returns.
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

    def check_health(self) -> None:
        """A cheap health request between calls: ``EngineFailure`` if an engine in its own process
        does not answer (``rollout.vllm_health.ping``); nothing to ask of one in this process."""
        ...

    def shutdown(self) -> None:
        """Release the engine and its processes; it cannot be used afterwards."""
        ...


class EngineFailure(RuntimeError):
    """The engine died or stopped answering inside a call (its process killed, stopped, or lost):
    the engine is unusable; its owner may start a new one (``rollout.engine_restarts``)."""


class EngineState:
    """The protocol's state rules, which every engine enforces with the same messages: no call after
    ``shutdown``; after a failed weight update no call but ``shutdown`` (the weights are undefined);
    no ``generate`` / ``score`` / ``sleep`` during an update, and no nested update; nothing that
    needs a part of the engine (``WAKE_TAGS``) while that part sleeps.

    An engine calls ``check`` (or ``check_idle``) first in each method, wraps each phase of an
    update in ``update_phase``, and records ``sleep``/``wake_up`` with ``slept``/``woken``.
    """

    def __init__(self) -> None:
        self.shut_down = False
        self.broken: str | None = None  # why the weights are undefined after a failed update
        self.update_open = False
        self.asleep: set[str] = set()  # WAKE_TAGS still asleep
        self.sleep_level = 0  # of the last sleep

    def check(self, method: str, *, needs: Sequence[str] = WAKE_TAGS) -> None:
        """Raise unless the engine runs, is unbroken and is awake for ``needs``."""
        if self.shut_down:
            raise RuntimeError(f"{method}: the engine was shut down")
        if self.broken is not None:
            raise RuntimeError(
                f"{method}: a weight update failed ({self.broken}); the engine's weights are undefined: "
                "shut it down and start a new one"
            )
        asleep = self.asleep & set(needs)
        if asleep:
            raise RuntimeError(f"{method}: the engine is asleep ({', '.join(sorted(asleep))}); call wake_up first")

    def check_idle(self, method: str) -> None:
        """``check``, and no weight update in progress (``generate``, ``score``, ``sleep``)."""
        self.check(method)
        if self.update_open:
            raise RuntimeError(f"{method}: a weight update is in progress; call finish_weight_update first")

    def check_update(self, method: str, *, opening: bool = False) -> None:
        """Raise unless a weight update may take this step: none open when ``opening``
        (``begin_weight_update``), else one open; the weights awake either way."""
        self.check(method, needs=("weights",))
        if opening and self.update_open:
            raise RuntimeError(f"{method}: a weight update is already in progress; call finish_weight_update first")
        if not opening and not self.update_open:
            raise RuntimeError(f"{method}: no weight update in progress; call begin_weight_update first")

    def update_phase(self, step: str, call: Callable[[], object]) -> None:
        """Run one phase of a weight update; a failure leaves the weights undefined (``broken``)."""
        try:
            call()
        except Exception as error:
            self.broken = f"{step} raised {type(error).__name__}: {error}"
            self.update_open = False
            raise

    def check_sleep(self, level: int) -> None:
        """Raise unless ``sleep(level)`` may run."""
        self.check_idle("sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")

    def slept(self, level: int) -> None:
        self.asleep, self.sleep_level = set(WAKE_TAGS), level

    def waking(self, tags: Sequence[str] | None) -> set[str]:
        """The parts ``wake_up(tags)`` brings back (None: all), after checking that they sleep."""
        self.check("wake_up", needs=())
        wanted = set(WAKE_TAGS if tags is None else tags)
        unknown = wanted - set(WAKE_TAGS)
        if unknown:
            raise ValueError(f"wake_up: unknown tags {sorted(unknown)}; expected some of {WAKE_TAGS}")
        if not wanted <= self.asleep:
            raise RuntimeError(f"wake_up: {sorted(wanted - self.asleep)} not asleep (asleep: {sorted(self.asleep)})")
        return wanted


def check_update_arguments(
    named_tensors: Sequence[tuple[str, torch.Tensor]] | None,
    path: str | os.PathLike | None,
    ipc: dict | None = None,
) -> list[tuple[str, torch.Tensor]] | None:
    """``update_weights``' arguments checked: exactly one given; ``named_tensors`` as a non-empty
    list of (str, tensor) pairs (returned), ``path`` an existing file or ``ipc`` a CUDA IPC bucket's
    description (``parallel.cuda_ipc.check_description``; None returned for both)."""
    arguments = {"named_tensors": named_tensors, "path": path, "ipc": ipc}
    given = [name for name, value in arguments.items() if value is not None]
    if len(given) != 1:
        raise ValueError(
            f"update_weights: expected exactly one of named_tensors, path and ipc, got {' and '.join(given) or 'none'}"
        )
    if ipc is not None:
        from megatron_empg.parallel.cuda_ipc import check_description

        check_description(ipc, argument="update_weights: ipc")
        return None
    if named_tensors is None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"update_weights: path {str(path)!r} is not a file")
        return None
    pairs = list(named_tensors)
    if not pairs:
        raise ValueError("update_weights: named_tensors is empty; expected (hf_name, tensor) pairs")
    for i, pair in enumerate(pairs):
        if not (len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_tensors[{i}]: expected a (str, torch.Tensor) pair, got {pair!r:.80}")
    return pairs


def check_generate_arguments(
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    vocab_size: int,
    max_model_len: int,
    seeds: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int | None]]:
    """``generate``'s arguments checked (a ``SamplingConfig``; prompts of at most ``max_model_len - 1``
    tokens, as vLLM keeps room for one output token; stop token ids in the vocabulary; one int seed
    per prompt if ``seeds`` is given). Returns the prompts as lists of ints and each prompt's
    request seed (``seeds``, else ``sampling.seed + i * n``, else None)."""
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling: expected a SamplingConfig, got {type(sampling).__name__}")
    token_prompts = check_token_sequences(
        prompts, argument="prompts", vocab_size=vocab_size, max_length=max_model_len - 1
    )
    bad_stop = [t for t in sampling.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"sampling.stop_token_ids: {bad_stop} outside [0, vocab_size={vocab_size})")
    if seeds is not None:
        seeds = list(seeds)
        if len(seeds) != len(token_prompts) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise ValueError(f"seeds: expected {len(token_prompts)} ints (one per prompt), got {seeds!r}")
        return token_prompts, seeds
    if sampling.seed is None:
        return token_prompts, [None] * len(token_prompts)
    return token_prompts, [sampling.seed + i * sampling.n for i in range(len(token_prompts))]


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
            raise ValueError(f"{argument}[{i}]: {len(sequence)} tokens, more than the engine allows ({max_length})")
        try:
            ids = [operator.index(token) for token in sequence]
        except TypeError as error:
            raise TypeError(f"{argument}[{i}]: token ids must be integers ({error})") from None
        bad = next((j for j, token in enumerate(ids) if not 0 <= token < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{argument}[{i}][{bad}]: token id {ids[bad]} is outside [0, vocab_size={vocab_size})")
        checked.append(ids)
    return checked
