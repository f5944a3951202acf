"""When a run does not fit its GPUs: the cheapest changes that make it fit, each planned, and the
check that ``empg check`` and ``empg train`` run before anything starts.

Candidates, cheapest first (what each costs in time, roughly): the fused output loss (~2 % of a
step), the forward passes on the update's rows, the engine asleep while training, a lower
``gpu_memory_utilization`` (a smaller KV cache), the sdpa attention (faster, not slower), the
distributed optimizer, the anchor's master in host memory (a copy each EMA update), selective then
full recompute (one more forward of the attention / of every layer), a smaller token budget (more,
shorter micro-batches), context parallelism (each row over more ranks), more tensor parallelism
(fewer data-parallel replicas). Each is planned alone; if none fits, they are added up in that order
(each only if it lowers the peak) until the plan fits, and those the others do without are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from megatron_empg.config import ConfigError, RunConfig
from megatron_empg.config.schema import apply_overrides, from_dict, to_dict
from megatron_empg.trainer.bind.memory_plan import MemoryPlan, PlanOptions, plan_memory

log = logging.getLogger(__name__)
FIELD = "train.memory_check"


@dataclasses.dataclass(frozen=True)
class Fix:
    """``overrides`` (``dotted.key=value``, as ``empg train`` takes them) and the peak they plan."""

    label: str
    overrides: tuple[str, ...]
    peak_bytes: int

    def describe(self) -> str:
        return f"{self.label}: {' '.join(self.overrides)} -> {self.peak_bytes / 2**30:.1f} GiB"


def with_overrides(config: RunConfig, overrides: tuple[str, ...]) -> RunConfig:
    """``config`` with dotted overrides applied (as on the command line), validated."""
    new = from_dict(RunConfig, apply_overrides(to_dict(config), overrides, cls=RunConfig))
    new.model_config()
    return new


def _candidates(components, plan: MemoryPlan) -> list[tuple[str, tuple[str, ...]]]:
    config, model, layout = components.config, components.model, components.layout
    train, rollout, anchor = config.train, config.rollout, config.algorithm.anchor
    out: list[tuple[str, tuple[str, ...]]] = []
    if not train.fused_output_loss:
        out.append(("logits one chunk at a time", ("train.fused_output_loss=true",)))
    if train.max_tokens_per_forward_microbatch is not None:
        out.append(("forward passes on the update's rows", ("train.max_tokens_per_forward_microbatch=null",)))
    if not rollout.sleep_while_training and not layout.engine_ranks:
        out.append(("the engine asleep while training", ("rollout.sleep_while_training=true",)))
    if rollout.engine == "vllm" and not layout.engine_ranks:
        rank = plan.ranks[0]
        others = rank.total("rollout") - rank.device["rollout"].get("engine_awake", 0)
        utilization = int((plan.device_bytes - others) / plan.device_bytes * 20) / 20
        if 0.1 <= utilization < rollout.gpu_memory_utilization:
            out.append(("a smaller KV cache", (f"rollout.gpu_memory_utilization={utilization:.2f}",)))
    if model.attention_backend == "unfused":
        out.append(("the sdpa attention", (f"model_overrides={[*config.model_overrides, 'attention_backend=sdpa']}",)))
    if layout.dp > 1 and not config.optimizer.use_distributed_optimizer:
        out.append(("the distributed optimizer", ("optimizer.use_distributed_optimizer=true",)))
    if components.stats.anchor and not anchor.master_on_cpu:
        out.append(("the anchor's master in host memory", ("algorithm.anchor.master_on_cpu=true",)))
    if train.recompute == "none" and model.attention_backend == "unfused":
        out.append(("selective recompute", ("train.recompute=selective",)))
    if train.recompute != "full":
        out.append(("full recompute", ("train.recompute=full",)))
    if train.max_tokens_per_microbatch is None and train.micro_batch_size > 1:
        out.append(("one sequence per micro-batch", ("train.micro_batch_size=1",)))
    budget = train.max_tokens_per_microbatch
    if budget is not None:
        step = 1024
        for smaller in range((budget - 1) // step * step, train.max_seq_len - 1, -step):
            out.append((f"micro-batches of {smaller} tokens", (f"train.max_tokens_per_microbatch={smaller}",)))
    cp = config.parallel.context_parallel_size
    if train.packing and model.attention_backend in ("sdpa", "te"):
        for more in (2 * cp, 4 * cp):  # the same rows over more ranks: the per-rank budget shrinks
            split = [f"parallel.context_parallel_size={more}"]
            if budget is not None:
                split.append(f"train.max_tokens_per_microbatch={-(-budget * cp // more)}")
            out.append((f"context parallelism {more}", tuple(split)))
    tp = config.parallel.tensor_model_parallel_size
    for more in (2 * tp, 4 * tp):
        if more <= 8:
            out.append((f"tensor parallelism {more}", (f"parallel.tensor_model_parallel_size={more}",)))
    return out


def cheapest_fixes(
    components,
    world_size: int,
    device_bytes: int,
    *,
    options: PlanOptions = PlanOptions(),
    bind: Callable,
    limit: int = 5,
) -> list[Fix]:
    """Up to ``limit`` single changes that make ``components``' plan fit ``device_bytes`` (one per
    kind: the largest token budget, the least tensor parallelism), cheapest first; if none does,
    the candidates added up in order until one fits (one combined ``Fix``), or []."""
    base = plan_memory(components, device_bytes=device_bytes, options=options)
    candidates = _candidates(components, base)
    fixes: list[Fix] = []
    kinds: set[str] = set()
    for label, overrides in candidates:
        kind = overrides[0].split("=", 1)[0]
        if kind in kinds:
            continue
        planned = _plan(components.config, overrides, world_size, device_bytes, options, bind)
        if planned is not None and planned.fits:
            kinds.add(kind)
            fixes.append(Fix(label, overrides, planned.peak.peak_bytes))
    if fixes:
        return fixes[:limit]
    return _together(components.config, candidates, _overflow(base), world_size, device_bytes, options, bind)


def _overflow(plan: MemoryPlan) -> int:
    """Bytes over the device, summed over every rank kind and phase."""
    return sum(max(0, r.total(p) - plan.device_bytes) for r in plan.ranks for p in r.phases)


def _together(config, candidates, overflow: int, world_size, device_bytes, options, bind) -> list[Fix]:
    """Candidates added in order, each one that lowers the overflow, until the plan fits; then,
    the dearest first, each one the others do without is dropped. One ``Fix``, or []."""
    chosen: list[tuple[str, tuple[str, ...]]] = []
    for label, overrides in candidates:
        kind = overrides[0].split("=", 1)[0]
        if any(o[0].split("=", 1)[0] == kind for _, o in chosen):
            continue
        trial = _plan(config, _joined([*chosen, (label, overrides)]), world_size, device_bytes, options, bind)
        if trial is None or _overflow(trial) >= overflow:
            continue
        chosen.append((label, overrides))
        overflow, fitting = _overflow(trial), trial
        if trial.fits:
            for candidate in reversed(list(chosen)):
                rest = [c for c in chosen if c is not candidate]
                smaller = _plan(config, _joined(rest), world_size, device_bytes, options, bind) if rest else None
                if smaller is not None and smaller.fits:
                    chosen, fitting = rest, smaller
            return [Fix(" + ".join(label for label, _ in chosen), _joined(chosen), fitting.peak.peak_bytes)]
    return []


def _joined(chosen) -> tuple[str, ...]:
    return tuple(o for _, overrides in chosen for o in overrides)


def _plan(config: RunConfig, overrides, world_size, device_bytes, options, bind) -> MemoryPlan | None:
    try:
        components = bind(with_overrides(config, tuple(overrides)), world_size, check_paths=False)
    except ConfigError:
        return None  # the change does not fit the layout (heads, prompts, ...): not a fix
    return plan_memory(components, device_bytes=device_bytes, options=options)


def check_memory(
    components, world_size: int, device_bytes: int, *, bind: Callable, options: PlanOptions = PlanOptions()
) -> MemoryPlan:
    """The plan on ``device_bytes``; when it does not fit, a ``ConfigError`` naming
    ``train.memory_check`` with the largest terms and the fixes (a warning with
    ``train.memory_check: warn``)."""
    plan = plan_memory(components, device_bytes=device_bytes, options=options)
    if plan.fits:
        return plan
    rank = plan.peak
    phase = rank.peak_phase
    every = {**rank.resident, **rank.phases[phase], **rank.device[phase]}
    largest = sorted(every.items(), key=lambda kv: -kv[1])[:4]
    fixes = cheapest_fixes(components, world_size, device_bytes, options=options, bind=bind)
    message = (
        f"the {rank.kind} needs {rank.peak_bytes / 2**30:.1f} GiB in the {phase} phase, the GPU has "
        f"{device_bytes / 2**30:.1f} GiB (empg plan shows every term); largest: "
        + ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.1f} GiB" for k, v in largest)
        + ". "
        + ("Changes that fit: " + "; ".join(f.describe() for f in fixes) + "." if fixes else "No change found fits.")
        + f" Or set {FIELD}: warn to start anyway."
    )
    if components.config.train.memory_check == "warn":
        log.warning("memory plan: %s", message)
        return plan
    raise ConfigError(FIELD, message)
