"""Checkpoints (``mcore.checkpoint``): resume equivalence, TP2 -> TP1 resharding, atomicity, retention.

The RL step is the one of ``test_train_step`` (old pass, PPO + Top-k KL + entropy, Adam with warmup
and cosine decay), followed by an update of the EMA anchor (``mcore.anchor.EmaAnchor``, tau 0.5,
every step; with the distributed optimizer its float32 master is sharded over DP).

Spawns (processes are new in each phase, so a resume really starts from disk)::

    phase 1  world 1: TP1 4 steps straight; TP1 2 steps + save; scenarios (a save before the first
                      update, a crash before the commit, loads that must fail, keep_last, the
                      step-0 checkpoint loaded by fresh fp32 and bf16 runs)
             world 2: DP2 (distributed optimizer) 4 steps; DP2 2 steps + save (+ 1 step + save as
                      dp_reshardable); TP2 and PP2: 2 steps + save + 1 more step (the continuation
                      a TP1 resume must match)
    phase 2  world 1: TP1 load + 2 steps; the TP2, PP2 and DP2 checkpoints loaded at TP1/PP1/DP1 + 1
                      step; a distributed-optimizer checkpoint into a non-distributed optimizer
             world 2: DP2 load + 2 steps
"""

from __future__ import annotations

import json
import os
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_empg.config import OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.mcore import checkpoint as ckpt
from megatron_empg.mcore.checkpoint import save as ckpt_save
from tests.adam_bound import assert_grads_close, assert_params_within_adam_bound, named_applied_grads
from tests.dist import run_distributed
from tests.mcore.test_train_step import ADAM_EPS, MODEL, OPTIM, K, N, S, loss_fn

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

STEPS = 4  # the RL step of test_train_step (model, batch shape, loss and optimizer settings)
TAU = 0.5  # anchor EMA factor
EXACT = dict(rtol=0.0, atol=0.0)  # resume at the same layout: the same float ops in the same order


# --------------------------------------------------------------------------------------------
# Worker side.


def _global_batch(step: int, vocab_size: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)  # batch i depends on i only: a resume regenerates it
    tokens = torch.randint(0, vocab_size, (N, S + 1), generator=g)
    loss_mask = torch.zeros(N, S, dtype=torch.bool)
    for i in range(N):
        loss_mask[i, 4 + i % 4 : S - (i % 3)] = True
    return {
        "input_ids": tokens[:, :S],
        "target_ids": tokens[:, 1:],
        "loss_mask": loss_mask,
        "advantages": torch.randn(N, 1, generator=g).expand(N, S).clone(),
        "anchor_noise": 0.3 * torch.randn(N, S, generator=g),
        "topk_anchor_noise": 0.3 * torch.randn(N, S, K, generator=g),
    }


def _split(batch: dict, dp_rank: int, dp_size: int, num_microbatches: int = 2) -> list[dict]:
    rows = N // dp_size
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    size = rows // num_microbatches
    return [{k: v[i * size : (i + 1) * size] for k, v in mine.items()} for i in range(num_microbatches)]


LORA_BASE = {"path": "/bases/tiny", "fingerprint": "0" * 64}  # what a LoRA run's checkpoints record


