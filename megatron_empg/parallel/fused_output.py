"""Log-probs and entropy at given ids straight from the output layer's input and weight shard.

``vocab_parallel_logprobs`` reads a [T, V_local] logits tensor that the output layer wrote whole:
at 16,384 tokens and V = 151,936 that is 5 GB in bf16 before its gradient. Here the logits are
computed one chunk of tokens at a time, as in Liger-Kernel's fused linear cross-entropy, and only
one chunk exists at a time:

    forward   per chunk: logits = hidden_chunk @ weight.T in the model's dtype, then this rank's
              statistics (``vocab_parallel._local_pass``) -> ONE all-gather of [T, 2 + M] per call
              and the same reduction as ``vocab_parallel_logprobs``; saved: hidden, ids, lse (and H)
    backward  per chunk: the logits again, their gradient in the model's dtype, as the logits'
              own gradient would be (the fused Triton kernel in place where ``_local_pass`` uses it,
              ``kernels.vocab_logprob_kernels``; else ``core.logprob.logsoftmax_backward_`` in a
              float32 scratch), then grad_hidden_chunk = grad @ weight and
              grad_weight += grad.T @ hidden_chunk summed in float32; no collective

The upstream gradient of the per-token outputs is unknown until ``rl_loss`` has run on them, so
the backward recomputes each chunk's logits: four GEMMs of [T, V_local, H] instead of three.

Tensor parallelism: ``hidden`` is what every TP rank's output-layer matmul sees (after any
sequence-parallel gather), the same on all of them. Its gradient here is this rank's part only;
the caller reduces it over TP as Megatron's ColumnParallelLinear reduces its input gradient
(``mcore.step`` wraps ``hidden`` in Megatron's copy-to / gather-from-sequence-parallel region,
whose backward all-reduces / reduce-scatters).

Weight gradient: under Megatron's DDP (the weight has ``main_grad`` and ``grad_added_to_main_grad``)
the chunks are summed straight into ``main_grad`` (no [V_local, H] float32 temporary), the weight is
marked ``grad_added_to_main_grad`` and, as Megatron's gradient-accumulation fusion does, a dummy
gradient (uninitialized, [V_local, H] in the weight's dtype) is returned so that DDP's hook on the
weight's gradient accumulator still runs; none when the weight is the input embedding's on this
stage (``zero_out_wgrad``): the embedding's own gradient runs the hook, which adds it. Without DDP
the chunks are summed in a float32 buffer returned in the weight's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.torch_version import TorchVersion

from megatron_empg.core.logprob import chunk_ranges, load_masked_, logsoftmax_backward_
from megatron_empg.kernels import vocab_logprob_kernels
from megatron_empg.parallel.vocab_parallel import (
    VocabShard,
    _all_gather,
    _check_ids,
    _local_pass,
    _owned_local_ids,
    _reduce_pass,
    upstream_grads,
)

# Tokens per chunk. Each chunk's weight-gradient GEMM reads and writes the whole float32 [V_local, H]
# sum (1.9 GB at V = 151,936, H = 1536), so fewer chunks cost less: on an H100 at 16,384 tokens the
# backward took 91 ms in chunks of 256 and 44 ms in chunks of 1024, for one [1024, V_local] bf16
# buffer (311 MB) instead of 78 MB (benchmarks/fused_output.py; benchmarks/README.md).
FUSED_CHUNK_SIZE = 1024
# CUDA's addmm sums low-precision products into a float32 output from torch 2.8 (out_dtype).
_CUDA_ADDMM_OUT_DTYPE = TorchVersion(torch.__version__) >= "2.8"


@dataclass(frozen=True)
class OutputLayerInput:
    """What the output layer would turn into this TP rank's logits, given to ``rl_loss`` instead.

    Attributes:
        hidden: [B, S, H] in the model's dtype: the output layer's input as this rank's matmul sees
            it (after any sequence-parallel gather), identical on every rank of the TP group.
        weight: [V_local, H] in the model's dtype: this rank's rows of the output layer (the input
            embedding's when they are tied); logits = hidden @ weight.T.
    """

    hidden: Tensor
    weight: Tensor


def _main_grad(weight: Tensor) -> Tensor | None:
    """Megatron DDP's gradient buffer of ``weight`` ([V_local, H], usually float32), or None."""
    return getattr(weight, "main_grad", None) if hasattr(weight, "grad_added_to_main_grad") else None


def accumulate_weight_grad_(acc: Tensor, grad: Tensor, hidden: Tensor, scratch: Tensor | None) -> None:
    """acc [V_local, H] += grad.T @ hidden, the products of the model-dtype operands ``grad`` [c, V_local]
    and ``hidden`` [c, H] summed in ``acc``'s dtype. ``scratch``: None or a free [>= c, V_local] buffer
    of acc's dtype."""
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), hidden)
    elif acc.is_cuda and _CUDA_ADDMM_OUT_DTYPE:
        torch.addmm(acc, grad.t(), hidden, out_dtype=acc.dtype, out=acc)
    else:  # no mixed-dtype GEMM (CPU): the same operands, exactly upcast
        upcast = scratch[: grad.shape[0]].copy_(grad) if scratch is not None else grad.to(acc.dtype)
        acc.addmm_(upcast.t(), hidden.to(acc.dtype))


