"""``train_step`` refuses a bad optimizer step (``core.step_guard``) on a tiny Megatron model.

- one rank: a NaN loss, then a gradient-norm spike (the loss x 1e6 after ``MIN_HISTORY`` applied
  steps): each refused step leaves the parameters, Adam's state and the LR schedule bit-identical
  to before it, and the next step equals, bit for bit, the step an uninterrupted run without the
  bad step takes from the same parameters (no gradient of the refused step leaks into it);
- two data-parallel ranks (distributed optimizer): only rank 1's loss is NaN, and both refuse;
  only rank 1's guard sees a spike (another history), and both refuse; the parameters stay equal
  across the ranks and unchanged, and the next step applies on both.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.core.aggregation import LossSum
from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.core.step_guard import MIN_HISTORY, GradNormGuard
from megatron_empg.parallel.rl_loss import RLLoss
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen2"
N, S = 4, 12  # sequences per rank and step, sequence length
# a warmup: every applied step changes the LR, so one that a refused step advanced shows
OPTIM = dict(lr=1e-3, lr_warmup_steps=20, clip_grad=1.0)


def _scaled(loss_fn, factor: float):
    """``loss_fn`` with its objective and its reported ``loss`` multiplied by ``factor``."""

    def scaled(*args, **kwargs) -> RLLoss:
        out = loss_fn(*args, **kwargs)
        metrics = {**out.metrics, "loss": LossSum(out.metrics["loss"].loss_sum * factor, out.metrics["loss"].count)}
        return RLLoss(LossSum(out.loss.loss_sum * factor, out.loss.count), metrics)

    return scaled


class _Run:
    """A tiny fp32 model, its optimizer and schedule on this rank's layout, and its batches."""

    def __init__(self, distributed_optimizer: bool = False) -> None:
        from megatron_empg.mcore import model as mcore_model
        from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
        from megatron_empg.mcore.parallel_state import initialize_model_parallel
        from megatron_empg.trainer.bind.build import bind_loss

        self.config = load_model_config(MODEL)
        self.groups = initialize_model_parallel(ParallelConfig(), seed=1234)
        self.chunks = mcore_model.build_gpt_model(self.config, ParallelConfig(), params_dtype=torch.float32)
        settings = OptimizerConfig(**OPTIM, use_distributed_optimizer=distributed_optimizer)
        self.ddp = wrap_with_ddp(self.chunks, settings)
        self.optimizer = build_optimizer(self.ddp, settings)
        self.scheduler = build_scheduler(self.optimizer, settings)
        self.loss_fn = bind_loss(LossConfig(policy_loss="ppo_clip"), vocab_size=self.config.vocab_size, topk=0)[0]

    def batch(self, seed: int) -> list[MicroBatch]:
        """This rank's micro-batch of step ``seed``, with its old log-probs (the policy's now)."""
        from megatron_empg.mcore.step import StatsRequest, forward_stats

        g = torch.Generator().manual_seed(1000 * seed + self.groups.dp_rank)
        tokens = torch.randint(0, self.config.vocab_size, (N, S + 1), generator=g)
        mask = torch.zeros(N, S, dtype=torch.bool)
        mask[:, 4:] = True
        advantages = torch.randn(N, 1, generator=g).expand(N, S).clone()
        mb = MicroBatch(tokens[:, :S], tokens[:, 1:], mask, advantages)
        [stats] = forward_stats(self.ddp, [mb], StatsRequest(vocab_size=self.config.vocab_size), self.groups)
        mb.old_logprobs = stats.logprobs - 0.01  # ratios off 1: the PPO loss has a gradient
        return [mb]

    def step(self, batch: list[MicroBatch], *, factor: float = 1.0, guard: GradNormGuard | None = None):
        from megatron_empg.mcore.step import train_step

        loss_fn = self.loss_fn if factor == 1.0 else _scaled(self.loss_fn, factor)
        return train_step(self.ddp, self.optimizer, self.scheduler, batch, loss_fn, groups=self.groups, guard=guard)

    def snapshot(self) -> dict:
        """Copies of the parameters, Adam's state (this rank's shards) and the schedule's step count."""
        params = {name: p.detach().clone() for name, p in self.chunks[0].named_parameters()}
        adam = {}
        for j, sub in enumerate(getattr(self.optimizer, "chained_optimizers", [self.optimizer])):
            tensors = [p for group in sub.optimizer.param_groups for p in group["params"]]
            for i, param in enumerate(tensors):
                for key, value in sub.optimizer.state.get(param, {}).items():
                    adam[(j, i, key)] = value.clone() if torch.is_tensor(value) else value
        return {"params": params, "adam": adam, "scheduler": self.scheduler.num_steps}


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _uninterrupted() -> dict:
    """Steps 0 and 1 without a bad step: the first snapshot, the second step, the last snapshot."""
    from megatron_empg.mcore.parallel_state import destroy_model_parallel

    run = _Run()
    try:
        batches = [run.batch(i) for i in range(2)]  # old log-probs of the initial policy, as `_one_rank`'s
        start = run.snapshot()
        run.step(batches[0])
        second = run.step(batches[1])
        return {"start": start, "second": second, "end": run.snapshot()}
    finally:
        destroy_model_parallel()