class _Run:
    """One layout's policy, optimizer, scheduler and anchor in this process."""

    def __init__(
        self,
        tp: int,
        distopt: bool,
        pp: int = 1,
        dtype: torch.dtype = torch.float32,
        model: str = MODEL,
        model_overrides: tuple[str, ...] = (),
        **parallel_fields,
    ) -> None:
        from megatron_empg.mcore import model as mcore_model
        from megatron_empg.mcore.anchor import EmaAnchor
        from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
        from megatron_empg.mcore.parallel_state import initialize_model_parallel

        self.model_name = model
        self.cfg = load_model_config(model, model_overrides)
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **parallel_fields)
        self.groups = initialize_model_parallel(parallel, seed=1234)
        self.chunks = mcore_model.build_gpt_model(self.cfg, parallel, params_dtype=dtype)
        settings = OptimizerConfig(**OPTIM, use_distributed_optimizer=distopt)
        self.ddp = wrap_with_ddp(self.chunks, settings)
        self.optimizer = build_optimizer(self.ddp, settings)
        self.scheduler = build_scheduler(self.optimizer, settings)
        if self.cfg.lora is not None:  # a LoRA policy's anchor: its base with averaged adapters
            from megatron_empg.mcore.lora.anchor import AdapterAnchor

            self.anchor = AdapterAnchor(self.ddp, self.optimizer, tau=TAU, period=1)
        else:
            self.anchor = EmaAnchor.from_configs(
                self.cfg, parallel, self.ddp, self.optimizer, tau=TAU, period=1, compute_dtype=dtype
            )
        self.cursor = 0
        self.losses: list[float] = []
        self.grads: list[dict] = []  # per step, the gradients Adam applied (tests.adam_bound)
        self.lrs: list[float] = []

    def step(self) -> None:
        from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
        from megatron_empg.parallel.rl_loss import loss_units

        g = self.groups
        parts = _split(_global_batch(self.cursor, self.cfg.vocab_size), g.dp_rank, g.dp_size)
        mbs = [MicroBatch(p["input_ids"], p["target_ids"], p["loss_mask"], p["advantages"]) for p in parts]
        old = forward_stats(self.ddp, mbs, StatsRequest(vocab_size=self.cfg.vocab_size, k=K), g)
        for mb, part, stats in zip(mbs, parts, old or [], strict=old is not None):  # None before the last stage
            mb.old_logprobs = stats.logprobs
            mb.topk_ids = stats.topk_ids
            mb.anchor_logprobs = stats.logprobs + part["anchor_noise"]
            mb.topk_anchor_logprobs = stats.topk_logprobs + part["topk_anchor_noise"]
        vocab = self.cfg.vocab_size
        result = train_step(
            self.ddp, self.optimizer, self.scheduler, mbs, loss_fn(vocab), groups=g, loss_units=loss_units
        )
        self.anchor.update()
        self.losses.append(result.metrics["loss"])
        self.grads.append(named_applied_grads(self.chunks, self.ddp, self.optimizer))
        self.lrs.append(result.lr)
        self.cursor += 1

    def save(self, root: str, **options) -> Path:  # options: keep_last, optimizer_format
        return ckpt.save_checkpoint(
            root,
            ckpt.TrainState(self.cursor, data={"cursor": self.cursor}),
            self.parts(),
            self.groups,
            options=ckpt.SaveOptions(**options),
            model=ckpt.ModelMetadata(name=self.model_name, base=LORA_BASE if self.cfg.lora is not None else None),
        )

    def parts(self, anchor=True) -> ckpt.CheckpointParts:
        """``anchor``: True for the run's, or an anchor (None: none)."""
        anchor = self.anchor if anchor is True else anchor
        return ckpt.CheckpointParts(self.ddp, optimizer=self.optimizer, scheduler=self.scheduler, anchor=anchor)

    def load(self, path, anchor=True, **kwargs) -> ckpt.TrainState:
        kwargs = {"model_name": self.model_name, **kwargs}
        state = ckpt.load_checkpoint(path, self.parts(anchor), self.groups, **kwargs)
        self.cursor = state.data["cursor"]
        return state

    def snapshot(self) -> dict:
        from megatron_empg.mcore import weights as mcore_weights

        params, local_names = {}, {}
        for chunk in self.chunks:
            names = mcore_weights.global_names(chunk)
            for name, p in chunk.named_parameters():
                params[names[name]] = (p.detach().clone(), mcore_weights.tp_partition(p))
                local_names[names[name]] = name
        optim = []  # the torch optimizers' states in parameter order (same build, same order)
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            state = sub.optimizer.state_dict()["state"]
            optim.append(
                {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for i, st in state.items()}
            )
        groups = []  # hyperparameters of each torch param group
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            groups.append([{k: v for k, v in g.items() if k != "params"} for g in sub.optimizer.param_groups])
        return {
            "params": params,
            "local_names": local_names,
            "optim": optim,
            "param_groups": groups,
            "lr": self.optimizer.param_groups[0]["lr"],
            "sched_steps": self.scheduler.num_steps,
            "anchor": self.anchor.full_master_state(),
            "losses": list(self.losses),
            "grads": list(self.grads),
            "lrs": list(self.lrs),
            "cursor": self.cursor,
            "tp_rank": self.groups.tp_rank,
            "tp": self.groups.tp_size,
        }

    def close(self) -> None:
        from megatron_empg.mcore.parallel_state import destroy_model_parallel

        destroy_model_parallel()


