"""The terms of a rank's GPU memory, each a closed form of the config (``trainer.bind.memory_plan`` adds
them up per phase). Torch-free: the config module only.

Bytes per token and layer that one transformer layer keeps for its backward (``layer_activations``;
bf16, h = hidden, q = heads x head_dim and kv = groups x head_dim of this TP rank, f = ffn / TP):

    RMSNorms (input, pre-MLP)   2 x (c_norm h + 4)       (q/k norms: c_norm (q + kv) + 4 (heads + groups))
    QKV input, fc1 input        2h + 2h
    RoPE cos, sin (q and k)     8 head_dim
    attention, sdpa / te        2q (q after RoPE) + 2kv (k after RoPE) + 2(q + 2kv) (the QKV output, kept by v)
                                + 2q (the output, which is also the projection's input: SDPA's and varlen's
                                outputs are laid out [s, heads, dim] in memory) + 4 heads (logsumexp)
    attention, unfused          2q (q) + 4q (k, v expanded to the query heads) + 2q (the projection's input),
                                and 6 heads x L per token of a sequence of L (fp32 softmax + bf16 copy)
    SwiGLU                      10f (fc1 output 4f, silu output 2f, the up half + 0.0 2f, fc2 input 2f);
                                6f fused (fc1 output, fc2 input)
    mixture of experts          in place of the SwiGLU, per token: k x (S + 2h + 32) + 11 E, for top-k
                                routing to E experts of F = moe_ffn / ETP (each routed copy keeps its
                                permuted input 2h, its expert's SwiGLU S and its probability and
                                indices; the router its fp32 logits and probabilities). S by
                                ``model.moe_experts``: grouped 10F (fc1 output 4F, silu output 2F, the
                                product before the probs 2F, fc2 input 2F), 6F fused (the fused weighted
                                SwiGLU keeps fc1's output only, and fc2 its input); sequential and te 12F,
                                8F fused (an estimate: 12F less the 4F the dense fusion saves). Measured
                                on the CPU, grouped fused included (tests/trainer/test_memory_plan.py).
                                Routing is taken as balanced: an
                                expert-parallel rank receives, on average, k copies of as many tokens as
                                it sends; a capacity factor bounds the imbalance, dropless runs can exceed it.

A LoRA policy (frozen base) keeps 4 bytes less per norm element (the float32 normalized copy only
the norm weight's gradient needs; measured on the CPU, taken to hold on CUDA) and each adapter's
``x A^T``, 2r per token and adapted projection.

c_norm (``Calibration.norm_bytes_per_element``) is what torch's RMSNorm keeps per element: 8 on the
CPU (its composite form keeps two float32 copies: measured with ``saved_tensors_hooks``,
``tests/trainer/test_memory_plan.py``), 6 on CUDA, fitted to the one GPU run of the step (H100,
torch 2.11, the unfused local spec: 129 KB per token and layer measured, 130.6 KB by this formula).
The other GPU-only constants are ``Calibration``'s too, each with where it comes from.
"""

from __future__ import annotations

import dataclasses

from megatron_empg.config import ModelConfig, ParallelConfig, RunConfig
from megatron_empg.mcore.checkpoint.size import DTYPE_BYTES, local_experts, local_parameters

