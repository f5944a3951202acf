"""``empg train`` on the CPU demo (its warm start; the transformers engine, so no vLLM start-up):
packed rows in token-budget micro-batches train exactly as padded rows over 3 steps; the forward
passes on rows of three update rows (``train.max_tokens_per_forward_microbatch``) train as on the
update rows, to the parameters; and on two data-parallel ranks sharing one engine, balancing the
samples between the replicas changes which replica trains on what, never the result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.dist import run_distributed
from tests.trainer.demo_runs import CLOSE_ABS, CLOSE_REL, demo_config, run_train

pytestmark = [pytest.mark.process]  # starts processes: not in make test-fast

# Per step: every metric of the update (losses, KL, entropy, grad norm) and of the rollouts (the
# same samples, as the synced weights agree to rounding).
COMPARED = (
    "actor/loss",
    "actor/policy_loss",
    "actor/kl",
    "actor/entropy",
    "actor/grad_norm",
    "reward/mean",
    "response/length_mean",
)


def _config(tmp_path, name, warm_start, **train) -> dict:
    config = demo_config(tmp_path, name, warm_start, steps=3)
    config["rollout"]["engine"] = "hf"
    config["train"].update(train)
    return config


def _metrics(config, tmp_path, name, *overrides, nproc=None) -> list[dict]:
    out = run_train(config, tmp_path, name, *overrides, nproc=nproc, timeout=400)
    assert out.returncode == 0, out.stderr[-4000:]
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    return records


def _assert_same_training(a: list[dict], b: list[dict]) -> None:
    for step, (x, y) in enumerate(zip(a, b), start=1):
        for key in COMPARED:
            assert y[key] == pytest.approx(x[key], rel=CLOSE_REL, abs=CLOSE_ABS), (step, key)


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory, warm_start) -> Path:
    """3 demo steps in packed rows of at most 160 tokens: the run's directory (metrics, checkpoints)."""
    tmp = tmp_path_factory.mktemp("packed")
    _metrics(_config(tmp, "packed", warm_start, packing=True, max_tokens_per_microbatch=160), tmp, "packed")
    return tmp / "packed"


@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_packing_on_equals_packing_off_over_three_steps(tmp_path, warm_start, packed_run):
    padded = _metrics(_config(tmp_path, "padded", warm_start, packing=False), tmp_path, "padded")
    packed = read_metrics(packed_run / "metrics.jsonl")
    _assert_same_training(padded, packed)
    for x, y in zip(padded, packed):
        # 128 samples of 7-19 tokens: padded to the micro-batch's longest (a multiple of 8), packed
        # to a multiple of 8 per row of ~160 tokens
        assert y["batch/padding_fraction"] < 0.1 < x["batch/padding_fraction"]
        assert y["batch/micro_batches_mean"] > x["batch/micro_batches_mean"] == 2  # 128 / 64; 160-token rows
        # the engine (transformers, fp32) and the old pass agree on every sampled token's log-prob
        assert x["batch/sampler_logprob_gap"] < 1e-4 and y["batch/sampler_logprob_gap"] < 1e-4


def _parameters(rank: int, world_size: int, checkpoint: str) -> dict[str, torch.Tensor]:
    """The model tensors of a training checkpoint (``mcore.convert.ModelCheckpointReader``)."""
    from megatron_empg.mcore.convert import ModelCheckpointReader, megatron_session

    with megatron_session():
        reader = ModelCheckpointReader(checkpoint)
        return {name: reader.read(name) for name in reader.names}


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_forward_rows_of_three_update_rows_train_as_the_update_rows(tmp_path, warm_start, packed_run):
    """The old pass (log-probs, the policy's top-8) and the anchor pass (log-probs at those ids) on
    rows of up to 480 tokens: the same losses, KL, grad norms and samples at every step, and the
    same parameters after the 3 steps."""
    config = _config(
        tmp_path,
        "forward",
        warm_start,
        packing=True,
        max_tokens_per_microbatch=160,
        max_tokens_per_forward_microbatch=480,
    )
    forward = _metrics(config, tmp_path, "forward")
    packed = read_metrics(packed_run / "metrics.jsonl")
    _assert_same_training(packed, forward)
    assert [r["rollout/digest"] for r in forward] == [r["rollout/digest"] for r in packed]
    for ours, theirs in zip(forward, packed):  # ~12 update rows of ~160 tokens: ~4 forward rows of 3
        assert ours["batch/micro_batches_mean"] == theirs["batch/micro_batches_mean"] > 6
        assert theirs["batch/forward_micro_batches_mean"] == theirs["batch/micro_batches_mean"]
        assert ours["batch/forward_micro_batches_mean"] <= ours["batch/micro_batches_mean"] / 2
    ours, reference = (
        run_distributed(_parameters, 1, str(run / "checkpoints" / "step_00000003"))[0]
        for run in (tmp_path / "forward", packed_run)
    )
    _assert_same_parameters(ours, reference, [r["actor/lr"] for r in packed])


