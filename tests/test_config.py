"""megatron_empg.config: typed building from dicts/YAML, dotted overrides, validation messages, the
model_configs/ files and their published parameter counts."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import pytest
import yaml

from megatron_empg.config import (
    MODEL_CONFIG_DIR,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    apply_overrides,
    from_dict,
    load_config,
    load_model_config,
    padded_vocab_size,
    parse_yaml,
    to_dict,
    to_yaml,
)

# --------------------------------------------------------------------------------------------
# The generic machinery, on small dataclasses.


@dataclasses.dataclass
class Inner:
    size: int
    scale: float = 1.0
    mode: Literal["a", "b"] = "a"
    limit: int | None = None

    def validate(self) -> None:
        if self.size > 100:
            raise ConfigError("size", f"must be <= 100, got {self.size}")


@dataclasses.dataclass
class Outer:
    name: str
    inner: Inner
    flag: bool = False
    ids: tuple[int, ...] = ()
    names: list[str] = dataclasses.field(default_factory=list)
    pair: tuple[int, str] | None = None
    token: int | list[int] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    maybe: Inner | None = None

    def validate(self) -> None:
        if self.inner.size == 13 and self.flag:
            raise ConfigError("flag", "cannot be true with inner.size 13")


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_from_dict_builds_nested_types_and_coerces():
    data = {
        "name": "x",
        "inner": {"size": 3, "scale": 2, "mode": "b", "limit": None},
        "ids": [1, 2],
        "pair": [4, "s"],
        "token": [1, 2],
        "extra": {"k": [1, {"z": 2}]},
        "maybe": {"size": 1},
    }
    obj = from_dict(Outer, data)
    assert obj.inner == Inner(size=3, scale=2.0, mode="b")
    assert isinstance(obj.inner.scale, float)  # an int is accepted for a float
    assert obj.ids == (1, 2) and obj.pair == (4, "s") and obj.token == [1, 2]
    assert obj.extra == {"k": [1, {"z": 2}]} and obj.maybe == Inner(size=1)
    assert from_dict(Outer, {"name": "x", "inner": {"size": 1}, "token": 7}).token == 7


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "inner": {"size": "two"}}, "inner.size: expected int, got 'two'"),
        ({"name": "x", "inner": {"size": 1.5}}, "inner.size: expected int, got 1.5"),
        ({"name": "x", "inner": {"size": True}}, "inner.size: expected int, got True"),
        ({"name": "x", "inner": {"size": 1, "scale": "1e-3"}}, "inner.scale: expected float, got '1e-3'"),
        ({"name": "x", "inner": {"size": 1, "scale": False}}, "inner.scale: expected float, got False"),
        ({"name": "x", "inner": {"size": 1}, "flag": 1}, "flag: expected bool (true/false), got 1"),
        (
            {"name": "x", "inner": {"size": 1}, "flag": "yes"},
            "flag: expected bool (true/false), got 'yes' (YAML 1.1's yes/no/on/off are text here: write true or false)",
        ),
        ({"name": 3, "inner": {"size": 1}}, "name: expected str, got 3"),
        ({"name": "x", "inner": {"size": 1, "mode": "c"}}, "inner.mode: expected one of 'a', 'b', got 'c'"),
        ({"name": "x", "inner": {"size": 1, "limit": "x"}}, "inner.limit: expected int, got 'x'"),
        ({"name": "x", "inner": 5}, "inner: expected a mapping (Inner), got 5"),
        ({"name": "x", "inner": None}, "inner: expected a mapping (Inner), got None"),
        ({"name": "x", "inner": {"size": 1}, "ids": [1, "b"]}, "ids[1]: expected int, got 'b'"),
        ({"name": "x", "inner": {"size": 1}, "ids": 3}, "ids: expected tuple[int, ...], got 3"),
        ({"name": "x", "inner": {"size": 1}, "pair": [1]}, "pair: expected tuple[int, str] (2 items), got 1 items"),
        ({"name": "x", "inner": {"size": 1}, "token": "eos"}, "token: expected int | list[int] | None, got 'eos'"),
        ({"name": "x", "inner": {"size": 1}, "extra": [1]}, "extra: expected dict[str, Any], got a list ([1])"),
        ({"name": "x", "inner": {"size": 1}, "maybe": {"size": "s"}}, "maybe.size: expected int, got 's'"),
    ],
)
def test_wrong_types_name_the_field_and_the_expectation(data, message):
    assert _error(from_dict, Outer, data) == message


def test_unknown_key_names_the_dotted_path_and_lists_allowed_keys():
    message = _error(from_dict, Outer, {"name": "x", "inner": {"size": 1, "sise": 2}})
    assert message == "inner.sise: unknown key; allowed keys: size, scale, mode, limit"
    message = _error(from_dict, Outer, {"name": "x", "inner": {"size": 1}, "a": 1, "b": 2})
    assert message.startswith("a, b: unknown keys; allowed keys: name, inner, flag, ids,")
    message = _error(from_dict, Outer, {"name": "x", "inner": {"size": 1, "x": 0}}, path="run")
    assert message.startswith("run.inner.x: unknown key")


def test_missing_required_fields_are_errors():
    assert _error(from_dict, Outer, {"inner": {"size": 1}}) == "name: missing required field"
    assert _error(from_dict, Outer, {"name": "x", "inner": {}}) == "inner.size: missing required field"
    assert _error(from_dict, Outer, {}) == "name, inner: missing required fields"


def test_validate_runs_on_nested_dataclasses_with_their_path():
    assert _error(from_dict, Outer, {"name": "x", "inner": {"size": 101}}) == "inner.size: must be <= 100, got 101"
    message = _error(from_dict, Outer, {"name": "x", "inner": {"size": 1}, "maybe": {"size": 200}})
    assert message == "maybe.size: must be <= 100, got 200"
    assert _error(from_dict, Outer, {"name": "x", "inner": {"size": 13}, "flag": True}).startswith("flag: cannot")


def test_overrides_nested_defaults_yaml_values_and_free_form_dicts():
    base = {"name": "x", "inner": {"size": 1}}
    out = apply_overrides(
        base,
        [
            "inner.scale=1e-6",
            "flag=true",
            "ids=[1, 2]",
            "inner.limit=null",
            "inner.limit=5",
            "name=y",
            "maybe.size=3",
            "extra.a.b=1",
            "extra.c={d: 2}",
            "token=-1",
            "names=[p, q]",
        ],
        cls=Outer,
    )
    assert base == {"name": "x", "inner": {"size": 1}}  # not modified
    obj = from_dict(Outer, out)
    assert obj.inner.scale == 1e-6 and obj.flag is True and obj.ids == (1, 2) and obj.inner.limit == 5
    assert obj.name == "y" and obj.maybe == Inner(size=3) and obj.token == -1 and obj.names == ["p", "q"]
    assert obj.extra == {"a": {"b": 1}, "c": {"d": 2}}
    assert load_config(Outer, base, ["inner.mode=b"]).inner.mode == "b"


def test_override_of_unknown_key_is_an_error_naming_it():
    base = {"name": "x", "inner": {"size": 1}}
    message = _error(apply_overrides, base, ["inner.sise=2"], cls=Outer)
    assert message.startswith("inner.sise: unknown key in override 'inner.sise=2'; allowed keys: size, scale")
    assert _error(apply_overrides, base, ["nme=2"], cls=Outer).startswith("nme: unknown key")
    assert _error(apply_overrides, base, ["flag.x=2"], cls=Outer).startswith("flag: is bool, not a mapping")
    assert _error(apply_overrides, base, ["name"], cls=Outer) == "override 'name' is not of the form dotted.key=value"
    # without a schema a key exists if the data has it
    assert apply_overrides(base, ["inner.size=4"]) == {"name": "x", "inner": {"size": 4}}
    assert _error(apply_overrides, base, ["inner.scale=2"]).startswith("inner.scale: unknown key in override")
    # the override's value is then type-checked by from_dict
    assert _error(load_config, Outer, base, ["inner.size=two"]) == "inner.size: expected int, got 'two'"


def test_yaml_reads_exponents_without_a_dot_as_floats():
    assert parse_yaml("a: 1e-6\nb: 1.0e-6\nc: 3\nd: -2E+3\ne: 1_000\nf: '1e-6'") == {
        "a": 1e-6,
        "b": 1e-6,
        "c": 3,
        "d": -2000.0,
        "e": 1000,
        "f": "1e-6",
    }


def test_a_defaults_file_is_merged_under_the_files_own_keys(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "root.yaml").write_text("name: root\ninner: {size: 1, mode: a}\nids: [1, 2]\n")
    (tmp_path / "mid.yaml").write_text("defaults: base/root.yaml\ninner: {size: 2}\nids: [3]\n")
    (tmp_path / "top.yaml").write_text("defaults: mid.yaml\ninner: {scale: 0.5}\nname: top\n")
    obj = load_config(Outer, tmp_path / "top.yaml", ["inner.mode=b"])
    assert obj.name == "top" and obj.inner == Inner(size=2, scale=0.5, mode="b") and obj.ids == (3,)
    (tmp_path / "top_extra.yaml").write_text("defaults: top.yaml\nextra: {a: 1}\n")
    assert load_config(Outer, tmp_path / "top_extra.yaml").extra == {"a": 1}
    (tmp_path / "clear.yaml").write_text("defaults: top_extra.yaml\nextra: {}\n")
    assert load_config(Outer, tmp_path / "clear.yaml").extra == {}
    (tmp_path / "loop_a.yaml").write_text("defaults: loop_b.yaml\n")
    (tmp_path / "loop_b.yaml").write_text("defaults: loop_a.yaml\n")
    assert "a cycle of defaults files" in _error(load_config, Outer, tmp_path / "loop_a.yaml")
    (tmp_path / "missing.yaml").write_text("defaults: nowhere.yaml\n")
    assert "nowhere.yaml does not exist" in _error(load_config, Outer, tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("defaults: [a.yaml]\n")
    assert _error(load_config, Outer, tmp_path / "bad.yaml").startswith("defaults: ")


def test_to_dict_round_trips():
    obj = from_dict(
        Outer,
        {
            "name": "x",
            "inner": {"size": 2, "mode": "b"},
            "ids": [3],
            "pair": [1, "a"],
            "extra": {"k": {"j": [1]}},
            "maybe": {"size": 4},
        },
    )
    data = to_dict(obj)
    assert data["ids"] == [3] and data["inner"] == {"size": 2, "scale": 1.0, "mode": "b", "limit": None}
    assert from_dict(Outer, data) == obj
    assert from_dict(Outer, yaml.safe_load(to_yaml(obj))) == obj


# --------------------------------------------------------------------------------------------
# ModelConfig / ParallelConfig validation: every message names the field.

TINY = {
    "name": "t",
    "family": "qwen2",
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "vocab_size": 250,
    "max_position_embeddings": 256,
    "rope_theta": 1e6,
    "norm_epsilon": 1e-6,
    "add_qkv_bias": True,
    "qk_layernorm": False,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["num_attention_heads=3", "num_query_groups=1"], "num_attention_heads", "does not divide hidden_size=64"),
        (["num_query_groups=3"], "num_query_groups", "num_query_groups=3 does not divide num_attention_heads=4"),
        (["num_layers=0"], "num_layers", "must be positive"),
        (["hidden_size=-64"], "hidden_size", "must be positive"),
        (["norm_epsilon=0"], "norm_epsilon", "must be > 0"),
        (["qk_layernorm=true"], "qk_layernorm", "family 'qwen2' requires qk_layernorm: false"),
        (["add_qkv_bias=false"], "add_qkv_bias", "family 'qwen2' requires add_qkv_bias: true"),
        (["family=qwen3"], "add_qkv_bias", "family 'qwen3' requires add_qkv_bias: false"),
        (["family=qwen3", "add_qkv_bias=false"], "qk_layernorm", "family 'qwen3' requires qk_layernorm: true"),
        (["family=llama"], "add_qkv_bias", "family 'llama' requires add_qkv_bias: false"),
        (["head_dim=32"], "head_dim", "family 'qwen2' has no head_dim"),
        (["head_dim=15"], "head_dim", "must be even"),
        (["family=gpt2"], "family", "expected one of 'qwen2', 'llama', 'qwen3'"),
        (["eos_token_id=250"], "eos_token_id", "outside the vocabulary"),
        (["eos_token_id=[1, 300]"], "eos_token_id", "token id 300 is outside"),
        (["rope_scaling={rope_type: yarn, factor: 4}"], "rope_scaling.rope_type", "supported rope scalings"),
        (["rope_scaling={rope_type: llama3, factor: 8}"], "rope_scaling.low_freq_factor", "needs a positive"),
    ],
)
def test_invalid_model_configs_name_the_field(overrides, field, words):
    message = _error(load_config, ModelConfig, TINY, overrides)
    assert message.startswith(f"{field}:") and words in message, message


def test_head_dim_allows_heads_that_do_not_divide_hidden_size():
    cfg = load_config(
        ModelConfig,
        TINY,
        [
            "family=qwen3",
            "add_qkv_bias=false",
            "qk_layernorm=true",
            "num_attention_heads=6",
            "num_query_groups=2",
            "head_dim=32",
        ],
    )
    assert cfg.kv_channels == 32
    message = _error(
        load_config,
        ModelConfig,
        TINY,
        ["family=llama", "add_qkv_bias=false", "num_attention_heads=6", "num_query_groups=2", "head_dim=32"],
    )
    assert message.startswith("num_attention_heads: family 'llama' (Hugging Face) needs")


@pytest.mark.parametrize(
    ("parallel", "field", "words"),
    [
        (
            {"tensor_model_parallel_size": 8},
            "tensor_model_parallel_size",
            "does not divide model.num_attention_heads=4",
        ),
        ({"tensor_model_parallel_size": 4}, "tensor_model_parallel_size", "does not divide model.num_query_groups=2"),
        ({"pipeline_model_parallel_size": 3}, "pipeline_model_parallel_size", "does not divide model.num_layers=4"),
        (
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4},
            "virtual_pipeline_model_parallel_size",
            "num_layers=4 is not divisible by pipeline_model_parallel_size x",
        ),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            "virtual_pipeline_model_parallel_size",
            "needs pipeline_model_parallel_size >= 2",
        ),
        ({"sequence_parallel": True}, "sequence_parallel", "needs tensor_model_parallel_size > 1"),
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size", "must be >= 1"),
    ],
)
def test_invalid_parallel_layouts_name_the_field(parallel, field, words):
    model = load_config(ModelConfig, TINY)
    with pytest.raises(ConfigError) as info:
        from_dict(ParallelConfig, parallel).validate_for(model)
    assert str(info.value).startswith(f"{field}:") and words in str(info.value), str(info.value)


def test_world_size_must_be_a_multiple_of_tp_times_pp():
    model = load_config(ModelConfig, TINY)
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    parallel.validate_for(model, world_size=8)
    message = _error(parallel.validate_for, model, world_size=6)
    assert "world size 6 is not divisible by tensor_model_parallel_size x pipeline_model_parallel_size" in message
    ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2).validate_for(model, 2)


@pytest.mark.parametrize(
    ("vocab", "divisible_by", "tp", "expected"),
    [
        (250, 128, 1, 256),
        (250, 128, 2, 256),
        (300, 128, 1, 384),
        (300, 128, 2, 512),
        (256, 128, 2, 256),
        (151936, 128, 1, 151936),
        (151936, 128, 8, 152576),
        (128256, 128, 4, 128512),
        (5, 1, 4, 8),
    ],
)
def test_padded_vocab_size_is_the_next_multiple_of_divisible_by_times_tp(vocab, divisible_by, tp, expected):
    assert padded_vocab_size(vocab, divisible_by, tp) == expected
    assert (
        ParallelConfig(tensor_model_parallel_size=tp, make_vocab_size_divisible_by=divisible_by).padded_vocab_size(
            vocab
        )
        == expected
    )


def test_padded_vocab_size_rejects_bad_arguments():
    assert _error(padded_vocab_size, 0, 128, 1).startswith("vocab_size:")
    assert _error(padded_vocab_size, 10, 128, True).startswith("tensor_model_parallel_size:")


# --------------------------------------------------------------------------------------------
# model_configs/*.yaml

YAMLS = sorted(MODEL_CONFIG_DIR.glob("*.yaml"))
REAL = [
    "deepseek-r1-distill-qwen-1.5b",
    "qwen2.5-1.5b",
    "qwen2.5-3b",
    "qwen2.5-7b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "llama3.1-8b",
    "qwen3-30b-a3b",
]
TINY_MODELS = ["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]
LOCAL = ["demo-qwen2"]  # built locally (tools/make_demo_model.py), no HF model id

# Published totals (billions, as rounded by the publisher: Hugging Face's safetensors count / the
# Qwen model cards' "Number of Parameters (Non-Embedding)").
PUBLISHED_TOTAL = {
    "deepseek-r1-distill-qwen-1.5b": 1.78,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen3-1.7b": 1.72,  # the model card's "1.7B" (1.4B non-embedding); not checked against HF's count
    "qwen3-4b": 4.02,
    "qwen3-8b": 8.19,
    "llama3.1-8b": 8.03,
    "qwen3-30b-a3b": 30.53,
}
PUBLISHED_NON_EMBEDDING = {"qwen2.5-1.5b": 1.31, "qwen2.5-3b": 2.77, "qwen2.5-7b": 6.53, "qwen3-8b": 6.95}


def test_the_expected_model_files_exist():
    assert sorted(p.stem for p in YAMLS) == sorted(REAL + TINY_MODELS + LOCAL)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_every_model_yaml_loads_validates_and_round_trips(path):
    cfg = load_model_config(path)
    assert cfg == load_model_config(path.stem)
    assert cfg.name == path.stem
    assert from_dict(ModelConfig, yaml.safe_load(to_yaml(cfg))) == cfg
    assert (cfg.hf_model_id is None) == (cfg.name in TINY_MODELS + LOCAL)
    # every layout the CPU tests use is valid for the tiny models
    if cfg.name.startswith("tiny-"):
        assert cfg.vocab_size % 128, "tiny vocabularies are not multiples of 128, to exercise padding"
        ParallelConfig(tensor_model_parallel_size=2).validate_for(cfg, world_size=2)


def test_unknown_model_name_lists_the_known_ones():
    message = _error(load_model_config, "qwen9")
    assert "no model config named 'qwen9'" in message and "'qwen2.5-7b'" in message


def hf_parameter_count(hf: dict, active: bool = False) -> int:
    """Weights of a Qwen2 / Llama / Qwen3 (dense or MoE) model from its Hugging Face config fields;
    ``active``: a MoE's weights one token uses (``num_experts_per_tok`` experts)."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * (q + 2 * kv) + q * h
    if hf["model_type"] == "qwen2":  # q/k/v biases (hard-coded in Qwen2Attention)
        attention += q + 2 * kv
    if hf["model_type"] in ("qwen3", "qwen3_moe"):  # per-head q/k RMSNorm
        attention += 2 * head_dim
    if hf["model_type"] == "qwen3_moe":  # router [E, h] and E (or top-k) SwiGLU experts
        experts = hf["num_experts_per_tok"] if active else hf["num_experts"]
        mlp = hf["num_experts"] * h + experts * 3 * h * hf["moe_intermediate_size"]
    else:
        mlp = 3 * h * hf["intermediate_size"]
    return layers * (attention + mlp + 2 * h) + h + vocab * h * (1 if hf["tie_word_embeddings"] else 2)


