"""Megatron ``GPTModel``s from a ``ModelConfig`` and a ``ParallelConfig``, and loading full weights.

In every rank, after ``parallel_state.initialize_model_parallel(parallel, seed)``::

    chunks = build_gpt_model(model_cfg, parallel)        # one GPTModel per virtual pipeline stage
    load_full_state_dict(chunks, full_state_dict)        # this rank's TP/PP slice of TP1/PP1 weights

Layer names: each chunk numbers its layers ``decoder.layers.0 ..`` locally; ``layer_offset(chunk)``
and ``global_name`` map them to the full model's indices (checkpoints and weight sync use the global
names). Megatron is imported lazily (after the CPU shims), so this module imports cheaply and its
pure-torch helpers (``tp_slice``, ``global_name``) work without megatron.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megatron_empg.config import ConfigError, ModelConfig, ParallelConfig
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.attention_backends import AttentionChoice, resolve_attention_backend
from megatron_empg.mcore.experts import expert_offset, is_expert_parameter, moe_overrides, shift_experts
from megatron_empg.mcore.fusions import FusionPlan, fusion_plan, install_wgrad_accumulation

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

# Parameters whose rows are the (padded) vocabulary, sharded over TP along dim 0.
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")
# Megatron's llama3 rope scaling has these parameters fixed (RotaryEmbedding._apply_scaling defaults).
_MEGATRON_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

TE_MISSING = (
    "Transformer Engine is not importable. It is a GPU extra that comes with the NGC PyTorch container "
    "(install this package there with `pip install -e '.[gpu]'`)."
)


def te_available() -> bool:
    """Whether megatron-core found Transformer Engine."""
    cpu_shims.import_megatron()
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def resolve_attention(model: ModelConfig, override: str | None = None) -> AttentionChoice:
    """What ``override`` (else ``model.attention_backend``) means here (``mcore.attention_backends``);
    ``te`` also needs megatron-core to have found Transformer Engine."""
    choice = resolve_attention_backend(override or model.attention_backend)
    if choice.uses_te and not te_available():
        raise ConfigError(
            "model.attention_backend",
            "te: transformer_engine imports, but megatron-core did not "
            "accept it (see megatron.core.extensions.transformer_engine); use sdpa",
        )
    return choice


# --------------------------------------------------------------------------------------------
# Configs and specs.


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype,
    use_cpu_initialization: bool,
    fp8: str | None = None,
    attention: AttentionChoice | None = None,
    fusions: FusionPlan | None = None,
    routing_replay: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``model`` split as ``parallel``.

    RMSNorm, SwiGLU, no linear biases except QKV when ``add_qkv_bias``, q/k norm when
    ``qk_layernorm``, dropout 0. ``attention``: the resolved ``model.attention_backend`` (None:
    resolve it here), which picks the TE or the local implementation. ``fusions``: the fusion
    switches (None: ``mcore.fusions.fusion_plan`` for this machine). ``routing_replay``: the routers
    can replay given experts (``mcore.router_replay``; a mixture of experts only). ``overrides`` are
    any other ``TransformerConfig`` fields (they win over both).
    """
    cpu_shims.import_megatron()
    from megatron.core.transformer import TransformerConfig

    attention = attention or resolve_attention(model)
    te = attention.uses_te
    if fp8 is not None and not te:
        raise ConfigError(
            "model.attention_backend", f"fp8={fp8!r} needs te (Transformer Engine); it is {attention.describe()}"
        )
    if parallel.sequence_parallel and not te:
        raise ConfigError(
            "parallel.sequence_parallel",
            "needs model.attention_backend te (the local spec's torch "
            f"norms do not support it); it is {attention.describe()}",
        )
    fusions = fusions or fusion_plan(attention, cuda=torch.cuda.is_available())
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.initializer_range,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        fp8=fp8,
        use_cpu_initialization=use_cpu_initialization,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        # Transformer Engine's CP attention: the ring (p2p) exchange of K/V blocks, overlapped with
        # the attention of the blocks already there (Megatron-LM's default); without TE the local
        # spec's SdpaAttention all-gathers K and V instead (mcore.attention).
        cp_comm_type="p2p",
        # The interleaved schedule sends activations and gradients to both neighbours in one call.
        # Batched, the ops go out in a fixed order (send prev, recv prev, send next, recv next): at
        # PP 2 both neighbours are one rank, whose sends and receives then pair up crossed (a
        # gradient lands where an activation was expected: silently wrong, seen on gloo with more
        # micro-batches than stages). Unbatched, Megatron orders them by rank parity (as
        # Megatron-LM does for VPP, where overlap_p2p_comm turns batching off).
        batch_p2p_comm=not parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        transformer_impl="transformer_engine" if te else "local",
        **fusions.overrides,
    )
    if routing_replay and not model.is_moe:
        raise ConfigError("algorithm.router_replay", f"replays experts; model {model.family!r} has none")
    if model.is_moe:
        kwargs.update(moe_overrides(model, parallel, grouped_gemm=te, routing_replay=routing_replay))
    kwargs.update(overrides)
    if kwargs["gradient_accumulation_fusion"]:
        install_wgrad_accumulation()
    return TransformerConfig(**kwargs)


