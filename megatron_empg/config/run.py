"""The run: its data, training loop, validation, logging, checkpoints, and ``RunConfig``, the
whole of it."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from megatron_empg.config.algorithm import AlgorithmConfig, OptimizerConfig
from megatron_empg.config.model import ModelConfig, ParallelConfig, load_model_config
from megatron_empg.config.rollout import RolloutConfig, SamplingConfig, WeightSyncConfig
from megatron_empg.config.schema import Config, ConfigError, check_duration, join_path, named_in

# The names of tasks.registry.PROMPT_SOURCES (config imports no task; a test keeps them equal).
DataSource = Literal["files", "arithmetic"]
DATA_SOURCES = typing.get_args(DataSource)
DATA_FILE_SUFFIXES = (".parquet", ".jsonl")
ArithmeticOp = Literal["+", "-", "*"]
ARITHMETIC_OPS = typing.get_args(ArithmeticOp)
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]  # the logging module's level names
LOG_LEVELS = typing.get_args(LogLevel)
OptimizerFormat = Literal["fully_reshardable", "dp_reshardable"]  # the distributed optimizer's (mcore.checkpoint)
OPTIMIZER_FORMATS = typing.get_args(OptimizerFormat)


def _check_data_files(field: str, paths: list[str]) -> None:
    """Each of ``paths`` (the list ``field``) names a parquet or JSONL file."""
    for i, path in enumerate(paths):
        if not path.endswith(DATA_FILE_SUFFIXES):
            raise ConfigError(f"{field}[{i}]", f"expected a {' or '.join(DATA_FILE_SUFFIXES)} file, got {path!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig(Config):
    """Training prompts and the reward that scores their responses (``rollout.data``, ``tasks``).

    Rewards that check answers in worker processes (``math``, ``math_dapo``: math-verify, whose
    sympy can work on one expression for ever) run ``reward_workers`` processes per rank; the other
    rewards run in the rank's process, a sample past ``reward_timeout_s`` scoring 0 (its thread is
    abandoned, since Python cannot stop it). Timed-out samples are counted in ``reward/timeouts``.
    """

    source: DataSource = "arithmetic"
    """Where prompts come from: ``files`` reads ``train_files``; ``arithmetic`` generates small
    arithmetic problems ("12+7=") from ``seed`` on the fly (``tasks.arithmetic``)."""
    reward: str = named_in("megatron_empg.tasks.registry:REWARDS", "arithmetic")
    """The reward that scores responses (``arithmetic`` with source ``arithmetic``)."""
    train_files: list[str] = dataclasses.field(default_factory=list)
    """Parquet or JSONL files, one record per row (source ``files``; empty for ``arithmetic``)."""
    prompt_key: str = "prompt"
    """A record's prompt: a string or a list of chat messages (``{role, content}``); a dotted key
    reaches into nested records."""
    answer_key: str = "answer"
    """A record's gold answer: a string, an int or a list of strings (several answers); dotted
    keys (``reward_model.ground_truth``) reach into nested records."""
    system_prompt: str | None = None
    """A first system message of chat-template prompts; null: none."""
    prompt_template: str | None = None
    """A format string with one ``{prompt}`` field that rewrites the user's text first (a string
    prompt, or the last user message), e.g. ``"{prompt} Let's think step by step and output the
    final answer within \\boxed{{}}."`` (literal braces doubled, as in ``str.format``); null: as is."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template and its generation prompt (where it has
    one); false: plain text."""
    max_prompt_tokens: int = 1024
    """The longest prompt in tokens; a longer one is an error, or dropped (``drop_long_prompts``)."""
    drop_long_prompts: bool = False
    """Drop (and count) prompts longer than ``max_prompt_tokens`` instead of failing."""
    shuffle: bool = True
    """Each epoch's order is a permutation drawn from (``seed``, epoch); false: file order."""
    seed: int = 0
    """Seed of the shuffle and of the arithmetic problems (>= 0)."""
    arithmetic_digits: int = 2
    """Source ``arithmetic``: the most digits of an operand, in [1, 9]."""
    arithmetic_ops: list[ArithmeticOp] = dataclasses.field(default_factory=lambda: ["+", "-"])
    """Source ``arithmetic``: the operators of the problems (distinct)."""
    reward_workers: int = 2
    """Worker processes per rank of a reward that checks answers in processes (``math``,
    ``math_dapo``)."""
    reward_timeout_s: float = 5.0
    """Seconds one sample's check may take in a worker process (then it scores 0); for an
    in-process reward, the seconds of a batch call, then of each sample's if it overran."""
    reward_budget_s: float | None = None
    """Seconds a step's scoring may take on each rank (worker-process rewards): the samples not
    checked by then score 0 (not the reward's incorrect score) and ``reward/unscored`` is their
    fraction of the step's samples (logged with a budget only); a validation call of ``validation.batch_size`` prompts gets the whole budget. Null:
    no budget."""

    def validate(self) -> None:
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
        if self.reward_workers < 1:
            raise ConfigError("reward_workers", f"expected a number of processes >= 1, got {self.reward_workers!r}")
        check_duration("reward_timeout_s", self.reward_timeout_s)
        check_duration("reward_budget_s", self.reward_budget_s, "seconds (or null for no budget)")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Config):
    """The loop: ``steps`` RL steps of ``prompts_per_step`` prompts (x ``rollout.sampling.n``
    responses) of at most ``max_seq_len`` tokens each, in micro-batches (docs/packing.md).

    Bad steps are refused (``core.step_guard``): an optimizer step whose loss or gradient norm is
    not finite, or whose gradient norm is a spike (``skip_grad_norm_factor``), changes neither the
    weights, the optimizer's state, the LR schedule nor the EMA anchor's schedule, on every rank
    (``train/skipped_steps`` counts a step's refused optimizer steps).
    """

    steps: int = 100
    """RL steps of the run."""
    prompts_per_step: int = 64
    """Prompts per RL step over all replicas (each with ``rollout.sampling.n`` responses)."""
    micro_batch_size: int = 8
    """Sequences per micro-batch (without ``max_tokens_per_microbatch``)."""
    max_seq_len: int = 1024
    """The longest sample (prompt + response, a whole search episode) in tokens."""
    seed: int = 1234
    """Seed of the model's initialization and the trainer's random state (``torch``, Megatron's
    RNG tracker)."""
    params_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """The policy's parameters (bfloat16: with float32 master weights in the optimizer)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in the update pass (Megatron's): ``selective`` recomputes the core
    attention, whose [b, heads, s, s] scores dominate long sequences; ``full`` whole layers
    (``recompute_num_layers`` per checkpointed unit: only their inputs are kept). The gradient is
    the same; the time goes up and the memory down."""
    recompute_num_layers: int = 1
    """Layers per checkpointed unit of ``recompute: full``."""
    packing: bool = True
    """A micro-batch is one row of its sequences back to back, attention and positions restarting
    at each (Megatron's THD layout), instead of one right-padded row per sequence."""
    max_tokens_per_microbatch: int | None = None
    """Fill each micro-batch with as many sequences as fit this many tokens (needs ``packing``;
    must hold a sequence of ``max_seq_len``); null: ``micro_batch_size`` sequences."""
    max_tokens_per_forward_microbatch: int | None = None
    """The forward-only passes (old and anchor), which keep no activations for a backward pass, run
    on the update's packed rows concatenated in order into rows of at most this many tokens,
    padding included (``trainer.batching.forward_batch``; needs ``packing``, must hold the update's widest
    row). The logits of one such row, [tokens, V / TP] bf16, are the passes' peak. Null: on the
    update's micro-batches."""
    balance: bool = True
    """Split each mini-batch's samples between the replicas of one engine by estimated compute
    (tokens plus the attention's quadratic term) rather than keep them where they were sampled;
    the gradient is the same."""
    fused_output_loss: bool = False
    """The update pass computes the logits from the output layer's input and weight one chunk of
    tokens at a time inside the loss (``parallel.fused_output``), so that the [tokens, V / TP]
    logits and their gradient never exist whole: at 16,384 tokens of a 151,936 vocabulary 0.78 GB
    of GPU memory instead of 5.4 GB, for 1.5x the output layer's and the loss's time (one more
    GEMM; H100, benchmarks/README.md). The gradient is the same up to rounding."""
    memory_check: Literal["error", "warn"] = "error"
    """When the memory plan (``trainer.bind.memory_plan``, ``empg plan``) exceeds the GPU, checked before
    anything starts: ``error`` (with the changes that would fit) or ``warn`` and start anyway."""
    skip_grad_norm_factor: float | None = 10.0
    """Refuse an optimizer step whose gradient norm exceeds this factor x the median of the last 20
    applied steps' (from the 6th applied step); null: no spike check."""
    max_consecutive_skips: int = 5
    """Refused optimizer steps in a row that stop the run with a ``BadStepsError``, the step's
    samples saved in ``<logging.dir>/bad_step_<step>/`` (``trainer.run.bad_steps``)."""

    def validate(self) -> None:
        for name in ("steps", "prompts_per_step", "micro_batch_size", "recompute_num_layers", "max_consecutive_skips"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_tokens_per_microbatch", "max_tokens_per_forward_microbatch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1 or null, got {getattr(self, name)!r}")
        if self.seed < 0:
            raise ConfigError("seed", f"must be >= 0, got {self.seed!r}")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len", f"must be >= 2, got {self.max_seq_len!r}")
        factor = self.skip_grad_norm_factor
        if factor is not None and not factor > 1:
            raise ConfigError(
                "skip_grad_norm_factor", f"expected a number > 1, or null for no spike check, got {factor!r}"
            )
        budget = self.max_tokens_per_microbatch
        if budget is not None and not self.packing:
            raise ConfigError("max_tokens_per_microbatch", "needs packing: true (a token budget fills packed rows)")
        # that it holds a sequence of max_seq_len is checked with the layout (a budget is per
        # context-parallel rank: trainer.bind.layout)
        if self.max_tokens_per_forward_microbatch is not None and not self.packing:
            raise ConfigError(
                "max_tokens_per_forward_microbatch", "needs packing: true (forward rows are packed rows back to back)"
            )


@dataclasses.dataclass(frozen=True)
class ValidationConfig(Config):
    """Held-out prompts answered and scored under the current weights.

    The files are read like ``data``'s training files (keys, template, chat template, prompt
    length) and scored by ``data.reward``; with ``rollout.search_agent`` the answers are whole
    search episodes. Responses are sampled as in ``rollout.sampling`` (``max_tokens``, stop
    strings, seed) but with this section's ``n``, ``temperature``, ``top_p`` and ``top_k``: by
    default one greedy answer per prompt. Metrics: ``val/<source>/reward/mean``,
    ``.../accuracy``, the reward's own (``.../reward/exact_match``), response lengths, the agent's
    ``rollout/*_mean``, and the same over all sources as ``val/...``.
    """

    files: list[str] = dataclasses.field(default_factory=list)
    """Parquet or JSONL files of held-out prompts. Prompts are grouped by data source: a record's
    ``data_source`` column, else its file's name without suffix."""
    interval: int = 0
    """Steps between validation passes (a multiple of ``logging.interval``); 0: never."""
    at_start: bool = False
    """Also validate before the first step of a run that does not ``--resume`` (logged at the step
    it starts from: 0, or that of ``checkpoint.continue_from``)."""
    max_prompts_per_source: int | None = None
    """Keep the first this many prompts of each data source; null: all."""
    n: int = 1
    """Responses per prompt."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass, in (0, 1]."""
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens; null: all."""
    batch_size: int = 512
    """Prompts per engine call."""

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
class LoggingConfig(Config):
    """Where metrics go, every ``interval`` steps: the console, ``<dir>/metrics.jsonl``, Weights &
    Biases (offline when no API key is set)."""

    dir: str = "runs/empg"
    """The run's directory: ``metrics.jsonl``, heartbeats, hang reports, ``restarts.jsonl``."""
    progress: Literal["auto", "rich", "tqdm", "none"] = "auto"
    """Console: on a terminal a progress bar (``auto`` and ``rich``: rich's, ``tqdm``: tqdm's),
    elsewhere (a Slurm log file, a pipe) one line per logged step; ``none``: neither."""
    third_party_level: LogLevel = "WARNING"
    """The level of other libraries' loggers (vLLM, Megatron, transformers, torch): ``WARNING``
    hides their INFO chatter, ``INFO`` or ``DEBUG`` restore it."""
    jsonl: bool = True
    """Write ``<dir>/metrics.jsonl`` (one JSON object per logged step)."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = "megatron-empg"
    """The Weights & Biases project."""
    wandb_run_name: str | None = None
    """The Weights & Biases run name; null: W&B's own."""
    interval: int = 1
    """Steps between logged steps."""

    def validate(self) -> None:
        if self.interval < 1:
            raise ConfigError("interval", f"must be >= 1, got {self.interval!r}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Config):
    """Atomic distributed checkpoints, and the weights or training state a run starts from."""

    dir: str = "runs/empg/checkpoints"
    """Where checkpoints are saved (and ``--resume`` looks)."""
    interval: int = 50
    """Steps between checkpoints; 0: only at the end and on SIGTERM/SIGUSR1."""
    keep_last: int | None = 3
    """How many of the newest checkpoints are kept; null: all."""
    init_from: str | None = None
    """The policy's first weights: a HF model directory, a converted or training checkpoint; null:
    random init."""
    continue_from: str | None = None
    """A training checkpoint of an earlier stage (e.g. the 8k stage of a staged long-context run)
    whose whole training state (policy, optimizer, LR schedule, EMA anchor, step counter) this run
    starts from, under its own data and length settings: the prompt order of this run's ``data``
    section, continued at the step counter. Applies when ``dir`` has no checkpoint to ``--resume``
    from; exclusive with ``init_from``."""
    optimizer_format: OptimizerFormat = "fully_reshardable"
    """How the distributed optimizer is saved: ``fully_reshardable`` (per-parameter tensors in model
    space, loadable at another TP, PP, DP or EP) or ``dp_reshardable`` (flat per-DP-rank buffers,
    refused at another TP/PP/VPP/EP/ETP) (``mcore.checkpoint``)."""
    async_save: bool | None = None
    """Write a checkpoint's files in the background while the next steps train: the step waits only
    for a copy of the state into reused host buffers (pinned on a GPU), and the save is committed at
    the end of the first step after every rank wrote its files; the previous checkpoint stays the
    newest complete one until then. The last step's and a pre-emption's saves block. Null: on with a
    GPU, off on a CPU (where the copy costs about what the write does)."""
    verify: Literal["checksum", "size"] = "checksum"
    """How a resume makes sure the checkpoint's files are intact (a damaged newest one is skipped for
    an older one): ``checksum`` records every file's CRC32 at save and compares it at resume, the
    ranks sharing the reads (one extra read of the checkpoint at each save and resume, about 3 GB/s
    per rank from the page cache); ``size`` compares file sizes only (a ``stat`` per file; catches
    truncated and missing files, not damaged content)."""

    def validate(self) -> None:
        if self.init_from is not None and self.continue_from is not None:
            raise ConfigError("continue_from", "and init_from are exclusive (continue_from carries the policy weights)")
        if self.interval < 0:
            raise ConfigError("interval", f"must be >= 0 (0: only at the end), got {self.interval!r}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError("keep_last", f"must be >= 1 or null (keep all), got {self.keep_last!r}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Config):
    """The process group."""

    timeout_minutes: float = 60.0
    """Minutes a collective may wait before the NCCL watchdog (or gloo) aborts the job. Phases that
    some ranks wait through (the rollout and validation passes of the slowest engine) must end
    within it."""

    def validate(self) -> None:
        check_duration("timeout_minutes", self.timeout_minutes, "minutes", per_second=1 / 60)


@dataclasses.dataclass(frozen=True)
class PhaseTimeouts(Config):
    """Seconds each phase of a step may last before the run is declared hung (``trainer.run.watchdog``).
    A value set here always holds. Null: learned from the run's own history once the phase was seen
    ``supervisor.learn_after`` times (``supervisor.safety_factor`` x the slowest time seen, at least
    ``supervisor.learned_floor_s``), and until then a default, a floor plus seconds per token of the
    step's upper bound (``train.prompts_per_step`` x ``rollout.sampling.n`` x
    ``rollout.max_model_len``; the table is ``trainer.run.phase_limits.AUTO_TIMEOUTS``)."""

    start: float | None = None
    """Until the first step: models loaded, engines started, the first weight sync."""
    step: float | None = None
    """A step's time outside its other phases: its metrics, the log, the ranks' stop vote, the
    engines' end-of-step message."""
    rollout: float | None = None
    """A step's rollout: generation and rewards."""
    advantages: float | None = None
    """The advantages of a step's samples."""
    batching: float | None = None
    """Building a step's micro-batches."""
    old_pass: float | None = None
    """The old policy's forward pass (log-probs of the samples)."""
    anchor_pass: float | None = None
    """The anchor's forward pass."""
    teacher_pass: float | None = None
    """The distillation teacher's forward pass."""
    update: float | None = None
    """The update pass and optimizer steps of a step."""
    ema_update: float | None = None
    """The anchor's EMA update."""
    weight_sync: float | None = None
    """Pushing the weights into the engines (and the consistency gate)."""
    validation: float | None = None
    """A validation pass."""
    checkpoint: float | None = None
    """Saving a checkpoint."""
    draw: float | None = None
    """An engine rank's generation of a rollout (disaggregated)."""
    load: float | None = None
    """An engine rank's load of pushed weights (disaggregated)."""

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            check_duration(field.name, getattr(self, field.name), "seconds (or null: the default)")


@dataclasses.dataclass(frozen=True)
class SupervisorConfig(Config):
    """Hangs and restarts. A phase that outlasts its timeout ends the run with exit code 3
    (restartable) after every rank wrote its stacks to ``logging.dir/hang-<time>/``. The launchers
    (``launchers/torchrun.sh``, ``launchers/slurm/train.sbatch``, nemo-run) restart a run that
    ended restartable (a hang, a lost rank, a checkpoint save that failed: a full disk), or whose
    ranks were killed, with ``--resume``; a configuration error (exit 2), a crash or a clean end is
    not restarted."""

    phase_timeout_s: PhaseTimeouts = dataclasses.field(default_factory=PhaseTimeouts)
    """Seconds each phase of a step may last."""
    heartbeat_interval_s: float = 5.0
    """Seconds between a process's beats into ``logging.dir/heartbeats``."""
    learn_after: int = 3
    """How many times a phase must have ended (in this attempt or earlier ones of the run: the
    times are kept in ``logging.dir/phase-times/``) before its limit is learned from them; 0: never
    (each phase keeps its default)."""
    safety_factor: float = 5.0
    """A learned limit is this many times the slowest time seen of the phase (>= 1)."""
    learned_floor_s: float = 60.0
    """The least a learned limit may be, in seconds: a phase of a second is not declared hung for
    a pause of a few (a collection, a slow file system)."""
    max_restarts: int = 3
    """Restarts the launchers make within ``restart_window_s`` (``logging.dir/restarts.jsonl``
    keeps the history)."""
    restart_window_s: float = 86400.0
    """The window, in seconds, that ``max_restarts`` counts restarts in."""

    def validate(self) -> None:
        check_duration("heartbeat_interval_s", self.heartbeat_interval_s)
        if self.learn_after < 0:
            raise ConfigError("learn_after", f"must be >= 0 (0: never learn), got {self.learn_after!r}")
        if not 1 <= self.safety_factor <= 1e6:
            raise ConfigError("safety_factor", f"must be in [1, 1e6], got {self.safety_factor!r}")
        check_duration("learned_floor_s", self.learned_floor_s)
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts!r}")
        check_duration("restart_window_s", self.restart_window_s)


@dataclasses.dataclass(frozen=True)
class RunConfig(Config):
    """A whole training run (``empg train CONFIG.yaml [a.b.c=value ...]``)."""

    model: str
    """A name in ``model_configs/`` (``qwen2.5-7b``) or the path of a model YAML."""
    model_overrides: list[str] = dataclasses.field(default_factory=list)
    """Dotted overrides of the model config (``[attention_backend=sdpa]``)."""
    tokenizer: str | None = None
    """A HF directory with the tokenizer (the engine's too); null: the HF directory of
    ``checkpoint.init_from``."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Model parallelism."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """The training loop."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """Advantages, loss, anchor."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """Adam and the LR schedule."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """The rollout engines and sampling."""
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    """Weights into the engines, and the consistency gate."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Training prompts and the reward."""
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    """Held-out validation passes."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Metrics and the console."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints, and what a run starts from."""
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    """The process group."""
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    """Hangs and restarts."""

    def model_config(self) -> ModelConfig:
        """The resolved ``ModelConfig`` (errors name ``model`` / ``model_overrides``)."""
        try:
            return load_model_config(self.model, self.model_overrides)
        except ConfigError as e:
            raise ConfigError("model" if e.field in ("", "model") else join_path("model", e.field), e.reason) from None

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
