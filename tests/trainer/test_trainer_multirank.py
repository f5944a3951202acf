"""The RL loop on two gloo ranks (``launchers/torchrun.sh``, NPROC_PER_NODE=2) at TP2, PP2 and DP2,
against the same run in one process.

Three steps of the demo recipe (EMA-PG, reverse Top-k KL) from a short warm start, 4 prompts x 4
samples per step. The vLLM engines run in their own processes (the launcher's CPU defaults:
``rollout.in_process=false``, ``weight_sync.transport=shm_file``): at DP2 two of them
(``rollout.engines=2``, one per replica, each synced from its own rank and each sampling its
replica's 2 prompts) or one on a third rank of its own for both (``rollout.placement=disaggregated``,
weights over the link); at TP2 and PP2 one (a single replica). (One colocated engine for two
replicas, ``rollout.engines=single``, trains in ``test_packing_e2e.py``'s balancing test.)
The reference is one process with an in-process engine fed by reference, so the runs share no
transport code. Seeds follow the global prompt index and the weights are equal up to fp32
rounding, so the rollouts are identical (the same ``rollout/digest`` of their tokens) and the
per-step metrics must agree: the rollout statistics exactly, the training statistics to fp32 rounding. Also checked: one metrics record per
step (rank 0 writes them), the consistency gate after every sync on every engine (each serves the
weights gathered from both TP shards or both pipeline stages: same byte count as the single
process), the engines' sample counts, and checkpoints recording the layout. (A run of 2 ranks with
two engines, pre-empted and resumed through Slurm, is checked against the same reference in
``tests/launchers/test_slurm.py``.)
"""

from __future__ import annotations

import pytest

from megatron_empg.mcore.checkpoint import read_checkpoint_info
from megatron_empg.trainer.run.metrics_log import read_metrics
from tests.dist import run_distributed
from tests.trainer.demo_runs import (
    LAUNCH_TIMEOUT_S,
    assert_same_steps,
    run_train,
    small_demo_config,
)

STEPS = 3
GATE_TOLERANCE = 1e-4  # the recipe's weight_sync.gate_tolerance (fp32)

LAYOUTS = {  # command-line overrides, the layout the checkpoints must record, and the engines
    "tp2": (["parallel.tensor_model_parallel_size=2"], {"tp": 2, "pp": 1, "dp": 1}, 1),
    "pp2": (["parallel.pipeline_model_parallel_size=2"], {"tp": 1, "pp": 2, "dp": 1}, 1),
    "dp2-engines2": (["rollout.engines=2"], {"tp": 1, "pp": 1, "dp": 2}, 2),
    # two training ranks and an engine rank of its own (3 processes): the engine draws for both
    "dp2-disaggregated": (
        ["rollout.placement=disaggregated", "rollout.engine_ranks=1"],
        {"tp": 1, "pp": 1, "dp": 2},
        1,
    ),
}


@pytest.mark.dist
@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_process(layout, small_demo_reference, tmp_path, warm_start):
    overrides, expected_layout, engines = LAYOUTS[layout]
    root = tmp_path / layout / "checkpoints"
    nproc = 3 if "rollout.engine_ranks=1" in overrides else 2
    done = run_train(
        small_demo_config(tmp_path, layout, warm_start, STEPS),
        tmp_path,
        layout,
        *overrides,
        nproc=nproc,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert sorted(p.name for p in root.glob("step_*")) == [f"step_{s:08d}" for s in range(1, STEPS + 1)]

    metrics = read_metrics(tmp_path / layout / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # one record per step (rank 0 writes them)
    # with one engine rank 0 holds every sample: the same tokens as the reference
    assert_same_steps(metrics, small_demo_reference, same_tokens=engines == 1)
    for ours in metrics:
        step = ours["step"]
        assert 0.0 <= ours["sync/gate_max_logprob_diff"] <= GATE_TOLERANCE, step
        # each engine samples its replicas' prompts: 16 samples per step in all
        assert (ours["engines/count"], ours["engines/samples_min"], ours["engines/samples_max"]) == (
            engines,
            16 / engines,
            16 / engines,
        ), step
        assert (
            ours["engines/tokens_min"] * engines
            <= ours["response/length_mean"] * 16
            <= ours["engines/tokens_max"] * engines
        )

    info = read_checkpoint_info(root / f"step_{STEPS:08d}")
    assert {k: info["layout"][k] for k in expected_layout} == expected_layout and info["layout"]["world_size"] == 2
    assert info["parts"]["optimizer"] == "saved" and info["parts"]["anchor"] and info["parts"]["hf_assets"]


def _signalled(rank: int, world_size: int, received: list) -> list:
    import torch.distributed as dist

    from megatron_empg.trainer.run.signals import any_rank_signalled

    return [any_rank_signalled(r[rank], dist.group.WORLD) for r in received]


@pytest.mark.dist
def test_a_signal_on_some_ranks_stops_every_rank():
    """SIGTERM (15) / SIGUSR1 (10) seen by one rank only, or different ones on each: every rank
    takes the same decision (the largest number), so all of them checkpoint and stop together."""
    received = [(None, None), (15, None), (None, 10), (10, 15)]  # per case: rank 0's, rank 1's
    expected = [None, 15, 10, 15]
    assert run_distributed(_signalled, 2, received, timeout=120) == [expected, expected]
