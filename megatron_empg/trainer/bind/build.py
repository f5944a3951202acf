"""The bind step: every setting of a run resolved and checked once, before any engine or model starts.

    components = bind(config, world_size=8)      # ConfigError naming the dotted field, in seconds
    trainer = Trainer(components)                 # builds engines and models from what bind resolved

``bind`` reads the config, the registries (the only lists of names: ``core.advantages``,
``parallel.rl_loss.ALL_POLICY_LOSSES``, ``core.kl_term.KL_KINDS``, ``core.aggregation.AGG_MODES``, ``core.behavior_is.BEHAVIOR_IS``,
``tasks.registry.REWARDS``, ``rollout.engines.ENGINES``, ``weight_sync.transport.TRANSPORTS``,
``core.distill.losses.DISTILL_LOSSES``: ``trainer.bind.distill``) and
every record of each data file; it starts nothing and touches no device. In order:

1. ``model.attention_backend`` on this machine (``mcore.attention_backends``: ``auto`` becomes a
   name, ``te`` without Transformer Engine is an error), a mixture of experts' ``model.moe_experts``
   likewise (``mcore.moe.backends``; a dense model's is only checked to be a name), then the layout on ``world_size`` ranks (``trainer.bind.layout``: heads and groups vs TP, layers vs PP,
   the prompts' split over DP, the engine and its TP);
2. each registry name, then each argument dict bound to its function's signature
   (``core.checks.check_keywords``; the KL term by ``core.kl_term.bind_kl``), then one update-pass loss on a tiny random batch through
   ``rl_loss`` with exactly the run's settings, forward and backward: the loss functions' own
   value checks (a clip of -5, ``tail_grad: bogus``) run here instead of at the first update;
3. the length limits (the probe in the engine's context, a whole sample in ``train.max_seq_len``);
4. the paths (``trainer.bind.paths``): data and validation files (every record, streamed:
   ``rollout.data.check_records``; 5-7 s of CPU per million rows of DAPO-Math's shape),
   ``init_from`` and ``continue_from`` (their model field by field, their files as the converters
   check them), ``tokenizer``, and the run's directories;

5. with the GPU's memory (``device_bytes``), the memory plan of every rank (``trainer.bind.memory_plan``):
   a run that does not fit is an error listing the changes that would (``trainer.bind.memory_fixes``).

``empg check CONFIG [overrides] --world-size N [--gpu-memory-gib M]`` runs it alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron_empg.config import ConfigError, LossConfig, ModelConfig, RunConfig
from megatron_empg.core.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from megatron_empg.core.aggregation import AGG_MODES
from megatron_empg.core.behavior_is import BEHAVIOR_IS
from megatron_empg.core.checks import ArgumentError, check_keywords
from megatron_empg.core.distill.term import DistillTerm
from megatron_empg.core.kl_term import KL_KINDS, KLTerm, StatsPlan, bind_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.rpg import RPG_POLICY_LOSSES
from megatron_empg.mcore.attention_backends import AttentionChoice, resolve_attention_backend
from megatron_empg.mcore.moe.backends import ExpertsChoice, check_moe_experts_name, resolve_moe_experts
from megatron_empg.parallel.rl_loss import ALL_POLICY_LOSSES, rl_loss
from megatron_empg.rollout.engine import ROUTED_EXPERT_LIMIT
from megatron_empg.rollout.engines import ENGINES, EngineKind
from megatron_empg.rollout.rewards import RewardFn
from megatron_empg.tasks.registry import REWARDS
from megatron_empg.trainer.bind import anchor_kind
from megatron_empg.trainer.bind.distill import DistillBinding, bind_distill
from megatron_empg.trainer.bind.layout import Layout, check_layout, engine_kind
from megatron_empg.trainer.bind.paths import check_paths_of
from megatron_empg.weight_sync.transport import TRANSPORTS

# Arguments the trainer passes itself: a config that sets them is an error.
_POLICY_LOSS_INPUTS = ("logprobs", "old_logprobs", "advantages", "validate")


@dataclasses.dataclass(frozen=True)
class Components:
    """What ``bind`` resolved: the config, the model, the layout and one object per registry name.

    ``loss_fn(logits, batch, *, vocab_start, tp_group) -> RLLoss``: ``rl_loss`` with every option
    of ``algorithm.loss`` bound. ``engine``: the ``EngineKind`` of ``rollout.engine``.
    ``transport``: ``build(engine, weight_sync_config)`` of ``weight_sync.transport``.
    ``attention``: what ``model.attention_backend`` resolved to on this machine, ``experts`` what
    ``model.moe_experts`` did (None for a dense model); ``model`` holds the resolved names, so that
    every model of the run is built alike. ``anchor_storage``: the EMA anchor's storage kind here
    and why (``anchor_kind.anchor_storage``). ``distill``: ``algorithm.distill`` resolved (the term
    ``loss_fn`` carries, the teacher's model config), or None.
    """

    config: RunConfig
    model: ModelConfig
    layout: Layout
    advantage: AdvantageEstimator
    loss_fn: Callable
    stats: StatsPlan
    reward: RewardFn
    engine: EngineKind
    transport: Callable
    attention: AttentionChoice
    experts: ExpertsChoice | None = None
    distill: DistillBinding | None = None
    anchor_storage: tuple[str, str] = ("plain", "")


def bind(
    config: RunConfig, world_size: int, *, check_paths: bool = True, device_bytes: int | None = None
) -> Components:
    """Resolve and check every setting of ``config`` for a run on ``world_size`` ranks (module
    docstring). ``check_paths=False`` skips the files (a machine that cannot see them);
    ``device_bytes`` (the GPU's memory) also checks the memory plan (``trainer.bind.memory_fixes``).

    Raises ``ConfigError`` naming the dotted field and what was expected."""
    model = config.model_config()
    attention = resolve_attention_backend(model.attention_backend)
    model = dataclasses.replace(model, attention_backend=attention.name)  # what every builder of the run uses
    experts = None
    if model.is_moe:
        experts = resolve_moe_experts(model.moe_experts, attention)
        model = dataclasses.replace(model, moe_experts=experts.name)
    else:
        check_moe_experts_name(model.moe_experts)
    if config.parallel.sequence_parallel and not attention.uses_te:
        raise ConfigError(
            "parallel.sequence_parallel",
            "needs model.attention_backend te (the local spec's torch "
            f"norms do not support it); it is {attention.describe()}",
        )
    layout = check_layout(config, model, world_size)
    algorithm = config.algorithm
    advantage = _registered("algorithm.advantage", algorithm.advantage, ADVANTAGE_ESTIMATORS)
    distill = bind_distill(config, model, check_paths=check_paths)
    loss_fn, stats = bind_loss(
        algorithm.loss,
        vocab_size=model.vocab_size,
        topk=algorithm.topk,
        anchor_is_behaviour_policy=algorithm.anchor_is_behaviour_policy,
        distill=distill.term if distill is not None else None,
    )
    _registered("algorithm.behavior_is", algorithm.behavior_is, BEHAVIOR_IS)
    reward = _registered("data.reward", config.data.reward, REWARDS)
    engine = engine_kind(config)  # checked by check_layout
    _check_router_replay(config, model, engine)
    transport = _registered("weight_sync.transport", config.weight_sync.transport, TRANSPORTS)
    _check_anchor(config)
    _check_lora(config, model, attention)
    _check_lora_sync(config, model)
    _check_lengths(config, model)
    if check_paths:
        check_paths_of(config, model)
    components = Components(
        config,
        model,
        layout,
        advantage,
        loss_fn,
        stats,
        reward,
        engine,
        transport,
        attention,
        experts,
        distill,
        anchor_kind.anchor_storage(config),
    )
    if device_bytes is not None:
        from megatron_empg.trainer.bind.memory_fixes import check_memory

        check_memory(components, world_size, device_bytes, bind=bind)
    return components


def _registered(field: str, name: str, registry: dict[str, Any]) -> Any:
    if name not in registry:
        raise ConfigError(field, f"unknown name {name!r}; expected one of {sorted(registry)}")
    return registry[name]


# --------------------------------------------------------------------------------------------
# The update-pass loss.


def bind_loss(
    loss: LossConfig,
    *,
    vocab_size: int,
    topk: int,
    anchor_is_behaviour_policy: bool = False,
    distill: DistillTerm | None = None,
) -> tuple[Callable, StatsPlan]:
    """``rl_loss`` with ``algorithm.loss`` (``loss``) bound for a vocabulary of ``vocab_size`` and a
    Top-k KL of ``topk`` (checked by one forward and backward on a tiny batch), and what the old and
    anchor passes must compute for it (``KLTerm.stats``; ``anchor_is_behaviour_policy``: the old
    pass serves as the anchor pass where it can); with the distillation term ``distill``."""
    field = "algorithm.loss"
    policy_loss = _registered(f"{field}.policy_loss", loss.policy_loss, ALL_POLICY_LOSSES)
    if loss.policy_loss in RPG_POLICY_LOSSES and "kl_coef" in loss.policy_loss_args:
        raise ConfigError(
            f"{field}.policy_loss_args.kl_coef",
            f"was renamed to beta (RPG's coefficient of the divergence inside the policy loss, apart from "
            f"{field}.kl_coef, the separate KL term's): policy_loss_args.beta: {loss.policy_loss_args['kl_coef']}",
        )
    _bind_arguments(f"{field}.policy_loss_args", policy_loss, loss.policy_loss_args, _POLICY_LOSS_INPUTS, positional=3)
    _registered(f"{field}.agg_mode", loss.agg_mode, dict.fromkeys(AGG_MODES))
    term, stats = None, StatsPlan()
    if loss.kl is not None:
        _registered(f"{field}.kl", loss.kl, KL_KINDS)
        try:
            term = bind_kl(loss.kl, loss.kl_args)
        except ArgumentError as error:
            raise ConfigError(_dotted(f"{field}.kl_args", error.argument), error.reason) from None
        if term.kind.topk and not topk <= vocab_size:
            raise ConfigError("algorithm.topk", f"must be <= model.vocab_size={vocab_size}, got {topk}")
        stats = term.stats(topk, anchor_is_behaviour_policy=anchor_is_behaviour_policy)
    kwargs = dict(
        vocab_size=vocab_size,
        policy_loss=loss.policy_loss,
        policy_loss_args=loss.policy_loss_args,
        kl=term,
        kl_coef=loss.kl_coef,
        entropy_coef=loss.entropy_coef,
        log_entropy=loss.log_entropy,
        agg_mode=loss.agg_mode,
        inplace_backward=loss.inplace_backward,
        distill=distill,
        **({"chunk_size": loss.chunk_size} if loss.chunk_size else {}),
    )
    loss_fn = functools.partial(rl_loss, **kwargs)
    _dry_run(loss_fn, term, topk, field)
    return loss_fn, stats


def _bind_arguments(field: str, fn: Callable, args: dict, reserved: tuple[str, ...], *, positional: int) -> None:
    """``args`` must be keyword arguments of ``fn`` (after its ``positional`` tensor inputs), none
    of them one the trainer passes itself (``reserved``)."""
    try:
        check_keywords(fn, args, reserved, positional=positional)
    except ArgumentError as error:
        raise ConfigError(_dotted(field, error.argument), error.reason) from None


def _dotted(field: str, argument: str | None) -> str:
    return field if argument is None else f"{field}.{argument}"


def _dry_run(loss_fn: Callable, term: KLTerm | None, k: int, field: str) -> None:
    """One forward and backward of ``loss_fn`` on 2 x 3 tokens of random logits (float32), so that
    the loss functions check their argument values now; a failure names the argument it mentions."""
    vocab = loss_fn.keywords["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, vocab, generator=generator, requires_grad=True)
    logprobs = torch.log_softmax(torch.randn(2, 3, vocab, generator=generator), dim=-1)
    targets = torch.randint(0, vocab, (2, 3), generator=generator)
    topk = torch.arange(k).expand(2, 3, k) if term is not None and term.kind.topk else None
    distill = loss_fn.keywords["distill"]
    teacher = {}
    if distill is not None:  # the teacher: another random distribution, its top-k by torch.topk
        teacher_logprobs = torch.log_softmax(torch.randn(2, 3, vocab, generator=generator), dim=-1)
        top = torch.topk(teacher_logprobs, min(distill.teacher_k, vocab), dim=-1)
        teacher = dict(
            teacher_logprobs=teacher_logprobs.gather(-1, targets[..., None])[..., 0],
            teacher_topk_ids=top.indices,
            teacher_topk_logprobs=top.values,
        )
    batch = MicroBatch(
        input_ids=targets,
        target_ids=targets,
        loss_mask=torch.tensor([[True, True, False], [True, False, False]]),
        advantages=torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]),
        old_logprobs=logprobs.gather(-1, targets[..., None])[..., 0],
        anchor_logprobs=logprobs.gather(-1, targets[..., None])[..., 0] - 0.1 if term is not None else None,
        topk_ids=topk,
        topk_anchor_logprobs=logprobs.gather(-1, topk) if topk is not None else None,
        **teacher,
    )
    try:
        out = rl_loss(logits, batch, **{**loss_fn.keywords, "inplace_backward": False}, vocab_start=0, tp_group=None)
        out.loss.loss_sum.backward()
    except (ValueError, TypeError) as error:
        sections = {"policy_loss_args": loss_fn.keywords["policy_loss_args"], "kl_args": term.args if term else {}}
        raise ConfigError(_field_of(field, str(error), sections), str(error)) from None
    if not torch.isfinite(logits.grad).all():
        raise ConfigError(field, "the update-pass loss has a non-finite gradient on a random batch")


def _field_of(field: str, message: str, sections: dict[str, dict]) -> str:
    """The dotted field an argument error is about: ``clip_eps_low=-5 must ...`` with
    ``clip_eps_low`` in ``policy_loss_args`` -> ``algorithm.loss.policy_loss_args.clip_eps_low``."""
    name = message.split("=", 1)[0].strip()
    for section, args in sections.items():
        if name in (args or {}):
            return f"{field}.{section}.{name}"
    return field


# --------------------------------------------------------------------------------------------
# Engine, anchor, lengths, paths.


def _check_router_replay(config: RunConfig, model: ModelConfig, engine: EngineKind) -> None:
    """``algorithm.router_replay: rollout`` needs experts, an engine that returns its routing on
    some device (whether on this run's: ``trainer.bind.machine.check_machine``, on the nodes, since a
    login node without GPUs binds GPU recipes too), single-turn samples (a search episode's turns
    would need their routing spliced) drawn by one version of the weights (``rollout.partial``
    would mix them)."""
    if config.algorithm.router_replay == "none":
        return
    field, name = "algorithm.router_replay", config.rollout.engine
    if not model.is_moe:
        raise ConfigError(
            field,
            f"rollout replays the routing of a mixture of experts; model {model.family!r} "
            "has no experts: set it to none",
        )
    if model.num_experts > ROUTED_EXPERT_LIMIT:
        raise ConfigError(
            field,
            f"rollout stores expert ids as int16: model.num_experts={model.num_experts} exceeds {ROUTED_EXPERT_LIMIT}",
        )
    if not engine.routes_on:
        able = sorted(n for n, kind in ENGINES.items() if kind.routes_on)
        raise ConfigError(
            field, f"rollout needs an engine that returns its routed experts ({able}); rollout.engine {name!r} does not"
        )
    if config.rollout.search_agent is not None:
        raise ConfigError(field, "rollout is not built for the search agent's multi-turn episodes; set it to none")
    if config.rollout.partial:
        raise ConfigError(
            field,
            "rollout cannot take rollout.partial (a response's routing would come from "
            "several weight versions); set one of them off",
        )


def _check_anchor(config: RunConfig) -> None:
    anchor = config.algorithm.anchor
    if anchor.fp8 == "te" and config.optimizer.use_distributed_optimizer:
        raise ConfigError(
            "algorithm.anchor.fp8",
            "te with optimizer.use_distributed_optimizer would need the policy in FP8 parameters too; "
            "use fp8: emulated, or turn the distributed optimizer off",
        )


def _check_lora(config: RunConfig, model: ModelConfig, attention: AttentionChoice) -> None:
    """A LoRA policy (``model.lora``): the local spec's linears, the plain optimizer, an anchor over
    the adapters in their own dtype."""
    if model.lora is None:
        return
    if attention.uses_te:
        raise ConfigError(
            "model.lora",
            f"the adapters wrap Megatron's local linears; attention is {attention.describe()}: set "
            "model.attention_backend sdpa (or unfused)",
        )
    if config.checkpoint.init_from is None:
        raise ConfigError("checkpoint.init_from", "a LoRA policy adapts a base model: set it to the base's directory")
    if config.optimizer.use_distributed_optimizer:
        raise ConfigError(
            "optimizer.use_distributed_optimizer",
            "a LoRA policy trains only its adapters, whose optimizer state is small: set it false",
        )
    anchor = config.algorithm.anchor
    if anchor.compute_dtype == "float8_e4m3fn" or anchor.master_on_cpu:
        field = "compute_dtype" if anchor.compute_dtype == "float8_e4m3fn" else "master_on_cpu"
        raise ConfigError(
            f"algorithm.anchor.{field}",
            "a LoRA policy's anchor is its base with averaged adapters (the adapters' dtype, on the "
            "device: a few MB); leave it at its default",
        )


def _check_lora_sync(config: RunConfig, model: ModelConfig) -> None:
    """``weight_sync.lora_mode: adapter``: a LoRA policy, vLLM (its LoRA adapters), no weight
    update inside a draw (a running request keeps the adapter it started with)."""
    from megatron_empg.mcore.lora.sync import LORA_SYNC_MODES

    field = "weight_sync.lora_mode"
    if _registered(field, config.weight_sync.lora_mode, LORA_SYNC_MODES).name != "adapter":
        return
    if model.lora is None:
        raise ConfigError(field, "adapter pushes a LoRA policy's adapters: set model.lora (or lora_mode merged)")
    if config.rollout.engine != "vllm":
        raise ConfigError(
            field, f"adapter needs an engine that serves LoRA adapters (vllm), not {config.rollout.engine!r}"
        )
    if config.rollout.partial:
        raise ConfigError(
            field, "adapter cannot take rollout.partial (a running request keeps its adapter); use merged"
        )


def _check_lengths(config: RunConfig, model: ModelConfig) -> None:
    rollout, sync, train = config.rollout, config.weight_sync, config.train
    max_model_len = rollout.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(
            "rollout.max_model_len",
            f"{max_model_len} exceeds the model's max_position_embeddings={model.max_position_embeddings}",
        )
    if train.max_seq_len > model.max_position_embeddings:
        raise ConfigError(
            "train.max_seq_len",
            f"{train.max_seq_len} exceeds the model's max_position_embeddings={model.max_position_embeddings}",
        )
    if sync.probe_length + sync.probe_continuation > max_model_len - 1:
        raise ConfigError(
            "weight_sync.probe_length",
            f"probe_length + probe_continuation = {sync.probe_length + sync.probe_continuation} must be <= "
            f"rollout.max_model_len - 1 = {max_model_len - 1}",
        )
    if config.algorithm.overlong_buffer >= rollout.sampling.max_tokens:
        raise ConfigError(
            "algorithm.overlong_buffer",
            f"{config.algorithm.overlong_buffer} must be < rollout.sampling.max_tokens={rollout.sampling.max_tokens}",
        )
    if rollout.sampling.max_tokens >= train.max_seq_len:
        raise ConfigError(
            "rollout.sampling.max_tokens",
            f"{rollout.sampling.max_tokens} leaves no room for a prompt in train.max_seq_len={train.max_seq_len}",
        )
    longest = min(config.data.max_prompt_tokens + rollout.sampling.max_tokens, max_model_len)
    if config.data.source == "files" and rollout.search_agent is None and longest > train.max_seq_len:
        raise ConfigError(
            "train.max_seq_len",
            f"{train.max_seq_len} is shorter than the longest sample, min(data.max_prompt_tokens + "
            f"rollout.sampling.max_tokens, rollout.max_model_len) = {longest}",
        )
