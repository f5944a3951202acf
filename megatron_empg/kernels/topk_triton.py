"""Fused Triton top-k over a vocab shard: the top-k columns of ``vocab_parallel._local_pass`` at
k > 0 (the old pass of a reverse Top-k KL, the anchor pass of a forward one).

``topk(logits, k, n_valid)`` gives, per token row of this TP rank's logits shard [T, V_local]
(bf16 or fp32), the k largest of its first ``n_valid`` columns, exactly as
``core.logprob.topk_value_then_id`` on the fp32-upcast row: values descending, ties to the LOWER
column, whatever the straddle of a tie at the k-th place; -0.0 ties +0.0 (they compare equal);
NaN ranks above +inf (as in ``torch.topk``), NaNs among themselves by column, which is torch's
result whenever a row's NaNs fit in k (beyond that torch's choice among NaNs is arbitrary).
Columns >= ``n_valid`` (vocab padding) are never selected.

Keys. Each fp32 value maps to an int32 of the same order (its bits for v >= 0, minus its magnitude
bits for v < 0, so that -0.0 = +0.0; any NaN to INT32_MAX), and with the column to one int64

    key = ord(v) << 32 | (2^31 - 1 - column)

so that a larger key is a larger value, or the same value at a lower column: the tie rule is a
plain max.

Streaming: one program per row, ONE read of its logits in blocks of ``BLOCK`` columns, no [T, V]
temporary, no host sync. The program keeps the k best keys so far in a [K_PAD] register vector
(unordered; until filled, distinct keys below every column's) and their minimum, the k-th key.
Blocks go in column order, so a column of a later block loses every tie against a kept one: a
block can contribute only when its largest ord exceeds the k-th key's, one int32 reduction per
block, which is all most blocks cost once the first ones have raised the threshold (on random
logits some k ln(V_local / BLOCK) columns are ever kept). A block that can contribute inserts its
keys best first, each replacing the current minimum, until its best remaining key is below the
k-th one: k + 1 block reductions for the first block, one more than it keeps for a later one. At
the end the kept keys are sorted, the columns decoded, and the values loaded again at those k
columns (the logit itself, -0.0 and NaN payloads included).

Cost: the insertion loop is serial in the kept keys, so the kernel serves 1 <= k <= ``MAX_K``;
above it ``megatron_empg.kernels.vocab_topk_kernel`` answers None and ``_local_pass`` takes the
chunked torch path (``topk`` itself raises). Dispatch and ``TRITON_INTERPRET`` as for
``vocab_logprob_triton``.
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl
from torch import Tensor

from megatron_empg.kernels import KERNEL_DTYPES

# The largest k served: the first block alone costs k + 1 block-wide reductions per row.
MAX_K = 128
# Columns per program iteration: a block that can contribute holds BLOCK int64 keys across its
# insertion loop (16 per thread on 8 warps at 4096). A module attribute, so that tests can force
# many blocks per row; benchmarks/topk_kernel.py sweeps it.
BLOCK_COLUMNS = 4096

_PAD_ORD = tl.constexpr(-(2**31))  # below every value's ord (-inf is -0x7F800000): never kept
_INT64_MIN = tl.constexpr(-(2**63))  # a removed or non-candidate key: below the placeholders
_INT64_MAX = tl.constexpr(2**63 - 1)  # the slots >= k: never the minimum


@triton.jit
def _ord(z):
    """fp32 -> int32 of the same order; -0.0 and +0.0 -> 0, any NaN -> INT32_MAX."""
    bits = z.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    ords = tl.where(bits < 0, -magnitude, magnitude)
    return tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, ords)


@triton.jit
def _key(ords, cols):
    """(ord, column) -> int64, larger for a larger ord, then for a lower column (< 2^31)."""
    return (ords.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _topk_kernel(
    logits_ptr,
    logits_row_stride,
    width,
    n_valid,
    k,
    values_ptr,
    ids_ptr,
    BLOCK: tl.constexpr,
    K_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    offsets = tl.arange(0, BLOCK)
    slots = tl.arange(0, K_PAD)
    top = tl.where(slots < k, _key(tl.full([K_PAD], _PAD_ORD, tl.int32), slots), _INT64_MAX)
    kth = tl.min(top, axis=0)
    kth_ord = (kth >> 32).to(tl.int32)
    for start in range(0, n_valid, BLOCK):
        cols = start + offsets
        # As in vocab_logprob_triton: loads masked at the width (vector loads), then the padding.
        z = tl.load(logits_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        ords = tl.where(cols < n_valid, _ord(z), _PAD_ORD)
        if tl.max(ords, axis=0) > kth_ord:
            keys = tl.where(ords > kth_ord, _key(ords, cols), _INT64_MIN)
            best = tl.max(keys, axis=0)
            while best > kth:
                top = tl.where(top == kth, best, top)  # keys are distinct: one slot
                kth = tl.min(top, axis=0)
                keys = tl.where(keys == best, _INT64_MIN, keys)
                best = tl.max(keys, axis=0)
            kth_ord = (kth >> 32).to(tl.int32)
    top = tl.sort(tl.where(slots < k, top, _INT64_MIN), descending=True)
    top_cols = 0x7FFFFFFF - (top & 0x7FFFFFFF)
    out = row * k + slots
    tl.store(ids_ptr + out, top_cols, mask=slots < k)
    values = tl.load(logits_ptr + top_cols, mask=slots < k, other=0.0).to(tl.float32)
    tl.store(values_ptr + out, values, mask=slots < k)


def launch_config(width: int) -> tuple[int, int]:
    """(BLOCK columns per program iteration, num_warps) for rows of ``width`` columns."""
    block = min(triton.next_power_of_2(max(width, 1)), max(16, BLOCK_COLUMNS))
    return block, 8 if block >= 2048 else 4


def topk(
    logits: Tensor, k: int, n_valid: int, *, block_size: int | None = None, num_warps: int | None = None
) -> tuple[Tensor, Tensor]:
    """The k largest of each row's first ``n_valid`` columns (module docstring): one read of ``logits``.

    Args:
        logits: [T, V_local] bf16 / fp32, unit column stride, any row stride; columns >= ``n_valid``
            are padding, never selected.
        k: 1 <= k <= min(n_valid, ``MAX_K``) (above ``MAX_K``: the torch path, see the module).
        n_valid: real columns of this shard (n_valid <= V_local < 2^31).
        block_size, num_warps: override ``launch_config`` (benchmark sweeps).

    Returns:
        (values [T, k] float32, descending; ids [T, k] int64 local columns), equal to
        ``core.logprob.topk_value_then_id(logits[:, :n_valid].float(), k)``.
    """
    num_tokens, width = logits.shape
    if logits.dtype not in KERNEL_DTYPES or (width > 1 and logits.stride(1) != 1):
        raise ValueError(
            f"logits must be {KERNEL_DTYPES} with unit column stride, got {logits.dtype} strides {logits.stride()}"
        )
    if not 0 <= n_valid <= min(width, 2**31 - 1):
        raise ValueError(f"n_valid={n_valid} must be in [0, V_local={width}]")
    if not 1 <= k <= min(n_valid, MAX_K):
        raise ValueError(f"k={k} must be in [1, min(n_valid={n_valid}, MAX_K={MAX_K})]")
    values = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return values, ids
    block, warps = launch_config(width)
    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
        _topk_kernel[(num_tokens,)](
            logits,
            logits.stride(0),
            width,
            n_valid,
            k,
            values,
            ids,
            BLOCK=block_size or block,
            K_PAD=max(16, triton.next_power_of_2(k)),
            num_warps=num_warps or warps,
        )
    return values, ids
