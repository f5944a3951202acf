"""How samples are drawn (``rollout``, its sampling and search agent) and how weights reach the
engines (``weight_sync``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from megatron_empg.config.model import Dtype
from megatron_empg.config.schema import Config, ConfigError, check_duration, named_in


@dataclasses.dataclass(frozen=True)
class SamplingConfig(Config):
    """How the rollout engine samples responses (vLLM's ``SamplingParams`` names). ``top_k`` null
    and ``top_p`` 1.0 sample from the whole distribution."""

    n: int = 8
    """Responses per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Softmax temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``, in (0, 1]."""
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens; null: all."""
    max_tokens: int = 512
    """The most tokens a response (a search-agent turn) generates."""
    min_tokens: int = 0
    """Tokens a response has before an eos or a stop token id may end it."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Strings that end a response (its tokens run up to the one completing the string)."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Token ids that end a response besides eos (the token is kept)."""
    ignore_eos: bool = False
    """Keep generating past eos, up to ``max_tokens``."""
    seed: int | None = None
    """Request seeds: prompt i of a step's global batch draws from ``seed`` + an offset of the
    step and i, so a step's rollouts are reproducible; null: a fresh seed per request."""

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError("n", f"must be >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("top_k", f"must be >= 1 or null (off), got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for i, token in enumerate(self.stop_token_ids):
            if token < 0:
                raise ConfigError(f"stop_token_ids[{i}]", f"must be a token id >= 0, got {token!r}")
        if self.seed is not None and self.seed < 0:
            raise ConfigError("seed", f"must be >= 0 or null (a fresh seed per request), got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class SearchAgentConfig(Config):
    """Multi-turn search-agent rollouts (Search-R1's protocol, ``rollout.search_agent``).

    The policy writes ``<search>query</search>`` or ``<answer>...</answer>``; after a search the
    retriever's passages are appended inside ``<information>...</information>`` and the policy
    continues. ``rollout.sampling.max_tokens`` bounds each turn's generation, ``train.max_seq_len``
    a whole episode.
    """

    retriever_url: str
    """The retriever, a Search-R1-compatible server (e.g. ``python -m megatron_empg.rollout.retriever
    serve``): an http(s) URL such as http://127.0.0.1:8000."""
    topk: int = 3
    """Passages appended per search."""
    max_turns: int = 4
    """Turns that may search (0: answer without searching); one more, final turn may only answer."""
    max_obs_tokens: int = 500
    """The most tokens of one search's passages (cut beyond)."""
    timeout_s: float = 10.0
    """Seconds one retriever request may take."""
    retries: int = 3
    """Retries of a failed retriever request (``1 + retries`` tries); then the step fails."""

    @property
    def turns_per_episode(self) -> int:
        """The most ``generate`` calls an episode takes (each draws from its own seed)."""
        return self.max_turns + 1

    def validate(self) -> None:
        if not self.retriever_url.startswith(("http://", "https://")):
            raise ConfigError(
                "retriever_url", f"expected an http(s) URL such as http://127.0.0.1:8000, got {self.retriever_url!r}"
            )
        if self.topk < 1:
            raise ConfigError("topk", f"must be >= 1, got {self.topk!r}")
        if self.max_turns < 0:
            raise ConfigError("max_turns", f"must be >= 0 (0: answer without searching), got {self.max_turns!r}")
        if self.max_obs_tokens < 1:
            raise ConfigError("max_obs_tokens", f"must be >= 1, got {self.max_obs_tokens!r}")
        check_duration("timeout_s", self.timeout_s)
        if self.retries < 0:
            raise ConfigError("retries", f"must be >= 0, got {self.retries!r}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Config):
    """The rollout engine (vLLM): sampling, and how and where the engines run
    (``parallel.placement``, docs/engines.md)."""

    RETIRED: ClassVar[dict[str, str]] = {
        "mode": "was replaced by rollout.max_staleness: mode sync is max_staleness 0, one_step_off is 1",
    }

    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """How responses are sampled."""
    dtype: Dtype = "bfloat16"
    """The engine's weights and activations."""
    max_model_len: int | None = None
    """The engine's context in tokens (prompt + response); null: the model's
    ``max_position_embeddings``."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs (slower decoding, faster start, less memory)."""
    in_process: bool = True
    """Run the engine core in the trainer's process (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    so weight updates pass tensors by reference; false: a child process, updates through a
    shared-memory file."""
    tensor_parallel_size: int = 1
    """GPUs (ranks) one engine is split over."""
    gpu_memory_utilization: float = 0.5
    """Fraction of a GPU's memory an engine process takes for weights and KV cache (GPU), in (0, 1]."""
    kv_cache_gib: int = 1
    """KV-cache size of an engine process on CPU in GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    sleep_while_training: bool = True
    """Release the engines' GPU memory while the trainer trains (GPU, colocated)."""
    sleep_level: Literal[1, 2] = 2
    """What sleeping releases: 1 offloads the weights to host memory and drops the KV cache, 2
    drops both (the weights are synced again before the next rollout anyway)."""
    seed: int = 0
    """The engine's own random seed (vLLM's ``seed``)."""
    engine: str = named_in("megatron_empg.rollout.engines:ENGINES", "vllm")
    """The engine: ``vllm``, or ``hf`` (transformers in the trainer's process, for machines without
    vLLM)."""
    engines: Literal["per_replica", "single"] | int = "per_replica"
    """How many engines sample a step (colocated): ``per_replica`` (one per data-parallel replica,
    on its first GPUs), ``single`` (one, on global rank 0, for the whole world) or an int E dividing
    the data-parallel size (engine e serves replicas ``[e*DP/E, (e+1)*DP/E)``). Each engine process
    takes ``kv_cache_gib`` / ``gpu_memory_utilization``."""
    search_agent: SearchAgentConfig | None = None
    """Multi-turn rollouts with a search tool; null: one response per sample, no tools."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """``colocated``: the engines live on training ranks, as ``engines`` says; ``disaggregated``:
    the last ``engine_ranks`` ranks of the job only run engines, and training replica 0 broadcasts
    the weights to every engine after each step (``weight_sync.transport`` is then how an engine
    rank hands them to its own engine)."""
    engine_ranks: int = 0
    """Disaggregated: how many of the job's ranks only run engines, one engine per
    ``tensor_parallel_size`` of them (E = engine_ranks / tensor_parallel_size, dividing the
    data-parallel size of the training ranks); 0 when colocated."""
    max_staleness: int = 0
    """How many weight versions the engines may run ahead of the trainer (> 0: disaggregated only):
    0 draws a step's samples with the weights it starts from; k >= 1 lets the engines draw step t's
    samples with any weights from step t - 1 - k on (the weights after t - 1 - k steps) while
    earlier steps train (1: one step off, step t drawn by step t - 1's starting weights); each
    sample carries the version that drew it."""
    engine_restarts: int = 2
    """How many times in the whole run (all its attempts: ``logging.dir/engine-restarts.json``
    keeps the count) the colocated engines may be started again after an engine in its own process
    (``in_process: false``) died, stopped or did not answer its health request inside a rollout;
    the rollout is then drawn again with the same prompts and seeds from the weights pushed before
    it. Past it (or on an engine rank of a disaggregated run, at the first loss) the run exits
    restartable (``supervisor``)."""
    partial: bool = False
    """Partial rollouts (max_staleness >= 1, an engine that updates mid generation, no search
    agent): an engine loads each pushed update between decode steps, and the responses in flight go
    on with the new weights (their KV recomputed); every token carries the version that sampled it."""

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def num_engines(self, dp: int) -> int:
        """E for a run of ``dp`` data-parallel replicas (``engines``, or disaggregated
        ``engine_ranks / tensor_parallel_size``; E need not divide ``dp`` here: ``trainer.bind.layout``
        checks that)."""
        if self.disaggregated:
            return self.engine_ranks // self.tensor_parallel_size
        return {"per_replica": dp, "single": 1}.get(self.engines, self.engines)  # type: ignore[arg-type]

    def validate(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2 or null, got {self.max_model_len!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_gib < 1:
            raise ConfigError("kv_cache_gib", f"must be >= 1 (whole GiB), got {self.kv_cache_gib!r}")
        if isinstance(self.engines, int) and self.engines < 1:
            raise ConfigError("engines", f"must be per_replica, single or an int >= 1, got {self.engines!r}")
        if self.disaggregated:
            if self.engine_ranks < 1:
                raise ConfigError(
                    "engine_ranks", f"must be >= 1 with placement disaggregated, got {self.engine_ranks!r}"
                )
            if self.engine_ranks % self.tensor_parallel_size:
                raise ConfigError(
                    "engine_ranks",
                    f"{self.engine_ranks} must be a multiple of tensor_parallel_size="
                    f"{self.tensor_parallel_size} (each engine runs on that many engine ranks)",
                )
            if self.engines != "per_replica":
                raise ConfigError(
                    "engines",
                    f"is for placement colocated; disaggregated engines are engine_ranks / "
                    f"tensor_parallel_size (leave engines at per_replica), got {self.engines!r}",
                )
        elif self.engine_ranks:
            raise ConfigError(
                "engine_ranks",
                f"needs placement disaggregated (colocated engines use training ranks), got {self.engine_ranks!r}",
            )
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0, got {self.seed!r}")
        if self.engine_restarts < 0:
            raise ConfigError("engine_restarts", f"must be >= 0, got {self.engine_restarts!r}")
        if self.max_staleness < 0:
            raise ConfigError(
                "max_staleness",
                f"must be >= 0 (0: every step drawn by the weights it starts from), got {self.max_staleness!r}",
            )
        if self.max_staleness > 0 and not self.disaggregated:
            raise ConfigError(
                "max_staleness",
                f"{self.max_staleness} needs placement disaggregated: colocated engines "
                "draw on the training ranks between steps (and sleep while they train), so they cannot "
                "run ahead of the trainer",
            )
        if self.partial and self.max_staleness < 1:
            raise ConfigError(
                "partial",
                "true needs max_staleness >= 1 (and placement disaggregated): at 0 no weights "
                "are pushed while a rollout is drawn",
            )
        if self.partial and self.search_agent is not None:
            raise ConfigError(
                "partial",
                "true is not built for the search agent (an episode's turns would need "
                "per-turn versions); set rollout.partial=false",
            )


@dataclasses.dataclass(frozen=True)
class WeightSyncConfig(Config):
    """Pushing the policy's weights into the rollout engine, and the consistency gate after it: the
    trainer and the engine score a probe batch of random tokens, and their log-probs must agree."""

    transport: str = named_in("megatron_empg.weight_sync.transport:TRANSPORTS", "in_process")
    """How weights reach the engine: ``in_process`` (tensors by reference: an in-process engine, CPU
    or colocated GPU), ``shm_file`` (a safetensors file per bucket in ``shm_dir``: an engine in
    another process), ``cuda_ipc`` (a CUDA IPC handle of a GPU buffer per bucket: an engine process
    on its owner's GPU; engine TP 1)."""
    bucket_size_mb: float = 512.0
    """Size of a weight bucket in MiB (a bucket never holds less than the largest tensor)."""
    shm_dir: str = "/dev/shm"
    """The tmpfs directory of ``shm_file``'s bucket files (room for one bucket is checked before
    the engines start)."""
    gate_tolerance: float | None = 1e-4
    """The largest allowed |log-prob difference| between trainer and engine on the probe batch;
    null: no gate."""
    probe_num_sequences: int = 2
    """Sequences in the probe batch."""
    probe_length: int = 160
    """Tokens per probe sequence: more than one KV-cache block (128 on CPU), so a stale prefix
    cache shows."""
    probe_continuation: int = 8
    """Tokens the engine samples after the probe and both sides score: checks the generation path
    too."""
    probe_seed: int = 0
    """Seed of the probe's random tokens and of the continuation's sampling."""
    lora_mode: str = named_in("megatron_empg.mcore.lora.sync:LORA_SYNC_MODES", "merged")
    """What a LoRA policy (``model.lora``) pushes: ``merged`` every weight with ``W + (alpha / r) B A``
    (any engine; the whole model's bytes), ``adapter`` the adapters only, which the engine serves on
    the base it started from as a LoRA adapter (``rollout.engine`` vllm; the adapters' bytes)."""

    def validate(self) -> None:
        if not self.bucket_size_mb > 0:
            raise ConfigError("bucket_size_mb", f"must be > 0, got {self.bucket_size_mb!r}")
        if self.gate_tolerance is not None and not self.gate_tolerance > 0:
            raise ConfigError("gate_tolerance", f"must be > 0 or null (no gate), got {self.gate_tolerance!r}")
        if self.probe_num_sequences < 1:
            raise ConfigError("probe_num_sequences", f"must be >= 1, got {self.probe_num_sequences!r}")
        if self.probe_length < 2:
            raise ConfigError("probe_length", f"must be >= 2, got {self.probe_length!r}")
        if self.probe_continuation < 0:
            raise ConfigError("probe_continuation", f"must be >= 0, got {self.probe_continuation!r}")
        if self.probe_seed < 0:
            raise ConfigError("probe_seed", f"must be >= 0, got {self.probe_seed!r}")
