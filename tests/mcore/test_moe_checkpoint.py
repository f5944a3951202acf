"""Checkpoints of a mixture of experts change the expert-parallel size: saved at EP 2 (world 2:
each rank 4 of tiny-qwen3-moe's 8 experts, under global names in the checkpoint), loaded at EP 1
(world 1), the model, the Adam state and the EMA anchor's float32 master are those saved.

The run is test_checkpoint's (``_Run``: the RL step of test_train_step, the aux loss on, then the
anchor's EMA update, tau 0.5), two steps, then a save; with the plain optimizer and with the
distributed one (fully_reshardable; at EP 2 its dense state and anchor master are sharded over
DP 2, the experts' over expert-DP 1: ``mcore.anchor`` mirrors the expert buffers). The optimizer
state is compared by parameter name (the distributed one range by range). The experts are
``SequentialMLP``'s (one parameter per expert, so its optimizer state has per-expert names);
``GroupedExperts``' checkpoints at another EP size and implementation: test_grouped_experts.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_empg.mcore.checkpoint import TrainState
from tests.dist import run_distributed
from tests.mcore.test_checkpoint import _errors, _Run

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen3-moe"
SEQUENTIAL = ("moe_experts=sequential",)
STEPS = 2


def _named_optimizer_state(run: _Run) -> dict[str, dict[str, torch.Tensor]]:
    """Global parameter name -> its Adam state (exp_avg, exp_avg_sq) of a non-distributed optimizer,
    whose torch optimizers hold the model parameters themselves (fp32)."""
    from megatron_empg.mcore import weights as mcore_weights

    name_of = {}
    for chunk in run.chunks:
        names = mcore_weights.global_names(chunk)
        name_of.update({id(p): names[n] for n, p in chunk.named_parameters()})
    out = {}
    for sub in getattr(run.optimizer, "chained_optimizers", [run.optimizer]):
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                state = sub.optimizer.state[p]
                out[name_of[id(p)]] = {k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")}
    return out


def _distributed_optimizer_pieces(run: _Run) -> dict[str, list[tuple[int, int, dict[str, torch.Tensor]]]]:
    """Global parameter name -> this rank's [start, end) ranges of the flattened parameter in the
    distributed optimizer and their Adam state (one range per rank that owns part of it)."""
    from megatron_empg.mcore import weights as mcore_weights

    name_of = {}
    for chunk in run.chunks:
        names = mcore_weights.global_names(chunk)
        name_of.update({id(p): names[n] for n, p in chunk.named_parameters()})
    out: dict = {}
    for sub in run.optimizer.chained_optimizers:
        for model_group, shard_group in zip(sub.model_fp32_groups, sub.shard_fp32_groups, strict=True):
            for param, main in zip(model_group, shard_group, strict=True):
                r = sub._get_model_param_range_map(param)["param"]
                state = sub.optimizer.state[main]
                out.setdefault(name_of[id(param)], []).append(
                    (r.start, r.end, {k: state[k].clone() for k in ("exp_avg", "exp_avg_sq")})
                )
    return out


def _snapshot(run: _Run, distopt: bool) -> dict:
    out = run.snapshot()
    out["named_optim"] = _distributed_optimizer_pieces(run) if distopt else _named_optimizer_state(run)
    out["chained"] = len(getattr(run.optimizer, "chained_optimizers", [run.optimizer]))
    return out


def _save(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for distopt in (False, True):
        run = _Run(1, distopt, model=MODEL, model_overrides=SEQUENTIAL, expert_model_parallel_size=2)
        try:
            for _ in range(STEPS):
                run.step()
            run.save(os.path.join(root, f"distopt_{distopt}"))
            if distopt:  # the format whose flat per-DP-rank buffers depend on the expert grid
                run.save(os.path.join(root, "dp_reshardable"), optimizer_format="dp_reshardable")
            out[distopt] = _snapshot(run, distopt)
        finally:
            run.close()
    return out


def _load(rank: int, world_size: int, root: str) -> dict:
    from megatron_empg.mcore import checkpoint as ckpt

    out = {}
    for distopt in (False, True):
        run = _Run(1, distopt, model=MODEL, model_overrides=SEQUENTIAL)
        try:
            if distopt:  # refused before anything is read
                out["dp_reshardable_error"] = _errors(run.load, os.path.join(root, "dp_reshardable", "step_00000002"))
            extra = run.load(ckpt.find_latest_checkpoint(os.path.join(root, f"distopt_{distopt}")).path)
            out[distopt] = {"extra": extra, **_snapshot(run, distopt)}
        finally:
            run.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("moe_checkpoints"))
    saved = run_distributed(_save, 2, root, timeout=240)
    loaded = run_distributed(_load, 1, root, timeout=240)[0]
    return {"saved": saved, "loaded": loaded}


@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distributed"])
def test_ep2_checkpoint_loads_at_ep1(results, distopt):
    loaded = results["loaded"][distopt]
    assert loaded["extra"] == TrainState(STEPS, data={"cursor": STEPS})
    covered, experts, optim_pieces = set(), set(), {}
    for rank, saved in enumerate(s[distopt] for s in results["saved"]):
        assert saved["chained"] == 2  # Megatron gives the experts their own optimizer (expert-DP group)
        for name, (value, _) in saved["params"].items():
            covered.add(name)
            experts.add(name) if ".mlp.experts." in name else None
            torch.testing.assert_close(loaded["params"][name][0], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            anchor = saved["anchor"][f"0.{saved['local_names'][name]}"]  # the anchor keeps local names
            torch.testing.assert_close(
                loaded["anchor"][f"0.{name}"], anchor, rtol=0, atol=0, msg=lambda m: f"anchor {name}: {m}"
            )
            if not distopt:
                for key, state in saved["named_optim"][name].items():
                    torch.testing.assert_close(
                        loaded["named_optim"][name][key],
                        state,
                        rtol=0,
                        atol=0,
                        msg=lambda m: f"optimizer {name}.{key}: {m}",
                    )
            else:  # the saved ranks' ranges, each equal to that range of the whole loaded state
                [(start, end, whole)] = loaded["named_optim"][name]
                assert (start, end) == (0, value.numel())
                for lo, hi, state in saved["named_optim"].get(name, []):
                    optim_pieces[name] = optim_pieces.get(name, 0) + hi - lo
                    for key, piece in state.items():
                        torch.testing.assert_close(
                            whole[key][lo:hi],
                            piece,
                            rtol=0,
                            atol=0,
                            msg=lambda m: f"optimizer {name}.{key}[{lo}:{hi}]: {m}",
                        )
        assert loaded["lr"] == pytest.approx(saved["lr"], rel=1e-12) and loaded["sched_steps"] == saved["sched_steps"]
    assert covered == loaded["params"].keys()
    if distopt:  # the saved ranges cover every parameter once (dense ones split over DP 2)
        assert optim_pieces == {name: loaded["params"][name][0].numel() for name in covered}
    assert len([n for n in experts if ".linear_fc1." in n]) == 2 * 8  # 2 layers x 8 experts, from both ranks
    # the anchor is not the policy (tau 0.5 after two updates): its equality above is its own
    name = next(iter(sorted(experts)))
    assert not torch.equal(loaded["anchor"][f"0.{name}"], loaded["params"][name][0])


def test_dp_reshardable_distributed_optimizer_cannot_change_ep(results):
    error = results["loaded"]["dp_reshardable_error"]
    assert "dp_reshardable" in error and "TP/PP/VPP/EP/ETP" in error
    assert "(1, 1, None, 2, 1)), not at (1, 1, None, 1, 1)" in error  # (TP, PP, VPP, EP, ETP)
