"""On-policy distillation (``algorithm.distill``): a frozen teacher as the KL target."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from megatron_empg.config.schema import Config, ConfigError, named_in

TeacherDtype = Literal["bfloat16", "float32"]
TEACHER_DTYPES = typing.get_args(TeacherDtype)
DistillPlacement = Literal["trainer", "engine"]
DISTILL_PLACEMENTS = typing.get_args(DistillPlacement)


@dataclasses.dataclass(frozen=True)
class TeacherConfig(Config):
    """The teacher: a model that never moves, sharing the student's tokenizer and vocabulary (the
    bind step checks both, and that its heads and layers divide the student's TP / PP / CP)."""

    model: str
    """A name in ``model_configs/`` (``qwen3-8b``) or the path of a model YAML, as ``model`` is."""
    checkpoint: str
    """The teacher's weights: a HF model directory or a Megatron (converted or training) checkpoint
    (``placement: engine``: a HF model directory only)."""
    dtype: TeacherDtype = "bfloat16"
    """The dtype of the teacher's forward weights."""
    offload: bool = False
    """Keep the teacher's weights in pinned host memory between its passes (GPU), to save GPU memory
    (``placement: trainer``; an engine teacher sleeps between its calls with ``rollout.sleep_while_training``)."""
    tokenizer: str | None = None
    """The teacher's tokenizer (a HF directory or hub name), checked equal to the student's
    ``tokenizer``; null: ``checkpoint`` (a HF directory holds one)."""
    gpu_memory_utilization: float = 0.2
    """``placement: engine`` with vLLM on a GPU: the fraction of the GPU its teacher engine takes
    (weights and KV cache; scoring needs no long cache), in (0, 1]; it sits beside the rollout
    engine's ``rollout.gpu_memory_utilization`` (the two must sum to <= 1)."""

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")


@dataclasses.dataclass(frozen=True)
class DistillConfig(Config):
    """On-policy distillation: the student samples, the teacher scores every sampled token, and the
    loss pulls the student toward the teacher on its own samples (verl's ``distillation`` with
    the same loss names and clamps). It works alongside the RL loss and the EMA anchor
    (``use_task_rewards``) or alone. docs/algorithms.md "On-policy distillation" has the formulas."""

    teacher: TeacherConfig
    """The teacher model."""
    loss: str = named_in("megatron_empg.core.distill.losses:DISTILL_LOSSES", "k1")
    """The per-token loss: ``k1`` / ``kl`` (reverse KL, log pi - log pi_teacher), ``abs``, ``k2`` /
    ``mse``, ``k3`` / ``low_var_kl`` (single-sample estimators at the sampled token) or
    ``forward_kl_topk`` (the forward KL over the teacher's ``topk`` ids)."""
    topk: int = 128
    """k of ``forward_kl_topk``: the teacher's top-k ids per token (<= the vocabulary); the other
    losses take the teacher's top-1 only (``distill/teacher_topk_mass`` is then its mass)."""
    use_policy_gradient: bool = True
    """The loss enters as a per-token advantage -sg(loss) of a PPO-clip policy loss (the published
    recipe with ``k1``); false: the loss is backpropagated directly (GKD; ``k3``, ``forward_kl_topk``)."""
    use_task_rewards: bool = True
    """Keep the RL loss (task rewards, ``algorithm.loss``) and add ``coef`` x the distillation
    loss; false: pure distillation (the distillation loss alone, coefficient 1)."""
    coef: float = 1.0
    """The distillation loss's coefficient alongside the task rewards (verl's
    ``distillation_loss_coef``), >= 0."""
    loss_max_clamp: float | None = 10.0
    """Per-token losses are clamped to [-c, c] (> 0); null: no clamp."""
    log_prob_floor: float | None = 10.0
    """``forward_kl_topk``'s log-probs are clamped from below at -``log_prob_floor`` (> 0; verl's
    ``log_prob_min_clamp`` -10); null: no clamp."""
    clip_eps_low: float = 0.2
    """The PPO clip of the policy-gradient form: ratio >= 1 - clip_eps_low, in [0, 1)."""
    clip_eps_high: float = 0.2
    """The PPO clip of the policy-gradient form: ratio <= 1 + clip_eps_high."""
    clip_c: float | None = 3.0
    """The dual-clip constant c > 1 of the policy-gradient form (verl's default); null: off."""
    placement: DistillPlacement = "trainer"
    """Where the teacher runs: ``trainer`` (a Megatron model on the training ranks, forward only,
    at the student's TP / PP / CP) or ``engine`` (an engine of ``rollout.engine``'s kind beside
    each colocated rollout engine, from ``teacher.checkpoint`` as a HF directory, scoring the
    samples with top-k prompt log-probs: exact at the sampled token, no tail beyond the top-k)."""

    def validate(self) -> None:
        if self.topk < 1:
            raise ConfigError("topk", f"must be >= 1, got {self.topk!r}")
        if self.coef < 0:
            raise ConfigError("coef", f"must be >= 0, got {self.coef!r}")
        if not self.use_task_rewards and self.coef != 1.0:
            raise ConfigError("coef", f"is {self.coef!r} but use_task_rewards is false (the loss stands alone, coef 1)")
        if self.loss_max_clamp is not None and not self.loss_max_clamp > 0:
            raise ConfigError("loss_max_clamp", f"must be > 0 or null, got {self.loss_max_clamp!r}")
        if self.log_prob_floor is not None and not self.log_prob_floor > 0:
            raise ConfigError("log_prob_floor", f"must be > 0 or null, got {self.log_prob_floor!r}")
        if not 0 <= self.clip_eps_low < 1:
            raise ConfigError("clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low!r}")
        if self.clip_eps_high < 0:
            raise ConfigError("clip_eps_high", f"must be >= 0, got {self.clip_eps_high!r}")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ConfigError("clip_c", f"must be > 1 or null, got {self.clip_c!r}")
        if self.loss in ("k1", "kl") and not self.use_policy_gradient:
            raise ConfigError(
                "use_policy_gradient",
                f"is false with loss {self.loss}: its gradient does not depend on the teacher; use k3 or forward_kl_topk",
            )
