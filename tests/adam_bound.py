"""How far apart Adam can move two runs' parameters whose gradients differ by rounding: the tolerance
of every test that compares parameters after optimizer steps across layouts (docs/testing.md,
"Tolerances after an optimizer step").

Two layouts (TP, PP, CP, DP, packing, micro-batch counts, another CPU vector width) sum the same
terms in another order, so their gradients differ by rounding, ~1e-7 of a tensor's scale. Adam then
divides by sqrt(v): an element whose gradient nearly cancels turns a 1e-12 difference into a
parameter difference of up to ~lr. A fixed ``atol`` on the parameters therefore holds on one CPU
and not on another. The rule here instead:

- the gradients of the first step (same weights on both sides) are compared tightly
  (``assert_grads_close``): that is where a layout bug shows;
- each step's applied gradients are recorded on both sides (``applied_grads``), and the parameters
  must agree within what Adam allows for the recorded gradient differences (``adam_drift_bound``):
  a bound, not an observation, so it holds on any CPU. A layout bug in the update itself (a stale
  shard, a wrong moment) moves a parameter by ~lr where the bound is ~1e-8.

The bound, for torch's AdamW (Megatron's CPU and fused Adam compute the same) at step t over the
gradient history g_1..g_t, with m_hat = sum_i a_i g_i and v_hat = sum_i b_i g_i^2 (bias-corrected
weights a_i = (1-b1) b1^(t-i) / (1-b1^t), b_i = (1-b2) b2^(t-i) / (1-b2^t), so sum b_i = 1) and
s = sqrt(v_hat): the update is lr_t * f with f = m_hat / (s + eps).
- |f| <= R_t = sqrt(sum_i a_i^2 / b_i) (Cauchy-Schwarz), so two updates differ by at most 2 R_t lr_t;
- |df/dg_i| <= (a_i + R_t sqrt(b_i)) / (s + eps), and along the segment between the two histories
  s >= max(s, s') - sqrt(sum_i b_i d_i^2) (s is a weighted 2-norm), d_i = |g_i - g'_i|;
- decoupled weight decay multiplies both parameters by (1 - lr wd) <= 1: it shrinks the difference.
So |p_T - p'_T| <= sum_t lr_t min(2 R_t, sum_i (a_i + R_t sqrt(b_i)) d_i / (s_lo + eps)), plus the
rounding of the update arithmetic itself (a few float32 ulps of |p| and of the update per step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

FLOAT32_ULP = 2.0**-23
# Rounding of one Adam step's arithmetic (decay, moments, sqrt, division, subtraction), in float32
# ulps of |p| + lr * R_t: each is correctly rounded, and a vector unit may fuse a multiply-add.
ULPS_PER_STEP = 8
# The first step's gradients, same weights on both sides, differ by rounding only: up to 7e-7 of
# the tensor's largest element (test_train_step's TP 2 and DP 2, AVX-512); 1e-5 of it is 14x that,
# and no division amplifies it. The suite passes with it under AVX-512, AVX2 and default.
GRAD_RTOL_OF_SCALE = 1e-5


def _weights(t: int, beta1: float, beta2: float) -> tuple[Tensor, Tensor, float]:
    """Adam's bias-corrected weights of g_1..g_t in m_hat (a) and v_hat (b), float64 [t] each, and
    R_t, the largest |m_hat| / sqrt(v_hat)."""
    age = torch.arange(t - 1, -1, -1, dtype=torch.float64)  # t - i for i = 1..t
    a = (1 - beta1) * beta1**age / (1 - beta1**t)
    b = (1 - beta2) * beta2**age / (1 - beta2**t)
    return a, b, math.sqrt(float((a * a / b).sum()))


def adam_step_bound(lr: float, step: int, *, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most one Adam update at ``step`` (1-based) can move an element: lr * R_t, whatever the
    gradients. Two runs differ by at most twice this per step."""
    return lr * _weights(step, beta1, beta2)[2]


def adam_drift_bound(
    grads: Sequence[Tensor],
    ref_grads: Sequence[Tensor],
    lrs: Sequence[float],
    *,
    beta1: float,
    beta2: float,
    eps: float,
) -> Tensor:
    """Per element, the most that ``len(lrs)`` Adam steps from equal parameters can put between two
    runs whose applied gradients (after clipping) were ``grads`` and ``ref_grads`` (one tensor per
    step, any shape, the same on both sides). float64, that shape. Module docstring: derivation."""
    assert len(grads) == len(ref_grads) == len(lrs), (len(grads), len(ref_grads), len(lrs))
    ours = torch.stack([g.detach().double() for g in grads])  # [T, *shape]
    ref = torch.stack([g.detach().double() for g in ref_grads])
    diff = (ours - ref).abs()
    bound = torch.zeros_like(ref[0])
    for t, lr in enumerate(lrs, start=1):
        a, b, reach = _weights(t, beta1, beta2)
        shape = (t,) + (1,) * (ref.dim() - 1)
        a, b = a.view(shape), b.view(shape)
        s_ours = (b * ours[:t] ** 2).sum(0).sqrt()
        s_ref = (b * ref[:t] ** 2).sum(0).sqrt()
        s_low = (torch.maximum(s_ours, s_ref) - (b * diff[:t] ** 2).sum(0).sqrt()).clamp(min=0)
        lipschitz = ((a + reach * b.sqrt()) * diff[:t]).sum(0) / (s_low + eps)
        bound += lr * torch.clamp(lipschitz, max=2 * reach)
    return bound