def _straight(tp: int, distopt: bool, steps: int) -> dict:
    run = _Run(tp, distopt)
    try:
        for _ in range(steps):
            run.step()
        return run.snapshot()
    finally:
        run.close()


def _train_and_save(
    tp: int, distopt: bool, root: str, steps: int, after: int = 0, pp: int = 1, resave: tuple | None = None
) -> dict:
    """``steps`` steps, save, then ``after`` more steps in the same process (and with ``resave``,
    (root, optimizer format), save again there)."""
    run = _Run(tp, distopt, pp)
    try:
        for _ in range(steps):
            run.step()
        path = run.save(root)
        saved = run.snapshot()
        for _ in range(after):
            run.step()
        if resave is not None:
            run.save(resave[0], optimizer_format=resave[1])
        return {"path": str(path), "saved": saved, "after": run.snapshot()}
    finally:
        run.close()


def _resume(tp: int, distopt: bool, root: str, steps: int) -> dict:
    run = _Run(tp, distopt)
    try:
        found = ckpt.find_latest_checkpoint(root)
        extra = run.load(found.path)
        loaded = run.snapshot()
        for _ in range(steps):
            run.step()
        return {"extra": extra, "found": found, "loaded": loaded, "final": run.snapshot()}
    finally:
        run.close()


class _Crash(RuntimeError):
    pass