def _one_rank(rank: int, world_size: int) -> dict:
    from megatron_empg.mcore.parallel_state import destroy_model_parallel

    reference = _uninterrupted()
    run = _Run()  # the same seed: the same initial parameters (checked)
    try:
        out = {"same_start": _identical(run.snapshot()["params"], reference["start"]["params"])}
        guard = GradNormGuard(factor=10.0)
        batches = [run.batch(i) for i in range(MIN_HISTORY + 2)]
        first = run.step(batches[0], guard=guard)
        before = run.snapshot()
        nan = run.step(batches[1], factor=float("nan"), guard=guard)
        after_nan = run.snapshot()
        out["nan"] = {
            "skipped": nan.skipped,
            "lr": (first.lr, nan.lr),
            "history": list(guard.history),
            "unchanged": [_identical(before[k], after_nan[k]) for k in ("params", "adam")],
            "scheduler": (before["scheduler"], after_nan["scheduler"]),
        }
        went_on = run.step(batches[1], guard=guard)
        went_on_state, second, end = run.snapshot(), reference["second"], reference["end"]
        out["next"] = {
            "lr": (went_on.lr, second.lr),
            "grad_norm": (went_on.grad_norm, second.grad_norm),
            "loss": (went_on.metrics["loss"], second.metrics["loss"]),
            "same": [_identical(went_on_state[k], end[k]) for k in ("params", "adam")],
        }

        for batch in batches[2:MIN_HISTORY]:  # MIN_HISTORY applied steps in all: the spike check is on
            run.step(batch, guard=guard)
        before = run.snapshot()
        norms = list(guard.history)
        spike = run.step(batches[MIN_HISTORY], factor=1e6, guard=guard)
        after = run.snapshot()
        normal = run.step(batches[MIN_HISTORY], guard=guard)
        out["spike"] = {
            "skipped": spike.skipped,
            "grad_norm": spike.grad_norm,
            "norms": norms,
            "unchanged": [_identical(before[k], after[k]) for k in ("params", "adam")],
            "scheduler": (before["scheduler"], after["scheduler"]),
            "history_after": list(guard.history),
            "normal": (normal.skipped, normal.grad_norm),
        }
        return out
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_distributed(_one_rank, 1, timeout=240)[0]


def test_a_nan_loss_is_refused_and_changes_nothing(one_rank):
    nan = one_rank["nan"]
    assert nan["skipped"] == "non-finite loss (nan)"
    assert nan["unchanged"] == [True, True]  # parameters, Adam's moments and step count
    assert nan["scheduler"] == (1, 1) and nan["lr"][1] == nan["lr"][0] == pytest.approx(1e-3 / 20)
    assert len(nan["history"]) == 1  # only the applied step's norm


