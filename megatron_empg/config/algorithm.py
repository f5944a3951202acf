"""What is optimised: the optimizer, the loss, the EMA anchor, dynamic sampling (``algorithm``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_empg.config.schema import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam with grad clipping and a linear warmup + decay LR schedule (Megatron's argument names).

    ``lr_decay_steps`` null: no decay after the warmup (constant at ``lr``). ``clip_grad`` 0: off.
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.lr_warmup_steps < 0:
            raise ConfigError("lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError("lr_decay_style", f"expected one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(
                "lr_decay_steps", f"must exceed lr_warmup_steps={self.lr_warmup_steps}, got {self.lr_decay_steps!r}"
            )
        if self.clip_grad < 0:
            raise ConfigError("clip_grad", f"must be >= 0 (0 disables clipping), got {self.clip_grad!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The update-pass objective: arguments of ``parallel.rl_loss.rl_loss`` (see there).

    loss = agg(policy loss) + kl_coef * agg(KL) - entropy_coef * agg(entropy). ``policy_loss`` is
    a key of ``parallel.rl_loss.ALL_POLICY_LOSSES`` (``ppo_clip``: GRPO / DAPO / dual-clip;
    ``rpg``, ``rpg_reinforce*``, ``rpg_dual_clip``) with ``policy_loss_args`` its keyword arguments;
    ``kl`` is null, a sampled estimator (``k1`` .. ``k5``, ``k3pp``), ``topk``, an RPG penalty
    (``rpg_fkl``, ``rpg_rkl``, ``rpg_ufkl``, ``rpg_urkl``, ``rpg_ujs``: d(pi / pi_anchor)) or
    ``grpo_corrected`` (RPG's importance-weighted GRPO KL), with ``kl_args`` (``importance_weight``,
    ``iw_clip``; for ``topk`` also ``direction``, ``tail``, ``tail_grad``; for the RPG terms
    ``max_abs_value``);
    ``agg_mode`` one of ``core.aggregation.AGG_MODES``. The names and arguments are resolved and
    checked by ``trainer.build.bind`` (``empg check``), before anything starts.
    """

    policy_loss: str = "ppo_clip"
    policy_loss_args: dict = dataclasses.field(default_factory=dict)
    kl: str | None = None
    kl_coef: float = 0.0
    kl_args: dict = dataclasses.field(default_factory=dict)
    entropy_coef: float = 0.0
    log_entropy: bool = True
    agg_mode: str = "token-mean"
    chunk_size: int | None = None
    inplace_backward: bool = True  # the logits are Megatron's output buffer, read by nothing else

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.kl_coef < 0:
            raise ConfigError("kl_coef", f"must be >= 0, got {self.kl_coef!r}")
        if self.kl is None and self.kl_coef != 0:
            raise ConfigError("kl_coef", f"is {self.kl_coef!r} but kl is null (no estimator)")
        if self.kl is None and self.kl_args:
            raise ConfigError("kl_args", f"are set ({sorted(self.kl_args)}) but kl is null (no estimator)")
        if self.entropy_coef < 0:
            raise ConfigError("entropy_coef", f"must be >= 0 (a bonus: loss -= coef * H), got {self.entropy_coef!r}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("chunk_size", f"must be >= 1 or null, got {self.chunk_size!r}")


ANCHOR_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """The reference policy of the KL term: an EMA of the policy with a float32 master.

    Every ``period`` optimizer steps: anchor <- tau * anchor + (1 - tau) * policy. ``tau`` 1 keeps
    the initial policy (GRPO's fixed reference); ``tau`` 0 with ``period`` 1 is RPG's iterative reset.
    ``compute_dtype``: the anchor's forward weights (the master stays float32). For
    ``float8_e4m3fn``, ``fp8``: ``te`` stores Transformer Engine FP8 parameters (``fp8_param``;
    GPU with TE, and not with the distributed optimizer, whose buffers would need the policy in
    FP8 too), ``emulated`` FP8 values with per-tensor scales in the forward dtype (any machine:
    the arithmetic without the memory saving), ``auto`` TE where it can, else emulated.
    ``master_on_cpu``: the float32 master in pinned host memory (GPU), for memory.
    """

    tau: float = 0.95
    period: int = 10
    first_update: int | None = None  # null: after `period` steps
    compute_dtype: Literal["bfloat16", "float32", "float8_e4m3fn"] = "bfloat16"
    fp8: Literal["auto", "te", "emulated"] = "auto"
    master_on_cpu: bool = False

    def validate(self) -> None:
        if not 0 <= self.tau <= 1:
            raise ConfigError("tau", f"must be in [0, 1], got {self.tau!r}")
        if self.period < 1:
            raise ConfigError("period", f"must be >= 1, got {self.period!r}")
        if self.first_update is not None and self.first_update < 1:
            raise ConfigError("first_update", f"must be >= 1 or null, got {self.first_update!r}")
        if self.fp8 == "te" and self.compute_dtype != "float8_e4m3fn":
            raise ConfigError(
                "fp8", f"te stores FP8 weights: it needs compute_dtype float8_e4m3fn, got {self.compute_dtype}"
            )


DYNAMIC_SAMPLING_METRICS = ("acc", "reward")


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a group whose responses all
    score the same ``metric`` (``acc``: all correct or all wrong; ``reward``: one reward, the
    overlong penalty included) has no advantage, so it is dropped and more prompts are sampled,
    ``prompts_per_gen_batch`` at a time (verl's ``gen_batch_size``; null: ``train.prompts_per_step``),
    until every replica holds its ``train.prompts_per_step`` / DP groups, for at most
    ``max_num_gen_batches`` generation batches a step. If they are spent, the dropped groups fill
    what is missing (they add no policy gradient) and a warning says how many; verl stops the run
    instead."""

    metric: Literal["acc", "reward"] = "acc"
    prompts_per_gen_batch: int | None = None
    max_num_gen_batches: int = 20

    def validate(self) -> None:
        if self.max_num_gen_batches < 1:
            raise ConfigError("max_num_gen_batches", f"must be >= 1, got {self.max_num_gen_batches!r}")
        if self.prompts_per_gen_batch is not None and self.prompts_per_gen_batch < 1:
            raise ConfigError("prompts_per_gen_batch", f"must be >= 1 or null, got {self.prompts_per_gen_batch!r}")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """What one RL step optimizes: advantages (``advantage``: a name of ``core.advantages``'
    registry), the update-pass loss (policy loss + KL to the anchor + entropy), the Top-k KL's k,
    and how the rollout batch is split into optimizer steps.

    ``loss.kl`` null trains without a reference (no anchor is built). ``mini_batches``: optimizer
    steps per rollout batch (the old log-probs are computed once, before the first).
    ``mask_truncated``: responses cut by ``max_tokens`` carry no loss (DAPO's overlong filter).
    ``overlong_buffer`` > 0: DAPO's soft overlong punishment, a response of L tokens loses
    ``overlong_penalty * (L - (rollout.sampling.max_tokens - overlong_buffer)) / overlong_buffer`` of
    its reward when L passes ``max_tokens - overlong_buffer`` (``rollout.rewards.overlong_penalty``).
    ``dynamic_sampling``: DAPO's group filter (``DynamicSamplingConfig``); null: every group trains.
    ``behavior_is``: the importance correction of the sampled-token loss terms against the engine's
    sampling policy mu (a name of ``core.behavior_is``' registry: ``none``, ``tis``: min(pi_old/mu,
    C), ``mis``: pi_old/mu where it lies in [1/C, C], else 0), C = ``behavior_is_cap`` >= 1.
    ``router_replay`` (a mixture of experts): ``rollout`` makes the old, anchor and update passes
    route every token to the experts the engine routed it to when it sampled (R3, rollout routing
    replay: the engine returns them, Megatron's ``RouterReplay`` replays them), so that the trainer's
    log-probs differ from the sampler's by numerics only, not by a flipped expert choice; ``none``:
    the trainer's router decides. ``trainer.build.bind`` checks that the model has experts and the
    engine can return its routing on this machine.
    """

    advantage: str = "grpo"
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    anchor: AnchorConfig = dataclasses.field(default_factory=AnchorConfig)
    topk: int = 32
    mini_batches: int = 1
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: DynamicSamplingConfig | None = None
    behavior_is: str = "none"
    behavior_is_cap: float = 2.0
    router_replay: Literal["rollout", "none"] = "none"

    @property
    def anchor_is_behaviour_policy(self) -> bool:
        """Whether the anchor is, at every step, the policy that sampled it: tau 0 once per step
        (after its ``mini_batches`` optimizer steps), RPG's iterative reference."""
        anchor = self.anchor
        return anchor.tau == 0 and anchor.period == self.mini_batches and anchor.first_update in (None, anchor.period)

    def validate(self) -> None:
        if self.topk < 1:
            raise ConfigError("topk", f"must be >= 1, got {self.topk!r}")
        if self.mini_batches < 1:
            raise ConfigError("mini_batches", f"must be >= 1, got {self.mini_batches!r}")
        if self.overlong_buffer < 0:
            raise ConfigError("overlong_buffer", f"must be >= 0 (0: off), got {self.overlong_buffer!r}")
        if self.overlong_penalty < 0:
            raise ConfigError("overlong_penalty", f"must be >= 0, got {self.overlong_penalty!r}")
        if not self.behavior_is_cap >= 1:  # also rejects NaN
            raise ConfigError("behavior_is_cap", f"must be >= 1, got {self.behavior_is_cap!r}")
