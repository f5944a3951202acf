"""The bytes a ``save_checkpoint`` writes, from the configs alone (no torch, no megatron): for the
pre-emption budget of a run (``benchmarks/checkpoint_save.py --recipes``) and the disk it needs.

What a save writes (``mcore.checkpoint``, torch_dist format), per parameter of ``n`` elements:

    model           n x params dtype (2 bf16/fp16, 4 fp32)
    main params     n x 4 (float32), when the params are not float32 or the optimizer is
                    distributed (its fully_reshardable format saves them either way)
    Adam m, v       2 n x 4
    anchor master   n x 4, with an EMA anchor (EMA-PG; not RPG's iterative reference)

over the parameters of ``ModelConfig.num_parameters`` with the embedding rows padded as Megatron
pads them (``ParallelConfig.padded_vocab_size``). Gradients are not saved. Left out: about 4 KiB of
zip framing per tensor file entry, ``.metadata`` (tens of KiB), the RNG states, scheduler and loop
state, the JSON files: under 1% for a 2M-parameter model, 0.01% at 1.5B
(``tests/mcore/test_checkpoint_size.py`` compares with the bytes on disk).

Per rank. Each TP x PP rank holds its part of every parameter (column/row-parallel splits and the
vocabulary over TP, layers over PP; norms are replicated over TP and written by TP rank 0). Over
DP the save is fully parallel (``mcore.checkpoint.stream.save_strategy``): Megatron's
``distribute_shards_to_ranks`` gives each tensor to the least loaded DP rank holding it, the
tensors held by fewest ranks first, then the largest first; ``per_rank`` repeats that. With the
distributed optimizer's ``dp_reshardable`` format each DP rank writes its own 1/DP of the
optimizer state (bucket padding left out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from megatron_empg.config import ModelConfig, OptimizerConfig, ParallelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4


@dataclasses.dataclass(frozen=True)
class CheckpointBytes:
    """``total``: bytes of one checkpoint; ``per_rank``: by global rank (Megatron's order: TP
    fastest, then DP, then PP); ``parts``: ``total`` by part (model, main_params, adam, anchor)."""

    total: int
    per_rank: tuple[int, ...]
    parts: Mapping[str, int]

    @property
    def max_per_rank(self) -> int:
        return max(self.per_rank)


def local_experts(model: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """Elements of each expert tensor one rank holds per layer: its ``num_experts / EP`` experts'
    fc1 and fc2, split over ETP (``[]`` for a dense model)."""
    if not model.is_moe:
        return []
    etp, f, h = parallel.expert_tp_size, model.moe_ffn_hidden_size, model.hidden_size
    return [2 * f * h // etp, f * h // etp] * (model.num_experts // parallel.expert_model_parallel_size)


def local_parameters(
    model: ModelConfig, parallel: ParallelConfig, tp_rank: int, pp_rank: int, *, experts: bool = True
) -> list[tuple[int, bool]]:
    """``(elements, replicated over TP)`` of each parameter tensor held by the rank at
    (``tp_rank``, ``pp_rank``): every layer of its pipeline stage, the embedding on the first
    stage, the final norm and the untied output layer on the last. A mixture of experts: the router
    (replicated over TP) and, when ``experts``, the rank's ``local_experts`` (not replicated over TP:
    the expert grid splits them)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h, d, ffn = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    layer = [((q + 2 * kv) * h // tp, False), (q * h // tp, False)]
    if model.is_moe:
        layer.append((model.num_experts * h, True))  # the router
        layer += [(n, False) for n in local_experts(model, parallel)] if experts else []
    else:
        layer += [(2 * ffn * h // tp, False), (ffn * h // tp, False)]
    layer += [(h, True), (h, True)]  # input and pre-MLP RMSNorm
    if model.add_qkv_bias:
        layer.append(((q + 2 * kv) // tp, False))
    if model.qk_layernorm:
        layer += [(d, True), (d, True)]
    out = layer * (model.num_layers // pp)
    vocab_rows = parallel.padded_vocab_size(model.vocab_size) // tp
    if pp_rank == 0:
        out.append((vocab_rows * h, False))
    if pp_rank == pp - 1:
        out.append((h, True))
        if not model.tie_word_embeddings:
            out.append((vocab_rows * h, False))
    return [(n, replicated) for n, replicated in out if tp_rank == 0 or not replicated]


def _distribute(tensors: list[tuple[int, tuple[int, ...]]], ranks: int) -> list[int]:
    """Bytes per rank of Megatron's ``distribute_shards_to_ranks``: ``tensors`` are ``(bytes,
    ranks holding it)``; fewest holders first, then largest first, each to its least loaded holder
    (ties: the lowest rank)."""
    load = [0] * ranks
    for size, holders in sorted(tensors, key=lambda t: (len(t[1]), -t[0])):
        rank = min(holders, key=lambda r: (load[r], r))
        load[rank] += size
    return load


def checkpoint_bytes(
    model: ModelConfig,
    parallel: ParallelConfig,
    optimizer: OptimizerConfig,
    *,
    anchor: bool,
    params_dtype: str,
    world_size: int,
    optimizer_format: str = "fully_reshardable",
) -> CheckpointBytes:
    """The bytes a save writes (module docstring) on ``world_size`` training ranks (TP x PP x DP;
    engine-only ranks write nothing), with an EMA anchor or not, the params in ``params_dtype``
    ("bfloat16", "float16", "float32") and the distributed optimizer's ``optimizer_format``."""
    if params_dtype not in DTYPE_BYTES:
        raise ValueError(f"params_dtype={params_dtype!r}: expected one of {sorted(DTYPE_BYTES)}")
    if optimizer_format not in ("fully_reshardable", "dp_reshardable"):
        raise ValueError(f"optimizer_format={optimizer_format!r}: expected fully_reshardable or dp_reshardable")
    parallel.validate_for(model, world_size)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    ranks_per_stage = world_size // pp
    distributed = optimizer.use_distributed_optimizer
    # The tensors saved per parameter (part, bytes per element): Adam's m and v are two.
    saved = [("model", DTYPE_BYTES[params_dtype]), ("adam", FP32), ("adam", FP32)]
    if params_dtype != "float32" or distributed:
        saved.append(("main_params", FP32))
    if anchor:
        saved.append(("anchor", FP32))
    own_shards = distributed and optimizer_format == "dp_reshardable"  # the optimizer's parts stay on their rank
    parts = dict.fromkeys(("model", "main_params", "adam", "anchor"), 0)
    per_rank = [0] * world_size
    every_dp_rank = tuple(range(dp))
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            tensors, own = [], 0
            for n, _ in local_parameters(model, parallel, tp_rank, pp_rank, experts=False):
                for part, size in saved:
                    parts[part] += n * size
                    if own_shards and part in ("main_params", "adam"):
                        own += n * size
                    else:
                        tensors.append((n * size, every_dp_rank))
            if own:
                tensors += [(own // dp, (r,)) for r in range(dp)]
            for dp_rank, size in enumerate(_distribute(tensors, dp)):
                per_rank[tp_rank + tp * (dp_rank + dp * pp_rank)] = size
        # The experts lie on the expert grid (ETP x EP x expert-DP per stage): counted whole, spread
        # evenly over the stage's ranks (each expert shard goes to one of its expert-DP holders).
        expert_elements = (
            sum(local_experts(model, parallel)) * parallel.expert_grid_size // pp * (model.num_layers // pp)
        )
        for part, size in saved:
            parts[part] += expert_elements * size
            for rank in range(pp_rank * ranks_per_stage, (pp_rank + 1) * ranks_per_stage):
                per_rank[rank] += expert_elements * size // ranks_per_stage
    return CheckpointBytes(total=sum(parts.values()), per_rank=tuple(per_rank), parts=parts)
