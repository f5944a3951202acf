"""On-policy distillation on the CPU demo (its warm start, the transformers engine): a teacher equal
to the student (the warm start itself, float32 as the policy) trains as plain RL at the first step
(zero distillation KL, every top-1 agreeing, the same loss and gradient norm), its KL grows as the
student leaves it (the teacher never moves), and a run stopped and resumed (the teacher reloaded
from its checkpoint, not saved) equals the uninterrupted one."""

from __future__ import annotations

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import CLOSE_ABS, CLOSE_REL, demo_config, run_train

pytestmark = [pytest.mark.process, pytest.mark.megatron]

COMPARED = ("actor/loss", "actor/policy_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "reward/mean")
DISTILL = ("distill/kl", "distill/loss", "distill/teacher_topk_mass", "distill/top1_agreement")


def _config(tmp_path, name, warm_start, *, steps: int, teacher: bool) -> dict:
    config = demo_config(tmp_path, name, warm_start, steps=steps)
    config["rollout"]["engine"] = "hf"
    config["optimizer"]["lr"] = 1e-3  # the student leaves the teacher within 2 steps
    if teacher:
        spec = {"model": "demo-qwen2", "checkpoint": str(warm_start), "dtype": "float32"}
        config["algorithm"]["distill"] = {"teacher": spec, "loss": "k1", "coef": 1.0}
    return config


@pytest.mark.timeout(600)
def test_a_teacher_equal_to_the_student_trains_as_plain_rl_at_first_and_resumes(tmp_path, warm_start):
    runs = {}
    for name in ("plain", "teacher"):
        out = run_train(_config(tmp_path, name, warm_start, steps=2, teacher=name == "teacher"), tmp_path, name)
        assert out.returncode == 0, out.stderr[-4000:]
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    plain, taught = runs["plain"][0], runs["teacher"][0]
    for key in COMPARED:
        assert taught[key] == pytest.approx(plain[key], rel=CLOSE_REL, abs=CLOSE_ABS), key
    assert abs(taught["distill/kl"]) < 1e-6 and taught["distill/top1_agreement"] == 1.0
    assert 0 < taught["distill/teacher_topk_mass"] <= 1.0 + 1e-6
    # negative control: the student has moved by step 2, the teacher has not
    last = runs["teacher"][-1]
    assert last["distill/kl"] > 1e-5 and last["actor/loss"] != runs["plain"][-1]["actor/loss"]

    first = run_train(_config(tmp_path, "resumed", warm_start, steps=1, teacher=True), tmp_path, "first")
    assert first.returncode == 0, first.stderr[-4000:]
    second = run_train(_config(tmp_path, "resumed", warm_start, steps=2, teacher=True), tmp_path, "second", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stderr
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2]
    for key in COMPARED + DISTILL:
        assert resumed[1][key] == pytest.approx(last[key], rel=CLOSE_REL, abs=CLOSE_ABS), key


@pytest.mark.timeout(600)
def test_an_engine_teacher_equal_to_the_student_scores_zero_kl_then_parts(tmp_path, warm_start):
    """``placement: engine``: the transformers engine beside the rollout engine scores the samples
    (its top-k prompt log-probs travel with them); at step 1 the teacher is the student (the HF
    warm start the policy starts from), so the distillation KL is 0 up to the two float32
    implementations' rounding and every top-1 agrees; at step 2 the student has moved."""
    config = _config(tmp_path, "engine", warm_start, steps=2, teacher=True)
    config["algorithm"]["distill"]["placement"] = "engine"
    out = run_train(config, tmp_path, "engine")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "distillation teacher engine" in out.stderr
    first, last = read_metrics(tmp_path / "engine" / "metrics.jsonl")
    assert abs(first["distill/kl"]) < 1e-5 and first["distill/top1_agreement"] == 1.0
    assert 0 < first["distill/teacher_topk_mass"] <= 1.0 + 1e-6 and first["engines/teacher_seconds_max"] > 0
    assert last["distill/kl"] > 1e-5  # negative control: the student left the teacher