def rounding_slack(params: Tensor, lrs: Sequence[float], *, beta1: float = 0.9, beta2: float = 0.999) -> Tensor:
    """What the update arithmetic's own rounding can add over ``len(lrs)`` steps: ``ULPS_PER_STEP``
    float32 ulps of |p| + the step's largest update, per step. float64, the shape of ``params``."""
    reach = sum(adam_step_bound(lr, t, beta1=beta1, beta2=beta2) for t, lr in enumerate(lrs, start=1))
    return len(lrs) * ULPS_PER_STEP * FLOAT32_ULP * (params.detach().double().abs() + reach)


def assert_params_within_adam_bound(
    params: Tensor,
    ref_params: Tensor,
    grads: Sequence[Tensor],
    ref_grads: Sequence[Tensor],
    lrs: Sequence[float],
    *,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float,
    what: str,
) -> None:
    """``params`` within ``adam_drift_bound`` (plus ``rounding_slack``) of ``ref_params``, element by
    element; the message names the worst element, its difference and its bound."""
    bound = adam_drift_bound(grads, ref_grads, lrs, beta1=beta1, beta2=beta2, eps=eps)
    bound = bound + rounding_slack(ref_params, lrs, beta1=beta1, beta2=beta2)
    diff = (params.detach().double() - ref_params.detach().double()).abs()
    excess = diff - bound
    if params.shape != ref_params.shape or bool((excess > 0).any()):
        worst = int(excess.argmax()) if params.shape == ref_params.shape else 0
        raise AssertionError(
            f"{what}: shapes {tuple(params.shape)} vs {tuple(ref_params.shape)}, or element {worst} differs by "
            f"{diff.flatten()[worst]:.3g}, past Adam's bound {bound.flatten()[worst]:.3g} for its gradients "
            f"(which differ by {max(float((g - r).abs().flatten()[worst]) for g, r in zip(grads, ref_grads)):.3g})"
        )


def assert_grads_close(grad: Tensor, ref_grad: Tensor, what: str) -> None:
    """The same weights' gradients, summed in another order: within ``GRAD_RTOL_OF_SCALE`` of the
    reference tensor's largest element (an all-zero reference must be matched exactly)."""
    scale = float(ref_grad.abs().max()) if ref_grad.numel() else 0.0
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=GRAD_RTOL_OF_SCALE * scale, msg=lambda m: f"{what}: {m}")


def applied_grads(ddp_models, optimizer) -> dict[int, Tensor]:
    """The gradients the last optimizer step applied (after clipping), by ``id`` of the model
    parameter, whole (this rank's TP shard of it), float32 copies. Read after ``train_step`` and before
    the next one zeroes them.

    Megatron's fp32 optimizer points each parameter's ``.grad`` at its ``main_grad`` and clips it in
    place; the distributed optimizer gives each DP rank a range of every parameter, so the ranges
    are put together over the optimizer's DP group (a collective: every rank of it calls this)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out: dict[int, Tensor] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            out.update(_gathered_shards(opt))
            continue
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                out[id(param)] = param.grad.detach().float().clone()
        # bf16 parameters: Adam steps their float32 main copies
        for model_group, main_group in zip(
            getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])
        ):
            for model_param, main_param in zip(model_group, main_group):
                out[id(model_param)] = out.pop(id(main_param))
    return out


def _gathered_shards(opt) -> dict[int, Tensor]:
    """A distributed optimizer's applied gradients, each DP rank's range of every parameter
    all-reduced into whole tensors over its DP group (each element is owned by one rank)."""
    owned = {}
    pairs = [*zip(opt.model_fp32_groups, opt.shard_fp32_groups)]
    pairs += zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)  # bf16: float32 main shards
    for model_group, shard_group in pairs:
        for model_param, shard in zip(model_group, shard_group):
            owned[id(model_param)] = (opt._get_model_param_range_map(model_param)["param"], shard.grad)
    out = {}
    for buffer in opt.buffers:  # the same parameters, in the same order, on every DP rank
        for param in buffer.params:
            whole = torch.zeros(param.numel(), dtype=torch.float32)
            if id(param) in owned:
                span, grad = owned[id(param)]
                whole[span.start : span.end] = grad.detach().float()
            torch.distributed.all_reduce(whole, group=opt.data_parallel_group)
            out[id(param)] = whole.view(param.shape)
    return out


def named_applied_grads(chunks, ddp_models, optimizer) -> dict[str, Tensor]:
    """``applied_grads`` under the global names ``mcore.weights.named_weight_shards`` gives the
    parameters (a stacked expert weight's gradient row by row, per expert); a frozen parameter
    (a LoRA policy's base) has none."""
    from megatron_empg.mcore import weights as mcore_weights

    by_id = applied_grads(ddp_models, optimizer)
    named = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        layers, experts = mcore_weights.layer_offset(module), mcore_weights.expert_offset(module)
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            for expert, grad, _ in mcore_weights.split_experts(name, by_id[id(param)]):
                named[mcore_weights.global_name(expert, layers, experts)] = grad
    return named
