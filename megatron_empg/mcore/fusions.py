"""Megatron's fusion switches (``TransformerConfig`` fields), on where their kernels are present,
with the reason for each; and the torch stand-in for the one kernel Megatron's weight-gradient
fusion needs without Transformer Engine or apex.

    bias_activation_fusion        SwiGLU as one compiled kernel forward and backward (Megatron's
                                  ``bias_swiglu_impl``: ``torch.compile``, no TE), keeping only
                                  fc1's output for backward. On CUDA.
    gradient_accumulation_fusion  weight gradients accumulated straight into the fp32 gradient
                                  buffer (``main_grad``) by one GEMM with fp32 output, instead of a
                                  bf16 gradient then an add. TE's linears do it themselves; Megatron's
                                  own linears (the local spec's, and the output layer on every spec)
                                  call ``fused_weight_gradient_mlp_cuda``, apex's, or where apex is
                                  missing ``WgradAccumulation`` below. On CUDA.
    apply_rope_fusion             TE's fused RoPE (the TE spec): needs Transformer Engine.
    masked_softmax_fusion         the fused scale-mask-softmax of the unfused attention's scores
                                  (apex/TE CUDA extensions), and what the TE spec runs with.
    persist_layer_norm            apex's persistent LayerNorm kernel: not for RMSNorm, always off
                                  (torch's RMSNorm is one fused kernel on CUDA).
    bias_dropout_fusion           off: without biases and with dropout 0 it is one add.

On CPU every switch is off: the compiled and mixed-dtype kernels are for CUDA (the tests turn
them on one at a time and compare with the unfused model).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import torch

from megatron_empg.mcore.attention_backends import AttentionChoice
from megatron_empg.parallel.fused_output import accumulate_weight_grad_

FUSIONS = (
    "bias_activation_fusion",
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
)
_SOFTMAX_EXTENSIONS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda")


@dataclasses.dataclass(frozen=True)
class FusionPlan:
    """``overrides``: the ``TransformerConfig`` fields of ``FUSIONS``; ``reasons``: field -> why."""

    overrides: dict[str, bool]
    reasons: dict[str, str]

    def describe(self) -> str:
        on = [f for f in FUSIONS if self.overrides[f]]
        off = [f for f in FUSIONS if not self.overrides[f]]
        return "; ".join([*(f"{f} on ({self.reasons[f]})" for f in on), *(f"{f} off ({self.reasons[f]})" for f in off)])


def fusion_plan(attention: AttentionChoice, *, cuda: bool) -> FusionPlan:
    """Which fusions a model on ``attention``'s spec runs with, on a CUDA machine or not."""
    te = attention.uses_te
    plan: dict[str, tuple[bool, str]] = {
        "persist_layer_norm": (
            False,
            "apex's persistent kernel is LayerNorm only; RMSNorm is " + ("TE's" if te else "torch's fused kernel"),
        ),
        "bias_dropout_fusion": (False, "no biases and dropout 0: one add, nothing to fuse"),
    }
    if not cuda:
        reason = "CPU: the compiled and mixed-dtype kernels are for CUDA"
        plan.update(
            dict.fromkeys(
                (
                    "bias_activation_fusion",
                    "gradient_accumulation_fusion",
                    "apply_rope_fusion",
                    "masked_softmax_fusion",
                ),
                (False, reason),
            )
        )
    else:
        plan["bias_activation_fusion"] = (True, "SwiGLU by torch.compile")
        kernel = "apex's kernel" if _apex_wgrad() else "a torch GEMM with fp32 output"
        plan["gradient_accumulation_fusion"] = (
            True,
            f"TE's linears; the output layer through {kernel}" if te else f"Megatron's linears through {kernel}",
        )
        plan["apply_rope_fusion"] = (True, "TE's fused RoPE") if te else (False, "needs Transformer Engine")
        if attention.name == "sdpa":
            plan["masked_softmax_fusion"] = (False, "sdpa's kernels fuse the softmax")
        elif te or _softmax_extensions():
            plan["masked_softmax_fusion"] = (True, "TE's attention" if te else "apex's softmax kernels")
        else:
            plan["masked_softmax_fusion"] = (False, "needs apex's or TE's softmax extensions")
    return FusionPlan({f: plan[f][0] for f in FUSIONS}, {f: plan[f][1] for f in FUSIONS})


def _apex_wgrad() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _softmax_extensions() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in _SOFTMAX_EXTENSIONS)


# --------------------------------------------------------------------------------------------
# Weight-gradient accumulation without apex.


def _addmm_(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output.T [out, tokens] @ total_input [tokens, in] (apex's argument
    order; leading dims are flattened into tokens): ``parallel.fused_output.accumulate_weight_grad_``,
    one GEMM with fp32 output on CUDA."""
    accumulate_weight_grad_(
        main_grad, grad_output.reshape(-1, grad_output.shape[-1]), total_input.reshape(-1, total_input.shape[-1]), None
    )


WgradAccumulation = types.SimpleNamespace(wgrad_gemm_accum_fp32=_addmm_, wgrad_gemm_accum_fp16=_addmm_)
"""apex's ``fused_weight_gradient_mlp_cuda`` interface (``wgrad_gemm_accum_fp32/fp16(input,
grad_output, main_grad)``), in torch."""


def install_wgrad_accumulation() -> None:
    """Let Megatron's linears use ``gradient_accumulation_fusion`` without apex: its layers module
    looks the kernel module up at call time. Does nothing where apex's kernel is installed."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return
    layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
    layers._grad_accum_fusion_available = True
