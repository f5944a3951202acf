"""The run: its data, training loop, validation, logging, checkpoints, and ``RunConfig``, the
whole of it."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from megatron_empg.config.algorithm import AlgorithmConfig, OptimizerConfig
from megatron_empg.config.model import ModelConfig, ParallelConfig, load_model_config
from megatron_empg.config.rollout import RolloutConfig, SamplingConfig, WeightSyncConfig
from megatron_empg.config.schema import ConfigError, join_path

DATA_SOURCES = ("files", "arithmetic")  # = tasks.registry.PROMPT_SOURCES (config imports no task)
DATA_FILE_SUFFIXES = (".parquet", ".jsonl")
ARITHMETIC_OPS = ("+", "-", "*")


def _check_data_files(field: str, paths: list[str]) -> None:
    """Each of ``paths`` (the list ``field``) names a parquet or JSONL file."""
    for i, path in enumerate(paths):
        if not path.endswith(DATA_FILE_SUFFIXES):
            raise ConfigError(f"{field}[{i}]", f"expected a {' or '.join(DATA_FILE_SUFFIXES)} file, got {path!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training prompts and the reward that scores their responses (``rollout.data``, ``tasks``).

    ``source``: ``files`` reads ``train_files`` (parquet or JSONL, one record per row);
    ``arithmetic`` generates small arithmetic problems ("12+7=") from ``seed`` on the fly, with
    operands of up to ``arithmetic_digits`` digits and the operators ``arithmetic_ops``
    (``tasks.arithmetic``). ``reward`` is a key of ``tasks.registry.REWARDS`` (checked at bind).

    A record's ``prompt_key`` holds a string or a list of chat messages (``{role, content}``), its
    ``answer_key`` a string, an int or a list of strings (several gold answers); a dotted key
    (``reward_model.ground_truth``) reaches into nested records. With ``apply_chat_template`` and a
    tokenizer that has a chat template, prompts are rendered by it with the generation prompt
    (``system_prompt`` as a first system message), else as plain text. ``prompt_template``, a
    format string with one ``{prompt}`` field, rewrites the user's text first (a string prompt, or
    the last user message), e.g. ``"{prompt} Let's think step by step and output the final answer
    within \\boxed{{}}."`` (literal braces doubled, as in ``str.format``). A prompt longer than
    ``max_prompt_tokens`` is an error, or with ``drop_long_prompts`` dropped and counted.
    ``shuffle``: each epoch's order is a permutation drawn from (``seed``, epoch).

    Rewards that check answers in worker processes (``math``, ``math_dapo``: math-verify, whose
    sympy can work on one expression for ever) run ``reward_workers`` processes per rank and give
    each sample at most ``reward_timeout_s`` seconds (then it scores 0, counted in
    ``reward/timeouts``). ``reward_budget_s`` (null: none) bounds a step's scoring on each rank:
    once it has taken that long, the samples not yet checked score 0 (not the reward's incorrect
    score) and ``reward/unscored`` is their fraction of the step's samples (logged with a budget
    only); a validation call of ``validation.batch_size`` prompts gets the whole budget. The other
    rewards run in the rank's process: a batch call, then each sample's if it overran, may take
    ``reward_timeout_s`` (a sample past it scores 0, counted in ``reward/timeouts``; its thread is
    abandoned, since Python cannot stop it).
    """

    source: Literal["files", "arithmetic"] = "arithmetic"
    reward: str = "arithmetic"
    train_files: list[str] = dataclasses.field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str | None = None
    prompt_template: str | None = None
    apply_chat_template: bool = True
    max_prompt_tokens: int = 1024
    drop_long_prompts: bool = False
    shuffle: bool = True
    seed: int = 0
    arithmetic_digits: int = 2
    arithmetic_ops: list[Literal["+", "-", "*"]] = dataclasses.field(default_factory=lambda: ["+", "-"])
    reward_workers: int = 2
    reward_timeout_s: float = 5.0
    reward_budget_s: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError("source", f"expected one of {DATA_SOURCES}, got {self.source!r}")
        if self.source == "files":
            if not self.train_files:
                raise ConfigError("train_files", "source 'files' needs at least one .parquet or .jsonl file")
            _check_data_files("train_files", self.train_files)
        elif self.source == "arithmetic":
            if self.train_files:
                raise ConfigError("train_files", "source 'arithmetic' generates its prompts: leave train_files empty")
            if self.reward != "arithmetic":
                raise ConfigError("reward", f"source 'arithmetic' needs reward 'arithmetic', got {self.reward!r}")
        for name in ("prompt_key", "answer_key"):
            if not getattr(self, name):
                raise ConfigError(name, "must be a non-empty key")
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ConfigError("system_prompt", "must be null or non-empty text")
        if self.prompt_template is not None:
            try:
                self.prompt_template.format(prompt="")
            except (KeyError, IndexError, ValueError) as error:
                raise ConfigError(
                    "prompt_template", f"must be a format string whose only field is {{prompt}} ({error!r})"
                ) from None
            if "{prompt}" not in self.prompt_template:
                raise ConfigError("prompt_template", "must contain the field {prompt}")
        if self.max_prompt_tokens < 1:
            raise ConfigError("max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens!r}")
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0, got {self.seed!r}")
        if not 1 <= self.arithmetic_digits <= 9:
            raise ConfigError("arithmetic_digits", f"must be in [1, 9], got {self.arithmetic_digits!r}")
        if not self.arithmetic_ops or len(set(self.arithmetic_ops)) != len(self.arithmetic_ops):
            raise ConfigError(
                "arithmetic_ops", f"expected distinct operators from {ARITHMETIC_OPS}, got {self.arithmetic_ops!r}"
            )
        for i, op in enumerate(self.arithmetic_ops):
            if op not in ARITHMETIC_OPS:
                raise ConfigError(f"arithmetic_ops[{i}]", f"expected one of {ARITHMETIC_OPS}, got {op!r}")
        if self.reward_workers < 1:
            raise ConfigError("reward_workers", f"expected a number of processes >= 1, got {self.reward_workers!r}")
        if not 0 < self.reward_timeout_s < math.inf:
            raise ConfigError("reward_timeout_s", f"expected finite seconds > 0, got {self.reward_timeout_s!r}")
        if self.reward_budget_s is not None and not 0 < self.reward_budget_s < math.inf:
            raise ConfigError(
                "reward_budget_s", f"expected finite seconds > 0, or null for no budget, got {self.reward_budget_s!r}"
            )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop: ``steps`` RL steps of ``prompts_per_step`` prompts (x ``rollout.sampling.n``
    responses) of at most ``max_seq_len`` tokens each, in micro-batches of ``micro_batch_size``
    sequences, or (``max_tokens_per_microbatch``) of as many as fit that many tokens.

    ``packing``: a micro-batch is one row of its sequences back to back, attention and positions
    restarting at each (Megatron's THD layout), instead of one right-padded row per sequence.
    ``max_tokens_per_microbatch`` needs it and must hold a sequence of ``max_seq_len``.
    ``max_tokens_per_forward_microbatch``: the forward-only passes (old and anchor), which keep no
    activations for a backward pass, run on the update's packed rows concatenated in order into rows
    of at most that many tokens, padding included (``trainer.forward_batch``); null: on the
    update's micro-batches. It needs packing and must hold the update's widest row (checked at bind,
    ``trainer.layout``). The logits of one such row, [tokens, V / TP] bf16, are the passes' peak.
    ``balance``: each mini-batch's samples are split between the replicas of one engine by
    estimated compute (tokens plus the attention's quadratic term) rather than kept where they
    were sampled; the gradient is the same.

    ``recompute``: activation recompute in the update pass (Megatron's): ``none``; ``selective``
    (the core attention, whose [b, heads, s, s] scores dominate long sequences); ``full`` (whole
    layers, ``recompute_num_layers`` per checkpointed unit: only their inputs are kept, each is run
    again in the backward pass). The gradient is the same; the time goes up and the memory down.

    ``fused_output_loss``: the update pass computes the logits from the output layer's input and
    weight one chunk of tokens at a time inside the loss (``parallel.fused_output``), so that the
    [tokens, V / TP] logits and their gradient never exist whole: at 16,384 tokens of a 151,936
    vocabulary 0.78 GB of GPU memory instead of 5.4 GB, for 1.5x the output layer's and the loss's
    time (one more GEMM; H100, benchmarks/README.md). The gradient is the same up to rounding.

    ``memory_check``: what a run does when its memory plan (``trainer.memory_plan``, ``empg plan``)
    exceeds the GPU, checked before anything starts: ``error`` (with the changes that would fit)
    or ``warn`` and start anyway.

    Bad steps are refused (``core.step_guard``): an optimizer step whose loss or gradient norm is
    not finite, or whose gradient norm exceeds ``skip_grad_norm_factor`` x the median of the last
    20 applied steps' (from the 6th applied step; null: no such check), changes neither the
    weights, the optimizer's state, the LR schedule nor the EMA anchor's schedule, on every rank
    (``train/skipped_steps`` counts a step's refused optimizer steps). ``max_consecutive_skips``
    refused optimizer steps in a row stop the run with a ``BadStepsError``, the samples of the
    step saved in ``<logging.dir>/bad_step_<step>/`` (``trainer.bad_steps``).
    """

    steps: int = 100
    prompts_per_step: int = 64
    micro_batch_size: int = 8
    max_seq_len: int = 1024
    seed: int = 1234
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 1
    packing: bool = True
    max_tokens_per_microbatch: int | None = None
    max_tokens_per_forward_microbatch: int | None = None
    balance: bool = True
    fused_output_loss: bool = False
    memory_check: Literal["error", "warn"] = "error"
    skip_grad_norm_factor: float | None = 10.0
    max_consecutive_skips: int = 5

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "recompute_num_layers", "max_consecutive_skips"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)!r}")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len", f"must be >= 2, got {self.max_seq_len!r}")
        factor = self.skip_grad_norm_factor
        if factor is not None and not 1 < factor < math.inf:
            raise ConfigError(
                "skip_grad_norm_factor", f"expected a finite number > 1, or null for no spike check, got {factor!r}"
            )
        budget = self.max_tokens_per_microbatch
        if budget is not None and not self.packing:
            raise ConfigError("max_tokens_per_microbatch", "needs packing: true (a token budget fills packed rows)")
        # that it holds a sequence of max_seq_len is checked with the layout (a budget is per
        # context-parallel rank: trainer.layout)
        if self.max_tokens_per_forward_microbatch is not None and not self.packing:
            raise ConfigError(
                "max_tokens_per_forward_microbatch", "needs packing: true (forward rows are packed rows back to back)"
            )


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
    """Held-out prompts answered and scored under the current weights every ``interval`` steps
    (0: never) and, with ``at_start``, before the first step of a run that does not ``--resume``
    (logged at the step it starts from: 0, or that of ``checkpoint.continue_from``).

    ``files`` (parquet or JSONL) are read like ``data``'s training files (keys, template, chat
    template, prompt length) and scored by ``data.reward``; with ``rollout.search_agent`` the
    answers are whole search episodes. Prompts are grouped by data source, a record's
    ``data_source`` column, else its file's name without suffix, keeping the first
    ``max_prompts_per_source`` of each (null: all). Responses are sampled as in
    ``rollout.sampling`` (``max_tokens``, stop strings, seed) but with this section's ``n``,
    ``temperature``, ``top_p`` and ``top_k``: by default one greedy answer per prompt. The engine
    takes ``batch_size`` prompts per call. Metrics: ``val/<source>/reward/mean``, ``.../accuracy``,
    the reward's own (``.../reward/exact_match``), response lengths, the agent's ``rollout/*_mean``,
    and the same over all sources as ``val/...``.
    """

    files: list[str] = dataclasses.field(default_factory=list)
    interval: int = 0
    at_start: bool = False
    max_prompts_per_source: int | None = None
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    batch_size: int = 512

    def validate(self) -> None:
        _check_data_files("files", self.files)
        if self.interval < 0:
            raise ConfigError("interval", f"must be >= 0 (0: never), got {self.interval!r}")
        if (self.interval or self.at_start) and not self.files:
            raise ConfigError("files", "a validation pass (interval > 0 or at_start) needs at least one file")
        if self.files and not (self.interval or self.at_start):
            raise ConfigError("interval", "files are set but no pass is asked for: set interval > 0 or at_start: true")
        if self.max_prompts_per_source is not None and self.max_prompts_per_source < 1:
            raise ConfigError(
                "max_prompts_per_source", f"must be >= 1 or null (all), got {self.max_prompts_per_source!r}"
            )
        if self.batch_size < 1:
            raise ConfigError("batch_size", f"must be >= 1, got {self.batch_size!r}")
        self.sampling(SamplingConfig())  # SamplingConfig's checks of n, temperature, top_p and top_k

    def sampling(self, rollout: SamplingConfig) -> SamplingConfig:
        """``rollout`` with this section's ``n``, ``temperature``, ``top_p`` and ``top_k``."""
        return dataclasses.replace(rollout, n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go, every ``interval`` steps: the console, ``<dir>/metrics.jsonl``, Weights &
    Biases (offline when no API key is set).

    Console: on a terminal a progress bar (``progress``: ``auto`` is rich's), elsewhere (a Slurm log
    file, a pipe) one line per logged step; ``none``: neither. ``third_party_level``: the level of
    other libraries' loggers (vLLM, Megatron, transformers, torch): ``WARNING`` hides their INFO
    chatter, ``INFO`` or ``DEBUG`` restore it.
    """

    dir: str = "runs/empg"
    progress: Literal["auto", "rich", "tqdm", "none"] = "auto"
    third_party_level: str = "WARNING"
    jsonl: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-empg"
    wandb_run_name: str | None = None
    interval: int = 1

    def validate(self) -> None:
        if self.interval < 1:
            raise ConfigError("interval", f"must be >= 1, got {self.interval!r}")
        if self.third_party_level not in LOG_LEVELS:
            raise ConfigError("third_party_level", f"expected one of {LOG_LEVELS}, got {self.third_party_level!r}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # the logging module's level names


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Atomic distributed checkpoints under ``dir`` every ``interval`` steps (0: only at the end
    and on SIGTERM/SIGUSR1), keeping the ``keep_last`` newest. ``init_from``: the policy's first
    weights: a HF model directory, a converted or training checkpoint, or null (random init).

    ``continue_from``: a training checkpoint of an earlier stage (e.g. the 8k stage of a staged
    long-context run) whose whole training state (policy, optimizer, LR schedule, EMA anchor,
    step counter) this run starts from, under its own data and length settings: the prompt order
    of this run's ``data`` section, continued at the step counter. Applies when this run's
    ``dir`` has no checkpoint to ``--resume`` from.

    ``verify``: how a resume makes sure the checkpoint's files are intact (a damaged newest one is
    skipped for an older one). ``checksum``: every file's CRC32 is recorded at save and compared at
    resume, the ranks sharing the reads (one extra read of the checkpoint at each save and resume,
    about 3 GB/s per rank from the page cache). ``size``: file sizes only (a ``stat`` per file;
    catches truncated and missing files, not damaged content).
    """

    dir: str = "runs/empg/checkpoints"
    interval: int = 50
    keep_last: int | None = 3
    init_from: str | None = None
    continue_from: str | None = None
    optimizer_format: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    verify: Literal["checksum", "size"] = "checksum"

    def validate(self) -> None:
        if self.init_from is not None and self.continue_from is not None:
            raise ConfigError("continue_from", "and init_from are exclusive (continue_from carries the policy weights)")
        if self.interval < 0:
            raise ConfigError("interval", f"must be >= 0 (0: only at the end), got {self.interval!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", f"must be >= 1 or null (keep all), got {self.keep_last!r}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The process group. ``timeout_minutes``: how long a collective may wait before the NCCL
    watchdog (or gloo) aborts the job. Phases that some ranks wait through (the rollout and
    validation passes of the slowest engine) must end within it."""

    timeout_minutes: float = 60.0

    def validate(self) -> None:
        if not self.timeout_minutes > 0:
            raise ConfigError("timeout_minutes", f"must be > 0, got {self.timeout_minutes!r}")


@dataclasses.dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds each phase of a step may last before the run is declared hung (``trainer.watchdog``):
    null takes the default, a floor plus seconds per token of the step's upper bound
    (``train.prompts_per_step`` x ``rollout.sampling.n`` x ``rollout.max_model_len``; the table is
    ``trainer.watchdog.AUTO_TIMEOUTS``). ``start``: until the first step (models, engines, the
    first weight sync); ``draw`` and ``load``: an engine rank's generation and weight load."""

    start: float | None = None
    rollout: float | None = None
    advantages: float | None = None
    batching: float | None = None
    old_pass: float | None = None
    anchor_pass: float | None = None
    update: float | None = None
    ema_update: float | None = None
    weight_sync: float | None = None
    validation: float | None = None
    checkpoint: float | None = None
    draw: float | None = None
    load: float | None = None

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not value > 0:
                raise ConfigError(field.name, f"must be > 0 seconds or null (the default), got {value!r}")


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    """Hangs and restarts. Every process beats every ``heartbeat_interval_s`` into
    ``logging.dir/heartbeats`` and a phase that outlasts ``phase_timeout_s`` ends the run with exit
    code 3 (restartable) after every rank wrote its stacks to ``logging.dir/hang-<time>/``. The
    launchers (``launchers/torchrun.sh``, ``launchers/slurm/train.sbatch``, nemo-run) restart a
    run that ended restartable, or whose ranks were killed, with ``--resume``, up to
    ``max_restarts`` times within ``restart_window_s`` seconds (``logging.dir/restarts.jsonl`` keeps
    the history); a configuration error (exit 2), a crash or a clean end is not restarted."""

    phase_timeout_s: PhaseTimeouts = dataclasses.field(default_factory=PhaseTimeouts)
    heartbeat_interval_s: float = 5.0
    max_restarts: int = 3
    restart_window_s: float = 86400.0

    def validate(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ConfigError("heartbeat_interval_s", f"must be > 0, got {self.heartbeat_interval_s!r}")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts!r}")
        if not self.restart_window_s > 0:
            raise ConfigError("restart_window_s", f"must be > 0, got {self.restart_window_s!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole training run (``empg train CONFIG.yaml [a.b.c=value ...]``).

    ``model``: a name in ``model_configs/`` or a YAML path; ``model_overrides``: dotted overrides
    of it. ``tokenizer``: a HF directory with the tokenizer (the engine's too); null: the HF
    directory of ``checkpoint.init_from``.
    """

    model: str
    model_overrides: list[str] = dataclasses.field(default_factory=list)
    tokenizer: str | None = None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)

    def model_config(self) -> ModelConfig:
        """The resolved ``ModelConfig`` (errors name ``model`` / ``model_overrides``)."""
        try:
            return load_model_config(self.model, self.model_overrides)
        except ConfigError as e:
            raise ConfigError(join_path("model", e.field) if e.field != "model" else "model", e.reason) from None

    def validate(self) -> None:
        if self.tokenizer is None and self.checkpoint.init_from is None and self.checkpoint.continue_from is None:
            raise ConfigError(
                "tokenizer",
                "needed when checkpoint.init_from and checkpoint.continue_from are null (the engine needs a tokenizer)",
            )
        if not self.rollout.in_process and self.weight_sync.transport == "in_process":
            raise ConfigError(
                "weight_sync.transport",
                "in_process hands tensors to the engine by reference, which needs rollout.in_process=true; an engine "
                "in its own process (rollout.in_process=false) takes shm_file",
            )
        if self.validation.interval % self.logging.interval:  # else a pass's metrics fall between two records
            raise ConfigError(
                "validation.interval",
                f"must be a multiple of logging.interval={self.logging.interval}, got {self.validation.interval}",
            )
