"""Checkpoints across context parallelism: saved at CP 2 (the distributed optimizer and the EMA
anchor's fp32 master sharded over the DP x CP ranks), loaded at CP 1, and one more step there equal
to the step CP 2 took after its save; then saved at CP 1 and loaded back at CP 2. The steps are
``test_cp_training``'s (packed rows, every sequence padded to 2 x CP, each CP rank its share).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.mcore import checkpoint as ckpt
from megatron_empg.trainer.batching.batch import MicroBatchPlan, micro_batches
from tests.adam_bound import applied_grads, assert_grads_close, assert_params_within_adam_bound
from tests.dist import run_distributed
from tests.trainer.test_cp_training import ADAM_EPS, BUDGET, CP, MODEL, _samples

pytestmark = [pytest.mark.dist, pytest.mark.megatron, pytest.mark.layout]


class _Run:
    def __init__(self, cp: int) -> None:
        from megatron_empg.mcore.anchor import EmaAnchor
        from megatron_empg.mcore.model import build_gpt_model
        from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
        from megatron_empg.mcore.parallel_state import initialize_model_parallel
        from megatron_empg.trainer.bind.build import bind_loss

        self.cfg = load_model_config(MODEL)
        self.parallel = ParallelConfig(context_parallel_size=cp)
        self.groups = initialize_model_parallel(self.parallel, seed=9)
        self.chunks = build_gpt_model(self.cfg, self.parallel)
        settings = OptimizerConfig(lr=1e-3, clip_grad=1.0, adam_eps=ADAM_EPS, use_distributed_optimizer=True)
        self.ddp = wrap_with_ddp(self.chunks, settings)
        self.optimizer = build_optimizer(self.ddp, settings)
        self.scheduler = build_scheduler(self.optimizer, settings)
        self.anchor = EmaAnchor.from_configs(
            self.cfg, self.parallel, self.ddp, self.optimizer, tau=0.5, period=1, compute_dtype=torch.float32
        )
        self.loss, _ = bind_loss(
            LossConfig(kl="k3", kl_coef=0.1, agg_mode="seq-mean-token-mean"), vocab_size=self.cfg.vocab_size, topk=1
        )
        self.cursor = 0
        self.grads: list[dict] = []  # per step, the gradients Adam applied (tests.adam_bound)
        self.lrs: list[float] = []

    def step(self) -> float:
        from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
        from megatron_empg.parallel.context_parallel import split_microbatch

        samples = _samples()[self.cursor % 2 :: 2]  # each step its own samples
        plan = MicroBatchPlan(packing=True, max_tokens=BUDGET * CP, segment_multiple=2 * CP)
        full = micro_batches(samples, torch.linspace(-1, 1, len(samples)).tolist(), plan)
        micro = [split_microbatch(mb, self.groups.cp_size, self.groups.cp_rank) for mb in full]
        stats = forward_stats(
            self.ddp, micro, StatsRequest(vocab_size=self.cfg.vocab_size, with_entropy=False), self.groups
        )
        for mb, out in zip(micro, stats):
            mb.old_logprobs = out.logprobs + 0.05 * mb.advantages
            mb.anchor_logprobs = out.logprobs - 0.1 * mb.loss_mask
        result = train_step(self.ddp, self.optimizer, self.scheduler, micro, self.loss, groups=self.groups)
        self.anchor.update()
        self.cursor += 1
        by_id = applied_grads(self.ddp, self.optimizer)
        self.grads.append({n: by_id[id(p)] for n, p in self.chunks[0].named_parameters()})
        self.lrs.append(result.lr)
        return result.metrics["loss"]

    def save(self, root: str) -> str:
        return str(
            ckpt.save_checkpoint(
                root,
                ckpt.TrainState(self.cursor, data={"cursor": self.cursor}),
                self.parts(),
                self.groups,
                model=ckpt.ModelMetadata(name=MODEL),
            )
        )

    def parts(self) -> ckpt.CheckpointParts:
        return ckpt.CheckpointParts(self.ddp, optimizer=self.optimizer, scheduler=self.scheduler, anchor=self.anchor)

    def load(self, path: str) -> None:
        state = ckpt.load_checkpoint(path, self.parts(), self.groups, model_name=MODEL)
        self.cursor = state.data["cursor"]

    def snapshot(self) -> dict:
        return {
            "params": {n: p.detach().clone() for n, p in self.chunks[0].named_parameters()},
            "anchor": self.anchor.full_master_state(),
            "grads": list(self.grads),
            "lrs": list(self.lrs),
        }

    def close(self) -> None:
        from megatron_empg.mcore.parallel_state import destroy_model_parallel

        destroy_model_parallel()


def _save_at(rank: int, world_size: int, root: str, load: str | None) -> dict:
    """At CP ``world_size``: (load ``load`` or) 2 steps, save, 1 more step."""
    run = _Run(world_size)
    try:
        if load:
            run.load(load)
            loaded = run.snapshot()
        else:
            loaded = None
            run.step()
            run.step()
        path = run.save(os.path.join(root, f"cp{world_size}"))
        saved = run.snapshot()
        loss = run.step()
        return {"path": path, "saved": saved, "loaded": loaded, "next_loss": loss, "after": run.snapshot()}
    finally:
        run.close()


def _load_and_step(rank: int, world_size: int, path: str) -> dict:
    run = _Run(world_size)
    try:
        run.load(path)
        loaded = run.snapshot()
        return {"loaded": loaded, "next_loss": run.step(), "after": run.snapshot()}
    finally:
        run.close()


def _assert_states(actual: dict, expected: dict, tol: dict, what: str) -> None:
    for part in ("params", "anchor"):
        assert actual[part].keys() == expected[part].keys(), (what, part)
        for name, value in expected[part].items():
            torch.testing.assert_close(actual[part][name], value, **tol, msg=lambda m: f"{what} {part} {name}: {m}")


def _assert_step_after_load(actual: dict, expected: dict, what: str) -> None:
    """One step after the same loaded state at two layouts: the gradients tightly, the parameters
    within Adam's bound for the two steps' gradients (the history before it loaded exactly;
    ``tests.adam_bound``), and the anchor master within the same bound: its EMA update mixes the
    shared old master with the parameter, which moves it by at most as much."""
    (step,) = actual["grads"]
    for name, value in expected["params"].items():
        history = [g[name] for g in expected["grads"]]
        grads = history[:-1] + [step[name]]
        assert_grads_close(grads[-1], history[-1], f"{what} gradient of {name}")
        for got, want in (
            (actual["params"][name], value),
            (actual["anchor"][f"0.{name}"], expected["anchor"][f"0.{name}"]),
        ):
            assert_params_within_adam_bound(
                got, want, grads, history, expected["lrs"], eps=ADAM_EPS, what=f"{what} {name}"
            )
    assert actual["anchor"].keys() == expected["anchor"].keys() == {f"0.{n}" for n in expected["params"]}


def test_saved_at_cp2_loads_at_cp1_and_back(tmp_path):
    exact = dict(rtol=0, atol=0)
    cp2 = run_distributed(_save_at, 2, str(tmp_path), None, timeout=300)
    for rank in (0, 1):  # the CP ranks hold the same weights and (gathered) anchor master
        _assert_states(cp2[rank]["saved"], cp2[0]["saved"], exact, f"cp2 rank {rank}")
    (cp1,) = run_distributed(_load_and_step, 1, cp2[0]["path"], timeout=300)
    _assert_states(cp1["loaded"], cp2[0]["saved"], exact, "loaded at CP 1")
    assert cp1["next_loss"] == pytest.approx(cp2[0]["next_loss"], rel=1e-5)
    _assert_step_after_load(cp1["after"], cp2[0]["after"], "the step after, CP 1 vs CP 2")
    # and back: saved at CP 1 (after that step), loaded at CP 2
    (saved_cp1,) = run_distributed(_save_at, 1, str(tmp_path), cp2[0]["path"], timeout=300)
    back = run_distributed(_load_and_step, 2, saved_cp1["path"], timeout=300)
    for rank in (0, 1):
        _assert_states(back[rank]["loaded"], saved_cp1["saved"], exact, f"CP 1 checkpoint loaded at CP 2, rank {rank}")
        assert back[rank]["next_loss"] == pytest.approx(saved_cp1["next_loss"], rel=1e-5)
