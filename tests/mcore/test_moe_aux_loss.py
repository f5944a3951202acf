"""The router's auxiliary losses in the RL objective, and the step's ``moe/*`` metrics.

One rank, tiny-qwen3-moe, two micro-batches of different loss-token counts (so that a scale by the
tokens, Megatron's default for a per-token loss, would show). ``train_step`` runs on the same
weights with the router losses off (coefficients 0) and on (aux 0.05, z 0.02); the gradients
(fp32, finalized by Megatron DDP, read before they are used: clipping off) must differ by
exactly

    c_aux * d/dw mean_mb sum_layers aux_ref + c_z * d/dw mean_mb sum_layers z_ref

where aux_ref and z_ref are computed here from the routers' inputs and weights on a separate,
unwrapped copy of the model: Megatron's switch load-balancing loss E * sum_e f_e P_e (f_e: the
fraction of the micro-batch's token choices that went to e, P_e: the mean softmax score of e) and
the z-loss mean_t logsumexp(logits_t)^2. The metrics are checked against the same router logits;
the dropped-token fraction on a third model with capacity factor 1 against the count that the
capacity admits per expert. Independence of the DP size: test_moe_model's EP 2 layouts (DP 2 and
4, aux loss on) equal the one-rank run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen3-moe"
C_AUX, C_Z = 0.05, 0.02
S = 12


def _microbatches(vocab_size: int):
    from megatron_empg.core.microbatch import MicroBatch

    g = torch.Generator().manual_seed(5)
    out = []
    for rows, start in ((2, 3), (3, 7)):  # 18 and 15 loss tokens
        ids = torch.randint(0, vocab_size, (rows, S + 1), generator=g)
        mask = torch.zeros(rows, S, dtype=torch.bool)
        mask[:, start:] = True
        out.append(MicroBatch(ids[:, :S], ids[:, 1:], mask))
    return out


def _loss_fn(vocab_size: int):
    from megatron_empg.core.aggregation import LossSum
    from megatron_empg.parallel.rl_loss import RLLoss

    def loss_fn(logits, batch, *, vocab_start, tp_group):
        logprobs = torch.log_softmax(logits.float()[..., :vocab_size], -1).gather(-1, batch.target_ids[..., None])[
            ..., 0
        ]
        total = LossSum(-(logprobs * batch.loss_mask).sum(), batch.loss_mask.sum())
        return RLLoss(total, {"loss": LossSum(total.loss_sum.detach(), total.count)})

    return loss_fn


def _step_grads(model_cfg, full: dict, microbatches) -> tuple[dict, dict]:
    """One ``train_step`` on ``full``'s weights: (name -> finalized fp32 gradient, metrics)."""
    from megatron_empg.config import OptimizerConfig, ParallelConfig
    from megatron_empg.mcore import model as mcore_model
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import current_groups
    from megatron_empg.mcore.step import train_step
    from megatron_empg.parallel.rl_loss import loss_units

    chunks = mcore_model.build_gpt_model(model_cfg, ParallelConfig(moe_token_dispatcher_type="alltoall"))
    mcore_weights.load_full_state_dict(chunks, full)
    settings = OptimizerConfig(lr=1e-3, clip_grad=1e9)  # no clipping: the gradients stay as finalized
    ddp = wrap_with_ddp(chunks, settings)
    optimizer = build_optimizer(ddp, settings)
    result = train_step(
        ddp,
        optimizer,
        build_scheduler(optimizer, settings),
        microbatches,
        _loss_fn(model_cfg.vocab_size),
        groups=current_groups(),
        loss_units=loss_units,
    )
    return {n: p.main_grad.clone() for n, p in chunks[0].named_parameters()}, result.metrics


def _reference(model_cfg, full: dict, microbatches) -> dict:
    """Router losses and routing of the unwrapped model (router losses off) from its routers'
    inputs: their gradients and per-micro-batch, per-layer values and expert counts."""
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore import model as mcore_model
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.step import causal_mask

    model = mcore_model.build_gpt_model(model_cfg, ParallelConfig())[0]
    mcore_weights.load_full_state_dict([model], full)
    model.train()
    routers = [layer.mlp.router for layer in model.decoder.layers]
    captured: list = []
    for router in routers:
        router.register_forward_hook(lambda module, args, out: captured.append((module, args[0])))
    E, k = model_cfg.num_experts, model_cfg.moe_router_topk
    aux_total = z_total = 0.0
    values = {"aux": [], "z": [], "counts": []}
    for batch in microbatches:
        captured.clear()
        b, s = batch.input_ids.shape
        model(batch.input_ids, torch.arange(s).expand(b, s), causal_mask(s))
        for router, hidden in captured:
            logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().T  # [T, E]
            T = logits.shape[0]
            scores = torch.softmax(logits, -1)
            chosen = scores.topk(k, -1).indices
            counts = torch.bincount(chosen.flatten(), minlength=E).float()  # no gradient
            aux = E * sum((counts[e] / (T * k)) * scores[:, e].mean() for e in range(E))
            z = (torch.logsumexp(logits, -1) ** 2).mean()
            aux_total = aux_total + aux / len(microbatches)
            z_total = z_total + z / len(microbatches)
            values["aux"].append(aux.item())
            values["z"].append(z.item())
            values["counts"].append(counts)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(C_AUX * aux_total + C_Z * z_total, list(params.values()), allow_unused=True)
    values["grad"] = {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}
    return values