GIB = 2**30
MIB = 2**20
FP32 = 4
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The constants of the plan that only a GPU shows, in one place."""

    norm_bytes_per_element: float = 6.0  # CUDA, fitted to the H100 run (module docstring); CPU: 8, measured
    # Estimates, not measured yet (the smoke kit's train_step records the allocator's peak, not these):
    cuda_context: int = 600 * MIB  # the CUDA context, cuBLAS workspaces and NCCL buffers of one process
    allocator_slack: float = 0.05  # the caching allocator's reserve beyond its peak (expandable segments)
    engine_asleep: int = 1 * GIB  # a vLLM engine asleep: its CUDA context and graph pool stay
    fused_output_chunk: int = 1024  # parallel.fused_output.FUSED_CHUNK_SIZE
    vocab_chunk: int = 256  # core.logprob.DEFAULT_CHUNK_SIZE: the torch vocab path's fp32 scratch rows


CUDA = Calibration()
CPU = dataclasses.replace(CUDA, norm_bytes_per_element=8.0)


@dataclasses.dataclass(frozen=True)
class RankShape:
    """What one training rank holds of the model: ``params`` (elements on this TP x PP rank, its
    experts included), ``expert_params`` (of those, the experts': their optimizer state is sharded
    over the expert data-parallel ranks), ``layers`` on its pipeline stage, ``vocab_rows`` (its shard
    of the padded vocabulary), whether it has the output layer (last stage), and the largest weight
    it computes a gradient for."""

    params: int
    layers: int
    vocab_rows: int
    last_stage: bool
    largest_weight: int
    expert_params: int = 0
    adapters: int = 0  # a LoRA policy's adapter elements on this rank (beside ``params``, its frozen base)
    decoder_linears: int = 0  # the attention's and a dense MLP's linear weights (FP8 in an FP8 anchor)

    @property
    def trainable(self) -> int:
        """The elements that get gradients, optimizer state and an anchor master: the adapters of a
        LoRA policy, else every parameter."""
        return self.adapters or self.params


def lora_layer_parameters(model: ModelConfig, tp: int) -> int:
    """A layer's adapter elements on one of ``tp`` ranks (``mcore.lora.layers``: a column-parallel
    linear's B and a row-parallel one's A split over TP, the other matrix whole)."""
    lora = model.lora
    h, d, f = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    shapes = {  # target: (A's input columns on the rank, B's output rows on the rank)
        "q_proj": (h, q // tp),
        "k_proj": (h, kv // tp),
        "v_proj": (h, kv // tp),
        "o_proj": (q // tp, h),
        "gate_proj": (h, f // tp),
        "up_proj": (h, f // tp),
        "down_proj": (f // tp, h),
    }
    return sum(lora.rank * (a + b) for a, b in (shapes[t] for t in lora.resolved_targets(moe=model.is_moe)))


def rank_shape(model: ModelConfig, parallel: ParallelConfig, pp_rank: int) -> RankShape:
    """The ``RankShape`` of TP rank 0 (which also holds the replicated norms) of stage ``pp_rank``.
    A tied embedding is held twice on a last stage that is not the first (Megatron keeps a copy)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    tensors = [n for n, _ in local_parameters(model, parallel, 0, pp_rank)]
    vocab_rows = parallel.padded_vocab_size(model.vocab_size) // tp
    last = pp_rank == pp - 1
    if last and model.tie_word_embeddings and pp > 1:
        tensors.append(vocab_rows * model.hidden_size)
    layers = model.num_layers // pp
    adapters = layers * lora_layer_parameters(model, tp) if model.lora is not None else 0
    h, d = model.hidden_size, model.kv_channels
    q, kv = model.num_attention_heads * d, model.num_query_groups * d
    mlp = 0 if model.is_moe else 3 * model.ffn_hidden_size * h
    return RankShape(
        params=sum(tensors),
        layers=layers,
        vocab_rows=vocab_rows,
        last_stage=last,
        largest_weight=max(tensors),
        expert_params=layers * sum(local_experts(model, parallel)),
        adapters=adapters,
        decoder_linears=layers * ((2 * q + 2 * kv) * h + mlp) // tp,
    )


def moe_activations(model: ModelConfig, etp: int, *, fused_swiglu: bool) -> float:
    """Bytes per token a mixture-of-experts MLP keeps for backward (module docstring)."""
    f, k = model.moe_ffn_hidden_size // etp, model.moe_router_topk
    if model.moe_experts == "grouped":
        swiglu = 6 if fused_swiglu else 10
    else:
        swiglu = 8 if fused_swiglu else 12
    return k * (swiglu * f + BF16 * model.hidden_size + 32) + 11 * model.num_experts


def moe_forward_bytes(model: ModelConfig, etp: int, *, fused_swiglu: bool) -> float:
    """Bytes per token of a mixture-of-experts MLP's working set in a forward-only pass: each routed
    copy's permuted input and SwiGLU intermediates, the router's fp32 logits and probabilities."""
    f, k = model.moe_ffn_hidden_size // etp, model.moe_router_topk
    return k * (BF16 * model.hidden_size + (6 if fused_swiglu else 8) * f) + 2 * FP32 * model.num_experts


def moe_dispatch_bytes(model: ModelConfig, tokens: int) -> int:
    """One layer's token exchange in flight: the routed copies sent and received (bf16)."""
    return 2 * BF16 * model.hidden_size * model.moe_router_topk * tokens if model.is_moe else 0