def recompute_overrides(mode: str, num_layers: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` fields for activation recompute (``train.recompute``): ``none``;
    ``selective`` (core attention); ``full`` (every unit of ``num_layers`` layers, uniformly)."""
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": num_layers}
    raise ValueError(f"recompute mode {mode!r}: expected none, selective or full")


def layer_spec(model: ModelConfig, attention: AttentionChoice) -> ModuleSpec:
    """The TE layer spec for ``te``; else Megatron's local spec with the core attention of the
    backend (``mcore.attention``: ``SdpaAttention`` or ``UnfusedAttention``, both of which also take
    packed THD rows). A mixture of experts gets Megatron's MoE layer: TE's grouped experts with
    ``te``, else one local MLP per expert (``mlp.experts.local_experts.<j>``)."""
    cpu_shims.import_megatron()
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_empg.mcore.attention import SdpaAttention, UnfusedAttention

    if attention.uses_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=model.is_moe, qk_layernorm=model.qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=model.qk_layernorm
    )
    core = {"sdpa": SdpaAttention, "unfused": UnfusedAttention}[attention.name]
    spec.submodules.self_attention.submodules.core_attention = core
    return spec


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta  # GPTModel annotates it as int


def _apply_rope_scaling(chunk: GPTModel, model: ModelConfig) -> None:
    """Megatron's llama3 scaling fixes low/high_freq_factor and original_max_position_embeddings;
    recompute the inverse frequencies when the config's differ."""
    scaling = model.rope_scaling
    if scaling is None or not hasattr(chunk, "rotary_pos_emb"):
        return
    params = {k: scaling[k] for k in _MEGATRON_LLAMA3_DEFAULTS}
    if all(float(params[k]) == v for k, v in _MEGATRON_LLAMA3_DEFAULTS.items()):
        return
    rope = chunk.rotary_pos_emb
    d = model.kv_channels
    exponents = torch.arange(0, d, 2, dtype=torch.float32, device=rope.inv_freq.device) / d
    base = 1.0 / (_rotary_base(model.rope_theta) ** exponents)
    rope.inv_freq = rope._apply_scaling(base, factor=float(scaling["factor"]), **params)


def build_gpt_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    attention_backend: str | None = None,
    use_cpu_initialization: bool | None = None,
    fp8: str | None = None,
    meta_device: bool = False,
    **config_overrides: Any,
) -> list[GPTModel]:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (one without VPP).

    Needs Megatron's parallel state initialized with the same ``parallel`` (see
    ``mcore.parallel_state.initialize_model_parallel``), which also seeds the weights' RNG. The
    vocabulary is padded (``ParallelConfig.padded_vocab_size``); logits are vocab-sharded over TP
    (``parallel_output``). Parameters are in ``params_dtype`` (norms included); on a CUDA machine
    the chunks are moved to the current device. ``attention_backend`` (None: ``model.attention_backend``)
    picks the layer spec and core attention (``mcore.attention_backends``); the local spec's
    decoder gathers the RoPE table per token once per packed row (``mcore.thd``).
    ``use_cpu_initialization=None`` means: on CPU builds. ``meta_device``
    builds the chunks on the meta device (no memory, no initialization: shapes, names and
    ``sharded_state_dict`` only; implies CPU initialization, stays off CUDA). ``config_overrides``
    go to ``transformer_config``.
    """
    cpu_shims.import_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from megatron_empg.mcore.thd import install_per_token_rope

    parallel.validate_for(model, dist.get_world_size() if dist.is_initialized() else None)
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("model parallelism is not initialized; call parallel_state.initialize_model_parallel")
    actual = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    wanted = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_model_parallel_size,
    )
    if actual != wanted:
        raise RuntimeError(
            f"Megatron's parallel state is (TP, PP, VPP) = {actual} but the ParallelConfig asks {wanted}"
        )
    attention = resolve_attention(model, attention_backend)
    on_cuda = torch.cuda.is_available()
    if meta_device:  # Megatron's GPU initialization names the CUDA device explicitly
        use_cpu_initialization = True
    elif use_cpu_initialization is None:
        use_cpu_initialization = not on_cuda
    config = transformer_config(
        model,
        parallel,
        params_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        fp8=fp8,
        attention=attention,
        **config_overrides,
    )
    spec = layer_spec(model, attention)
    vocab_size = parallel.padded_vocab_size(model.vocab_size)
    scaling = model.rope_scaling
    vpp = parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        with torch.device("meta") if meta_device else contextlib.nullcontext():
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=vocab_size,
                max_sequence_length=model.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=model.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=1.0,
                rotary_base=_rotary_base(model.rope_theta),
                rope_scaling=scaling is not None,
                rope_scaling_factor=float(scaling["factor"]) if scaling is not None else 8.0,
                vp_stage=stage,
            )
        _apply_rope_scaling(chunk, model)
        if not attention.uses_te:
            install_per_token_rope(chunk.decoder)
        for param in chunk.parameters():  # as Megatron-LM's get_model: TP attributes on every param
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunk.to(dtype=params_dtype)  # local-spec norms are created in float32
        if config.moe_enable_routing_replay:
            from megatron_empg.mcore.router_replay import install

            install([chunk])
        if on_cuda and not meta_device:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


# --------------------------------------------------------------------------------------------
# Layer numbering across pipeline stages.


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """``decoder.layers.<i>.`` is numbered per model chunk, and experts per expert-parallel rank:
    shift both to the full model's indices."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)
    return shift_experts(name, expert_offset) if expert_offset else name


def local_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Inverse of ``global_name``."""
    return global_name(name, -layer_offset, -expert_offset)


def megatron_layer_offset(config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Megatron's global index of the first layer of (``pp_rank``, ``vp_stage``); current rank by default."""
    cpu_shims.import_megatron()
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)


def global_layer_indices(chunk: GPTModel) -> list[int]:
    """The full model's (0-based) index of each of ``chunk``'s ``decoder.layers``."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]


def layer_offset(chunk: GPTModel) -> int:
    """Global index of ``chunk``'s ``decoder.layers.0`` (its layers are consecutive)."""
    indices = global_layer_indices(chunk)
    if not indices:
        return megatron_layer_offset(chunk.config, getattr(chunk, "vp_stage", None))
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise RuntimeError(f"layers of a model chunk are not consecutive: {indices}")
    return indices[0]


def global_names(chunk: GPTModel) -> dict[str, str]:
    """``chunk``'s state-dict keys -> the full model's names."""
    offset, experts = layer_offset(chunk), expert_offset(chunk)
    return {name: global_name(name, offset, experts) for name in chunk.state_dict()}


# --------------------------------------------------------------------------------------------
# Loading a full (TP1/PP1) state dict.


def tp_partition(param: torch.Tensor | None) -> tuple[int, int] | None:
    """(partition_dim, partition_stride) of a TP-sharded parameter; None if replicated over TP."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, param.partition_stride
    return None


def tp_slice(full: torch.Tensor, partition: tuple[int, int] | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor that Megatron shards as ``partition`` (see above).

    A stride > 1 (SwiGLU's fc1 stacks [gate; up] rows: stride 2) means each rank owns every
    ``tp_size``-th of ``tp_size * stride`` equal chunks.
    """
    if partition is None or tp_size == 1:
        return full
    dim, stride = partition
    if full.size(dim) % (tp_size * stride):
        raise ValueError(f"dim {dim} of size {full.size(dim)} does not split into {tp_size} x {stride} chunks")
    chunks = torch.split(full, full.size(dim) // (tp_size * stride), dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def resize_vocab(full: torch.Tensor, rows: int, vocab_size: int | None = None) -> torch.Tensor:
    """``full`` with ``rows`` vocabulary rows: padding rows added as zeros or dropped.

    With ``vocab_size`` (the real vocabulary), rows from ``vocab_size`` on are zeroed and dropping
    a real row is an error.
    """
    if vocab_size is not None and (full.size(0) < vocab_size or rows < vocab_size):
        raise ValueError(f"vocabulary rows {full.size(0)} -> {rows} must both cover the vocab_size {vocab_size}")
    if full.size(0) > rows:
        full = full[:rows]
    elif full.size(0) < rows:
        full = torch.cat([full, full.new_zeros(rows - full.size(0), *full.shape[1:])])
    if vocab_size is not None and vocab_size < rows:
        full = full.clone()
        full[vocab_size:] = 0
    return full


def shard_full_state_dict(
    chunk: GPTModel,
    full_state_dict: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    layer_offset: int,
    *,
    vocab_size: int | None = None,
    canonical_name: Callable[[str], str] | None = None,
    expert_offset: int = 0,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> None:
    """Load this rank's TP slice of a full state dict into ``chunk`` (layers shifted by ``layer_offset``).

    Experts: this rank's ``local_experts.<j>`` is the full model's expert ``j + expert_offset``,
    split over the expert tensor-parallel ranks (``etp_rank`` of ``etp_size``) instead of TP.

    The full state dict uses global layer indices; its vocabulary rows may be padded differently
    (or not at all): they are resized to the chunk's padded vocabulary (see ``resize_vocab``). With
    tied embeddings a last pipeline stage's ``output_layer.weight`` comes from the embedding.
    ``canonical_name`` maps the chunk's names to the full state dict's spelling (the Transformer
    Engine spec's fused-norm names to the local spec's: ``weight_sync.mapping.canonical_name``).
    """
    params = dict(chunk.named_parameters())
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    sharded = {}
    for name, local in chunk.state_dict().items():
        key = global_name(name, layer_offset, expert_offset)
        if canonical_name is not None:
            key = canonical_name(key)
        full = full_state_dict.get(key)
        if full is None and tied and key == "output_layer.weight":
            full = full_state_dict.get("embedding.word_embeddings.weight")
        if not torch.is_tensor(full):
            if torch.is_tensor(local) and not name.endswith("_extra_state"):
                raise KeyError(f"{key} (local {name}) is missing from the full state dict")
            sharded[name] = local  # `_extra_state` entries: keep the chunk's own
            continue
        partition = tp_partition(params.get(name))
        if name in VOCAB_PARAMETERS:
            full = resize_vocab(full, local.size(0) * (tp_size if partition else 1), vocab_size)
        if is_expert_parameter(name):
            piece = tp_slice(full, partition, etp_rank, etp_size)
        else:
            piece = tp_slice(full, partition, tp_rank, tp_size)
        if piece.shape != local.shape:
            raise ValueError(
                f"{key}: the full tensor gives a {tuple(piece.shape)} slice, the model has {tuple(local.shape)}"
            )
        sharded[name] = piece.to(dtype=local.dtype, device=local.device).clone()
    chunk.load_state_dict(sharded, strict=True)


def load_full_state_dict(
    chunks: Sequence[GPTModel],
    full_state_dict: Mapping[str, torch.Tensor],
    *,
    vocab_size: int | None = None,
    canonical_name: Callable[[str], str] | None = None,
) -> None:
    """Load this rank's TP/PP(/VPP) slice of a TP1/PP1 state dict into its model chunks (arguments:
    ``shard_full_state_dict``)."""
    cpu_shims.import_megatron()
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp_rank, etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    for chunk in chunks:
        shard_full_state_dict(
            chunk,
            full_state_dict,
            tp_rank,
            tp_size,
            layer_offset(chunk),
            vocab_size=vocab_size,
            canonical_name=canonical_name,
            expert_offset=expert_offset(chunk),
            etp_rank=etp_rank,
            etp_size=etp_size,
        )


def named_weight_shards(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.Tensor, tuple[int, int] | None]]:
    """This rank's parameters as (global name, local tensor, TP partition) for a weight sync.

    ``chunks`` may be DDP-wrapped. The partition is ``tp_partition``'s (None: replicated over TP;
    an expert's is over the expert tensor-parallel ranks: ``is_expert_parameter``); the tensors are
    the parameters themselves (no copy). Experts carry their global index: each expert-parallel rank
    names only its own.
    """
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        offset, experts = layer_offset(module), expert_offset(module)
        for name, param in module.named_parameters():
            out.append((global_name(name, offset, experts), param, tp_partition(param)))
    return out


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits ``[..., V_padded / TP]`` -> ``[..., vocab_size]`` (padding columns dropped)."""
    cpu_shims.import_megatron()
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
