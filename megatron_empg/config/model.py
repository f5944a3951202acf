"""The model (``ModelConfig``, from ``model_configs/``) and its parallel layout (``ParallelConfig``)."""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from megatron_empg.config.lora import ATTENTION_TARGETS, LoraConfig
from megatron_empg.config.schema import Config, ConfigError, load_config, named_in

MODEL_CONFIG_DIR = Path(__file__).resolve().parents[2] / "model_configs"

Family = Literal["qwen2", "llama", "qwen3", "qwen3_moe"]
Dtype = Literal["bfloat16", "float16", "float32"]  # of weights: published (model) or an engine's (rollout)


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """What a model family's HF implementation is and hard-codes: its ``architectures`` name, QKV
    biases and q/k norms, and whether every layer's MLP is a mixture of experts."""

    hf_architecture: str
    add_qkv_bias: bool
    qk_layernorm: bool
    moe: bool = False


# The one table of model families (``Family`` names them for the config's type; a test checks that
# the two agree). The weight mapping (``weight_sync.mapping``) adds each family's tensor rules.
FAMILIES: dict[str, FamilySpec] = {
    "qwen2": FamilySpec("Qwen2ForCausalLM", add_qkv_bias=True, qk_layernorm=False),
    "llama": FamilySpec("LlamaForCausalLM", add_qkv_bias=False, qk_layernorm=False),
    "qwen3": FamilySpec("Qwen3ForCausalLM", add_qkv_bias=False, qk_layernorm=True),
    "qwen3_moe": FamilySpec("Qwen3MoeForCausalLM", add_qkv_bias=False, qk_layernorm=True, moe=True),
}
MOE_FAMILIES = tuple(name for name, spec in FAMILIES.items() if spec.moe)
# The rope scalings the Megatron build and the HF config both support, with their required keys.
_ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig(Config):
    """A decoder-only model (Qwen2/2.5, Llama-3.x, Qwen3 dense and MoE): RMSNorm, SwiGLU, RoPE, GQA.

    A mixture of experts (family ``qwen3_moe``) replaces every layer's MLP by ``num_experts``
    SwiGLU experts and a softmax router that sends each token to ``moe_router_topk`` of them.
    Sizes use Megatron's names; ``to_hf_config()`` gives the Hugging Face spelling.
    """

    name: str
    """The model's name (the file name in ``model_configs/``)."""
    family: Family
    """The architecture (HF ``model_type``), which fixes ``add_qkv_bias`` and ``qk_layernorm``."""
    num_layers: int
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int
    """Width of the residual stream."""
    ffn_hidden_size: int
    """The SwiGLU MLP's inner size (HF ``intermediate_size``); in a mixture of experts the dense MLP
    size HF's config keeps (unused by its layers)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA; HF ``num_key_value_heads``); = ``num_attention_heads`` for MHA."""
    vocab_size: int
    """The HF vocabulary (rows of the HF embedding); Megatron pads it (``padded_vocab_size``)."""
    max_position_embeddings: int
    """The longest sequence the model takes, in tokens."""
    rope_theta: float
    """RoPE's base."""
    norm_epsilon: float
    """RMSNorm's epsilon (HF ``rms_norm_eps``)."""
    add_qkv_bias: bool
    """Biases on the q, k, v projections (Qwen2)."""
    qk_layernorm: bool
    """RMSNorm on each head's queries and keys (Qwen3)."""
    tie_word_embeddings: bool
    """The output layer shares the embedding's weights."""
    head_dim: int | None = None
    """Per-head dimension (Qwen3 sets it); null: ``hidden_size // num_attention_heads``."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling in the HF spelling, e.g. Llama-3.1's ``{rope_type: llama3, factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings}``; null: none."""
    hidden_act: Literal["silu"] = "silu"
    """The MLP's activation (SwiGLU's gate)."""
    initializer_range: float = 0.02
    """Standard deviation of the random initialization (without ``checkpoint.init_from``)."""
    bos_token_id: int | None = None
    """The HF config's beginning-of-sequence token."""
    eos_token_id: int | list[int] | None = None
    """The HF config's end-of-sequence token(s)."""
    pad_token_id: int | None = None
    """The HF config's padding token."""
    dtype: Dtype = "bfloat16"
    """The dtype of the published weights."""
    hf_model_id: str | None = None
    """Hugging Face Hub id of the published checkpoint; null: none (a local or tiny model)."""
    attention_backend: str = named_in(
        "megatron_empg.mcore.attention_backends:ATTENTION_BACKENDS", "auto", also=("auto",)
    )
    """How the training models compute attention, not what they are (docs/gpu.md): ``auto`` is
    ``te`` where Transformer Engine imports, else ``sdpa`` where torch has it, else ``unfused``; a
    run sets it with ``model_overrides: [attention_backend=sdpa]`` (its errors name
    ``model.attention_backend``). The bind step resolves it."""
    num_experts: int | None = None
    """Experts per layer (family ``qwen3_moe``; null on dense families)."""
    moe_router_topk: int = 2
    """Experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU size (HF ``moe_intermediate_size``; null on dense families)."""
    moe_norm_topk_prob: bool = True
    """Renormalize the top-k routing probabilities to sum to 1 (HF ``norm_topk_prob``)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """The router's scores (``qwen3_moe``: softmax, its HF implementation)."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the router's load-balancing loss, added to the RL objective; 0: off."""
    moe_z_loss_coeff: float | None = None
    """Coefficient of the router's z-loss; null: off."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes, as a factor of the balanced share; null: dropless, as HF and vLLM."""
    moe_experts: str = named_in("megatron_empg.mcore.moe.backends:MOE_EXPERTS", "auto", also=("auto",))
    """How the training models compute the experts, not what they are (the same weights,
    checkpoints and weight sync): ``grouped`` keeps each projection's local experts as one stacked
    weight and runs PyTorch's grouped GEMM (CUDA bf16; an exact per-expert fallback elsewhere),
    ``sequential`` is Megatron's one-MLP-per-expert loop (the reference), ``te`` Transformer
    Engine's grouped experts (needs ``attention_backend`` te). ``auto`` is ``te`` where Transformer
    Engine imports and the layers are its spec, else ``grouped``. A run sets it with
    ``model_overrides: [moe_experts=grouped]`` (its errors name ``model.moe_experts``); the bind
    step resolves it, and ``empg check`` and the log say which runs and why. Unused by dense
    families."""

    lora: LoraConfig | None = None
    """Low-rank adapters on the linear layers, the base frozen (docs/lora.md); null: full
    fine-tuning. A run turns them on with ``model_overrides: [lora.rank=64]`` (its errors name
    ``model.lora.*``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (Megatron's ``kv_channels``, HF's ``head_dim``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError("head_dim", f"must be positive or null, got {self.head_dim}")
        for name in ("rope_theta", "norm_epsilon", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"num_attention_heads={self.num_attention_heads} does not divide hidden_size={self.hidden_size} "
                "(set head_dim to use heads of another size)",
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                "num_query_groups",
                f"num_query_groups={self.num_query_groups} does not divide "
                f"num_attention_heads={self.num_attention_heads}",
            )
        if self.kv_channels % 2:
            raise ConfigError("head_dim", f"the head dimension must be even for RoPE, got {self.kv_channels}")
        spec = FAMILIES[self.family]
        for flag in ("add_qkv_bias", "qk_layernorm"):
            required = getattr(spec, flag)
            if getattr(self, flag) != required:
                raise ConfigError(flag, f"family {self.family!r} requires {flag}: {str(required).lower()}")
        if self.family in ("qwen2", "llama") and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "num_attention_heads",
                f"family {self.family!r} (Hugging Face) needs num_attention_heads={self.num_attention_heads} "
                f"to divide hidden_size={self.hidden_size}",
            )
        if self.family == "qwen2" and self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise ConfigError("head_dim", "family 'qwen2' has no head_dim: leave it null (= hidden_size // heads)")
        self._validate_rope_scaling()
        self._validate_moe()
        if self.lora is not None and self.is_moe:
            mlp = [t for t in self.lora.targets if t not in ATTENTION_TARGETS and t != "all-linear"]
            if mlp:
                raise ConfigError(
                    "lora.targets",
                    f"{mlp}: a mixture of experts has no dense MLP and its experts take no adapters; "
                    f"adapt the attention projections {list(ATTENTION_TARGETS)} (or all-linear)",
                )
        for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            for token in value if isinstance(value, list) else [value]:
                if token is not None and not 0 <= token < self.vocab_size:
                    raise ConfigError(name, f"token id {token} is outside the vocabulary [0, {self.vocab_size})")

    def _validate_moe(self) -> None:
        # the values first, whatever the family: a dense model's are unused, not meaningless
        if self.moe_router_topk < 1:
            raise ConfigError("moe_router_topk", f"must be >= 1, got {self.moe_router_topk}")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError("moe_aux_loss_coeff", f"must be >= 0, got {self.moe_aux_loss_coeff}")
        for name in ("moe_z_loss_coeff", "moe_expert_capacity_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(name, f"must be > 0 or null, got {value}")
        if self.family not in MOE_FAMILIES:
            for name in ("num_experts", "moe_ffn_hidden_size"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        name,
                        f"family {self.family!r} is dense: leave num_experts and "
                        f"moe_ffn_hidden_size null (mixtures of experts: {list(MOE_FAMILIES)})",
                    )
            return
        for name in ("num_experts", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if value is None or value <= 0:
                raise ConfigError(name, f"family {self.family!r} needs a positive int, got {value!r}")
        if self.moe_router_topk > self.num_experts:
            raise ConfigError(
                "moe_router_topk", f"must be in [1, num_experts={self.num_experts}], got {self.moe_router_topk}"
            )
        if self.moe_router_score_function != "softmax":
            raise ConfigError(
                "moe_router_score_function",
                f"family {self.family!r} routes with softmax (its HF "
                f"implementation), got {self.moe_router_score_function!r}",
            )

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        rope_type = self.rope_scaling.get("rope_type")
        if rope_type not in _ROPE_SCALING_KEYS:
            raise ConfigError(
                "rope_scaling.rope_type",
                f"supported rope scalings are {sorted(_ROPE_SCALING_KEYS)} (or rope_scaling: null), got {rope_type!r}",
            )
        required = _ROPE_SCALING_KEYS[rope_type]
        allowed = ("rope_type", *required)
        for key in self.rope_scaling:
            if key not in allowed:
                raise ConfigError(f"rope_scaling.{key}", f"unknown key for rope_type {rope_type!r}; allowed: {allowed}")
        for key in required:
            value = self.rope_scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(
                    f"rope_scaling.{key}", f"rope_type {rope_type!r} needs a positive number, got {value!r}"
                )
        if rope_type == "llama3" and not self.rope_scaling["high_freq_factor"] > self.rope_scaling["low_freq_factor"]:
            raise ConfigError("rope_scaling.high_freq_factor", "must be greater than low_freq_factor")

    def num_parameters(self, *, padded_vocab_size: int | None = None, active: bool = False) -> int:
        """Number of weights of the model (embedding rows = ``padded_vocab_size`` or ``vocab_size``);
        ``active``: those one token uses (a mixture of experts counts ``moe_router_topk`` experts)."""
        embedding = (padded_vocab_size or self.vocab_size) * self.hidden_size
        tied = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.parameters_per_layer(active=active) + self.hidden_size + embedding * tied

    def expert_parameters(self) -> int:
        """Weights of one expert (SwiGLU: gate, up, down); 0 for a dense model."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size if self.is_moe else 0

    def parameters_per_layer(self, *, active: bool = False) -> int:
        """Weights of one transformer layer: attention, MLP (SwiGLU, or the router and the experts:
        ``moe_router_topk`` of them when ``active``) and the two RMSNorms."""
        h, d = self.hidden_size, self.kv_channels
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        if self.add_qkv_bias:
            attention += q + 2 * kv
        if self.qk_layernorm:
            attention += 2 * d
        if self.is_moe:
            experts = self.moe_router_topk if active else self.num_experts
            mlp = self.num_experts * h + experts * self.expert_parameters()  # router, experts
        else:
            mlp = 3 * h * self.ffn_hidden_size  # gate, up, down
        return attention + mlp + 2 * h  # + input and pre-MLP RMSNorm

    def to_hf_config(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.AutoConfig.for_model`` (transformers >= 5 spelling:
        ``rope_parameters`` holds ``rope_theta`` and the scaling; ``dtype`` not ``torch_dtype``)."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        hf: dict[str, Any] = {
            "model_type": self.family,
            "architectures": [FAMILIES[self.family].hf_architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": copy.copy(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "dtype": self.dtype,
        }
        if self.family in ("llama", "qwen3", "qwen3_moe"):
            hf.update(head_dim=self.kv_channels, attention_bias=False)
        if self.family == "llama":
            hf.update(mlp_bias=False)
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            hf.update(use_sliding_window=False)
        if self.is_moe:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.moe_router_topk,
                moe_intermediate_size=self.moe_ffn_hidden_size,
                norm_topk_prob=self.moe_norm_topk_prob,
                router_aux_loss_coef=self.moe_aux_loss_coeff,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        return hf


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's padded vocabulary: the next multiple of ``make_vocab_size_divisible_by * TP``."""
    for name, value in (
        ("vocab_size", vocab_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
        ("tensor_model_parallel_size", tensor_model_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(name, f"must be a positive int, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Config):
    """Model parallelism (docs/parallelism.md); the data-parallel size is what the world size leaves
    over: World = TP x PP x CP x DP. A mixture of experts lays its experts out on Megatron's second
    grid: World = ETP x EP x PP x expert-DP.
    """

    tensor_model_parallel_size: int = 1
    """TP: ranks each layer's weights are split over."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages the layers are split into."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule, >= 2, needs PP >= 2); null: one."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: the activations outside the TP regions split over the TP
    ranks (needs TP > 1 and ``model.attention_backend`` te)."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this x TP."""
    context_parallel_size: int = 1
    """CP: every packed row is split over CP ranks (each sequence padded to a multiple of 2 x CP
    and cut into 2 x CP chunks, rank r holding chunks r and 2 CP - 1 - r:
    ``parallel.context_parallel``); the CP ranks of a replica hold the same weights and train on
    the same samples, their gradients summed with the data-parallel ones."""
    expert_model_parallel_size: int = 1
    """EP: ranks that each hold ``num_experts / EP`` whole experts."""
    expert_tensor_parallel_size: int | None = None
    """ETP: ranks each expert is split over; null: = TP."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts: ``alltoall`` (Megatron-LM's default for EP) or
    ``allgather``."""

    @property
    def expert_tp_size(self) -> int:
        """ETP (``expert_tensor_parallel_size``, TP when null)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def expert_grid_size(self) -> int:
        """Ranks of one copy of the experts: ETP x EP x PP."""
        return self.expert_tp_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def replica_size(self) -> int:
        """Ranks per data-parallel replica: TP x PP x CP."""
        return self.model_parallel_size * self.context_parallel_size

    def validate(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "make_vocab_size_divisible_by",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        etp = self.expert_tensor_parallel_size
        if etp is not None and etp < 1:
            raise ConfigError("expert_tensor_parallel_size", f"must be >= 1 or null (= TP), got {etp}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if vpp < 2:
                raise ConfigError("virtual_pipeline_model_parallel_size", f"must be >= 2 or null, got {vpp}")
            if self.pipeline_model_parallel_size < 2:
                raise ConfigError(
                    "virtual_pipeline_model_parallel_size",
                    "needs pipeline_model_parallel_size >= 2 (interleaving splits each pipeline rank's layers)",
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("sequence_parallel", "needs tensor_model_parallel_size > 1")

    def padded_vocab_size(self, vocab_size: int) -> int:
        return padded_vocab_size(vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)

    def validate_world_size(self, world_size: int) -> None:
        if world_size < 1 or world_size % self.replica_size:
            cp = " x context_parallel_size" if self.context_parallel_size > 1 else ""
            raise ConfigError(
                "tensor_model_parallel_size",
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"pipeline_model_parallel_size{cp} = {self.tensor_model_parallel_size} x "
                f"{self.pipeline_model_parallel_size}{f' x {self.context_parallel_size}' if cp else ''}",
            )
        if world_size % self.expert_grid_size:
            raise ConfigError(
                "expert_model_parallel_size",
                f"world size {world_size} is not divisible by expert_tensor_parallel_size x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {self.expert_tp_size} x "
                f"{self.expert_model_parallel_size} x {self.pipeline_model_parallel_size}",
            )

    def validate_for(self, model: ModelConfig, world_size: int | None = None) -> None:
        """Check that ``model`` can be split this way (and, if given, over ``world_size`` ranks)."""
        self.validate()
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        for field in ("num_attention_heads", "num_query_groups"):
            if getattr(model, field) % tp:
                raise ConfigError(
                    "tensor_model_parallel_size",
                    f"tensor_model_parallel_size={tp} does not divide model.{field}={getattr(model, field)}",
                )
        if model.num_layers % pp:
            raise ConfigError(
                "pipeline_model_parallel_size",
                f"pipeline_model_parallel_size={pp} does not divide model.num_layers={model.num_layers}",
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and model.num_layers % (pp * vpp):
            raise ConfigError(
                "virtual_pipeline_model_parallel_size",
                f"model.num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size x "
                f"virtual_pipeline_model_parallel_size = {pp} x {vpp}",
            )
        self._validate_experts(model)
        if world_size is not None:
            self.validate_world_size(world_size)

    def _validate_experts(self, model: ModelConfig) -> None:
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        if not model.is_moe:
            if ep > 1 or etp not in (None, self.tensor_model_parallel_size):
                raise ConfigError(
                    "expert_model_parallel_size",
                    f"model {model.name!r} has no experts: leave "
                    "expert_model_parallel_size 1 and expert_tensor_parallel_size null",
                )
            return
        if model.num_experts % ep:
            raise ConfigError(
                "expert_model_parallel_size",
                f"expert_model_parallel_size={ep} does not divide model.num_experts={model.num_experts}",
            )
        if model.moe_ffn_hidden_size % self.expert_tp_size:
            raise ConfigError(
                "expert_tensor_parallel_size",
                f"expert_tensor_parallel_size={self.expert_tp_size} "
                f"does not divide model.moe_ffn_hidden_size={model.moe_ffn_hidden_size}",
            )


def model_config_path(name: str) -> Path:
    """``model_configs/<name>.yaml``; a ``ConfigError`` lists the known names if there is none."""
    path = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))
        raise ConfigError("model", f"no model config named {name!r} in {MODEL_CONFIG_DIR}; known: {known}")
    return path


def load_model_config(name_or_path: str | os.PathLike, overrides: Iterable[str] = ()) -> ModelConfig:
    """A ``ModelConfig`` from a YAML path, or from a name in ``model_configs/`` ("qwen2.5-7b")."""
    path = Path(name_or_path)
    if not path.is_file() and len(path.parts) == 1 and path.suffix not in (".yaml", ".yml"):
        path = model_config_path(str(name_or_path))
    return load_config(ModelConfig, path, overrides)
