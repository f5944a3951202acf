"""``rl_loss`` on an ``OutputLayerInput`` (hidden, weight shard) against the unfused path, at TP = 1 and 2.

The unfused path is what the model does without the hook: logits = hidden @ weight.T in the
model's dtype (autograd's matmul), then ``rl_loss`` on those logits. Both must give the same
(sum, count), metrics, hidden gradient (summed over the TP ranks, as Megatron's output layer
reduces its input gradient) and weight-shard gradient, in fp32 to a few ulps and in bf16 to a
stated tolerance; at TP 2 each rank's results also equal the TP 1 unfused ones (fp32). Vocab 37 in
2 x 19 rows: the padded row holds large values that would dominate every softmax if not masked.
Chunks of 4 tokens over 15: several chunks and a short last one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.parallel.fused_output import OutputLayerInput, fused_output_logprobs
from megatron_empg.parallel.rl_loss import rl_loss
from tests.dist import run_distributed

B, S, H, V, K = 3, 5, 16, 37, 4
TP, WIDTH = 2, 19  # V_pad = 38
CHUNK = 4

CASES = {
    # the Top-k KL recipe (tests/mcore/test_train_step.py): PPO clip, reverse Top-k KL with its
    # sampled tail, importance-weighted; the entropy as a metric only
    "ppo_topk_tail_entropy_metric": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28},
        kl="topk",
        kl_coef=0.1,
        kl_args={"direction": "reverse", "tail_grad": "unbiased", "importance_weight": True},
        agg_mode="token-mean",
    ),
    # a gradient through the entropy too (the second [chunk, V] temporary of the backward)
    "topk_forward_entropy_bonus": dict(
        policy_loss="ppo_clip",
        kl="topk",
        kl_coef=0.2,
        kl_args={"direction": "forward", "tail_grad": "reference"},
        entropy_coef=0.02,
        agg_mode="seq-mean-token-sum",
    ),
    # R1-Distill's recipe: dual-clip PPO, the sampled K3 KL, seq-mean-token-mean
    "r1_dualclip_k3_seqmean": dict(
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 3.0},
        kl="k3",
        kl_coef=0.1,
        agg_mode="seq-mean-token-mean",
    ),
    # no entropy at all: the forward's single-statistic path
    "k1_iw_no_entropy": dict(
        policy_loss="ppo_clip",
        kl="k1",
        kl_coef=0.05,
        kl_args={"importance_weight": True},
        log_entropy=False,
        agg_mode="token-mean",
    ),
}

# fp32: the same products summed in another order (chunks of 4, per-chunk weight-gradient GEMMs).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16: both paths round the logits and their gradient to bf16 and differ only in how the GEMMs
# block their sums; the weight gradient here is float32 over the chunks then rounded once (or not
# at all, in main_grad), there one GEMM over all tokens rounded once. Seen on CPU: identical at
# these sizes; at H = 512, T = 384, V = 3001 identical but the weight gradient, 1.8e-4 of its
# largest element (while either is 3e-2 from float64). Bounds: loss and metrics 1e-3, gradients
# 1e-2 of their largest element (2.5 bf16 ulps), room for another GEMM's blocking (cuBLAS).
BF16_TOL = dict(rtol=1e-3, atol=1e-3)
BF16_GRAD_REL = 1e-2


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = 0.6 * torch.randn(TP * WIDTH, H, generator=g)
    weight[V:] = 5.0  # padding: logits ~ 5 * sum(hidden), far above the real ones when unmasked
    log_p = torch.log_softmax(hidden @ weight[:V].T, -1)
    target = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[2, :2] = False
    old = log_p.gather(-1, target[..., None])[..., 0] + 0.3 * torch.randn(B, S, generator=g)
    anchor_log_p = torch.log_softmax(hidden @ weight[:V].T + 0.5 * torch.randn(B, S, V, generator=g), -1)
    topk_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * S)]).reshape(B, S, K)
    batch = MicroBatch(
        input_ids=target,
        target_ids=target,
        loss_mask=mask,
        advantages=torch.randn(B, S, generator=g),
        old_logprobs=old,
        anchor_logprobs=anchor_log_p.gather(-1, target[..., None])[..., 0],
        topk_ids=topk_ids,
        topk_anchor_logprobs=anchor_log_p.gather(-1, topk_ids),
    )
    return {"hidden": hidden, "weight": weight, "batch": batch}


def _run(inputs: dict, case: dict, *, fused: bool, dtype: torch.dtype, start: int, width: int, group) -> dict:
    """rl_loss from the weight rows [start, start + width), fused or through whole logits."""
    hidden = inputs["hidden"].to(dtype).clone().requires_grad_(True)
    weight = inputs["weight"][start : start + width].to(dtype).clone().requires_grad_(True)
    source = OutputLayerInput(hidden, weight) if fused else hidden @ weight.T
    out = rl_loss(source, inputs["batch"], vocab_start=start, vocab_size=V, tp_group=group, chunk_size=CHUNK, **case)
    grad_hidden, grad_weight = torch.autograd.grad(out.loss.loss_sum, (hidden, weight))
    if group is not None:  # what the output layer's input-gradient all-reduce does
        dist.all_reduce(grad_hidden, group=group)
    return {
        "loss_sum": out.loss.loss_sum.item(),
        "count": out.loss.count.item(),
        "metrics": {name: m.loss_sum.item() for name, m in out.metrics.items()},
        "grad_hidden": grad_hidden.float(),
        "grad_weight": grad_weight.float(),
    }


def _both(inputs: dict, dtype: torch.dtype, *, start: int, width: int, group) -> dict:
    kw = dict(dtype=dtype, start=start, width=width, group=group)
    return {
        name: {"fused": _run(inputs, case, fused=True, **kw), "unfused": _run(inputs, case, fused=False, **kw)}
        for name, case in CASES.items()
    }


def _compare(ours: dict, ref: dict, dtype: torch.dtype) -> None:
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert ours["count"] == ref["count"]
    torch.testing.assert_close(ours["loss_sum"], ref["loss_sum"], **tol)
    assert ours["metrics"].keys() == ref["metrics"].keys()
    for name, value in ref["metrics"].items():
        torch.testing.assert_close(ours["metrics"][name], value, **tol, msg=lambda m: f"metric {name}: {m}")
    for name in ("grad_hidden", "grad_weight"):
        expected, actual = ref[name], ours[name]
        assert expected.abs().max() > 0
        if dtype == torch.float32:
            torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{name}: {m}")
        else:
            error = ((actual - expected).abs().max() / expected.abs().max()).item()
            assert error < BF16_GRAD_REL, f"{name}: max error {error:.2e} of the largest element"


@pytest.fixture(scope="module")
def inputs() -> dict:
    return _inputs()


def _tp_worker(rank: int, world_size: int, inputs: dict) -> dict:
    kw = dict(start=rank * WIDTH, width=WIDTH, group=dist.group.WORLD)
    return {dtype: _both(inputs, dtype, **kw) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def tp2_results(inputs) -> list[dict]:
    return run_distributed(_tp_worker, TP, inputs, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_equals_unfused_tp1(inputs, name, dtype):
    results = _both(inputs, dtype, start=0, width=TP * WIDTH, group=None)[name]
    _compare(results["fused"], results["unfused"], dtype)
    assert results["fused"]["grad_weight"][V:].abs().max() == 0  # the padding row gets no gradient


@pytest.mark.dist
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_equals_unfused_tp2(inputs, tp2_results, name, dtype):
    tp1 = _both(inputs, torch.float32, start=0, width=TP * WIDTH, group=None)[name]["unfused"]
    for rank, per_dtype in enumerate(tp2_results):
        results = per_dtype[dtype][name]
        _compare(results["fused"], results["unfused"], dtype)
        if dtype == torch.float32:  # and both equal the whole vocabulary on one rank
            rows = slice(rank * WIDTH, (rank + 1) * WIDTH)
            _compare(results["fused"], {**tp1, "grad_weight": tp1["grad_weight"][rows]}, dtype)


def _megatron_like_weight(weight: torch.Tensor, *, zero_out_wgrad: bool) -> torch.nn.Parameter:
    """A parameter as Megatron's DDP leaves it: a float32 ``main_grad`` (already holding an earlier
    micro-batch's gradient) and ``grad_added_to_main_grad``."""
    param = torch.nn.Parameter(weight.clone())
    param.main_grad = torch.full(weight.shape, 0.5)
    param.grad_added_to_main_grad = False
    if zero_out_wgrad:
        param.zero_out_wgrad = True
    return param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_gradient_lands_in_main_grad(inputs, dtype):
    case = CASES["ppo_topk_tail_entropy_metric"]
    ref = _both(inputs, dtype, start=0, width=TP * WIDTH, group=None)["ppo_topk_tail_entropy_metric"]["unfused"]
    for zero_out_wgrad in (False, True):
        hidden = inputs["hidden"].to(dtype).clone().requires_grad_(True)
        weight = _megatron_like_weight(inputs["weight"].to(dtype), zero_out_wgrad=zero_out_wgrad)
        out = rl_loss(
            OutputLayerInput(hidden, weight),
            inputs["batch"],
            vocab_start=0,
            vocab_size=V,
            tp_group=None,
            chunk_size=CHUNK,
            **case,
        )
        out.loss.loss_sum.backward()
        assert weight.grad_added_to_main_grad  # DDP's hook will not add weight.grad again
        if zero_out_wgrad:  # shared with the embedding: only the embedding's gradient will run the hook
            assert weight.grad is None
        added = weight.main_grad - 0.5  # summed in float32, never rounded to the weight's dtype
        _compare({**ref, "grad_weight": added}, ref, dtype)


def test_bad_inputs_raise(inputs):
    hidden, weight = inputs["hidden"][0], inputs["weight"]
    ids = torch.zeros(S, 1, dtype=torch.int64)
    kw = dict(vocab_start=0, vocab_size=V, tp_group=None)
    with pytest.raises(ValueError, match="of one dtype"):
        fused_output_logprobs(hidden, weight.bfloat16(), ids, **kw)
    with pytest.raises(ValueError, match="weight \\[V_local, H\\]"):
        fused_output_logprobs(hidden, weight[:, :-1], ids, **kw)
    with pytest.raises(ValueError, match="ids must be in"):
        fused_output_logprobs(hidden, weight, ids + V, **kw)
    with pytest.raises(ValueError, match="^hidden must be \\[B, S, \\*\\]"):
        rl_loss(OutputLayerInput(hidden, weight), inputs["batch"], **kw)