def _worker(rank: int, world_size: int) -> dict:
    from megatron_empg.config import ParallelConfig, load_model_config
    from megatron_empg.mcore import model as mcore_model
    from megatron_empg.mcore import weights as mcore_weights
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    base = load_model_config(MODEL)
    off = dataclasses.replace(base, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None)
    on = dataclasses.replace(base, moe_aux_loss_coeff=C_AUX, moe_z_loss_coeff=C_Z)
    capped = dataclasses.replace(base, moe_expert_capacity_factor=1.0)
    initialize_model_parallel(ParallelConfig(), seed=3)
    try:
        full = {  # a full state dict names experts one by one (a stacked weight row by row)
            name: view.clone()
            for k, v in mcore_model.build_gpt_model(off, ParallelConfig())[0].state_dict().items()
            if torch.is_tensor(v)
            for name, view, _ in mcore_weights.split_experts(k, v)
        }
        microbatches = _microbatches(base.vocab_size)
        grads_off, metrics_off = _step_grads(off, full, microbatches)
        grads_on, metrics_on = _step_grads(on, full, microbatches)
        _, metrics_capped = _step_grads(capped, full, microbatches)
        reference = _reference(off, full, microbatches)
    finally:
        destroy_model_parallel()
    return {
        "diff": {n: grads_on[n] - grads_off[n] for n in grads_on},
        "grads_off": grads_off,
        "metrics_off": metrics_off,
        "metrics_on": metrics_on,
        "metrics_capped": metrics_capped,
        "reference": reference,
        "T": [mb.input_ids.numel() for mb in microbatches],
    }


@pytest.fixture(scope="module")
def result() -> dict:
    return run_distributed(_worker, 1, timeout=200)[0]


def test_router_losses_add_their_coefficient_times_their_mean_gradient(result):
    expected = result["reference"]["grad"]
    touched = 0
    for name, diff in result["diff"].items():
        torch.testing.assert_close(diff, expected[name], rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
        touched += bool(expected[name].abs().max() > 1e-6)
    # the router losses reach the routers and, through their inputs, the layers below
    assert any("router" in n for n in expected) and touched > 10
    router = "decoder.layers.0.mlp.router.weight"
    assert result["diff"][router].abs().max() > 100 * result["grads_off"][router].abs().max() * 1e-4


def test_metrics_are_the_router_logits_statistics(result):
    ref = result["reference"]
    metrics = result["metrics_on"]
    assert metrics["moe/aux_loss"] == pytest.approx(sum(ref["aux"]) / len(ref["aux"]), rel=1e-5)
    assert metrics["moe/z_loss"] == pytest.approx(sum(ref["z"]) / len(ref["z"]), rel=1e-5)
    layers = 2
    per_layer = [sum(ref["counts"][m * layers + layer] for m in range(2)) for layer in range(layers)]
    imbalance = max((c.max() / c.mean()).item() for c in per_layer)
    assert metrics["moe/expert_load_max_over_mean"] == pytest.approx(imbalance, rel=1e-6)
    assert "moe/z_loss" not in result["metrics_off"] and "moe/dropped_tokens" not in result["metrics_on"]
    # the metrics do not depend on the coefficients
    assert result["metrics_off"]["moe/aux_loss"] == pytest.approx(metrics["moe/aux_loss"], rel=1e-6)


def test_dropped_tokens_is_the_fraction_over_capacity(result):
    ref = result["reference"]
    E, k = 8, 2
    dropped = wanted = 0.0
    for i, counts in enumerate(ref["counts"]):
        T = result["T"][i // 2]
        capacity = math.ceil(T * k / E * 1.0)
        dropped += (counts - capacity).clamp(min=0).sum().item()
        wanted += T * k
    assert dropped > 0
    assert result["metrics_capped"]["moe/dropped_tokens"] == pytest.approx(dropped / wanted, rel=1e-6)