def _errors(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ckpt.CheckpointError as e:
        return str(e)
    return None


def _scenarios(root: str) -> dict:
    """A save before the first update; saves at steps 1 and 2, a crash while saving step 3, loads
    that must fail; retention over steps 3..6; the step-0 checkpoint loaded into a fresh run."""
    out = {}
    run = _Run(1, False)
    try:
        crash_root, keep_root, fresh_root = (os.path.join(root, name) for name in ("crash", "keep", "fresh"))
        fresh_path = run.save(fresh_root)  # the optimizer has not stepped yet
        for _ in range(2):
            run.step()
            run.save(crash_root)
        run.step()

        def crash(tmp_dir):
            raise _Crash(f"simulated crash after writing {tmp_dir.name}")

        original, ckpt_save._before_commit = ckpt_save._before_commit, crash
        try:
            run.save(crash_root)
        except _Crash as e:
            out["crash"] = str(e)
        finally:
            ckpt_save._before_commit = original
        out["after_crash"] = sorted(os.listdir(crash_root))
        tmp_dirs = [d for d in out["after_crash"] if ckpt.TMP_MARK in d]
        # loads that must fail before changing anything
        out["load_tmp_error"] = _errors(run.load, os.path.join(crash_root, tmp_dirs[0]))
        out["load_missing_error"] = _errors(run.load, os.path.join(crash_root, "step_00000099"))
        step2 = os.path.join(crash_root, "step_00000002")
        out["wrong_model_error"] = _errors(run.load, step2, model_name="qwen2.5-7b")
        out["no_anchor_error"] = _errors(run.load, step2, anchor=None)
        out["fresh_into_stepped_error"] = _errors(run.load, fresh_path)
        before = run.snapshot()
        run.load(step2, anchor=None, strict=False)  # non-strict: the anchor state is skipped
        out["anchor_kept"] = all(torch.equal(before["anchor"][k], v) for k, v in run.anchor.full_master_state().items())
        run.step()  # back at step 3

        listings = []
        for _ in range(4):  # steps 3..6 with keep_last=2
            run.save(keep_root, keep_last=2)
            listings.append(sorted(os.listdir(keep_root)))
            run.step()
        out["keep_listings"] = listings
    finally:
        run.close()
    run = _Run(1, False)  # a fresh run loads the checkpoint saved before the first update
    try:
        out["fresh_extra"] = run.load(fresh_path)
        run.step()
        out["fresh_losses"] = run.losses
    finally:
        run.close()
    # bf16: the optimizer's float32 main params must follow the loaded weights
    run = _Run(1, False, dtype=torch.bfloat16)
    try:
        bf16_path = run.save(os.path.join(root, "fresh_bf16"))
        run.step()
        out["bf16_straight"] = run.snapshot()["params"]
    finally:
        run.close()
    run = _Run(1, False, dtype=torch.bfloat16)
    try:
        with torch.no_grad():  # other weights, and main params that follow them
            for p in run.chunks[0].parameters():
                p.add_(0.5)
            run.optimizer.reload_model_params()
        run.load(bf16_path)
        run.step()
        out["bf16_resumed"] = run.snapshot()["params"]
    finally:
        run.close()
    return out


def _phase1_world1(rank: int, world_size: int, root: str) -> dict:
    return {
        "tp1_straight": _straight(1, False, STEPS),
        "tp1_first": _train_and_save(1, False, os.path.join(root, "tp1"), STEPS // 2),
        "scenarios": _scenarios(os.path.join(root, "scenarios")),
    }


def _phase1_world2(rank: int, world_size: int, root: str) -> dict:
    return {
        "dp2_straight": _straight(1, True, STEPS),
        "dp2_first": _train_and_save(  # saved again after one more step, in the dp_reshardable format
            1,
            True,
            os.path.join(root, "dp2"),
            STEPS // 2,
            after=1,
            resave=(os.path.join(root, "dp2_dpr"), "dp_reshardable"),
        ),
        "tp2_first": _train_and_save(2, False, os.path.join(root, "tp2"), STEPS // 2, after=1),
        "pp2_first": _train_and_save(1, False, os.path.join(root, "pp2"), STEPS // 2, after=1, pp=2),
    }


def _phase2_world1(rank: int, world_size: int, root: str) -> dict:
    return {
        "tp1_resume": _resume(1, False, os.path.join(root, "tp1"), STEPS // 2),
        "tp2_to_tp1": _resume(1, False, os.path.join(root, "tp2"), 1),
        "pp2_to_tp1": _resume(1, False, os.path.join(root, "pp2"), 1),
        "dp2_to_dp1": _resume(1, True, os.path.join(root, "dp2"), 1),  # distributed optimizer, DP 2 -> 1
        "dp2_dpr_to_dp1": _resume(1, True, os.path.join(root, "dp2_dpr"), 1),  # the same as dp_reshardable
        "distopt_into_plain_error": _errors(_resume, 1, False, os.path.join(root, "dp2_dpr"), 1),
    }


def _phase2_world2(rank: int, world_size: int, root: str) -> dict:
    return {"dp2_resume": _resume(1, True, os.path.join(root, "dp2"), STEPS // 2)}


# --------------------------------------------------------------------------------------------
# Parent side.


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("checkpoints"))
    out = {"root": root}
    out.update(run_distributed(_phase1_world1, 1, root, timeout=240)[0])
    phase1_w2 = run_distributed(_phase1_world2, 2, root, timeout=240)
    for name in phase1_w2[0]:
        out[name] = [r[name] for r in phase1_w2]
    out["tp1_keep_copy"] = str(Path(root) / "tp1_copy")
    shutil.copytree(Path(root) / "tp1", out["tp1_keep_copy"])  # for the pointer tests below
    out.update(run_distributed(_phase2_world1, 1, root, timeout=240)[0])
    phase2_w2 = run_distributed(_phase2_world2, 2, root, timeout=240)
    out["dp2_resume"] = [r["dp2_resume"] for r in phase2_w2]
    return out


def _assert_same_state(actual: dict, expected: dict, what: str, tol: dict = EXACT) -> None:
    assert actual["params"].keys() == expected["params"].keys()
    for name, (value, _) in expected["params"].items():
        torch.testing.assert_close(actual["params"][name][0], value, **tol, msg=lambda m: f"{what} param {name}: {m}")
    assert len(actual["optim"]) == len(expected["optim"])
    for a_sub, e_sub in zip(actual["optim"], expected["optim"]):
        assert a_sub.keys() == e_sub.keys() and e_sub, f"{what}: optimizer state entries differ"
        for idx, e_state in e_sub.items():
            assert e_state.keys() == a_sub[idx].keys() and {"exp_avg", "exp_avg_sq"} <= e_state.keys()
            for key, value in e_state.items():
                torch.testing.assert_close(
                    torch.as_tensor(a_sub[idx][key]),
                    torch.as_tensor(value),
                    **tol,
                    msg=lambda m: f"{what} optimizer state {idx}.{key}: {m}",
                )
    for a_groups, e_groups in zip(actual["param_groups"], expected["param_groups"], strict=True):
        for i, (a_group, e_group) in enumerate(zip(a_groups, e_groups, strict=True)):
            keys = (a_group.keys() | e_group.keys()) - {"step"}  # the distributed optimizer's copy of the Adam step
            diff = {k: (a_group.get(k), e_group.get(k)) for k in keys if a_group.get(k) != e_group.get(k)}
            assert not diff, f"{what}: param group {i} (actual, expected): {diff}"
    assert actual["lr"] == pytest.approx(expected["lr"], rel=1e-12, abs=0)
    assert actual["sched_steps"] == expected["sched_steps"]
    assert actual["anchor"].keys() == expected["anchor"].keys()
    for key, value in expected["anchor"].items():
        assert actual["anchor"][key].dtype == torch.float32
        torch.testing.assert_close(actual["anchor"][key], value, **tol, msg=lambda m: f"{what} anchor {key}: {m}")


def test_resume_tp1_equals_uninterrupted_run(results):
    resumed = results["tp1_resume"]
    assert resumed["extra"] == ckpt.TrainState(2, data={"cursor": 2})
    assert "points to it" in resumed["found"].reason
    _assert_same_state(resumed["loaded"], results["tp1_first"]["saved"], "tp1 right after load")
    _assert_same_state(resumed["final"], results["tp1_straight"], "tp1 2+2 vs 4 steps")
    assert resumed["final"]["losses"] == results["tp1_straight"]["losses"][2:]
    assert results["tp1_straight"]["anchor"].keys() and results["tp1_straight"]["sched_steps"] == STEPS


def test_resume_dp2_distributed_optimizer_equals_uninterrupted_run(results):
    for rank in range(2):
        resumed = results["dp2_resume"][rank]
        assert resumed["extra"] == ckpt.TrainState(2, data={"cursor": 2})
        _assert_same_state(resumed["loaded"], results["dp2_first"][rank]["saved"], f"dp2 rank {rank} after load")
        _assert_same_state(resumed["final"], results["dp2_straight"][rank], f"dp2 rank {rank} 2+2 vs 4 steps")


@pytest.mark.layout
@pytest.mark.parametrize("source", ["tp2", "pp2", "dp2"])
def test_checkpoint_loads_at_another_layout_and_training_continues(results, source):
    """Saved at TP2, PP2 or DP2 (distributed optimizer) in a world of 2, loaded at TP1/PP1/DP1."""
    from megatron_empg.mcore.weights import tp_slice

    saved_ranks = results[f"{source}_first"]
    target = results[f"{source}_to_tp1" if source != "dp2" else "dp2_to_dp1"]
    assert target["extra"] == ckpt.TrainState(2, data={"cursor": 2})
    loaded = target["loaded"]
    covered = set()
    for rank, saved_rank in enumerate(saved_ranks):
        saved = saved_rank["saved"]
        for name, (shard, partition) in saved["params"].items():
            covered.add(name)
            full = loaded["params"][name][0]
            piece = tp_slice(full, partition, saved["tp_rank"], saved["tp"])
            torch.testing.assert_close(piece, shard, rtol=0, atol=0, msg=lambda m: f"{source} {name}: {m}")
            full_anchor = loaded["anchor"][f"0.{name}"]  # one chunk per rank at TP1/PP1: local == global names
            piece = tp_slice(full_anchor, partition, saved["tp_rank"], saved["tp"])
            torch.testing.assert_close(piece, saved["anchor"][f"0.{saved['local_names'][name]}"], rtol=0, atol=0)
        assert loaded["lr"] == pytest.approx(saved["lr"], rel=1e-12) and loaded["sched_steps"] == saved["sched_steps"]
    assert covered == loaded["params"].keys()
    # the next step at the new layout gives the loss and parameters of the old layout's next step
    next_loss = saved_ranks[-1]["after"]["losses"][-1]  # the last pipeline stage computes it
    assert target["final"]["losses"] == pytest.approx([next_loss], rel=0, abs=1e-5)
    # (the parameters within Adam's bound for the two sides' gradients of that step, the history
    # before it being loaded exactly: tests.adam_bound)
    for rank, saved_rank in enumerate(saved_ranks):
        after = saved_rank["after"]
        for name, (shard, partition) in after["params"].items():
            mine = partial(tp_slice, partition=partition, tp_rank=after["tp_rank"], tp_size=after["tp"])
            grads = [step[name] for step in after["grads"]]
            (step,) = target["final"]["grads"]
            target_grads = grads[:-1] + [mine(step[name])]
            assert_grads_close(target_grads[-1], grads[-1], f"{source} step {len(grads)} gradient of {name}")
            assert_params_within_adam_bound(
                mine(target["final"]["params"][name][0]),
                shard,
                target_grads,
                grads,
                after["lrs"],
                eps=ADAM_EPS,
                what=f"{source} after one more step {name}",
            )


def test_crash_before_commit_leaves_only_a_temp_dir(results):
    s = results["scenarios"]
    assert "simulated crash" in s["crash"]
    listing = s["after_crash"]
    assert [d for d in listing if not d.startswith("step_00000003")] == ["latest", "step_00000001", "step_00000002"]
    crashed = [d for d in listing if d.startswith("step_00000003")]
    assert len(crashed) == 1 and ckpt.TMP_MARK in crashed[0], listing
    crash_root = Path(results["root"]) / "scenarios" / "crash"
    found = ckpt.find_latest_checkpoint(crash_root)
    assert found.step == 2 and found.path.name == "step_00000002" and "points to it" in found.reason
    assert ckpt.checkpoint_problem(crash_root / crashed[0]) is not None
    assert ckpt.INFO_FILE in s["load_tmp_error"] and "incomplete" in s["load_tmp_error"]
    assert "does not exist" in s["load_missing_error"]


def test_latest_pointing_to_a_bad_dir_falls_back_to_newest_complete(tmp_path, results):
    src = Path(results["root"]) / "scenarios" / "crash"
    root = tmp_path / "ckpts"
    shutil.copytree(src, root)
    (root / "latest").write_text("step_00000007\n")  # deleted checkpoint
    found = ckpt.find_latest_checkpoint(root)
    assert found.step == 2 and "step_00000007" in found.reason and "does not exist" in found.reason

    # a newer step dir whose completion marker is missing, and latest pointing to it
    shutil.copytree(root / "step_00000002", root / "step_00000005")
    (root / "step_00000005" / ckpt.INFO_FILE).unlink()
    (root / "latest").write_text("step_00000005\n")
    found = ckpt.find_latest_checkpoint(root)
    assert found.step == 2 and ckpt.INFO_FILE in found.reason

    # a marker that does not say complete, and a garbage latest
    info = json.loads((root / "step_00000002" / ckpt.INFO_FILE).read_text())
    (root / "step_00000002" / ckpt.INFO_FILE).write_text(json.dumps({**info, "complete": False}))
    (root / "latest").write_text("../../etc\n")
    found = ckpt.find_latest_checkpoint(root)
    assert found.step == 1 and "not a step_N" in found.reason and "complete: true" in found.reason
    with pytest.raises(ckpt.CheckpointError, match="complete: true"):
        ckpt.read_checkpoint_info(root / "step_00000002")

    # dist_checkpointing's own metadata missing
    (root / "step_00000001" / "metadata.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="refusing to start from scratch|Refusing"):
        ckpt.find_latest_checkpoint(root)  # latest exists, nothing complete: no silent fresh start
    (root / "latest").unlink()
    assert ckpt.find_latest_checkpoint(root) is None  # only leftovers, never committed: fresh start
    assert ckpt.find_latest_checkpoint(tmp_path / "nothing") is None


def test_keep_last_retention(results):
    listings = results["scenarios"]["keep_listings"]
    steps = [[d for d in listing if d != "latest"] for listing in listings]
    assert steps == [
        ["step_00000003"],  # the keep root starts empty
        ["step_00000003", "step_00000004"],
        ["step_00000004", "step_00000005"],
        ["step_00000005", "step_00000006"],
    ]
    keep_root = Path(results["root"]) / "scenarios" / "keep"
    assert (keep_root / "latest").read_text().strip() == "step_00000006"
    assert ckpt.find_latest_checkpoint(keep_root).step == 6
    info = ckpt.read_checkpoint_info(keep_root / "step_00000006")
    assert info["layout"] == {"tp": 1, "pp": 1, "vpp": None, "dp": 1, "world_size": 1}
    assert info["step"] == 6 and info["model_name"] == MODEL and info["parts"]["anchor"] is True


def test_loads_that_cannot_work_fail_clearly(results):
    s = results["scenarios"]
    assert "qwen2.5-7b" in s["wrong_model_error"] and MODEL in s["wrong_model_error"]
    assert "anchor" in s["no_anchor_error"] and "strict=False" in s["no_anchor_error"]
    assert "first update" in s["fresh_into_stepped_error"]
    assert s["anchor_kept"], "a non-strict load without an anchor changed the anchor"
    assert "distributed optimizer" in results["distopt_into_plain_error"]


def test_checkpoint_saved_before_the_first_update(results):
    s = results["scenarios"]
    assert s["fresh_extra"] == ckpt.TrainState(0, data={"cursor": 0})
    assert s["fresh_losses"] == results["tp1_straight"]["losses"][:1]
    for name, (value, _) in s["bf16_straight"].items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(s["bf16_resumed"][name][0], value, rtol=0, atol=0, msg=lambda m: f"bf16 {name}: {m}")


def test_dp_reshardable_distributed_optimizer_loads_at_another_dp_size(results):
    target = results["dp2_dpr_to_dp1"]
    assert target["extra"] == ckpt.TrainState(3, data={"cursor": 3})
    for rank in range(2):
        saved = results["dp2_first"][rank]["after"]  # saved again after one more step
        for name, (value, _) in saved["params"].items():
            torch.testing.assert_close(target["loaded"]["params"][name][0], value, rtol=0, atol=0)
    assert target["final"]["losses"] == pytest.approx(results["dp2_straight"][0]["losses"][3:], rel=0, abs=1e-5)