def test_the_step_after_a_refused_one_equals_the_uninterrupted_runs(one_rank):
    nxt = one_rank["next"]
    assert one_rank["same_start"] and nxt["same"] == [True, True]  # parameters, Adam's state: bit for bit
    assert nxt["lr"][0] == nxt["lr"][1] == pytest.approx(2e-3 / 20)  # the schedule's 2nd step, not its 3rd
    assert nxt["grad_norm"][0] == nxt["grad_norm"][1] > 0 and nxt["loss"][0] == nxt["loss"][1]


def test_a_grad_norm_spike_is_refused_and_changes_nothing(one_rank):
    spike = one_rank["spike"]
    median = sorted(spike["norms"])[len(spike["norms"]) // 2]
    assert len(spike["norms"]) == MIN_HISTORY and spike["grad_norm"] > 1e4 * median
    assert spike["skipped"] == (
        f"gradient norm {spike['grad_norm']:.4g} > {10 * median:.4g} "
        "(train.skip_grad_norm_factor=10 x the median of the last applied steps' norms)"
    )
    assert spike["unchanged"] == [True, True] and spike["scheduler"] == (MIN_HISTORY, MIN_HISTORY)
    normal_skipped, normal_norm = spike["normal"]
    assert normal_skipped is None and normal_norm < 10 * median  # the same batch, unscaled: applied
    assert spike["history_after"] == spike["norms"] + [normal_norm]


def _two_ranks(rank: int, world_size: int) -> dict:
    from megatron_empg.mcore.parallel_state import destroy_model_parallel

    run = _Run(distributed_optimizer=True)
    try:
        guard = GradNormGuard(factor=10.0)
        batches = [run.batch(i) for i in range(3)]
        run.step(batches[0], guard=guard)
        before = run.snapshot()
        # only rank 1's loss is NaN
        nan = run.step(batches[1], factor=float("nan") if rank == 1 else 1.0, guard=guard)
        after_nan = run.snapshot()
        # only rank 1's guard has a history under which this step's norm is a spike
        spiky = GradNormGuard(factor=10.0, history=[1e-9] * MIN_HISTORY) if rank == 1 else GradNormGuard(factor=10.0)
        spike = run.step(batches[1], guard=spiky)
        after_spike = run.snapshot()
        applied = run.step(batches[1], guard=guard)
        return {
            "nan": nan.skipped,
            "spike": spike.skipped,
            "applied": applied.skipped,
            "unchanged": [_identical(before["params"], s["params"]) for s in (after_nan, after_spike)],
            "schedule": [s["scheduler"] for s in (before, after_nan, after_spike)],
            "histories": (list(guard.history), list(spiky.history)),
            "params": run.snapshot()["params"],
            "params_before": before["params"],
        }
    finally:
        destroy_model_parallel()


def test_every_rank_refuses_what_one_rank_refuses():
    ranks = run_distributed(_two_ranks, 2, timeout=240)
    assert [r["nan"] for r in ranks] == ["non-finite loss (nan)"] * 2  # the loss is a global mean
    assert ranks[0]["spike"] == ranks[1]["spike"]  # rank 1's threshold, in the same words on both
    assert re.fullmatch(r"gradient norm \S+ > 1e-08 \(train.skip_grad_norm_factor=10 x .*\)", ranks[0]["spike"])
    assert [r["applied"] for r in ranks] == [None, None]
    for r in ranks:
        assert r["unchanged"] == [True, True] and r["schedule"] == [1, 1, 1]
    # the same norms recorded everywhere (the first and the last, applied, steps'); the spike recorded nowhere
    assert ranks[0]["histories"][0] == ranks[1]["histories"][0] and len(ranks[0]["histories"][0]) == 2
    assert ranks[0]["histories"][1] == [] and ranks[1]["histories"][1] == [1e-9] * MIN_HISTORY
    assert _identical(ranks[0]["params_before"], ranks[1]["params_before"])
    assert _identical(ranks[0]["params"], ranks[1]["params"])  # the applied step: the same update everywhere
    assert not _identical(ranks[0]["params"], ranks[0]["params_before"])
