"""RPG's iterative reference (anchor tau 0 once per step): the anchor is each step's behaviour
policy, so the trainer keeps no anchor model and reuses the old pass's log-probs for the KL. On
the CPU demo (its warm start, the transformers engine) that trains exactly as a real anchor that
is reset (to rounding) every step: tau 1e-9, which takes the anchor-model path."""

from __future__ import annotations

import pytest

from megatron_empg.config import RunConfig, load_config
from megatron_empg.trainer.bind.build import bind
from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import CLOSE_ABS, CLOSE_REL, DEMO_RECIPE, demo_config, run_train

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast

COMPARED = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/mean")


def test_bind_plans_no_anchor_pass_for_the_iterative_reference():
    def plan(*overrides):
        return bind(load_config(RunConfig, DEMO_RECIPE, list(overrides)), 1, check_paths=False).stats

    reset = plan("algorithm.anchor.tau=0.0", "algorithm.anchor.period=1")
    assert (reset.anchor, reset.anchor_is_old, reset.old_topk) == (False, True, 8)  # reverse Top-k: old top-k reused
    assert plan(
        "algorithm.anchor.tau=0.0", "algorithm.anchor.period=1", "algorithm.loss.kl=k3", "algorithm.loss.kl_args={}"
    ).anchor_is_old
    # not the behaviour policy: reset mid-step, an EMA, a later first update; a forward Top-k KL
    # needs the anchor's own top-k
    for overrides in (
        ("algorithm.anchor.tau=0.0", "algorithm.anchor.period=1", "algorithm.mini_batches=2"),
        ("algorithm.anchor.tau=0.5", "algorithm.anchor.period=1"),
        (),
        ("algorithm.anchor.tau=0.0", "algorithm.anchor.period=1", "algorithm.anchor.first_update=3"),
        ("algorithm.anchor.tau=0.0", "algorithm.anchor.period=1", "algorithm.loss.kl_args.direction=forward"),
    ):
        stats = plan(*overrides)
        assert stats.anchor and not stats.anchor_is_old, overrides


@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_reusing_the_old_pass_equals_an_anchor_reset_every_step(tmp_path, warm_start):
    """The demo's reverse Top-k KL: the old pass's log-probs at the targets and at its top-k ids
    both stand in for the anchor's (a K3 or RPG KL reads only the former)."""
    runs = {}
    for name, tau in (("reused", "0.0"), ("anchor", "1e-9")):
        config = demo_config(tmp_path, name, warm_start, steps=3)
        config["rollout"]["engine"] = "hf"
        # two optimizer steps per step: the second one's KL to pi_old (and its gradient) is not 0
        config["algorithm"].update(mini_batches=2)
        config["algorithm"]["anchor"].update(tau=float(tau), period=2)
        config["algorithm"]["loss"]["kl_coef"] = 0.2  # a KL term that moves the update
        out = run_train(config, tmp_path, name, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        assert ("no anchor model is kept" in out.stderr) == (name == "reused")
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    for step, (a, b) in enumerate(zip(runs["anchor"], runs["reused"]), start=1):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=CLOSE_REL, abs=CLOSE_ABS), (step, key)
    # the KL term is exercised: 0 at each step's first update (w = 1), not at its second
    assert all(abs(r["actor/kl"]) > 1e-7 for r in runs["reused"]), [r["actor/kl"] for r in runs["reused"]]
