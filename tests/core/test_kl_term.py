"""``core.kl_term``: binding a KL name and its arguments once, what the passes compute for it, and
the bound term's values against the math functions called directly (``core.kl``, ``core.topk_kl``,
``core.rpg``) on random log-probs, with and without behaviour weights."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.core.checks import ArgumentError
from megatron_empg.core.kl import KL_ESTIMATORS, sampled_kl
from megatron_empg.core.kl_term import KL_KINDS, StatsPlan, bind_kl
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.rpg import DIVERGENCES, corrected_grpo_kl, rpg_kl_penalty
from megatron_empg.core.topk_kl import topk_kl_from_logprobs

B, S, K, V = 2, 5, 3, 11


def test_every_user_facing_name_has_a_kind():
    assert set(KL_KINDS) == {*KL_ESTIMATORS, "topk", *(f"rpg_{d}" for d in DIVERGENCES), "grpo_corrected"}
    assert {KL_KINDS[name].name for name in KL_ESTIMATORS} == {"sampled"}
    assert KL_KINDS["topk"].topk and not any(kind.topk for name, kind in KL_KINDS.items() if name != "topk")


def test_bind_records_kind_direction_weighting_and_arguments():
    term = bind_kl("topk", {"direction": "forward", "tail": False, "importance_weight": True})
    assert (term.name, term.kind.name, term.direction, term.importance_weight) == ("topk", "topk", "forward", True)
    assert term.args == {"direction": "forward", "tail": False}
    term = bind_kl("rpg_urkl", {"max_abs_value": 20})
    assert (term.kind.name, term.direction, term.importance_weight, term.args) == (
        "rpg_penalty",
        None,
        False,
        {"max_abs_value": 20},
    )


def test_what_the_passes_compute_for_each_kind():
    reverse = bind_kl("topk", {"direction": "reverse"})
    forward = bind_kl("topk", {"direction": "forward"})
    assert reverse.stats(8) == StatsPlan(old_topk=8, anchor_at_old_topk=True, anchor=True)
    assert forward.stats(8) == StatsPlan(anchor_topk=8, anchor=True)
    for name in ("k3", "rpg_fkl", "grpo_corrected"):
        assert bind_kl(name).stats(8) == StatsPlan(anchor=True)
        assert bind_kl(name).stats(8, anchor_is_behaviour_policy=True) == StatsPlan(anchor_is_old=True)
    # the old pass's top-k serves a reverse Top-k KL's anchor; a forward one needs the anchor's own
    assert reverse.stats(8, anchor_is_behaviour_policy=True) == StatsPlan(
        old_topk=8, anchor_at_old_topk=True, anchor_is_old=True
    )
    assert forward.stats(8, anchor_is_behaviour_policy=True) == StatsPlan(anchor_topk=8, anchor=True)


@pytest.mark.parametrize(
    "name, kl_args, argument, reason",
    [
        ("topk", {"direction": "reverse", "importance_weight": 1}, "importance_weight", "expected true or false"),
        ("rpg_urkl", {"importance_weight": True}, "importance_weight", "does not apply to rpg_urkl"),
        ("grpo_corrected", {"importance_weight": True}, "importance_weight", "does not apply to grpo_corrected"),
        ("rpg_rkl", {"divergence": "fkl"}, "divergence", "is set by the trainer"),
        ("k3", {"estimator": "k1"}, "estimator", "is set by the trainer"),
        ("topk", {"direction": "reverse", "tail_weights": 1.0}, "tail_weights", "is set by the trainer"),
        ("k3", {"tail": True}, None, "unexpected keyword argument 'tail'; expected arguments of sampled_kl: iw_clip"),
        ("rpg_fkl", {"tail": True}, None, "expected arguments of rpg_kl_penalty: max_abs_value"),
        ("topk", {}, None, "missing a required argument: 'direction'"),
        ("topk", {"direction": "sideways"}, "direction", "the Top-k KL needs reverse or forward, got 'sideways'"),
    ],
)
def test_bad_arguments_name_the_key(name, kl_args, argument, reason):
    with pytest.raises(ArgumentError) as error:
        bind_kl(name, kl_args)
    assert error.value.argument == argument and reason in error.value.reason, error.value


def test_an_unknown_name_and_unchecked_arguments():
    with pytest.raises(ValueError, match=r"^kl='k7' is not one of"):
        bind_kl("k7")
    term = bind_kl("topk", {"tail": False}, check_args=False)  # the function checks them at the call
    assert term.direction is None and term.args == {"tail": False}


def _batch(generator: torch.Generator) -> tuple[MicroBatch, torch.Tensor]:
    """A micro-batch with every statistic a KL reads, and the policy's log-probs [B, S, V]."""
    logp = torch.log_softmax(torch.randn(B, S, V, generator=generator), -1)
    anchor = torch.log_softmax(torch.randn(B, S, V, generator=generator), -1)
    targets = torch.randint(0, V, (B, S), generator=generator)
    topk_ids = torch.randperm(V, generator=generator)[:K].expand(B, S, K).clone()
    batch = MicroBatch(
        targets,
        targets,
        old_logprobs=logp.gather(-1, targets[..., None])[..., 0] + 0.2 * torch.randn(B, S, generator=generator),
        anchor_logprobs=anchor.gather(-1, targets[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_anchor_logprobs=anchor.gather(-1, topk_ids),
    )
    return batch, logp


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(
    "name, kl_args",
    [
        ("k3", {}),
        ("k3pp", {"importance_weight": True, "iw_clip": (0.5, 2.0)}),
        ("topk", {"direction": "reverse", "importance_weight": True}),
        ("topk", {"direction": "forward", "tail_grad": "reference"}),
        ("rpg_ujs", {"max_abs_value": None}),
        ("grpo_corrected", {}),
    ],
)
def test_the_terms_values_are_the_math_functions(name, kl_args, weighted):
    g = torch.Generator().manual_seed(3)
    batch, logp = _batch(g)
    weights = torch.rand(B, S, generator=g) + 0.5 if weighted else None
    term = bind_kl(name, kl_args)
    ids = term.gather_ids(batch, lead_shape=torch.Size((B, S)), vocab_size=V)
    assert ids.shape == (B, S, K + 1 if term.kind.topk else 1) and torch.equal(ids[..., -1], batch.target_ids)
    values = term(logp.gather(-1, ids), batch, weights=weights)

    y = logp.gather(-1, batch.target_ids[..., None])[..., 0]
    w = 1.0 if weights is None else weights
    args = {key: value for key, value in kl_args.items() if key != "importance_weight"}
    old = batch.old_logprobs if kl_args.get("importance_weight") else None
    if name == "topk":
        in_head = (batch.topk_ids == batch.target_ids[..., None]).any(-1)
        head = logp.gather(-1, batch.topk_ids)
        expected = topk_kl_from_logprobs(
            head, batch.topk_anchor_logprobs, y, batch.anchor_logprobs, in_head, old_logprobs=old, **args
        )
        expected = expected.head + w * (expected.values - expected.head)  # the weights reach the tail only
    elif name == "grpo_corrected":
        expected = w * corrected_grpo_kl(y, batch.old_logprobs, batch.anchor_logprobs)
    elif name == "rpg_ujs":
        expected = w * rpg_kl_penalty(y, batch.anchor_logprobs, divergence="ujs", **args)
    else:
        expected = w * sampled_kl(y, batch.anchor_logprobs, estimator=name, old_logprobs=old, **args)
    torch.testing.assert_close(values, expected, rtol=1e-6, atol=1e-6)


def test_a_term_names_what_the_batch_lacks():
    g = torch.Generator().manual_seed(0)
    batch, _ = _batch(g)
    batch.topk_anchor_logprobs = None
    with pytest.raises(ValueError, match=r"^kl='topk' needs batch.topk_ids and batch.topk_anchor_logprobs"):
        bind_kl("topk", {"direction": "reverse"}).gather_ids(batch, lead_shape=batch.shape, vocab_size=V)
    batch.anchor_logprobs = None
    with pytest.raises(ValueError, match=r"^kl='k1' needs batch.anchor_logprobs"):
        bind_kl("k1").gather_ids(batch, lead_shape=batch.shape, vocab_size=V)
