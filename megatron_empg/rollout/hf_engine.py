"""``RolloutEngine`` on plain Hugging Face ``transformers`` in the caller's process (no vLLM): for a
GPU smoke test of the trainer where vLLM is missing, and for CPU tests. Speed is secondary.

It mirrors ``VllmEngine``: the same validation, state rules and error messages, and the results of
vLLM 0.32 with ``logprobs_mode="processed_logprobs"``:

* **Sampling**, per step on a response's float32 logits: below ``min_tokens`` generated tokens the
  eos ids and ``stop_token_ids`` get -inf (eos even with ``ignore_eos``: vLLM masks its
  ``all_stop_token_ids``, which always hold them). Temperature 0: the argmax, with the log-softmax
  of those logits (``n`` must be 1, as in vLLM). Otherwise logits / temperature (at least
  ``MIN_TEMPERATURE``, as in vLLM), vLLM's top-k and top-p masks (ties at the k-th value kept; the
  most likely tokens whose mass reaches ``top_p``, at least one), log-softmax; the token is drawn
  by ``torch.multinomial`` (vLLM races exponentials: the same distribution, other draws).
* **Seeds**: seed s gives response ``j`` of prompt ``i`` its own generator, seeded ``s + i * n + j``
  (vLLM's request seed ``s + i * n``, or ``seeds[i]``, plus the sample index): a prompt's samples do not depend on
  the rest of the batch (their log-probs only to rounding). No seed: torch's global generator.
* **Stopping**, in vLLM's order, eos ids only without ``ignore_eos``: the tokenizer's eos ->
  ``"stop"``, stop_reason None; a ``stop_token_ids`` id, or another eos id of the generation config
  (``generation_config.json``, else the model config; vLLM adds those to the stop token ids) ->
  ``"stop"`` with the id (the token is kept); a stop string in the generated text (decoded with
  ``skip_special_tokens=True``; text of the first ``min_tokens`` tokens cannot end one; an eos or
  stop token is not decoded) -> ``"stop"`` with the string, tokens up to the one completing it;
  ``max_tokens``, or prompt + response reaching ``max_model_len`` -> ``"length"``.
* **Batching**: the ``P * n`` responses run together, left-padded (attention mask, position ids
  from its cumsum) with a ``DynamicCache`` that lives for one ``generate`` call; finished responses
  leave the batch and the cache.
* **Updates between decode steps** (``generate(..., between_steps=)``, partial rollouts): the
  callback may run a whole weight update; the unfinished responses then go on with the new
  weights, their KV cache recomputed from their tokens by one forward of the new weights (what
  those weights compute for that prefix: the continuation is sampled exactly from them), and
  each token's ``Completion.versions`` entry is the ``weight_version`` that sampled it. ``score``: one right-padded forward, log-softmax in float32.
* **Routed experts** (``routed_experts=True``, a mixture of experts): forward hooks on every
  layer's router (``mlp.gate``) keep the top-k expert ids it chose (transformers' own ``topk`` of
  the float32 softmax of the router logits, in the engine's dtype) for each token it ran: the
  prompt in the first step, each new token in the next; ``Completion.routed_experts`` is vLLM's
  layout, every token but the last. Tokens recomputed after a weight update take the new routing.
* **Weight updates** copy HF-named tensors into the parameters in place (cast to the engine's dtype
  and device); a mixture of experts' per-expert checkpoint names go into their expert's rows of
  transformers' fused expert parameters (``fused_expert_slices``). An alias of a tied parameter (``lm_head.weight`` with tied embeddings) is skipped,
  as in vLLM: the embedding carries the value to the one shared parameter. As in vLLM, a failure
  inside an update leaves the weights undefined and the engine refuses all work but ``shutdown``.
* **Sleep** (CUDA): level 1 moves the parameters to host memory; level 2 frees them (their storage
  becomes an empty tensor, and ``wake_up(["weights"])`` allocates it again, uninitialised); then
  ``torch.cuda.empty_cache()``. Buffers (rotary tables) stay. After level 2 the next update must
  write every parameter, which ``finish_weight_update`` checks on every device, so that misuse
  fails on CPU too, where sleep and wake_up only track the state.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_empg.config import RolloutConfig, SamplingConfig
from megatron_empg.rollout.engine import (
    Completion,
    EngineState,
    FinishReason,
    TopkScores,
    check_generate_arguments,
    check_token_sequences,
    check_update_arguments,
)
from megatron_empg.rollout.hf_moe import RouterRecorder, fused_expert_slices

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LOAD_FORMATS = ("auto", "dummy")
MAX_LISTED_NAMES = 20  # of the parameters a level-2 update missed, in the error message
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it


@dataclass
class _Response:
    """One response being generated: its tokens so far and what ends it."""

    limit: int  # the most tokens it may have: max_tokens, or max_model_len - prompt length
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str | None] = field(default_factory=list)  # the weight_version that sampled each token
    routing: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] int16 per forward of its tokens
    searched: int = 0  # characters of the decoded text already searched for stop strings
    finish: tuple[FinishReason, int | str | None] | None = None


def _padded(sequences: list[list[int]], *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, max L]`` int64 token ids (padded with id 0) and attention mask (1: a token)."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        span = slice(width - len(sequence), width) if left else slice(0, len(sequence))
        input_ids[i, span] = torch.tensor(sequence)
        mask[i, span] = 1
    return input_ids, mask


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """``[B, V]`` float32 log-probs sampled from: ``logits`` (``[B, V]`` float32) / temperature,
    vLLM's top-k and top-p masks (``apply_top_k_top_p_pytorch``), log-softmax."""
    logits = logits / max(temperature, MIN_TEMPERATURE)
    top_k = None if top_k is None or top_k >= logits.shape[-1] else top_k
    if top_k is not None or top_p < 1:
        ascending, order = logits.sort(dim=-1)
        if top_k is not None:
            ascending = ascending.masked_fill(ascending < ascending[:, -top_k, None], -torch.inf)
        if top_p < 1:
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False  # keep at least the most likely token
            ascending = ascending.masked_fill(drop, -torch.inf)
        logits = torch.empty_like(logits).scatter_(-1, order, ascending)
    return logits.log_softmax(-1)


