"""``trainer.batch.training_micro_batches``: samples without a loss token skip the Megatron passes,
the tensors land on the model's device, and the optimizer step is the same as with every sample."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.trainer.batch import Sample, pack, training_micro_batches
from tests.dist import run_distributed

MODEL = "tiny-qwen2"


def _samples(no_loss: set[int], count: int = 8, vocab: int = 50) -> list[Sample]:
    """``count`` samples of prompts 3..6 tokens and responses 2..9 tokens; those in ``no_loss``
    have only observation tokens (``response_mask`` all False): no loss, as a masked truncation."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        prompt = torch.randint(2, vocab, (3 + i % 4,), generator=g).tolist()
        response = torch.randint(2, vocab, (2 + (7 * i) % 8,), generator=g).tolist()
        mask = [i not in no_loss] * len(response)
        out.append(Sample(prompt, response, [-1.0] * len(response), "stop", group=i // 2, response_mask=mask))
    return out


def test_samples_without_loss_leave_their_micro_batches():
    samples = _samples(no_loss={1, 2, 5})
    batch = pack(samples, pad_id=0)
    advantages = torch.arange(8, dtype=torch.float32)
    minis = training_micro_batches(batch, advantages, micro_batch_size=2, mini_batches=2, device=torch.device("cpu"))
    # mini-batch 0 (samples 0-3) keeps 0 and 3; mini-batch 1 (4-7) keeps 4, 6, 7 and fills with 5
    rows = [[int(mb["advantages"].amax(dim=1).max(dim=0).values) for mb in mini] for mini in minis]
    assert [len(mini) for mini in minis] == [1, 2]
    kept = [[0, 3], [4, 6], [7, 5]]
    for mb, indices in zip([mb for mini in minis for mb in mini], kept):
        width = mb["input_ids"].shape[1]
        torch.testing.assert_close(mb["input_ids"], batch.input_ids[indices, :width], rtol=0, atol=0)
        torch.testing.assert_close(mb["loss_mask"], batch.loss_mask[indices, :width], rtol=0, atol=0)
        expected = torch.where(batch.loss_mask[indices, :width], advantages[indices, None], 0.0)
        torch.testing.assert_close(mb["advantages"], expected, rtol=0, atol=0)
    assert rows == [[3], [6, 7]]
    # the width is cut after the last loss token of the kept samples (rounded up to 8)
    last = max(len(s.prompt_ids) + len(s.response_ids) - 2 for i, s in enumerate(samples) if i not in {1, 2, 5})
    assert minis[0][0]["input_ids"].shape[1] == -(-(last + 1) // 8) * 8 <= batch.input_ids.shape[1]
    assert not batch.loss_mask[:, minis[0][0]["input_ids"].shape[1] :].any()


def test_a_mini_batch_without_loss_keeps_one_micro_batch_and_tensors_go_to_the_device():
    batch = pack(_samples(no_loss={0, 1, 2, 3}), pad_id=0)
    minis = training_micro_batches(batch, torch.ones(8), micro_batch_size=2, mini_batches=2, device=torch.device("cpu"))
    assert [len(mini) for mini in minis] == [1, 2] and not minis[0][0]["loss_mask"].any()
    # the only move to the model's device ("meta" here: any device other than the host's)
    minis = training_micro_batches(batch, torch.ones(8), micro_batch_size=2, mini_batches=2, device=torch.device("meta"))
    assert {t.device.type for mini in minis for mb in mini for t in mb.values()} == {"meta"}
    with pytest.raises(ValueError, match="do not split into 3 mini-batches"):
        training_micro_batches(batch, torch.ones(8), micro_batch_size=2, mini_batches=3, device=torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# The optimizer step with and without the loss-free samples (Megatron, one rank).


def _naive(batch, advantages, micro_batch_size: int) -> list[dict]:
    """Every sample, the whole padded width: the micro-batches before samples were dropped."""
    from megatron_empg.core.advantages import token_advantages

    out = []
    for first in range(0, batch.input_ids.shape[0], micro_batch_size):
        rows = slice(first, first + micro_batch_size)
        out.append({"input_ids": batch.input_ids[rows], "target_ids": batch.target_ids[rows],
                    "loss_mask": batch.loss_mask[rows],
                    "advantages": token_advantages(advantages[rows], batch.loss_mask[rows])})  # fmt: skip
    return out


def _step(rank: int, world_size: int, agg_mode: str) -> dict:
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.build import bind_loss

    model = load_model_config(MODEL)
    loss = LossConfig(kl="k3", kl_coef=0.1, agg_mode=agg_mode, policy_loss_args={"clip_eps_low": 0.2})
    loss_fn, _ = bind_loss(loss, vocab_size=model.vocab_size, topk=1)
    batch = pack(_samples(no_loss={1, 2, 5}, vocab=model.vocab_size), pad_id=0)
    advantages = torch.linspace(-1, 1, 8)
    results = {}
    for name in ("all", "dropped"):
        groups = initialize_model_parallel(ParallelConfig(), seed=5)  # the same initial weights each time
        try:
            settings = OptimizerConfig(lr=1e-3, clip_grad=0.0)
            ddp = wrap_with_ddp(build_gpt_model(model, ParallelConfig()), settings)
            optimizer, scheduler = (opt := build_optimizer(ddp, settings)), build_scheduler(opt, settings)
            if name == "all":
                micro = _naive(batch, advantages, 2)
            else:
                (micro,) = training_micro_batches(batch, advantages, micro_batch_size=2, mini_batches=1,
                                                  device=torch.device("cpu"))  # fmt: skip
            stats = forward_stats(ddp, micro, StatsRequest(vocab_size=model.vocab_size, with_entropy=False), groups)
            for mb, out in zip(micro, stats):
                mb["old_logprobs"] = out["logprobs"] + 0.05 * mb["advantages"]  # a ratio != 1
                mb["anchor_logprobs"] = out["logprobs"] - 0.1
            result = train_step(ddp, optimizer, scheduler, micro, loss_fn, groups=groups)
            results[name] = {"micro_batches": len(micro), "metrics": result.metrics, "grad_norm": result.grad_norm,
                             "params": {n: p.detach().clone() for n, p in ddp[0].module.named_parameters()}}  # fmt: skip
        finally:
            destroy_model_parallel()
    return results


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_dropping_loss_free_samples_leaves_the_update_unchanged(agg_mode):
    (results,) = run_distributed(_step, 1, agg_mode)
    full, dropped = results["all"], results["dropped"]
    assert (full["micro_batches"], dropped["micro_batches"]) == (4, 3)  # 8 samples, 3 without loss: 5 + 1 filler
    for key in ("loss", "policy_loss", "kl", "entropy"):
        assert dropped["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-5, abs=1e-7), key
    assert dropped["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5)
    assert full["grad_norm"] > 0
    # fp32, the two differ only by matmul shapes; Adam's first update is about lr * sign(grad), so a
    # rounding-level gradient near 0 may move its weight by up to 2 lr: 1e-5 is 1% of lr (1e-3)
    for name, param in full["params"].items():
        torch.testing.assert_close(dropped["params"][name], param, rtol=0, atol=1e-5)
