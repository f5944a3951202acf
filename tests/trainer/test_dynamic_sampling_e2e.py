"""``empg train`` with DAPO's dynamic sampling on the CPU demo (its warm start; the transformers
engine): steps draw more than one generation batch, and a run stopped after two steps and
resumed trains its third step exactly as the uninterrupted run (the data cursor, which runs ahead
of the step counter, is checkpointed)."""

from __future__ import annotations

import pytest

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.trainer.demo_runs import demo_config, run_train

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast

COMPARED = (
    "actor/loss",
    "actor/policy_loss",
    "actor/kl",
    "actor/grad_norm",
    "reward/mean",
    "reward/accuracy",
    "dynamic_sampling/gen_batches",
    "dynamic_sampling/informative_fraction",
)


def _config(tmp_path, name, warm_start, steps):
    config = demo_config(tmp_path, name, warm_start, steps=steps)
    config["rollout"]["engine"] = "hf"
    # 4 prompts x 8 per step, drawn 4 at a time: the tests' short warm start answers a few percent
    # right, so most groups are all wrong, steps draw several batches and some reach the cap
    config["train"]["prompts_per_step"] = 4
    config["train"]["micro_batch_size"] = 32
    config["algorithm"]["dynamic_sampling"] = {"metric": "acc", "max_num_gen_batches": 4}
    return config


@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_dynamic_sampling_resumes_where_the_data_cursor_stopped(tmp_path, warm_start):
    full = run_train(_config(tmp_path, "full", warm_start, steps=3), tmp_path, "full", timeout=300)
    assert full.returncode == 0, full.stderr[-4000:]
    first = run_train(_config(tmp_path, "resumed", warm_start, steps=2), tmp_path, "first", timeout=300)
    assert first.returncode == 0, first.stderr[-4000:]
    second = run_train(_config(tmp_path, "resumed", warm_start, steps=3), tmp_path, "second", "--resume", timeout=300)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "at step 2" in second.stderr

    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    batches = [r["dynamic_sampling/gen_batches"] for r in records]
    assert all(b >= 1 for b in batches) and sum(batches) > 3, batches  # the cursor ran ahead of the steps
    for r in records:
        # dropped groups fill the batch only once the cap is reached
        assert r["dynamic_sampling/filled_groups"] == 0 or r["dynamic_sampling/gen_batches"] == 4
        informative = r["dynamic_sampling/informative_fraction"] * 4 * r["dynamic_sampling/gen_batches"]
        assert informative == pytest.approx(round(informative))  # a count of groups
        assert min(round(informative), 4) + r["dynamic_sampling/filled_groups"] == 4  # the step's 4 groups
        assert 0 < r["reward/accuracy"] < 0.5
        # what was drawn: every batch's samples, 32 per batch
        assert r["engines/samples_max"] == 32 * r["dynamic_sampling/gen_batches"]
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in COMPARED:
        assert resumed[2][key] == pytest.approx(records[2][key], rel=1e-5, abs=1e-7), key
