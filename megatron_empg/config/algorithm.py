"""What is optimised: the optimizer, the loss, the EMA anchor, dynamic sampling (``algorithm``)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from megatron_empg.config.distill import DistillConfig
from megatron_empg.config.schema import Config, ConfigError, named_in

LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
LR_DECAY_STYLES = typing.get_args(LrDecayStyle)
AnchorDtype = Literal["bfloat16", "float32", "float8_e4m3fn"]
ANCHOR_DTYPES = typing.get_args(AnchorDtype)
DynamicSamplingMetric = Literal["acc", "reward"]
DYNAMIC_SAMPLING_METRICS = typing.get_args(DynamicSamplingMetric)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Config):
    """Adam with grad clipping and a linear warmup + decay LR schedule (Megatron's argument names;
    ``mcore.optimizer``). Steps are optimizer steps (``algorithm.mini_batches`` per RL step)."""

    lr: float = 1e-6
    """Peak learning rate, reached after the warmup."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay, in [0, lr]."""
    weight_decay: float = 0.01
    """Adam's decoupled weight decay (constant over the run)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon (added to the second moment's square root)."""
    clip_grad: float = 1.0
    """Largest global gradient norm (L2) before clipping; 0: no clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``; 0: start at ``lr``."""
    lr_decay_steps: int | None = None
    """Optimizer step at which the decay to ``min_lr`` ends (> ``lr_warmup_steps``); null: no decay
    after the warmup (constant at ``lr``)."""
    lr_decay_style: LrDecayStyle = "constant"
    """Shape of the decay from ``lr`` to ``min_lr`` (with ``lr_decay_steps`` set)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (fp32 master weights, Adam moments) over the data-parallel ranks
    (Megatron's distributed optimizer)."""
    bucket_size: int | None = None
    """Parameters per gradient-reduction bucket of Megatron's DDP; null: Megatron's default
    (max(40M, 1M x DP) parameters)."""

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.lr_warmup_steps < 0:
            raise ConfigError("lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigError(
                "lr_decay_steps", f"must exceed lr_warmup_steps={self.lr_warmup_steps}, got {self.lr_decay_steps!r}"
            )
        if self.clip_grad < 0:
            raise ConfigError("clip_grad", f"must be >= 0 (0 disables clipping), got {self.clip_grad!r}")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)!r}")
        if not self.adam_eps > 0:
            raise ConfigError("adam_eps", f"must be > 0, got {self.adam_eps!r}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError("bucket_size", f"must be >= 1 or null (Megatron's default), got {self.bucket_size!r}")


@dataclasses.dataclass(frozen=True)
class LossConfig(Config):
    """The update-pass objective (``parallel.rl_loss.rl_loss``).

    loss = agg(policy loss) + kl_coef * agg(KL) - entropy_coef * agg(entropy). The names and
    arguments are resolved and checked by ``trainer.bind.build.bind`` (``empg check``), before anything
    starts: the KL term is bound once (``core.kl_term.bind_kl``), which also decides what the old
    and anchor passes compute for it. docs/algorithms.md "KL estimators" gives every term's formula.
    """

    policy_loss: str = named_in("megatron_empg.parallel.rl_loss:ALL_POLICY_LOSSES", "ppo_clip")
    """The policy loss: ``ppo_clip`` (GRPO / DAPO / dual-clip) or an RPG surrogate (``rpg``,
    ``rpg_reinforce*``, ``rpg_dual_clip``)."""
    policy_loss_args: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the policy loss (e.g. ``clip_eps_low``, ``clip_eps_high``; the RPG
    surrogates' own KL weight is ``beta``, not ``kl_coef``)."""
    kl: str | None = named_in("megatron_empg.core.kl_term:KL_KINDS", None)
    """The KL to the anchor: null (none, no anchor is built), a sampled estimator (``k1`` .. ``k5``,
    ``k3pp``), ``topk`` (the Top-k KL of ``algorithm.topk`` ids), an RPG penalty (``rpg_fkl``,
    ``rpg_rkl``, ``rpg_ufkl``, ``rpg_urkl``, ``rpg_ujs``: d(pi / pi_anchor)) or ``grpo_corrected``
    (RPG's importance-weighted GRPO KL)."""
    kl_coef: float = 0.0
    """The KL's coefficient beta >= 0 (0 with ``kl`` null)."""
    kl_args: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the KL: ``importance_weight``, ``iw_clip``; for ``topk`` also
    ``direction`` (reverse or forward), ``tail``, ``tail_grad``; for the RPG terms
    ``max_abs_value``."""
    entropy_coef: float = 0.0
    """The entropy bonus c >= 0 (loss -= c * entropy)."""
    log_entropy: bool = True
    """Compute the policy's entropy for the metrics even when ``entropy_coef`` is 0."""
    agg_mode: str = named_in("megatron_empg.core.aggregation:AGG_MODES", "token-mean")
    """How token terms become the loss (``core.aggregation``): a mean over all tokens, or over
    sequences of their token sum or mean."""
    chunk_size: int | None = None
    """Tokens per chunk of the log-prob computation; null: the path's default (256, or 1024 with
    ``train.fused_output_loss``)."""
    inplace_backward: bool = True
    """Write the logits' gradient into the logits (Megatron's output buffer, read by nothing else),
    saving one [tokens, V / TP] tensor."""

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


@dataclasses.dataclass(frozen=True)
class AnchorConfig(Config):
    """The reference policy of the KL term: an EMA of the policy with a float32 master.

    Every ``period`` optimizer steps: anchor <- tau * anchor + (1 - tau) * policy. ``tau`` 1 keeps
    the initial policy (GRPO's fixed reference); ``tau`` 0 with ``period`` 1 is RPG's iterative reset.
    """

    tau: float = 0.95
    """The EMA's decay in [0, 1]: the anchor's weight in each update."""
    period: int = 10
    """Optimizer steps between anchor updates (>= 1)."""
    first_update: int | None = None
    """Optimizer step of the first update (>= 1), the next ones ``period`` apart; null: ``period``."""
    compute_dtype: AnchorDtype = "bfloat16"
    """The dtype of the anchor's forward weights (the master stays float32)."""
    fp8: Literal["auto", "te", "torch", "emulated"] = "auto"
    """With ``compute_dtype`` float8_e4m3fn, how the anchor stores and runs FP8: ``torch`` keeps
    the decoder's linear weights as float8_e4m3fn with one scale per row (half the bf16 bytes) and
    multiplies them by the per-token quantized input through ``torch._scaled_mm`` (GPU sm89+; the
    CPU has a slow kernel); ``emulated`` stores the same and computes the same product in float32
    from the dequantized operands (any machine); ``te`` Transformer Engine FP8 parameters
    (``fp8_param``; GPU with TE, not with the distributed optimizer, whose buffers would need the
    policy in FP8 too); ``auto`` TE where it can, else torch where the GPU multiplies in FP8, else
    emulated. Embeddings, the output layer and norms keep the dequantized values in the forward dtype."""
    fp8_output_layer: bool = False
    """With ``fp8`` torch or emulated: an untied output layer in FP8 too (its weights half the
    bytes, its GEMM in FP8), at the cost of the logits' own rounding in the KL's reference; a tied
    one shares the embedding's weight, which stays in the forward dtype."""
    master_on_cpu: bool = False
    """Keep the float32 master in pinned host memory (GPU), to save GPU memory."""

    def validate(self) -> None:
        if not 0 <= self.tau <= 1:
            raise ConfigError("tau", f"must be in [0, 1], got {self.tau!r}")
        if self.period < 1:
            raise ConfigError("period", f"must be >= 1, got {self.period!r}")
        if self.first_update is not None and self.first_update < 1:
            raise ConfigError("first_update", f"must be >= 1 or null, got {self.first_update!r}")
        if self.fp8_output_layer and (self.compute_dtype != "float8_e4m3fn" or self.fp8 == "te"):
            raise ConfigError(
                "fp8_output_layer",
                f"is for the row-wise FP8 kinds (compute_dtype float8_e4m3fn, fp8 auto, torch or emulated); got "
                f"compute_dtype {self.compute_dtype}, fp8 {self.fp8}",
            )
        if self.fp8 != "auto" and self.compute_dtype != "float8_e4m3fn":
            raise ConfigError(
                "fp8", f"{self.fp8} stores FP8 weights: it needs compute_dtype float8_e4m3fn, got {self.compute_dtype}"
            )


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig(Config):
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a group whose responses all
    score the same ``metric`` has no advantage, so it is dropped and more prompts are sampled until
    every replica holds its ``train.prompts_per_step`` / DP groups. If the generation batches are
    spent, the dropped groups fill what is missing (they add no policy gradient) and a warning says
    how many; verl stops the run instead."""

    metric: DynamicSamplingMetric = "acc"
    """What must differ within a group: ``acc`` (not all correct or all wrong) or ``reward`` (not
    one reward, the overlong penalty included)."""
    prompts_per_gen_batch: int | None = None
    """Prompts sampled per generation batch (verl's ``gen_batch_size``); null:
    ``train.prompts_per_step``."""
    max_num_gen_batches: int = 20
    """The most generation batches a step draws."""

    def validate(self) -> None:
        if self.max_num_gen_batches < 1:
            raise ConfigError("max_num_gen_batches", f"must be >= 1, got {self.max_num_gen_batches!r}")
        if self.prompts_per_gen_batch is not None and self.prompts_per_gen_batch < 1:
            raise ConfigError("prompts_per_gen_batch", f"must be >= 1 or null, got {self.prompts_per_gen_batch!r}")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig(Config):
    """What one RL step optimizes: advantages, the update-pass loss (policy loss + KL to the anchor
    + entropy), the Top-k KL's k, and how the rollout batch is split into optimizer steps."""

    advantage: str = named_in("megatron_empg.core.advantages:ADVANTAGE_ESTIMATORS", "grpo")
    """The advantage estimator (``core.advantages``)."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """The update-pass loss."""
    anchor: AnchorConfig = dataclasses.field(default_factory=AnchorConfig)
    """The EMA anchor, the KL's reference (built only when ``loss.kl`` is set)."""
    topk: int = 32
    """k of the Top-k KL (``loss.kl: topk``), <= the vocabulary."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (the old log-probs are computed once, before the first)."""
    mask_truncated: bool = False
    """Responses cut by ``rollout.sampling.max_tokens`` carry no loss (DAPO's overlong filter)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment, in tokens (0: off): a response of L tokens loses
    ``overlong_penalty * (L - (max_tokens - overlong_buffer)) / overlong_buffer`` of its reward when
    L passes ``rollout.sampling.max_tokens - overlong_buffer``."""
    overlong_penalty: float = 1.0
    """What a response of ``max_tokens`` tokens loses to the overlong punishment
    (``rollout.rewards.overlong_penalty``'s factor)."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """DAPO's group filter; null: every group trains."""
    behavior_is: str = named_in("megatron_empg.core.behavior_is:BEHAVIOR_IS", "none")
    """The importance correction of the sampled-token loss terms against the engine's sampling
    policy mu: ``none``, ``tis`` (min(pi_old / mu, C)), ``mis`` (pi_old / mu where it lies in
    [1/C, C], else 0)."""
    behavior_is_cap: float = 2.0
    """C >= 1 of ``behavior_is``."""
    distill: DistillConfig | None = None
    """On-policy distillation from a frozen teacher, with or without the RL loss; null: none."""
    router_replay: Literal["rollout", "none"] = "none"
    """A mixture of experts: ``rollout`` makes the old, anchor and update passes route every token
    to the experts the engine routed it to when it sampled (R3, rollout routing replay: the engine
    returns them, Megatron's ``RouterReplay`` replays them), so that the trainer's log-probs differ
    from the sampler's by numerics only, not by a flipped expert choice; ``none``: the trainer's
    router decides. The bind step checks that the model has experts and the engine can return its
    routing on this machine."""

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
        if self.behavior_is_cap < 1:
            raise ConfigError("behavior_is_cap", f"must be >= 1, got {self.behavior_is_cap!r}")