def _assert_same_parameters(ours: dict, reference: dict, lrs: list[float]) -> None:
    """Two runs' checkpointed weights after the same Adam steps from the same warm start, where the
    runs' gradients differed by rounding: no gradients are recorded here, so each element within the
    most that Adam's updates at ``lrs`` can put between two runs, 2 lr_t R_t per step
    (``tests.adam_bound``; ~1e-4 at the demo's warmup LRs). That finds a wrong, stale or mixed-up
    tensor (the weights are ~1e-2); the update's fine detail per layout is what the Megatron-level
    tests check within the tight bound (test_packing, test_cp_training)."""
    from tests.adam_bound import adam_step_bound, rounding_slack

    reach = 2 * sum(adam_step_bound(lr, step) for step, lr in enumerate(lrs, start=1))
    assert ours.keys() == reference.keys() and len(reference) > 5
    weights = torch.cat([t.double().flatten() for t in reference.values()])
    assert 0 < reach < 1e-2 * float(weights.square().mean().sqrt())  # far below the weights' size
    for name, tensor in reference.items():
        slack = rounding_slack(tensor, lrs)
        excess = (ours[name].double() - tensor.double()).abs() - reach - slack
        assert float(excess.max()) <= 0, f"{name}: {float(excess.max()):.3g} past Adam's reach {reach:.3g}"


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_balancing_two_replicas_of_one_engine_leaves_training_unchanged(tmp_path, warm_start):
    runs = {}
    for balance in (False, True):
        name = f"balance_{balance}"
        config = _config(tmp_path, name, warm_start, balance=balance, max_tokens_per_microbatch=160)
        config["rollout"]["engines"] = "single"  # both replicas' samples on both ranks
        # the transformers engine lives in rank 0's process (the launcher's CPU default is vLLM's)
        runs[balance] = _metrics(
            config, tmp_path, name, "rollout.in_process=true", "weight_sync.transport=in_process", nproc=2
        )
    _assert_same_training(runs[False], runs[True])
    imbalance = [(k["batch/replica_imbalance"], b["batch/replica_imbalance"]) for k, b in zip(runs[False], runs[True])]
    assert all(balanced <= kept for kept, balanced in imbalance) and any(b < k for k, b in imbalance), imbalance
    assert all(balanced < 1.01 for _, balanced in imbalance), imbalance


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.timeout(600)
def test_context_parallel_two_ranks_train_as_one(tmp_path, warm_start, packed_run):
    """``parallel.context_parallel_size: 2`` on a world of 2: every row split over both ranks
    (sequences padded to a multiple of 4, 80 tokens per rank: the same 160-token rows), the
    engine on rank 0 synced from CP rank 0, the consistency gate scoring split rows: the same
    samples, losses, KL and grad norms at every step, and the same parameters after the 3 steps
    as the one-process run."""
    config = _config(tmp_path, "cp2", warm_start, packing=True, max_tokens_per_microbatch=80)
    config["parallel"] = {"context_parallel_size": 2}
    cp2 = _metrics(config, tmp_path, "cp2", "rollout.in_process=true", "weight_sync.transport=in_process", nproc=2)
    packed = read_metrics(packed_run / "metrics.jsonl")
    _assert_same_training(packed, cp2)
    assert [r["rollout/digest"] for r in cp2] == [r["rollout/digest"] for r in packed]
    assert all(r["sync/gate_max_logprob_diff"] < 1e-3 for r in cp2)
    ours, reference = (
        run_distributed(_parameters, 1, str(run / "checkpoints" / "step_00000003"))[0]
        for run in (tmp_path / "cp2", packed_run)
    )
    _assert_same_parameters(ours, reference, [r["actor/lr"] for r in packed])