class HfEngine:
    """A ``transformers`` causal LM as a ``RolloutEngine`` (see the module docstring).

    ``model_dir``: a Hugging Face model directory (config, tokenizer; weights unless
    ``load_format="dummy"``, which starts from random weights to be replaced by the first weight
    update). ``rollout``: dtype and context length (``tensor_parallel_size`` must be 1; vLLM's
    memory and process settings are ignored). ``device``: default the current CUDA device, else CPU.
    ``routed_experts``: return each completion's routing (``Completion.routed_experts``; a mixture
    of experts only).

    Attributes: ``vocab_size`` (the model config's), ``max_model_len`` (prompts and scored sequences
    may have at most ``max_model_len - 1`` tokens, as in vLLM), ``weight_version``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        rollout: RolloutConfig,
        *,
        load_format: str = "auto",
        device: torch.device | str | None = None,
        routed_experts: bool = False,
        max_logprobs: int | None = None,  # vLLM's limit of score_topk's k; none here (any k <= vocab_size)
    ) -> None:
        if not isinstance(rollout, RolloutConfig):
            raise TypeError(f"rollout: expected a RolloutConfig, got {type(rollout).__name__}")
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model_dir: {str(model_dir)!r} is not a directory")
        if rollout.tensor_parallel_size != 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={rollout.tensor_parallel_size}: HfEngine runs on one device (use 1)"
            )
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        dtype = DTYPES[rollout.dtype]
        config = AutoConfig.from_pretrained(model_dir)
        if load_format == "dummy":
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self._model: PreTrainedModel | None = model.to(self._device).eval().requires_grad_(False)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = rollout.max_model_len or config.max_position_embeddings
        self.weight_version: str | None = None
        try:  # where vLLM reads the generation config from
            generation_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:  # no generation_config.json
            generation_eos = GenerationConfig.from_model_config(config).eos_token_id
        self._eos_id: int | None = self._tokenizer.eos_token_id  # vLLM's eos: stop_reason None
        extra = {generation_eos} if isinstance(generation_eos, int) else set(generation_eos or ())
        self._extra_eos_ids = frozenset(extra - {self._eos_id})  # vLLM: stop token ids unless ignore_eos
        # What min_tokens masks (vLLM's all_stop_token_ids, less the request's stop_token_ids).
        self._all_eos_ids = self._extra_eos_ids | ({self._eos_id} - {None})
        # HF state-dict name -> parameter; every name of a tied parameter maps to the one object.
        self._parameters = dict(model.named_parameters(remove_duplicate=False))
        self._owners = dict(model.named_parameters())  # one name per parameter object
        self._shapes = {name: parameter.shape for name, parameter in self._owners.items()}
        # A mixture of experts: checkpoint name of one expert's tensor -> (fused parameter's
        # name, expert index, rows); what a complete update writes (the fused parameters by expert).
        self._expert_slices = fused_expert_slices(self._owners)
        fused = {owner for owner, _, _ in self._expert_slices.values()}
        self._complete = (set(self._owners) - fused) | set(self._expert_slices)
        self._offloads = self._device.type == "cuda"
        self._written: set[str] = set()  # owner names written since begin_weight_update
        self._must_write_all = False  # after a level-2 sleep, until an update wrote every parameter
        self._state = EngineState()
        self._routed_experts = routed_experts
        if routed_experts and not getattr(config, "num_experts", None):
            raise ValueError(f"routed_experts: the model ({type(model).__name__}) has no experts")

    # ----------------------------------------------------------------------------------------
    # Sampling and scoring.

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        *,
        seeds: Sequence[int] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[list[Completion]]:
        """Sample ``sampling.n`` responses per prompt.

        ``prompts``: ``[P][L_p]`` token ids (``1 <= L_p <= max_model_len - 1``, ids in
        ``[0, vocab_size)``); ``seeds``: ``[P]`` request seeds (default ``sampling.seed + i * n``,
        module docstring). Returns ``[P][n]`` ``Completion`` s in prompt and sample order; their
        ``logprobs`` are the processed sampler log-probs (module docstring). A response also ends
        with ``finish_reason="length"`` when prompt + response reach ``max_model_len``.
        ``between_steps``: called before every decode step but the first; it may update the
        weights (module docstring); the completions then carry ``versions``.
        """
        self._state.check_idle("generate")
        model = self._model
        token_prompts, request_seeds = check_generate_arguments(
            prompts, sampling, vocab_size=self.vocab_size, max_model_len=self.max_model_len, seeds=seeds
        )
        if sampling.temperature == 0 and sampling.n > 1:  # vLLM refuses it too
            raise ValueError(f"sampling: n must be 1 when using greedy sampling (temperature 0), got n={sampling.n}")
        rows = [prompt for prompt in token_prompts for _ in range(sampling.n)]  # row i * n + j
        row_seeds = [None if seed is None else seed + j for seed in request_seeds for j in range(sampling.n)]
        responses = [
            _Response(
                limit=min(sampling.max_tokens, self.max_model_len - len(prompt)),
                generator=None if seed is None else torch.Generator(self._device).manual_seed(seed),
            )
            for prompt, seed in zip(rows, row_seeds)
        ]
        recorder = RouterRecorder(model) if self._routed_experts else None
        try:
            with torch.inference_mode():
                self._decode(model, rows, responses, sampling, between_steps, recorder)
        finally:
            if recorder is not None:
                recorder.remove()
        return [
            [
                Completion(
                    r.token_ids,
                    r.logprobs,
                    *r.finish,
                    versions=r.versions if between_steps else None,
                    routed_experts=torch.cat(r.routing) if recorder is not None else None,
                )
                for r in responses[i * sampling.n : (i + 1) * sampling.n]
            ]
            for i in range(len(token_prompts))
        ]

    def _decode(
        self,
        model: PreTrainedModel,
        rows: list[list[int]],
        responses: list[_Response],
        sampling: SamplingConfig,
        between_steps: Callable[[], None] | None,
        recorder: RouterRecorder | None = None,
    ) -> None:
        """Generate every response until it finishes: one forward of the unfinished rows per step
        (``recorder``: each forward's routing into the responses, module docstring)."""
        from transformers import DynamicCache

        input_ids, mask = (t.to(self._device) for t in _padded(rows, left=True))
        cache = DynamicCache(config=model.config)
        active = list(range(len(rows)))  # indices into responses, in batch order
        stop_ids = sorted(self._all_eos_ids | set(sampling.stop_token_ids))  # masked below min_tokens
        for step in range(max(r.limit for r in responses)):
            if step and between_steps is not None:
                version = self.weight_version
                between_steps()
                if self.weight_version != version:  # new weights: the unfinished rows' KV from their tokens
                    sequences = [rows[i] + responses[i].token_ids for i in active]
                    input_ids, mask = (t.to(self._device) for t in _padded(sequences, left=True))
                    cache = DynamicCache(config=model.config)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
            logits = (
                model(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1]
                .float()
            )
            if recorder is not None:
                routing = recorder.take(*input_ids.shape)
                for b, i in enumerate(active):
                    if input_ids.shape[1] == 1 and step:  # one new token
                        responses[i].routing.append(routing[b])
                    else:  # the whole sequence (first step, or recomputed for new weights), less its padding
                        responses[i].routing = [routing[b][mask[b].bool().cpu()]]
            if step < sampling.min_tokens and stop_ids:
                logits[:, stop_ids] = -torch.inf
            if sampling.temperature == 0:
                logprobs = logits.log_softmax(-1)
                tokens = logits.argmax(-1)
            else:
                logprobs = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                probs = logprobs.exp()
                tokens = torch.cat(
                    [torch.multinomial(probs[b], 1, generator=responses[i].generator) for b, i in enumerate(active)]
                )
            chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
            keep = []
            for b, (i, token, logprob) in enumerate(zip(active, tokens.tolist(), chosen.tolist())):
                response = responses[i]
                response.token_ids.append(token)
                response.logprobs.append(logprob)
                response.versions.append(self.weight_version)
                response.finish = self._finish(response, sampling)
                if response.finish is None:
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(active):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, device=self._device)
                cache.batch_select_indices(index)
                mask, tokens = mask[index], tokens[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            input_ids = tokens[:, None]

    def _finish(self, response: _Response, sampling: SamplingConfig) -> tuple[FinishReason, int | str | None] | None:
        """How ``response`` ends after its newest token (vLLM's order of checks), or None."""
        token = response.token_ids[-1]
        if token == self._eos_id and not sampling.ignore_eos:
            return "stop", None
        if token in sampling.stop_token_ids or (token in self._extra_eos_ids and not sampling.ignore_eos):
            return "stop", token
        if sampling.stop:
            # Like vLLM's detokenizer: only text after the first min_tokens tokens may complete a
            # stop string, and of the matches in the new text the earliest-ending one wins.
            text = self._tokenizer.decode(response.token_ids, skip_special_tokens=True)
            searched, response.searched = response.searched, len(text)
            if len(response.token_ids) > sampling.min_tokens:
                matches = [
                    (start + len(stop), k, stop)
                    for k, stop in enumerate(sampling.stop)
                    if (start := text.find(stop, max(searched - len(stop) + 1, 0))) >= 0
                ]
                if matches:
                    return "stop", min(matches)[2]
        if len(response.token_ids) >= response.limit:
            return "length", None
        return None

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs ``log p(x_t | x_<t)``, ``t = 1 .. L-1``, from one batched forward.

        ``sequences``: ``[S][L_s]`` token ids (``1 <= L_s <= max_model_len - 1``). Returns
        ``[S][L_s - 1]`` floats: temperature 1, no top-k/top-p (the model's own distribution).
        """
        return [scores.target.tolist() for scores in self._scored("score", sequences, 1)]

    def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopkScores]:
        """``score`` with the top-k (``1 <= k <= vocab_size``) of each position's float32
        log-softmax: ``[S]`` ``TopkScores`` of ``L_s - 1`` positions each."""
        return self._scored("score_topk", sequences, k)

    def _scored(self, method: str, sequences: Sequence[Sequence[int]], k: int) -> list[TopkScores]:
        """One right-padded forward of ``sequences``; errors name ``method``."""
        self._state.check_idle(method)
        if not 1 <= k <= self.vocab_size:
            raise ValueError(f"{method}: k must be in [1, vocab_size={self.vocab_size}], got {k!r}")
        token_sequences = check_token_sequences(
            sequences, argument="sequences", vocab_size=self.vocab_size, max_length=self.max_model_len - 1
        )
        # Right padding: the default position ids 0 .. L_s - 1 are right as they are.
        input_ids, mask = (t.to(self._device) for t in _padded(token_sequences, left=False))
        with torch.inference_mode():
            logits = self._model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            return [
                TopkScores.from_logprobs(
                    logits[i, : len(seq) - 1].float().log_softmax(-1), input_ids[i, 1 : len(seq)], k
                )
                for i, seq in enumerate(token_sequences)
            ]

    # ----------------------------------------------------------------------------------------
    # Weight updates.

    def begin_weight_update(self) -> None:
        """Start a weight update; ``generate`` / ``score`` are refused until it is finished."""
        self._state.check_update("begin_weight_update", opening=True)
        self._state.update_open = True
        self._written = set()

    def update_weights(
        self,
        *,
        named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
        path: str | os.PathLike | None = None,
        ipc: dict | None = None,
    ) -> None:
        """Copy one bucket of HF-named weights into the model: ``named_tensors`` or ``path``.

        ``named_tensors``: ``[(hf_name, tensor)]``, Hugging Face names and shapes, any float dtype,
        on any device (cast to the engine's). ``path``: a safetensors file of such tensors
        (``safetensors.torch.save_file``), read one tensor at a time. Copied before this returns.
        ``ipc`` (a CUDA IPC bucket) is refused: this engine runs in the trainer's process.
        """
        self._state.check_update("update_weights")
        pairs = check_update_arguments(named_tensors, path, ipc)
        if ipc is not None:
            raise ValueError(
                "update_weights: HfEngine runs in the trainer's process and cannot map a CUDA IPC buffer exported "
                "there; use weight_sync.transport=in_process (cuda_ipc is for the vllm engine in its own process)"
            )
        if pairs is not None:
            self._state.update_phase("update_weights", lambda: self._copy(pairs))
            return

        def copy_from_file() -> None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as file:
                self._copy((name, file.get_tensor(name)) for name in file.keys())

        self._state.update_phase("update_weights", copy_from_file)

    def _copy(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            parameter = self._parameters.get(name)
            if name in self._expert_slices:  # one expert's part of a fused parameter
                owner, expert, rows = self._expert_slices[name]
                parameter = self._owners[owner][expert, rows]
            elif parameter is None:
                raise ValueError(f"update_weights: {name!r} is not a parameter of the model")
            elif name not in self._owners:
                continue  # an alias of a tied parameter (lm_head.weight): the owner's name carries it
            if not tensor.is_floating_point():
                raise TypeError(f"update_weights: {name!r} has dtype {tensor.dtype}; expected a float tensor")
            if tensor.shape != parameter.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {list(tensor.shape)}, the model's parameter "
                    f"{list(parameter.shape)}"
                )
            with torch.no_grad():
                parameter.copy_(tensor)  # casts to the parameter's dtype and device
            self._written.add(name)

    def finish_weight_update(self, version: str) -> None:
        """Finalize the update and set ``weight_version = version``; after a level-2 sleep, raises
        unless the update wrote every parameter."""
        self._state.check("finish_weight_update", needs=("weights",))
        if not isinstance(version, str) or not version:
            raise ValueError(f"finish_weight_update: version must be a non-empty string, got {version!r}")
        self._state.check_update("finish_weight_update")

        def check_complete() -> None:
            missing = sorted(self._complete - self._written) if self._must_write_all else []
            if missing:
                listed = ", ".join(missing[:MAX_LISTED_NAMES])
                more = f" and {len(missing) - MAX_LISTED_NAMES} more" if len(missing) > MAX_LISTED_NAMES else ""
                raise RuntimeError(
                    f"finish_weight_update: the engine slept at level 2 (its weights were dropped), so the update "
                    f"must write every parameter; {len(missing)} were not written: {listed}{more}"
                )
            if self._offloads:
                torch.cuda.synchronize(self._device)  # the copies are done before the caller reuses its tensors

        self._state.update_phase("finish_weight_update", check_complete)
        self._state.update_open = False
        self._must_write_all = False
        self.weight_version = version

    # ----------------------------------------------------------------------------------------
    # Memory and lifetime.

    def sleep(self, level: int = 1) -> None:
        """CUDA: level 1 moves the parameters to host memory, level 2 frees them. On CPU only the
        state is tracked. After level 2 the next weight update must write every parameter."""
        self._state.check_sleep(level)
        if self._offloads:
            for parameter in self._owners.values():
                parameter.data = parameter.data.to("cpu") if level == 1 else parameter.data.new_empty(0)
            torch.cuda.empty_cache()
        self._state.slept(level)
        self._must_write_all = self._must_write_all or level == 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``sleep`` for ``tags`` (``WAKE_TAGS``; None: all). ``"weights"`` brings the
        parameters back (after level 2 uninitialised until a weight update); ``"kv_cache"`` has
        nothing to allocate (the KV cache exists only inside ``generate``)."""
        wanted = self._state.waking(tags)
        if self._offloads and "weights" in wanted:
            for name, parameter in self._owners.items():
                if self._state.sleep_level == 1:  # the values kept in host memory
                    parameter.data = parameter.data.to(self._device)
                else:
                    parameter.data = torch.empty(self._shapes[name], dtype=parameter.dtype, device=self._device)
        self._state.asleep -= wanted

    def check_health(self) -> None:
        """Nothing to ask: the engine runs in this process (a hang in it is the watchdog's)."""

    def shutdown(self) -> None:
        """Free the model; every method but ``shutdown`` raises afterwards."""
        if self._state.shut_down:
            return
        self._state.shut_down = True
        self._model = None
        self._parameters, self._owners = {}, {}
        gc.collect()
        if self._offloads:
            torch.cuda.empty_cache()