class _FusedOutputLogprobs(torch.autograd.Function):
    """log pi at global ids [T, M] (and the entropy [T]) from hidden [T, H] and a weight shard."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, shard: VocabShard, chunk_size: int, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no work for it
        num_tokens, width = hidden.shape[0], weight.shape[0]
        local_ids, owned = _owned_local_ids(ids, shard, shard.num_valid(width))
        logits = hidden.new_empty(min(chunk_size, num_tokens), width)  # the one chunk of logits
        packed = torch.cat(
            [
                _local_pass(
                    torch.mm(hidden[s:e], weight.t(), out=logits[: e - s]),
                    local_ids[s:e],
                    owned[s:e],
                    shard,
                    k=0,
                    with_entropy=with_entropy,
                    chunk_size=chunk_size,
                )
                for s, e in chunk_ranges(num_tokens, chunk_size)
            ]
        )
        del logits
        stats = _reduce_pass(_all_gather(packed, shard.tp_group), num_ids=ids.shape[1], k=0, with_entropy=with_entropy)
        ctx.shard, ctx.chunk_size = shard, chunk_size
        if not with_entropy:
            ctx.save_for_backward(hidden, weight, local_ids, owned, stats.lse)
            return stats.logprobs
        ctx.save_for_backward(hidden, weight, local_ids, owned, stats.lse, stats.entropy)
        return stats.logprobs, stats.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        hidden, weight, local_ids, owned, lse, *entropy = ctx.saved_tensors
        entropy = entropy[0] if grad_entropy is not None else None
        num_tokens, width = hidden.shape[0], weight.shape[0]
        n_valid = ctx.shard.num_valid(width)
        acc = lse.dtype
        grad_ids, grad_total = upstream_grads(grad_logprobs, owned, acc)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        main_grad = _main_grad(weight) if ctx.needs_input_grad[1] else None
        grad_weight = main_grad
        if ctx.needs_input_grad[1] and main_grad is None:
            grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        rows = min(ctx.chunk_size, num_tokens)
        logits = hidden.new_empty(rows, width)  # the chunk's logits, then its gradient in the model's dtype
        kernels = vocab_logprob_kernels(logits)
        cols = torch.where(owned, local_ids, -1) if kernels is not None else None
        scratch = torch.empty(rows, width, dtype=acc, device=hidden.device) if kernels is None else None
        for s, e in chunk_ranges(num_tokens, ctx.chunk_size):
            chunk = torch.mm(hidden[s:e], weight.t(), out=logits[: e - s])
            per_token = (
                grad_ids[s:e] if grad_ids is not None else None,
                grad_total[s:e] if grad_total is not None else None,
            )
            ent = (entropy[s:e], grad_entropy[s:e].to(acc)) if entropy is not None else (None, None)
            if kernels is not None:  # in place: one read and one write of the chunk
                grad = kernels.logsoftmax_backward(chunk, chunk, n_valid, lse[s:e], cols[s:e], *per_token, *ent)
            else:
                z = load_masked_(scratch[: e - s], chunk, n_valid)
                grad = logsoftmax_backward_(
                    z, lse[s:e], local_ids[s:e], *per_token, entropy=ent[0], grad_entropy=ent[1]
                )
                if grad.dtype != chunk.dtype:  # the model's dtype, as the gradient of whole logits would be
                    grad = chunk.copy_(grad)
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[s:e])
            if grad_weight is not None:
                accumulate_weight_grad_(grad_weight, grad, hidden[s:e], scratch)
        if main_grad is not None:  # a dummy for DDP's hook, or none when tied (module docstring)
            weight.grad_added_to_main_grad = True
            grad_weight = None if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)
        elif grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        # One None per forward argument after weight: ids, shard, chunk_size, with_entropy.
        return grad_hidden, grad_weight, None, None, None, None


def fused_output_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    chunk_size: int = FUSED_CHUNK_SIZE,
    with_entropy: bool = True,
    validate: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``vocab_parallel_logprobs`` of the logits hidden @ weight.T, never holding more than
    ``chunk_size`` tokens of them (module docstring).

    Args:
        hidden: [T, H] (bf16 or fp32), the output layer's input, the same on every TP rank.
        weight: [V_local, H] in hidden's dtype, this rank's rows (global ids from ``vocab_start``).
        ids: [T, M] int64 global ids in [0, vocab_size).
        Other arguments: as ``vocab_parallel_logprobs``.

    Returns:
        (logprobs [T, M], entropy [T] or None), float32, identical on every rank of the group.
        Backward: hidden's gradient is this rank's part (to be summed over TP by the caller);
        weight's lands in ``main_grad`` under Megatron's DDP (module docstring).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden [T, H] and weight [V_local, H] of one dtype expected, got {hidden.dtype} "
            f"{tuple(hidden.shape)} and {weight.dtype} {tuple(weight.shape)}"
        )
    if hidden.shape[0] == 0:
        raise ValueError("hidden has no tokens")
    if vocab_size < 1 or vocab_start < 0:
        raise ValueError(f"invalid vocab shard: vocab_start={vocab_start}, vocab_size={vocab_size}")
    _check_ids(ids, hidden.shape[0], vocab_size, validate)
    shard = VocabShard(vocab_start, vocab_size, tp_group)
    out = _FusedOutputLogprobs.apply(hidden, weight, ids, shard, chunk_size, with_entropy)
    return out if with_entropy else (out, None)
