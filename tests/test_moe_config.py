"""Mixture-of-experts configuration: Qwen3-30B-A3B's published sizes, the HF config both ways, the
bind checks of the expert grid (EP, ETP) and the Megatron <-> HF expert names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import ConfigError, ParallelConfig, load_model_config, padded_vocab_size
from megatron_empg.mcore.weights import global_name, local_name
from megatron_empg.weight_sync import mapping
from tests.test_config import hf_parameter_count


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_qwen3_30b_a3b_has_its_published_total_and_active_parameters():
    cfg = load_model_config("qwen3-30b-a3b")
    hf = cfg.to_hf_config()
    # Hugging Face's safetensors count of Qwen/Qwen3-30B-A3B; 3.3B activated (its model card).
    assert cfg.num_parameters() == hf_parameter_count(hf) == 30_532_122_624
    assert cfg.num_parameters(active=True) == hf_parameter_count(hf, active=True) == 3_353_032_704
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (128, 8, 768)


def test_tiny_moe_matches_transformers_parameter_count_and_config():
    transformers = pytest.importorskip("transformers")
    cfg = load_model_config("tiny-qwen3-moe")
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf_config())
    assert type(hf_config).__name__ == "Qwen3MoeConfig" and hf_config.norm_topk_prob is True
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts"])
def test_model_config_from_hf_reads_both_spellings_of_the_expert_count(experts_key):
    cfg = load_model_config("tiny-qwen3-moe")
    hf = cfg.to_hf_config()
    hf[experts_key] = hf.pop("num_experts")
    back = mapping.model_config_from_hf(hf, name=cfg.name)
    assert back == cfg
    hf["norm_topk_prob"] = False
    assert mapping.model_config_from_hf(hf, name=cfg.name).moe_norm_topk_prob is False
    for key, value in (("mlp_only_layers", [1]), ("decoder_sparse_step", 2)):
        assert "mlp_only_layers" in _error(mapping.model_config_from_hf, {**hf, key: value})


def test_moe_fields_are_checked():
    cfg = load_model_config("tiny-qwen3-moe")
    for changes, field in [
        ({"num_experts": None}, "num_experts"),
        ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size"),
        ({"moe_router_topk": 9}, "moe_router_topk"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
        ({"moe_aux_loss_coeff": -1.0}, "moe_aux_loss_coeff"),
        ({"moe_z_loss_coeff": 0.0}, "moe_z_loss_coeff"),
        ({"moe_expert_capacity_factor": float("nan")}, "moe_expert_capacity_factor"),
    ]:
        assert _error(dataclasses.replace, cfg, **changes).startswith(field), changes  # checked on construction
    dense = load_model_config("tiny-qwen3")
    assert "is dense" in _error(dataclasses.replace, dense, num_experts=8)


def test_expert_grid_is_checked_against_the_model_and_the_world():
    moe, dense = load_model_config("tiny-qwen3-moe"), load_model_config("tiny-qwen3")
    ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2).validate_for(moe, world_size=4)
    ParallelConfig(expert_model_parallel_size=8, expert_tensor_parallel_size=1).validate_for(moe, world_size=8)
    message = _error(ParallelConfig(expert_model_parallel_size=3).validate_for, moe)
    assert "expert_model_parallel_size=3 does not divide model.num_experts=8" in message
    message = _error(ParallelConfig(expert_model_parallel_size=4, tensor_model_parallel_size=2).validate_for, moe, 4)
    assert "world size 4 is not divisible by expert_tensor_parallel_size x expert_model_parallel_size" in message
    message = _error(ParallelConfig(expert_tensor_parallel_size=3).validate_for, moe)
    assert "expert_tensor_parallel_size=3 does not divide model.moe_ffn_hidden_size=32" in message
    assert "has no experts" in _error(ParallelConfig(expert_model_parallel_size=2).validate_for, dense)
    assert _error(ParallelConfig, expert_model_parallel_size=0).startswith("expert_model_parallel_size")


def test_expert_names_round_trip_bit_exact_and_name_their_family():
    from tools.make_tiny_model import tiny_hf_model

    cfg = load_model_config("tiny-qwen3-moe")
    # In memory transformers fuses the experts; state_dict gives them per expert only on disk.
    fused = tiny_hf_model(cfg, seed=3).state_dict()
    hf_state = {}
    for key, tensor in fused.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e in range(cfg.num_experts):
                gate, up = tensor[e].chunk(2)
                hf_state[f"{prefix}{e}.gate_proj.weight"], hf_state[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            hf_state.update({f"{prefix}{e}.down_proj.weight": tensor[e] for e in range(cfg.num_experts)})
        else:
            hf_state[key] = tensor
    assert sorted(mapping.hf_tensor_names(cfg)) == sorted(hf_state)
    padded = padded_vocab_size(cfg.vocab_size, 128, 1)
    megatron = mapping.to_megatron_state_dict(hf_state, cfg, padded)
    fc1 = megatron["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert fc1.shape == (2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
    assert torch.equal(fc1[: cfg.moe_ffn_hidden_size], hf_state["model.layers.1.mlp.experts.5.gate_proj.weight"])
    back = {k: v for name, full in megatron.items() for k, v in mapping.to_hf(name, full, cfg)}
    assert sorted(back) == sorted(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in hf_state)
    assert mapping.tensor_rule("decoder.layers.0.mlp.router.weight", cfg).family == "moe.router"
    assert mapping.tensor_rule("decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight", cfg).family == (
        "moe.experts.down"
    )
    with pytest.raises(KeyError, match="expert 8 is outside the model's 8 experts"):
        mapping.hf_names_of("decoder.layers.0.mlp.experts.local_experts.8.linear_fc2.weight", cfg)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        mapping.to_hf("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", fc1[:-2], cfg)


def test_te_grouped_expert_names_and_expert_offsets():
    assert mapping.canonical_name("decoder.layers.3.mlp.experts.linear_fc1.weight5") == (
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    )
    local = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    assert global_name(local, 4, expert_offset=6) == "decoder.layers.5.mlp.experts.local_experts.8.linear_fc2.weight"
    assert local_name(global_name(local, 4, 6), 4, 6) == local
    grouped = "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    assert global_name(grouped, 0, expert_offset=4) == "decoder.layers.0.mlp.experts.linear_fc1.weight7"
    assert global_name("decoder.layers.0.mlp.router.weight", 2, expert_offset=4) == "decoder.layers.2.mlp.router.weight"


def test_one_table_of_model_families():
    import typing

    from megatron_empg.config import FAMILIES, Family

    assert set(typing.get_args(Family)) == set(FAMILIES) == set(mapping.ARCHITECTURES)
    for name, spec in FAMILIES.items():
        assert mapping.ARCHITECTURES[name].hf_architecture == spec.hf_architecture
        tiny = load_model_config(f"tiny-{name.replace('_', '-')}")
        back = mapping.model_config_from_hf(tiny.to_hf_config(), name=tiny.name)
        assert (back.add_qkv_bias, back.qk_layernorm, back.is_moe) == (spec.add_qkv_bias, spec.qk_layernorm, spec.moe)
