"""The KL term of the update objective, bound once from ``algorithm.loss.kl`` and ``kl_args``.

    term = bind_kl("topk", {"direction": "reverse", "importance_weight": True})   # ArgumentError if bad
    term.stats(k=32)        # StatsPlan(old_topk=32, anchor_at_old_topk=True, anchor=True)
    ids = term.gather_ids(batch, lead_shape=..., vocab_size=V)   # [*, M + 1], the target last
    values = term(gathered, batch, weights=w)                     # [*] per-token KL surrogate

``KL_KINDS`` maps each user-facing name to its ``KLKind``: the math function whose keyword
arguments ``kl_args`` are, the inputs the update pass gives it, and what the old and anchor passes
compute for it (docs/algorithms.md "KL estimators" has the formulas):

    name                              kind            function                           passes
    k1 k2 k3 k3pp k4 k5               sampled         kl.sampled_kl(estimator=name)      anchor
    topk                              topk            topk_kl.topk_kl_from_logprobs      anchor, top-k
    rpg_fkl rpg_rkl rpg_ufkl ...      rpg_penalty     rpg.rpg_kl_penalty(divergence=)    anchor
    grpo_corrected                    grpo_corrected  rpg.corrected_grpo_kl              anchor

``bind_kl`` is the only place that reads the name; the update pass (``parallel.rl_loss``) and the
bind step (``trainer.bind.build``) only call the term.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from megatron_empg.core.checks import ArgumentError, check_choice, check_keywords
from megatron_empg.core.kl import KL_ESTIMATORS, sampled_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.rpg import RPG_KL_PENALTIES, corrected_grpo_kl
from megatron_empg.core.topk_kl import DIRECTIONS, topk_kl_from_gathered, topk_kl_from_logprobs, topk_kl_ids

# Keyword arguments the update pass gives every KL function itself: a kl_args that sets one is an error.
_KL_INPUTS = ("old_logprobs", "validate", "estimator")


@dataclasses.dataclass(frozen=True)
class StatsPlan:
    """What the forward-only passes compute besides log-probs at the targets (from the KL).

    ``old_topk``: k of the policy's top-k in the old pass (a reverse Top-k KL's index set), 0: none.
    ``anchor_topk``: k of the anchor's own top-k (a forward Top-k KL's index set), 0: none.
    ``anchor_at_old_topk``: the anchor pass also scores the old pass's top-k ids (reverse).
    ``anchor``: whether there is an anchor pass at all (a KL term).
    ``anchor_is_old``: the KL's anchor is each step's behaviour policy (RPG's iterative reference,
    ``AlgorithmConfig.anchor_is_behaviour_policy``), so the old pass's log-probs (and top-k
    log-probs) serve the KL: no anchor model, no anchor pass (``anchor`` False).
    """

    old_topk: int = 0
    anchor_topk: int = 0
    anchor_at_old_topk: bool = False
    anchor: bool = False
    anchor_is_old: bool = False


KLValues = Callable[["KLTerm", Tensor, MicroBatch, "Tensor | None", bool], Tensor]


@dataclasses.dataclass(frozen=True)
class KLKind:
    """One family of KL terms.

    Attributes:
        name: the family (``sampled``, ``topk``, ``rpg_penalty``, ``grpo_corrected``).
        fn: the math function; ``kl_args`` (less ``importance_weight``) are its keyword arguments.
        inputs: how many leading tensor arguments the update pass gives ``fn``.
        reserved: the keywords of ``fn`` the update pass sets itself.
        importance_weight: whether ``kl_args.importance_weight`` applies (weighting by
            sg(pi_theta / pi_old) for samples from pi_old).
        topk: the Top-k KL: an index set is gathered and scored, and ``direction`` is required.
        values: (term, gathered [*, M + 1], batch, behaviour weights [*] or None, validate) -> [*].
    """

    name: str
    fn: Callable[..., Any]
    inputs: int
    reserved: tuple[str, ...]
    importance_weight: bool
    values: KLValues
    topk: bool = False


@dataclasses.dataclass(frozen=True)
class KLTerm:
    """The KL term of a run, bound by ``bind_kl``.

    Attributes:
        name: the user-facing name (``algorithm.loss.kl``, a key of ``KL_KINDS``).
        kind: its ``KLKind``.
        args: the keyword arguments of ``kind.fn`` (``kl_args`` less ``importance_weight``).
        importance_weight: weight by s = sg(pi_theta / pi_old) (sampled estimators: the value;
            Top-k: the sampled tail), so that the expectation is under pi_old.
        direction: ``reverse`` or ``forward`` for the Top-k KL, else None.
    """

    name: str
    kind: KLKind
    args: Mapping[str, Any]
    importance_weight: bool = False
    direction: str | None = None

    def stats(self, k: int, *, anchor_is_behaviour_policy: bool = False) -> StatsPlan:
        """What the old and anchor passes compute for this term with a Top-k KL of ``k`` ids; with
        ``anchor_is_behaviour_policy`` the old pass serves as the anchor pass where it can."""
        reverse, forward = self.direction == "reverse", self.direction == "forward"
        plan = StatsPlan(
            old_topk=k if reverse else 0, anchor_topk=k if forward else 0, anchor_at_old_topk=reverse, anchor=True
        )
        if anchor_is_behaviour_policy and not plan.anchor_topk:
            # a forward Top-k KL needs the anchor's own top-k, which the old pass does not compute
            plan = dataclasses.replace(plan, anchor=False, anchor_is_old=True)
        return plan

    def gather_ids(self, batch: MicroBatch, *, lead_shape, vocab_size: int) -> Tensor:
        """[*, M + 1] int64: the ids whose policy log-probs the term needs, the target last (M = 0,
        or the K ids of the Top-k index set). Raises ValueError naming what ``batch`` lacks."""
        if self.kind.topk and (batch.topk_ids is None or batch.topk_anchor_logprobs is None):
            raise ValueError(f"kl={self.name!r} needs batch.topk_ids and batch.topk_anchor_logprobs")
        if batch.anchor_logprobs is None:
            raise ValueError(f"kl={self.name!r} needs batch.anchor_logprobs")
        if self.kind.topk:
            return topk_kl_ids(batch.topk_ids, batch.target_ids, lead_shape=lead_shape, vocab_size=vocab_size)
        return batch.target_ids.unsqueeze(-1)

    def __call__(self, gathered: Tensor, batch: MicroBatch, *, weights: Tensor | None, validate: bool = True) -> Tensor:
        """[*] per-token KL surrogate from ``gathered`` [*, M + 1] (log pi_theta at ``gather_ids``,
        carrying the gradient) and ``batch``'s old and anchor log-probs, multiplied by the
        behaviour weights ``weights`` [*] (or None) wherever it is an expectation over the sampled
        token (the Top-k KL: its tail only; its head is an exact sum)."""
        return self.kind.values(self, gathered, batch, weights, validate)

    def _old(self, batch: MicroBatch) -> Tensor | None:
        return batch.old_logprobs if self.importance_weight else None


def _weighted(values: Tensor, weights: Tensor | None) -> Tensor:
    return values if weights is None else values * weights


def _sampled(term: KLTerm, gathered: Tensor, batch: MicroBatch, weights: Tensor | None, validate: bool) -> Tensor:
    logprobs = gathered[..., -1]
    values = term.kind.fn(
        logprobs, batch.anchor_logprobs, old_logprobs=term._old(batch), validate=validate, **term.args
    )
    return _weighted(values, weights)


def _topk(term: KLTerm, gathered: Tensor, batch: MicroBatch, weights: Tensor | None, validate: bool) -> Tensor:
    return topk_kl_from_gathered(
        gathered,
        batch.topk_ids,
        batch.target_ids,
        batch.topk_anchor_logprobs,
        batch.anchor_logprobs,
        old_logprobs=term._old(batch),
        tail_weights=weights,
        validate=validate,
        **term.args,
    ).values


def _penalty(term: KLTerm, gathered: Tensor, batch: MicroBatch, weights: Tensor | None, validate: bool) -> Tensor:
    return _weighted(term.kind.fn(gathered[..., -1], batch.anchor_logprobs, validate=validate, **term.args), weights)


def _corrected(term: KLTerm, gathered: Tensor, batch: MicroBatch, weights: Tensor | None, validate: bool) -> Tensor:
    # its importance weight w_old = pi_theta / pi_old is part of the term
    values = term.kind.fn(gathered[..., -1], batch.old_logprobs, batch.anchor_logprobs, validate=validate, **term.args)
    return _weighted(values, weights)


KL_KINDS: dict[str, KLKind] = {
    **{
        name: KLKind("sampled", functools.partial(sampled_kl, estimator=name), 2, _KL_INPUTS, True, _sampled)
        for name in KL_ESTIMATORS
    },
    "topk": KLKind("topk", topk_kl_from_logprobs, 5, (*_KL_INPUTS, "tail_weights"), True, _topk, topk=True),
    **{
        name: KLKind("rpg_penalty", fn, 2, (*_KL_INPUTS, "divergence"), False, _penalty)
        for name, fn in RPG_KL_PENALTIES.items()
    },
    "grpo_corrected": KLKind("grpo_corrected", corrected_grpo_kl, 3, _KL_INPUTS, False, _corrected),
}


def bind_kl(name: str, kl_args: Mapping[str, Any] | None = None, *, check_args: bool = True) -> KLTerm:
    """The ``KLTerm`` of ``name`` (a key of ``KL_KINDS``) with ``kl_args``: ``importance_weight``
    (true or false, sampled and Top-k kinds only) and keyword arguments of the kind's function.

    Raises ValueError (``kl=...``) for an unknown name and ``ArgumentError`` naming the key of
    ``kl_args`` (``argument`` None: the dict as a whole) for bad arguments. ``check_args=False``
    leaves the keywords (and the Top-k direction) to the function itself, at its first call, as
    every argument's value is."""
    check_choice("kl", name, KL_KINDS)
    kind = KL_KINDS[name]
    args = dict(kl_args or {})
    importance_weight = args.pop("importance_weight", False)
    if not isinstance(importance_weight, bool):
        raise ArgumentError("importance_weight", "expected true or false")
    if importance_weight and not kind.importance_weight:
        raise ArgumentError(
            "importance_weight",
            f"does not apply to {name} (RPG's penalties are exact under pi_old; grpo_corrected carries its own weight)",
        )
    direction = args.get("direction") if kind.topk else None
    if not check_args:
        return KLTerm(name, kind, args, importance_weight, direction)
    check_keywords(kind.fn, args, kind.reserved, positional=kind.inputs)
    if kind.topk and direction not in DIRECTIONS:
        raise ArgumentError("direction", f"the Top-k KL needs reverse or forward, got {direction!r}")
    return KLTerm(name, kind, args, importance_weight, direction)
