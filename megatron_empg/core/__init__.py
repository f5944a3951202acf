"""Pure-torch RL math on one device: no torch.distributed, no megatron.

Dimension letters used in docstrings:
    B  sequences in a batch        S  positions per sequence (padded)
    T  tokens, any leading shape [*] flattened or not
    V  vocabulary (real, unpadded)  K  top-k index-set size
Per-token tensors are float32 unless stated; masks are bool; token ids are int64.

Every loss-like function returns per-token values and, through `aggregation.aggregate`, a
`LossSum(loss_sum, count)`; only `aggregation.divide_by_count` divides, by a global count.
"""
