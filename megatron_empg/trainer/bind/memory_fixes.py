"""When a run does not fit its GPUs: the cheapest changes that make it fit, each planned, and the
check that ``empg check`` and ``empg train`` run before anything starts.

The kinds of change, cheapest first (what each costs in time, roughly): the fused output loss (~2 %
of a step), the forward passes on the update's rows, the engine asleep while training, a smaller KV
cache (a lower ``gpu_memory_utilization``), the sdpa attention (faster, not slower), the
distributed optimizer, the anchor's master in host memory (a copy each EMA update), recompute
(selective: one more forward of the attention; full: of every layer), one sequence per
micro-batch, a smaller token budget (more, shorter micro-batches), context parallelism (each row
over more ranks), more tensor parallelism (fewer data-parallel replicas, the engines split alike).
Some kinds have steps (the KV cache, the budget, CP and TP sizes), mildest first.

Changes are combined: a kind costs more than all the cheaper kinds together, so the cheapest
combination that fits is found from every kind at its strongest step by dropping, the dearest
first, each kind the others do without, then easing each kept kind to its mildest step that still
fits (``_cheapest``). The next few do without one kind of a combination found. At most
``MAX_PLANS`` distinct plans are made (each is a bind and a plan, ~30 ms).
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
MAX_PLANS = 150


@dataclasses.dataclass(frozen=True)
class Fix:
    """``overrides`` (``dotted.key=value``, as ``empg train`` takes them) and the peak they plan."""

    label: str
    overrides: tuple[str, ...]
    peak_bytes: int

    def describe(self) -> str:
        return f"{self.label}: {' '.join(self.overrides)} -> {self.peak_bytes / 2**30:.1f} GiB"


Step = tuple[str, tuple[str, ...]]  # (label, overrides) of one step of a kind of change


def with_overrides(config: RunConfig, overrides: tuple[str, ...]) -> RunConfig:
    """``config`` with dotted overrides applied (as on the command line), validated."""
    new = from_dict(RunConfig, apply_overrides(to_dict(config), overrides, cls=RunConfig))
    new.model_config()
    return new


def _kinds(components) -> list[list[Step]]:
    """Each kind of change that applies to ``components``: its steps, mildest first; cheapest kind
    first."""
    config, model, layout = components.config, components.model, components.layout
    train, rollout, anchor = config.train, config.rollout, config.algorithm.anchor
    kinds: list[list[Step]] = []
    if not train.fused_output_loss:
        kinds.append([("logits one chunk at a time", ("train.fused_output_loss=true",))])
    if train.max_tokens_per_forward_microbatch is not None:
        kinds.append([("forward passes on the update's rows", ("train.max_tokens_per_forward_microbatch=null",))])
    if not rollout.sleep_while_training and not layout.engine_ranks:
        kinds.append([("the engine asleep while training", ("rollout.sleep_while_training=true",))])
    if rollout.engine == "vllm" and not layout.engine_ranks:
        lower = [u / 20 for u in range(int(rollout.gpu_memory_utilization * 20 - 1e-9), 1, -1)]  # 0.05 apart
        kinds.append([("a smaller KV cache", (f"rollout.gpu_memory_utilization={u:.2f}",)) for u in lower])
    if model.attention_backend == "unfused":
        kinds.append(
            [("the sdpa attention", (f"model_overrides={[*config.model_overrides, 'attention_backend=sdpa']}",))]
        )
    if layout.dp > 1 and not config.optimizer.use_distributed_optimizer:
        kinds.append([("the distributed optimizer", ("optimizer.use_distributed_optimizer=true",))])
    if components.stats.anchor and not anchor.master_on_cpu:
        kinds.append([("the anchor's master in host memory", ("algorithm.anchor.master_on_cpu=true",))])
    recompute = (
        [("selective recompute", ("train.recompute=selective",))] if model.attention_backend == "unfused" else []
    )
    if train.recompute != "full":
        kinds.append([*(recompute if train.recompute == "none" else []), ("full recompute", ("train.recompute=full",))])
    if train.max_tokens_per_microbatch is None and train.micro_batch_size > 1:
        kinds.append([("one sequence per micro-batch", ("train.micro_batch_size=1",))])
    budget = train.max_tokens_per_microbatch
    if budget is not None:
        step = 1024
        smaller = range((budget - 1) // step * step, train.max_seq_len - 1, -step)
        if smaller:
            kinds.append([(f"micro-batches of {n} tokens", (f"train.max_tokens_per_microbatch={n}",)) for n in smaller])
    cp = config.parallel.context_parallel_size
    if train.packing and model.attention_backend in ("sdpa", "te"):
        split = []
        for more in (2 * cp, 4 * cp):  # the same rows over more ranks: the per-rank budget shrinks
            overrides = [f"parallel.context_parallel_size={more}"]
            if budget is not None:
                overrides.append(f"train.max_tokens_per_microbatch={-(-budget * cp // more)}")
            split.append((f"context parallelism {more}", tuple(overrides)))
        kinds.append(split)
    tp = config.parallel.tensor_model_parallel_size
    # engines on their owners' GPUs are split as the training ranks are (trainer.bind.layout)
    engines_follow = not layout.engine_ranks and rollout.engines == "per_replica" and rollout.tensor_parallel_size == tp
    wider = [
        (
            f"tensor parallelism {more}",
            (f"parallel.tensor_model_parallel_size={more}",)
            + ((f"rollout.tensor_parallel_size={more}",) if engines_follow else ()),
        )
        for more in (2 * tp, 4 * tp)
        if more <= 8
    ]
    if wider:
        kinds.append(wider)
    return kinds


def cheapest_fixes(
    components,
    world_size: int,
    device_bytes: int,
    *,
    options: PlanOptions = PlanOptions(),
    bind: Callable,
    limit: int = 5,
) -> list[Fix]:
    """Up to ``limit`` combinations of changes that make ``components``' plan fit ``device_bytes``,
    cheapest first (module docstring), or []."""
    config = components.config
    kinds = _kinds(components)
    planned: dict[tuple[str, ...], MemoryPlan | None] = {}

    def plan(steps: dict[int, int]) -> MemoryPlan | None:
        overrides = _joined(kinds, steps)
        if overrides not in planned:
            if len(planned) == MAX_PLANS:
                raise _OutOfPlans
            planned[overrides] = _plan(config, overrides, world_size, device_bytes, options, bind)
        return planned[overrides]

    fixes: dict[tuple[int, ...], Fix] = {}
    try:
        for k, steps in enumerate(kinds):  # a step this run cannot take (TP 4 of 2 KV heads) is none
            while steps and plan({k: len(steps) - 1}) is None:
                steps.pop()
        todo: list[frozenset[int]] = [frozenset()]
        while todo and len(fixes) < limit:
            found = _cheapest(kinds, plan, forbidden=todo.pop(0))
            if found is None or tuple(sorted(found[0])) in fixes:
                continue
            steps, fitting = found
            label = " + ".join(kinds[k][steps[k]][0] for k in sorted(steps))
            fixes[tuple(sorted(steps))] = Fix(label, _joined(kinds, steps), fitting.peak.peak_bytes)
            # the next cheapest do without one of its kinds, the dearest first
            todo += [frozenset({k}) for k in sorted(steps, reverse=True)]
    except _OutOfPlans:
        log.info("memory fixes: stopped after %d plans", MAX_PLANS)
    return [fixes[combo] for combo in sorted(fixes, key=lambda combo: sum(2**k for k in combo))][:limit]


def _cheapest(kinds: list[list[Step]], plan: Callable, *, forbidden: frozenset[int]):
    """The cheapest combination of kinds (not ``forbidden``) that fits, each kind at its mildest step
    that does: (steps, plan), or None. Every kind at its strongest step first (each that keeps the
    plan possible); then, the dearest first, each kind the others do without is dropped; then each
    kind is eased. Assumes a change never adds memory, so a plan that does not fit stays so when
    a change is dropped or eased."""
    steps: dict[int, int] = {}
    for k in range(len(kinds)):
        if k not in forbidden and plan({**steps, k: len(kinds[k]) - 1}) is not None:
            steps[k] = len(kinds[k]) - 1
    fitting = plan(steps) if steps else None
    if fitting is None or not fitting.fits:
        return None
    for k in sorted(steps, reverse=True):
        rest = {c: s for c, s in steps.items() if c != k}
        trial = plan(rest) if rest else None
        if trial is not None and trial.fits:
            steps, fitting = rest, trial
    for k in sorted(steps):
        for milder in range(steps[k]):
            trial = plan({**steps, k: milder})
            if trial is not None and trial.fits:
                steps, fitting = {**steps, k: milder}, trial
                break
    return steps, fitting


class _OutOfPlans(Exception):
    """``MAX_PLANS`` plans were made."""


def _joined(kinds: list[list[Step]], steps: dict[int, int]) -> tuple[str, ...]:
    return tuple(o for k in sorted(steps) for o in kinds[k][steps[k]][1])


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