def layer_activations(
    model: ModelConfig,
    tp: int,
    attention: str,
    *,
    fused_swiglu: bool,
    cp: int = 1,
    cal: Calibration = CUDA,
    etp: int | None = None,
) -> tuple[float, float]:
    """(bytes per token, bytes per token x sequence length) one layer keeps for backward (module
    docstring); the second is the unfused attention's scores, 0 for the fused backends. Under
    context parallelism (``cp`` > 1) per token of this rank's share, plus the K and V gathered from
    the other CP ranks, which the attention keeps: 4 kv (cp - 1). A mixture of experts splits its
    experts over ``etp`` ranks (None: ``tp``)."""
    h, d = model.hidden_size, model.kv_channels
    heads = model.num_attention_heads // tp
    groups = max(1, model.num_query_groups // tp)
    q, kv, f = heads * d, groups * d, model.ffn_hidden_size // tp
    norm = cal.norm_bytes_per_element
    if model.lora is not None:  # a frozen norm weight: its gradient's float32 normalized copy is not kept
        norm -= FP32
    linear = 2 * (norm * h + 4) + BF16 * h + BF16 * h + 8 * d
    if model.qk_layernorm:
        linear += norm * (q + kv) + 4 * (heads + groups)
    if attention == "unfused":
        linear += BF16 * (q + 2 * q + q)
        quadratic = 6 * heads
    else:
        linear += BF16 * (q + kv + (q + 2 * kv) + q) + FP32 * heads + BF16 * 2 * kv * (cp - 1)
        quadratic = 0
    if model.is_moe:
        linear += moe_activations(model, etp or tp, fused_swiglu=fused_swiglu)
    else:
        linear += (6 if fused_swiglu else 10) * f
    if model.lora is not None:  # each adapter's x A^T [r], kept for B's gradient (x is the base's input)
        linear += BF16 * model.lora.rank * len(model.lora.resolved_targets(moe=model.is_moe))
    return linear, quadratic


def sequence_terms(tokens: int, max_seq_len: int) -> int:
    """Sum of L^2 over the sequences of a row of ``tokens`` at worst: as many ``max_seq_len``
    sequences as fit, then one of the rest."""
    full, rest = divmod(tokens, max_seq_len)
    return full * max_seq_len**2 + rest**2


def logits_bytes(tokens: int, vocab_rows: int, *, inplace_backward: bool, padded_rows: int) -> int:
    """The update pass's logits [tokens, V_local] bf16 on the last stage, with their gradient (in
    place by default) and, for padded micro-batches of several rows, GPTModel's transposed copy."""
    copies = 1 + (0 if inplace_backward else 1) + (1 if padded_rows > 1 else 0)
    return copies * tokens * vocab_rows * BF16


def params_bytes(model: ModelConfig, dtype: str, tp: int = 1) -> int:
    """The whole model's weights in ``dtype``, split over ``tp`` (an engine's copy)."""
    return model.num_parameters() * DTYPE_BYTES[dtype] // tp


def kv_cache_bytes_per_token(model: ModelConfig, dtype: str, tp: int = 1) -> int:
    """K and V of one token over every layer, as an engine caches them."""
    groups = max(1, model.num_query_groups // tp)
    return 2 * model.num_layers * groups * model.kv_channels * DTYPE_BYTES[dtype]


def microbatch_tensor_bytes(config: RunConfig, tokens: int, k: int) -> int:
    """The per-token tensors of a step's micro-batches (ids, targets, mask, advantages, sampler and
    old / anchor log-probs, positions, the Top-k ids and log-probs) over ``tokens``."""
    per_token = 8 + 8 + 1 + 4 + 4 + 8 + 8 + 4 + 4 + 4 + k * (8 + 4)
    return per_token * tokens


def bucket_file_bytes(config: RunConfig, model: ModelConfig) -> int:
    """The largest weight-sync bucket file: ``weight_sync.bucket_size_mb``, or the whole model if
    smaller, but never less than its largest tensor (a bucket holds at least one), plus a header."""
    size = DTYPE_BYTES[config.train.params_dtype]
    largest = max(model.vocab_size, model.ffn_hidden_size, model.num_attention_heads * model.kv_channels)
    largest *= model.hidden_size * size
    whole = model.num_parameters() * size
    return max(min(int(config.weight_sync.bucket_size_mb * 2**20), whole), largest) + 2**20
