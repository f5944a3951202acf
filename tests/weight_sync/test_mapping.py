"""Megatron <-> HF name/layout mapping: exact round trips on random HF models of each family, the
fused-QKV and SwiGLU layouts against hand-built index patterns, TP merge vs ``tp_slice``, and
HF config parsing. (Logit equality of converted models is tested in tests/tools/test_convert.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import MODEL_CONFIG_DIR, ConfigError, load_model_config, padded_vocab_size
from megatron_empg.mcore.weights import tp_slice
from megatron_empg.weight_sync import mapping

TINY = ["tiny-qwen2", "tiny-llama", "tiny-qwen3"]


@pytest.mark.parametrize("name", TINY)
def test_hf_round_trip_is_bit_exact_and_covers_every_tensor(name):
    from tools.make_tiny_model import tiny_hf_model

    model = load_model_config(name)
    hf_state = {k: v for k, v in tiny_hf_model(model, seed=3).state_dict().items()}
    if model.tie_word_embeddings:
        assert torch.equal(hf_state.pop("lm_head.weight"), hf_state["model.embed_tokens.weight"])
    assert sorted(mapping.hf_tensor_names(model)) == sorted(hf_state)

    padded = padded_vocab_size(model.vocab_size, 128, 2)
    back = {}
    for megatron_name in mapping.megatron_tensor_names(model):
        parts = {n: hf_state[n] for n in mapping.hf_names_of(megatron_name, model)}
        full = mapping.to_megatron(megatron_name, parts, model, padded)
        if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert full.shape == (padded, model.hidden_size)
            assert not full[model.vocab_size :].any()
        back.update(mapping.to_hf(megatron_name, full, model))
    assert sorted(back) == sorted(hf_state)
    for key, tensor in hf_state.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def _small(name: str, **changes) -> mapping.ModelConfig:
    return dataclasses.replace(load_model_config(name), **changes)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_qkv_layout_is_per_query_group(groups):
    """Row r of Megatron's fused QKV holds group r // ((Q+2)*D), slot (r // D) % (Q+2): q heads, k, v."""
    model = _small("tiny-qwen3", num_attention_heads=4, num_query_groups=groups, head_dim=2)
    per_group, d = 4 // groups, 2
    rows = []
    for g in range(groups):
        for slot in range(per_group + 2):
            for j in range(d):
                rows.append([g, slot, j])
    fused = torch.tensor(rows, dtype=torch.float64)  # [G*(Q+2)*D, 3]: each row says where it belongs
    q, k, v = mapping.split_qkv(fused, model)
    # HF: q_proj rows are heads in order (head h = group h // Q), k/v rows are groups in order.
    for h in range(4):
        for j in range(d):
            assert q[h * d + j].tolist() == [h // per_group, h % per_group, j]
    for g in range(groups):
        for j in range(d):
            assert k[g * d + j].tolist() == [g, per_group, j]
            assert v[g * d + j].tolist() == [g, per_group + 1, j]
    assert torch.equal(mapping.merge_qkv(q, k, v, model), fused)
    bias = fused[:, 0].clone()  # 1-D (bias) works the same way
    assert torch.equal(mapping.merge_qkv(*mapping.split_qkv(bias, model), model), bias)


def test_gate_up_and_wrong_shapes():
    model = load_model_config("tiny-qwen2")
    f, h = model.ffn_hidden_size, model.hidden_size
    gate, up = torch.randn(f, h), torch.randn(f, h)
    fc1 = mapping.to_megatron(
        "decoder.layers.1.mlp.linear_fc1.weight",
        {"model.layers.1.mlp.gate_proj.weight": gate, "model.layers.1.mlp.up_proj.weight": up},
        model,
        256,
    )
    assert torch.equal(fc1[:f], gate) and torch.equal(fc1[f:], up)
    with pytest.raises(ValueError, match="ffn_hidden_size"):
        mapping.split_gate_up(fc1[:-1], model)
    with pytest.raises(ValueError, match="q_proj has"):
        mapping.merge_qkv(torch.randn(3, h), torch.randn(32, h), torch.randn(32, h), model)
    with pytest.raises(KeyError, match="up_proj"):
        mapping.to_megatron(
            "decoder.layers.1.mlp.linear_fc1.weight", {"model.layers.1.mlp.gate_proj.weight": gate}, model, 256
        )
    with pytest.raises(ValueError, match="vocab_size is 250"):
        mapping.to_megatron(
            "embedding.word_embeddings.weight", {"model.embed_tokens.weight": torch.zeros(251, h)}, model, 256
        )
    with pytest.raises(KeyError, match="outside"):
        mapping.hf_names_of("decoder.layers.4.mlp.linear_fc2.weight", model)
    with pytest.raises(KeyError, match="no mapping rule"):
        mapping.hf_names_of("decoder.layers.0.self_attention.q_layernorm.weight", model)  # qwen2 has none


def test_tied_output_layer_and_te_names():
    llama = load_model_config("tiny-llama")
    assert llama.tie_word_embeddings
    assert mapping.hf_names_of("output_layer.weight", llama) == ()
    assert mapping.to_hf("output_layer.weight", torch.zeros(384, 64), llama) == []
    assert "output_layer.weight" not in mapping.megatron_tensor_names(llama)
    te = "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.canonical_name(te) == "decoder.layers.1.input_layernorm.weight"
    assert mapping.hf_names_of(te, llama) == ("model.layers.1.input_layernorm.weight",)
    assert mapping.hf_names_of("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", llama) == (
        "model.layers.0.post_attention_layernorm.weight",
    )
    assert mapping.tensor_rule("decoder.layers.0.self_attention.linear_qkv.weight", llama).family == "attention.qkv"


@pytest.mark.parametrize("tp,stride", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_tp_merge_inverts_tp_slice(tp, stride):
    full = torch.arange(16 * 24).reshape(16, 24)
    for dim in (0, 1):
        shards = [tp_slice(full, (dim, stride), rank, tp) for rank in range(tp)]
        assert torch.equal(mapping.tp_merge(shards, (dim, stride)), full)
    assert mapping.tp_merge([full, full], None) is full


@pytest.mark.parametrize("path", sorted(MODEL_CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_config_from_hf_inverts_to_hf_config(path):
    from transformers import AutoConfig

    model = load_model_config(path)
    hf = AutoConfig.for_model(**model.to_hf_config()).to_dict()
    back = mapping.model_config_from_hf(hf, name=model.name)
    assert back == dataclasses.replace(model, hf_model_id=None)


def test_model_config_from_hf_older_spelling_and_refusals():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    model = mapping.model_config_from_hf(hf)
    assert model.family == "llama" and model.rope_theta == 10000.0 and model.rope_scaling["rope_type"] == "llama3"
    assert model.dtype == "bfloat16" and model.num_query_groups == 2
    for change, field in [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"num_key_value_heads": 3}, "num_query_groups"),
    ]:
        with pytest.raises(ConfigError) as e:
            mapping.model_config_from_hf({**hf, **change})
        assert e.value.field == field, (change, e.value)
