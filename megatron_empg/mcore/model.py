"""Megatron ``GPTModel``s from a ``ModelConfig`` and a ``ParallelConfig``.

In every rank, after ``parallel_state.initialize_model_parallel(parallel, seed)``::

    chunks = build_gpt_model(model_cfg, parallel)        # one GPTModel per virtual pipeline stage
    load_full_state_dict(chunks, full_state_dict)        # mcore.weights: this rank's TP/PP slice

Megatron is imported lazily (after the CPU shims), so this module imports cheaply.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from megatron_empg.config import ConfigError, ModelConfig, ParallelConfig
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.attention_backends import AttentionChoice, resolve_attention_backend
from megatron_empg.mcore.fusions import FusionPlan, fusion_plan, install_wgrad_accumulation
from megatron_empg.mcore.lora import model as lora_model
from megatron_empg.mcore.moe.backends import ExpertsChoice, resolve_moe_experts
from megatron_empg.mcore.moe.layout import moe_overrides

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

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


def resolve_experts(
    model: ModelConfig, attention: AttentionChoice, override: str | None = None
) -> ExpertsChoice | None:
    """What ``override`` (else ``model.moe_experts``) means here for layers on ``attention``'s spec
    (``mcore.moe.backends``); ``te`` also needs megatron-core to have found Transformer Engine.
    None for a dense model."""
    if not model.is_moe:
        return None
    choice = resolve_moe_experts(override or model.moe_experts, attention)
    if choice.name == "te" and not te_available():
        raise ConfigError(
            "model.moe_experts",
            "te: transformer_engine imports, but megatron-core did not accept it "
            "(see megatron.core.extensions.transformer_engine); use grouped",
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
    experts: ExpertsChoice | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``model`` split as ``parallel``.

    RMSNorm, SwiGLU, no linear biases except QKV when ``add_qkv_bias``, q/k norm when
    ``qk_layernorm``, dropout 0. ``attention``: the resolved ``model.attention_backend`` (None:
    resolve it here), which picks the TE or the local implementation. ``fusions``: the fusion
    switches (None: ``mcore.fusions.fusion_plan`` for this machine). ``routing_replay``: the routers
    can replay given experts (``mcore.moe.replay``; a mixture of experts only). ``experts``: the
    resolved ``model.moe_experts`` (None: resolve it here). ``overrides`` are any other
    ``TransformerConfig`` fields (they win over both).
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
        experts = experts or resolve_experts(model, attention)
        kwargs.update(moe_overrides(model, parallel, te_grouped=experts.name == "te", routing_replay=routing_replay))
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


def layer_spec(model: ModelConfig, attention: AttentionChoice, experts: ExpertsChoice | None = None) -> ModuleSpec:
    """The TE layer spec for ``te``; else Megatron's local spec with the core attention of the
    backend (``mcore.attention``: ``SdpaAttention`` or ``UnfusedAttention``, both of which also take
    packed THD rows). A mixture of experts gets Megatron's MoE layer with the experts of
    ``experts`` (the resolved ``model.moe_experts``; None: resolve it here): TE's grouped experts
    (``te``, on the TE spec), ``GroupedExperts`` (``grouped``: ``mlp.experts.linear_fc<1|2>.weight``,
    stacked) or one MLP per expert (``sequential``: ``mlp.experts.local_experts.<j>``)."""
    cpu_shims.import_megatron()
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_empg.mcore.attention import SdpaAttention, UnfusedAttention

    experts = experts or resolve_experts(model, attention)
    te_grouped = experts is not None and experts.name == "te"
    if attention.uses_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=te_grouped, qk_layernorm=model.qk_layernorm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=model.num_experts,
            moe_grouped_gemm=False,
            normalization="RMSNorm",
            qk_layernorm=model.qk_layernorm,
        )
        core = {"sdpa": SdpaAttention, "unfused": UnfusedAttention}[attention.name]
        spec.submodules.self_attention.submodules.core_attention = core
    if experts is not None and experts.name == "grouped":
        _use_grouped_experts(spec)
    if model.lora is not None:
        if attention.uses_te:
            raise ConfigError(
                "model.lora",
                f"the adapters wrap Megatron's local linears; attention is {attention.describe()}: set "
                "model.attention_backend sdpa (or unfused)",
            )
        lora_model.use_lora(spec, model.lora, moe=model.is_moe)
    return spec


def _use_grouped_experts(spec: ModuleSpec) -> None:
    """``spec``'s MoE layer as ``GroupedMoELayer`` (Megatron's ``MoELayer``, whose dispatcher reads
    nothing on the host where the expert grid is one rank: ``mcore.moe.dispatch``) with
    ``GroupedExperts`` as its experts (``MoELayer`` takes any ``ExpertsBuilder``:
    ``(num_local_experts, config, *, pg_collection, name)``)."""
    import dataclasses
    import functools

    from megatron_empg.mcore.moe.dispatch import GroupedMoELayer
    from megatron_empg.mcore.moe.grouped import GroupedExperts

    mlp = spec.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
    submodules = dataclasses.replace(mlp.keywords["submodules"], experts=GroupedExperts)
    spec.submodules.mlp = functools.partial(GroupedMoELayer, *mlp.args, **{**mlp.keywords, "submodules": submodules})


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
    moe_experts: str | None = None,
    use_cpu_initialization: bool | None = None,
    fp8: str | None = None,
    meta_device: bool = False,
    lora_seed: int = 0,
    **config_overrides: Any,
) -> list[GPTModel]:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (one without VPP).

    Needs Megatron's parallel state initialized with the same ``parallel`` (see
    ``mcore.parallel_state.initialize_model_parallel``), which also seeds the weights' RNG. The
    vocabulary is padded (``ParallelConfig.padded_vocab_size``); logits are vocab-sharded over TP
    (``parallel_output``). Parameters are in ``params_dtype`` (norms included); on a CUDA machine
    the chunks are moved to the current device. ``attention_backend`` (None: ``model.attention_backend``)
    picks the layer spec and core attention (``mcore.attention_backends``), ``moe_experts`` (None:
    ``model.moe_experts``) a mixture of experts' implementation (``mcore.moe.backends``); the local spec's
    decoder gathers the RoPE table per token once per packed row (``mcore.thd``).
    ``use_cpu_initialization=None`` means: on CPU builds. ``meta_device``
    builds the chunks on the meta device (no memory, no initialization: shapes, names and
    ``sharded_state_dict`` only; implies CPU initialization, stays off CUDA). With ``model.lora``
    the base is frozen and the adapters drawn from ``lora_seed`` (``mcore.lora.model``).
    ``config_overrides`` go to ``transformer_config``.
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
    experts = resolve_experts(model, attention, moe_experts)
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
        experts=experts,
        **config_overrides,
    )
    spec = layer_spec(model, attention, experts)
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
        if model.lora is not None:
            lora_model.finish(chunk, model.lora)
        if config.moe_enable_routing_replay:
            from megatron_empg.mcore.moe.replay import install

            install([chunk])
        if on_cuda and not meta_device:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    if model.lora is not None and config.perform_initialization and not meta_device:
        from megatron_empg.mcore.lora.init import initialize_adapters

        initialize_adapters(chunks, model.lora, lora_seed)
    return chunks