@pytest.mark.parametrize("name", REAL)
def test_real_models_match_their_published_parameter_counts(name):
    cfg = load_model_config(name)
    hf = cfg.to_hf_config()
    total = hf_parameter_count(hf)
    assert total == cfg.num_parameters()
    assert abs(total / 1e9 - PUBLISHED_TOTAL[name]) <= 0.005 + 1e-9, total
    if name in PUBLISHED_NON_EMBEDDING:
        embedding = hf["vocab_size"] * hf["hidden_size"] * (1 if hf["tie_word_embeddings"] else 2)
        assert abs((total - embedding) / 1e9 - PUBLISHED_NON_EMBEDDING[name]) <= 0.005 + 1e-9


def test_to_hf_config_spells_rope_and_family_fields_for_transformers_5():
    llama = load_model_config("llama3.1-8b").to_hf_config()
    assert llama["model_type"] == "llama" and llama["architectures"] == ["LlamaForCausalLM"]
    assert llama["rope_parameters"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    assert llama["head_dim"] == 128 and llama["attention_bias"] is False and llama["rms_norm_eps"] == 1e-5
    qwen3 = load_model_config("qwen3-8b").to_hf_config()
    assert qwen3["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and qwen3["head_dim"] == 128
    qwen2 = load_model_config("qwen2.5-7b").to_hf_config()
    assert "head_dim" not in qwen2 and qwen2["num_key_value_heads"] == 4 and qwen2["dtype"] == "bfloat16"
    assert not re.search("torch_dtype|rope_theta|rope_scaling", " ".join(qwen2))


# ---------------------------------------------------------------- optimizer and loss sections


def test_optimizer_and_loss_config_load_and_name_bad_fields():
    from megatron_empg.config import LossConfig, OptimizerConfig

    cfg = load_config(LossConfig, {"kl": "topk", "kl_coef": 0.1, "kl_args": {"direction": "forward"}})
    assert cfg.kl_args == {"direction": "forward"} and cfg.agg_mode == "token-mean"
    with pytest.raises(ConfigError, match=r"^kl_coef: is 0.1 but kl is null"):
        load_config(LossConfig, {"kl_coef": 0.1})
    with pytest.raises(ConfigError, match=r"^kl_args: are set \(\['iw_clip'\]\) but kl is null"):
        load_config(LossConfig, {"kl_args": {"iw_clip": [0.5, 2]}})
    # names (kl, agg_mode, policy_loss) and the arguments' names and values: trainer.bind.build (tests/trainer/test_build.py)
    assert load_config(LossConfig, {"agg_mode": "token-sum", "kl": "k6", "kl_coef": 0.1}).kl == "k6"
    assert load_config(LossConfig, {"kl": "k3", "kl_coef": 0.1, "kl_args": {"importance_weight": True}}).kl == "k3"
    with pytest.raises(ConfigError, match=r"^lr_decay_steps: must exceed lr_warmup_steps=10"):
        load_config(OptimizerConfig, {"lr_warmup_steps": 10, "lr_decay_steps": 5})
    with pytest.raises(ConfigError, match=r"^min_lr: must be in \[0, lr=1e-06\]"):
        OptimizerConfig(min_lr=1.0)


# --------------------------------------------------------------------------------------------
# Rollout and weight-sync sections.


def test_rollout_config_nested_errors_name_the_dotted_field():
    from megatron_empg.config import RolloutConfig

    cfg = from_dict(RolloutConfig, {"sampling": {"n": 4, "stop": ["</answer>"]}, "dtype": "float32"})
    assert cfg.sampling.n == 4 and cfg.sampling.stop == ["</answer>"] and cfg.dtype == "float32"
    assert (cfg.engines, cfg.num_engines(8)) == ("per_replica", 8)
    assert from_dict(RolloutConfig, {"engines": "single"}).num_engines(8) == 1
    assert from_dict(RolloutConfig, {"engines": 2}).num_engines(8) == 2
    for data, field in [
        ({"sampling": {"top_p": 2.0}}, "sampling.top_p"),
        ({"sampling": {"min_tokens": 9, "max_tokens": 8}}, "sampling.min_tokens"),
        ({"sampling": {"nn": 1}}, "sampling.nn"),
        ({"kv_cache_gib": 0}, "kv_cache_gib"),
        ({"dtype": "fp8"}, "dtype"),
        ({"engines": 0}, "engines"),
        ({"engines": "per_gpu"}, "engines"),
        ({"engines": 2.0}, "engines"),
    ]:
        with pytest.raises(ConfigError) as e:
            from_dict(RolloutConfig, data)
        assert e.value.field == field, (data, e.value)


def test_weight_sync_config_validation():
    from megatron_empg.config import WeightSyncConfig

    assert from_dict(WeightSyncConfig, {"gate_tolerance": None}).gate_tolerance is None
    for data, field in [
        ({"bucket_size_mb": 0}, "bucket_size_mb"),
        ({"gate_tolerance": 0.0}, "gate_tolerance"),
        ({"probe_length": 1}, "probe_length"),
    ]:
        with pytest.raises(ConfigError) as e:
            from_dict(WeightSyncConfig, data)
        assert e.value.field == field, (data, e.value)


def test_run_config_cross_field_errors_name_the_dotted_field():
    from megatron_empg.config import RunConfig

    base = {"model": "tiny-qwen2", "tokenizer": "/tmp/tokenizer"}
    assert from_dict(RunConfig, base).model_config().name == "tiny-qwen2"
    for change, field in [
        ({"tokenizer": None}, "tokenizer"),
        ({"algorithm": {"loss": {"kl_coef": 0.1}}}, "algorithm.loss.kl_coef"),
        ({"algorithm": {"anchor": {"period": 0}}}, "algorithm.anchor.period"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
        ({"checkpoint": {"init_from": "/a", "continue_from": "/b"}}, "checkpoint.continue_from"),
        ({"logging": {"progress": "bar"}}, "logging.progress"),
        ({"logging": {"third_party_level": "LOUD"}}, "logging.third_party_level"),
        ({"distributed": {"timeout_minutes": 0}}, "distributed.timeout_minutes"),
        ({"algorithm": {"anchor": {"fp8": "te"}}}, "algorithm.anchor.fp8"),  # TE FP8 weights need the FP8 dtype
        ({"rollout": {"in_process": False}}, "weight_sync.transport"),  # tensors by reference need the engine here
    ]:
        with pytest.raises(ConfigError) as e:
            from_dict(RunConfig, {**base, **change})
        assert e.value.field == field, (change, e.value)
    # the tokenizer can come from the checkpoint a run starts from
    assert from_dict(RunConfig, {**base, "tokenizer": None, "checkpoint": {"continue_from": "/ckpt"}}).tokenizer is None
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, {**base, "model": "nope"}).model_config()
    assert e.value.field == "model"


def test_the_bad_step_settings_name_their_field():
    from megatron_empg.config import RunConfig

    base = {"model": "tiny-qwen2", "tokenizer": "/tmp/tokenizer"}
    train = from_dict(RunConfig, base).train
    assert (train.skip_grad_norm_factor, train.max_consecutive_skips) == (10.0, 5)
    assert from_dict(RunConfig, {**base, "train": {"skip_grad_norm_factor": None}}).train.skip_grad_norm_factor is None
    for change, field, words in [
        ({"skip_grad_norm_factor": 1.0}, "train.skip_grad_norm_factor", "expected a number > 1, or null"),
        ({"skip_grad_norm_factor": float("inf")}, "train.skip_grad_norm_factor", "expected a finite number, got inf"),
        ({"max_consecutive_skips": 0}, "train.max_consecutive_skips", "must be >= 1, got 0"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)) as e:
            from_dict(RunConfig, {**base, "train": change})
        assert e.value.field == field, (change, e.value)
