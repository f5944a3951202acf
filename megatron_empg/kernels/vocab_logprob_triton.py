"""Fused Triton kernels for the passes of ``parallel.vocab_parallel`` (the update pass; the anchor
and old passes, whose top-k columns come from ``topk_triton``).

Both kernels run one program per token row, streaming the row's V_local columns of this TP rank's
logits shard [T, V_local] (bf16 or fp32; accumulation in fp32) in blocks of ``BLOCK``:

    local_stats          ONE read of the logits: online max / sum exp(z - max) (and the sum of
                         exp(z - max) (z - max), for the entropy) over the n_valid real columns,
                         plus the logits at the M requested ids this rank owns, written as the
                         packed statistics [T, 1 + E + M] of ``vocab_parallel._local_pass`` at k = 0:
                             lse_local | sum_j p_j^local z_j (E) | z at the owned ids (0 elsewhere)
    logsoftmax_backward  ONE read and ONE write of [T, V_local] (in place when ``grad`` is ``logits``):
                             d/dz_j = [j = id_m] g_m - p_j (G + g_H (log p_j + H)),  p_j = exp(z_j - lse)
                         with the global lse after the TP all-gather, G = sum of g_m over all ids;
                         padding columns get 0.

As in Liger-Kernel's fused cross-entropy, each row is one program (int64 row offsets: T * V_local
exceeds 2^31), the softmax is online (no second read for the max), and the gradient at the
requested ids is computed in fp32 before the block loop, from their logits (which the loop may
overwrite in place), and stored after it: [j = id] g - p_j G cancels as p_j -> 1, so the id term
is added before the one rounding to the logits' dtype. The forward keeps the running sums as
per-lane vectors against a per-row running max: one cross-lane reduction (the block max) per block,
the sums reduced once at the end.

Dispatch (``megatron_empg.kernels.vocab_logprob_kernels``): the environment variable
``EMPG_VOCAB_KERNEL`` selects the implementation, read at each call:

    auto    (default) these kernels when the logits are on CUDA, triton imports and the logits
            are bf16 / fp32 with unit column stride (at k > 0 with ``topk_triton`` for the top-k,
            up to its ``MAX_K``); else the chunked torch path
    triton  the same, on any device: CPU tensors run under Triton's interpreter, which must be
            on (TRITON_INTERPRET=1) when triton is first imported and at each launch (tests);
            raises if triton does not import
    torch   always the chunked torch path

This module imports triton at import time; the dispatch imports it only when it is selected, so
``megatron_empg`` imports without triton.
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_empg.kernels import KERNEL_DTYPES

# Bytes of logits per program iteration: 8192 bf16 / 4096 fp32 columns on 16 / 8 warps (16 values
# per thread). Compiled for sm_90 that is 48-64 registers per thread and no spills in both kernels:
# two bf16 programs of 512 threads per SM. benchmarks/vocab_kernel.py sweeps the alternatives. A
# module attribute, so that tests can force many blocks per row.
BLOCK_BYTES = 16384


@triton.jit
def _local_stats_kernel(
    logits_ptr,
    logits_row_stride,
    width,
    n_valid,
    cols_ptr,
    num_ids,
    out_ptr,
    out_row_stride,
    WITH_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    out_ptr += row * out_row_stride
    offsets = tl.arange(0, BLOCK)
    row_max = float("-inf")
    sum_exp = tl.zeros([BLOCK], dtype=tl.float32)  # per lane: sum exp(z - shift)
    sum_exp_z = tl.zeros([BLOCK], dtype=tl.float32)  # per lane: sum exp(z - shift) (z - shift)
    for start in range(0, n_valid, BLOCK):
        cols = start + offsets
        # Loads masked at the row's width (a multiple of 16 under Megatron's padding: 16 B vector
        # loads), the padding then set to -inf: a mask at n_valid would split them into scalars.
        z = tl.load(logits_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        z = tl.where(cols < n_valid, z, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(z, axis=0))
        # The reference point of the sums: the running max, or 0 while every value was -inf
        # (exp(-inf - -inf) would be NaN). scale -> 0 when nothing came before.
        old_shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        scale = tl.exp(row_max - shift)
        e = tl.exp(z - shift)
        if WITH_ENTROPY:
            # sum e (z - shift) = scale (sum e_old (z - old_shift) + sum e_old (old_shift - shift))
            e_z = e * tl.where(e > 0, z - shift, 0.0)  # not 0 * -inf at padding and -inf logits
            sum_exp_z = (sum_exp_z + sum_exp * (old_shift - shift)) * scale + e_z
        sum_exp = sum_exp * scale + e
        row_max = new_max
    total = tl.sum(sum_exp, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    tl.store(out_ptr, shift + tl.log(total))  # -inf for a shard of padding only
    if WITH_ENTROPY:
        mean = tl.sum(sum_exp_z, axis=0) / tl.where(total > 0, total, 1.0) + shift  # 0 / 1 if no mass
        tl.store(out_ptr + 1, mean)
    ids = tl.arange(0, BLOCK_M)
    id_cols = tl.load(cols_ptr + row * num_ids + ids, mask=ids < num_ids, other=-1)
    z_ids = tl.load(logits_ptr + id_cols, mask=id_cols >= 0, other=0.0).to(tl.float32)
    tl.store(out_ptr + (2 if WITH_ENTROPY else 1) + ids, z_ids, mask=ids < num_ids)


@triton.jit
def _softmax_term(z, lse, grad_total, entropy, grad_entropy, HAS_ENTROPY_GRAD: tl.constexpr):
    """-p (G + g_H (log p + H)) in fp32; 0 where z = -inf."""
    log_p = z - lse
    p = tl.exp(log_p)
    coef = grad_total
    if HAS_ENTROPY_GRAD:
        coef = coef + grad_entropy * (tl.where(z == float("-inf"), 0.0, log_p) + entropy)
    return -p * coef


@triton.jit
def _logsoftmax_backward_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    width,
    n_valid,
    lse_ptr,
    grad_total_ptr,
    entropy_ptr,
    grad_entropy_ptr,
    cols_ptr,
    grad_ids_ptr,
    num_ids,
    HAS_IDS_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    lse = tl.load(lse_ptr + row)
    grad_total = 0.0
    entropy = 0.0
    grad_entropy = 0.0
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + row)
        grad_entropy = tl.load(grad_entropy_ptr + row)
    if HAS_IDS_GRAD:
        # The id columns' gradient, from their logits read before the loop may overwrite them (in
        # place), stored after it: only these two [BLOCK_M] vectors stay live across the loop.
        grad_total = tl.load(grad_total_ptr + row)
        ids = tl.arange(0, BLOCK_M)
        id_cols = tl.load(cols_ptr + row * num_ids + ids, mask=ids < num_ids, other=-1)
        grad_ids = tl.load(grad_ids_ptr + row * num_ids + ids, mask=id_cols >= 0, other=0.0)
        z_ids = tl.load(logits_ptr + id_cols, mask=id_cols >= 0, other=0.0).to(tl.float32)
        same = id_cols[:, None] == id_cols[None, :]  # [BLOCK_M, BLOCK_M]: a repeated id sums its g
        grad_at_ids = tl.sum(tl.where(same, grad_ids[None, :], 0.0), axis=1)
        grad_at_ids += _softmax_term(z_ids, lse, grad_total, entropy, grad_entropy, HAS_ENTROPY_GRAD)
        tl.debug_barrier()  # every warp has read the id logits before any warp writes a block
    offsets = tl.arange(0, BLOCK)
    for start in range(0, width, BLOCK):
        cols = start + offsets
        valid = cols < n_valid
        z = tl.load(logits_ptr + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        z = tl.where(valid, z, float("-inf"))  # as in the forward: vector loads, then the padding
        grad = _softmax_term(z, lse, grad_total, entropy, grad_entropy, HAS_ENTROPY_GRAD)
        grad = tl.where(valid, grad, 0.0)
        tl.store(grad_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < width)
    if HAS_IDS_GRAD:
        tl.debug_barrier()  # the loop's stores to the id columns land before these
        tl.store(grad_ptr + id_cols, grad_at_ids.to(grad_ptr.dtype.element_ty), mask=id_cols >= 0)


def launch_config(width: int, dtype: torch.dtype, *, forward: bool = False) -> tuple[int, int]:
    """(BLOCK columns per program iteration, num_warps) for rows of ``width`` columns of ``dtype``.
    The forward reads half as many bytes per iteration: on one H100 (bf16, 151,936 columns, with
    the entropy; benchmarks/results/vocab_kernel_gpu.json's sweep) 4096 columns on 8 warps took
    2.19 ms against 3.42 ms for 8192 on 16, which the backward prefers (3.56 ms against 3.68)."""
    nbytes = BLOCK_BYTES // 2 if forward else BLOCK_BYTES
    block = min(triton.next_power_of_2(max(width, 1)), max(16, nbytes // dtype.itemsize))
    return block, 16 if block >= 8192 else 8 if block >= 1024 else 4


def _config(logits: Tensor, block_size: int | None, num_warps: int | None, *, forward: bool) -> tuple[int, int]:
    block, warps = launch_config(logits.shape[1], logits.dtype, forward=forward)
    return block_size or block, num_warps or warps


def _check(logits: Tensor, cols: Tensor) -> None:
    if logits.dtype not in KERNEL_DTYPES or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(
            f"logits must be {KERNEL_DTYPES} with unit column stride, got {logits.dtype} strides {logits.stride()}"
        )
    if cols.dtype != torch.int64 or cols.shape[0] != logits.shape[0] or not cols.is_contiguous():
        raise ValueError(f"cols must be contiguous int64 [T, M], got {cols.dtype} {tuple(cols.shape)}")


def local_stats(
    logits: Tensor,
    cols: Tensor,
    n_valid: int,
    *,
    with_entropy: bool,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """This rank's packed statistics at k = 0 (module docstring): one read of ``logits``.

    Args:
        logits: [T, V_local] bf16 / fp32, unit column stride; columns >= ``n_valid`` are
            padding, masked to -inf.
        cols: [T, M] int64 contiguous: the local column of each requested id, -1 where another rank
            owns it.
        n_valid: real columns of this shard (0 <= n_valid <= V_local).
        with_entropy: also the column sum_j p_j^local z_j.
        block_size, num_warps: override ``launch_config`` (benchmark sweeps).

    Returns:
        [T, 1 + E + M] float32: lse_local (-inf where n_valid = 0) | mean logit (E) | z at the
        owned ids (0 elsewhere).
    """
    _check(logits, cols)
    num_tokens, num_ids = cols.shape
    out = torch.empty(num_tokens, (2 if with_entropy else 1) + num_ids, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return out
    block, warps = _config(logits, block_size, num_warps, forward=True)
    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
        _local_stats_kernel[(num_tokens,)](
            logits,
            logits.stride(0),
            logits.shape[1],
            n_valid,
            cols,
            num_ids,
            out,
            out.stride(0),
            WITH_ENTROPY=with_entropy,
            BLOCK=block,
            BLOCK_M=triton.next_power_of_2(max(num_ids, 1)),
            num_warps=warps,
        )
    return out


def logsoftmax_backward(
    logits: Tensor,
    grad: Tensor,
    n_valid: int,
    lse: Tensor,
    cols: Tensor,
    grad_ids: Tensor | None,
    grad_total: Tensor | None,
    entropy: Tensor | None,
    grad_entropy: Tensor | None,
    *,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Gradient w.r.t. this rank's logits of sum_m g_m log p(id_m) + g_H H (module docstring).

    Args:
        logits: [T, V_local] bf16 / fp32, unit column stride.
        grad: [T, V_local] of the logits' dtype, unit column stride: the output; may be ``logits``
            itself (in place: each block is read before it is written, the id logits before all).
        n_valid: real columns of this shard; the padding columns get 0.
        lse: [T] float32 logsumexp over every rank's columns.
        cols: [T, M] int64 contiguous, local column of each id or -1 (not owned).
        grad_ids: [T, M] float32 gradient of the log-probs (read only where owned), or None (no
            gradient through the log-probs); grad_total: [T] float32 sum of g over all ids, or None
            with ``grad_ids``.
        entropy, grad_entropy: [T] float32, or None (no gradient through the entropy).
        block_size, num_warps: override ``launch_config``.

    Returns:
        ``grad``.
    """
    _check(logits, cols)
    if grad.shape != logits.shape or grad.dtype != logits.dtype or (grad.shape[1] > 1 and grad.stride(1) != 1):
        raise ValueError(f"grad must be {logits.dtype} {tuple(logits.shape)} with unit column stride")
    num_tokens, width = logits.shape
    if num_tokens == 0:
        return grad
    block, warps = _config(logits, block_size, num_warps, forward=False)
    lse = lse.float().contiguous()

    def f32(t: Tensor | None) -> Tensor:  # an absent input's pointer is never read: any fp32 tensor
        return lse if t is None else t.float().contiguous()

    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
        _logsoftmax_backward_kernel[(num_tokens,)](
            logits,
            logits.stride(0),
            grad,
            grad.stride(0),
            width,
            n_valid,
            lse,
            f32(grad_total),
            f32(entropy),
            f32(grad_entropy),
            cols,
            f32(grad_ids),
            cols.shape[1],
            HAS_IDS_GRAD=grad_ids is not None,
            HAS_ENTROPY_GRAD=grad_entropy is not None,
            BLOCK=block,
            BLOCK_M=triton.next_power_of_2(max(cols.shape[1], 1)),
            num_warps=warps,
        )
    return grad
