"""Megatron GPTModels built from model_configs/: parameter counts and RoPE against transformers, and
TP2 / PP2 / PP2 x VPP2 builds that give the TP1 logits after ``load_full_state_dict``.

Two spawns in all. A 1-rank reference process builds each tiny model at TP1 (norms and biases
randomized so that they matter), returns its full state dict, parameter count, RoPE inverse
frequencies and forward logits, and checks the build's error paths. One 2-rank process then runs
every layout in turn: build, load the reference weights, forward through Megatron's schedule
(interleaved for VPP), return the TP-gathered logits with the padded vocabulary columns dropped and
the global layer indices and names of each model chunk. The parent compares.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_empg.config import ModelConfig, ParallelConfig, load_model_config
from tests.dist import run_distributed
from tests.test_config import hf_parameter_count

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

TINY = ["tiny-qwen2", "tiny-llama", "tiny-qwen3"]
SEQ, MICRO_BATCH, NUM_MICROBATCHES, SEED = 16, 2, 2, 1234
WORLD_SIZE = 2
# (model, layout name, ParallelConfig); every layout fits in WORLD_SIZE ranks.
LAYOUTS = [
    ("tiny-qwen2", "tp2", ParallelConfig(tensor_model_parallel_size=2)),
    ("tiny-qwen2", "pp2", ParallelConfig(pipeline_model_parallel_size=2)),
    ("tiny-qwen2", "pp2_vpp2", ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    ("tiny-qwen3", "tp2", ParallelConfig(tensor_model_parallel_size=2)),
    ("tiny-llama", "tp2", ParallelConfig(tensor_model_parallel_size=2)),
    ("tiny-llama", "pp2", ParallelConfig(pipeline_model_parallel_size=2)),  # tied embeddings across stages
]
LAYOUT_IDS = [f"{name}-{layout}" for name, layout, _ in LAYOUTS]
# fp32: TP/PP regroup reductions (matmul k-splits, all-reduce order), so values agree to rounding.
TOL = dict(rtol=1e-5, atol=1e-5)


def _llama31_rope_probe() -> ModelConfig:
    """A one-layer model with Llama-3.1-8B's RoPE (theta, llama3 scaling, head_dim 128), small elsewhere."""
    real = load_model_config("llama3.1-8b")
    return dataclasses.replace(
        real,
        name="llama3.1-8b-rope",
        num_layers=1,
        hidden_size=256,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=128,
        ffn_hidden_size=64,
        vocab_size=100,
        bos_token_id=None,
        eos_token_id=None,
    )


# --------------------------------------------------------------------------------------------
# Rank-side helpers.


def _forward(chunks: list, batches: list[dict], vocab_size: int) -> list[torch.Tensor] | None:
    """Forward-only through Megatron's schedule; the last stage's full logits per micro-batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_empg.mcore.weights import gather_logits

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked out
        positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        output = model(batch["tokens"], positions, mask)

        def loss_func(logits):
            return torch.zeros(()), {"logits": gather_logits(logits, vocab_size).detach().clone()}

        return output, loss_func

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=len(batches),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=True,
        )
    return [o["logits"] for o in outputs] if outputs else None


def _plain_groups(groups) -> dict:
    """The picklable part of a ParallelGroups (process groups do not cross processes)."""
    names = (
        "tp_rank",
        "tp_size",
        "pp_rank",
        "pp_size",
        "dp_rank",
        "dp_size",
        "vpp_size",
        "is_first_stage",
        "is_last_stage",
        "num_model_chunks",
    )
    return {n: getattr(groups, n) for n in names}


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the message is what is checked)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _reference(rank: int, world_size: int, batches: list[dict]) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model, transformer_config
    from megatron_empg.mcore.weights import load_full_state_dict

    parallel = ParallelConfig()
    results = {}
    g = torch.Generator().manual_seed(1)
    for name in TINY:
        cfg = load_model_config(name)
        parallel_state.initialize_model_parallel(parallel, SEED)
        (model,) = build_gpt_model(cfg, parallel)
        with torch.no_grad():  # norms init to 1 and biases to 0; make them matter
            for param_name, p in model.named_parameters():
                if param_name.endswith("layernorm.weight"):
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
                elif param_name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        results[name] = {
            "state_dict": {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)},
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "padded_vocab_size": model.vocab_size,
            "inv_freq": model.rotary_pos_emb.inv_freq.clone(),
            "logits": _forward([model], batches[name], cfg.vocab_size),
        }
        parallel_state.destroy_model_parallel()

    probe = _llama31_rope_probe()
    parallel_state.initialize_model_parallel(parallel, SEED)
    results[probe.name] = {"inv_freq": build_gpt_model(probe, parallel)[0].rotary_pos_emb.inv_freq.clone()}
    cfg = load_model_config("tiny-qwen2")
    (bf16_model,) = build_gpt_model(cfg, parallel, params_dtype=torch.bfloat16)
    load_full_state_dict([bf16_model], results["tiny-qwen2"]["state_dict"])
    bf16_logits = _forward([bf16_model], batches["tiny-qwen2"], cfg.vocab_size)
    results["bf16"] = {
        "dtypes": {p.dtype for p in bf16_model.parameters()},
        "finite": all(torch.isfinite(lg).all() for lg in bf16_logits),
        "max_abs_diff_to_fp32": max(
            (lg.float() - ref).abs().max().item() for lg, ref in zip(bf16_logits, results["tiny-qwen2"]["logits"])
        ),
        "max_abs_fp32": max(ref.abs().max().item() for ref in results["tiny-qwen2"]["logits"]),
    }
    results["errors"] = {
        "te": _error_of(lambda: build_gpt_model(cfg, parallel, attention_backend="te")),
        "unknown_backend": _error_of(lambda: build_gpt_model(cfg, parallel, attention_backend="flash")),
        "sequence_parallel": _error_of(
            lambda: transformer_config(
                cfg,
                ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                params_dtype=torch.float32,
                use_cpu_initialization=True,
            )
        ),
        "world_size": _error_of(lambda: build_gpt_model(cfg, ParallelConfig(tensor_model_parallel_size=2))),
        "reinitialize": _error_of(lambda: parallel_state.initialize_model_parallel(parallel, SEED)),
    }
    parallel_state.destroy_model_parallel()
    return results


def _run_layouts(rank: int, world_size: int, reference: dict, batches: dict) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import (
        global_layer_indices,
        global_names,
        layer_offset,
        load_full_state_dict,
        megatron_layer_offset,
    )

    results = {}
    for (name, layout, parallel), layout_id in zip(LAYOUTS, LAYOUT_IDS):
        cfg = load_model_config(name)
        groups = parallel_state.initialize_model_parallel(parallel, SEED)
        chunks = build_gpt_model(cfg, parallel)
        load_full_state_dict(chunks, reference[name]["state_dict"], vocab_size=cfg.vocab_size)
        results[layout_id] = {
            "groups": _plain_groups(groups),
            "chunks": [
                {
                    "layers": global_layer_indices(chunk),
                    "offset": layer_offset(chunk),
                    "megatron_offset": megatron_layer_offset(chunk.config, chunk.vp_stage),
                    "names": sorted(global_names(chunk).values()),
                    "pre_process": chunk.pre_process,
                    "post_process": chunk.post_process,
                    "padded_vocab_size": chunk.vocab_size,
                }
                for chunk in chunks
            ],
            "logits": _forward(chunks, batches[name], cfg.vocab_size),
        }
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=2), SEED)
    cfg = load_model_config("tiny-qwen2")
    results["state_mismatch"] = _error_of(lambda: build_gpt_model(cfg, ParallelConfig(pipeline_model_parallel_size=2)))
    parallel_state.destroy_model_parallel()
    return results


# --------------------------------------------------------------------------------------------
# Fixtures: two spawns for the whole module.


@pytest.fixture(scope="module")
def batches() -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        name: [
            {"tokens": torch.randint(0, load_model_config(name).vocab_size, (MICRO_BATCH, SEQ), generator=g)}
            for _ in range(NUM_MICROBATCHES)
        ]
        for name in TINY
    }


@pytest.fixture(scope="module")
def reference(batches) -> dict:
    return run_distributed(_reference, 1, batches, timeout=150)[0]


@pytest.fixture(scope="module")
def layouts(reference, batches) -> list[dict]:
    tensors = {name: {"state_dict": reference[name]["state_dict"]} for name in TINY}
    return run_distributed(_run_layouts, WORLD_SIZE, tensors, batches, timeout=240)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


# --------------------------------------------------------------------------------------------
# Against Hugging Face transformers.


@pytest.mark.parametrize("name", TINY)
def test_hf_model_from_to_hf_config_has_the_megatron_parameter_count(reference, transformers, name):
    cfg = load_model_config(name)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf_config()))
    hf_count = sum(p.numel() for p in hf_model.parameters())
    ref = reference[name]
    padding_rows = ref["padded_vocab_size"] - cfg.vocab_size
    assert padding_rows > 0  # the tiny vocabularies are padded
    megatron_unpadded = ref["num_parameters"] - padding_rows * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert hf_count == megatron_unpadded == cfg.num_parameters() == hf_parameter_count(cfg.to_hf_config())
    assert ref["num_parameters"] == cfg.num_parameters(padded_vocab_size=ref["padded_vocab_size"])
    # RoPE: Megatron's inverse frequencies (base, head_dim, llama3 scaling) equal transformers'
    torch.testing.assert_close(ref["inv_freq"], hf_model.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


def test_llama31_rope_scaling_matches_transformers(reference, transformers):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    probe = _llama31_rope_probe()
    hf_rope = LlamaRotaryEmbedding(transformers.AutoConfig.for_model(**probe.to_hf_config()))
    assert probe.rope_scaling["factor"] == 8.0  # Megatron's own llama3 path (its fixed defaults)
    torch.testing.assert_close(reference[probe.name]["inv_freq"], hf_rope.inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "name", ["deepseek-r1-distill-qwen-1.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "llama3.1-8b"]
)
def test_transformers_accepts_the_real_models_hf_configs(transformers, name):
    cfg = load_model_config(name)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf_config())  # a config only: no weights
    assert type(hf).__name__ == {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config"}[cfg.family]
    assert (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers) == (
        cfg.hidden_size,
        cfg.ffn_hidden_size,
        cfg.num_layers,
    )
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size) == (
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.vocab_size,
    )
    assert getattr(hf, "head_dim", cfg.hidden_size // cfg.num_attention_heads) == cfg.kv_channels
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta and hf.rms_norm_eps == cfg.norm_epsilon
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings and hf.dtype == torch.bfloat16
    assert hf.eos_token_id == cfg.eos_token_id and hf.bos_token_id == cfg.bos_token_id
    if cfg.rope_scaling is not None:
        assert {k: hf.rope_parameters[k] for k in cfg.rope_scaling} == cfg.rope_scaling


# --------------------------------------------------------------------------------------------
# Builds.


def test_bf16_build_has_bf16_parameters_and_close_logits(reference):
    bf16 = reference["bf16"]
    assert bf16["dtypes"] == {torch.bfloat16} and bf16["finite"]
    assert bf16["max_abs_diff_to_fp32"] < 0.02 * bf16["max_abs_fp32"], bf16


def test_build_errors_are_clear(reference):
    errors = reference["errors"]
    assert errors["te"].startswith(
        "ConfigError: model.attention_backend: te needs Transformer Engine, which does "
        "not import here (ModuleNotFoundError"
    ), errors["te"]
    assert "NGC PyTorch container" in errors["te"] and "use sdpa" in errors["te"]
    assert errors["unknown_backend"].startswith(
        "ConfigError: model.attention_backend: unknown name 'flash'; "
        "expected 'auto' or one of ['sdpa', 'te', 'unfused']"
    )
    assert errors["sequence_parallel"].startswith(
        "ConfigError: parallel.sequence_parallel: needs model.attention_backend te"
    ), errors["sequence_parallel"]
    assert errors["world_size"].startswith("ConfigError: tensor_model_parallel_size: world size 1 is not divisible")
    assert errors["reinitialize"].startswith("RuntimeError: model parallelism is already initialized")


def test_build_with_another_layout_than_initialized_is_an_error(layouts):
    for result in layouts:
        assert result["state_mismatch"].startswith(
            "RuntimeError: Megatron's parallel state is (TP, PP, VPP) = (2, 1, None) but the ParallelConfig asks "
            "(1, 2, None)"
        )


@pytest.mark.parametrize(("layout", "layout_id"), list(zip(LAYOUTS, LAYOUT_IDS)), ids=LAYOUT_IDS)
def test_layout_logits_equal_tp1(reference, layouts, layout, layout_id):
    name, _, parallel = layout
    expected = reference[name]["logits"]
    last_stage = [r[layout_id] for r in layouts if r[layout_id]["groups"]["is_last_stage"]]
    assert len(last_stage) == WORLD_SIZE // parallel.pipeline_model_parallel_size
    for result in last_stage:
        assert result["logits"] is not None and len(result["logits"]) == NUM_MICROBATCHES
        for actual, want in zip(result["logits"], expected):
            assert actual.shape == (MICRO_BATCH, SEQ, load_model_config(name).vocab_size)
            torch.testing.assert_close(actual, want, **TOL)


@pytest.mark.parametrize(("layout", "layout_id"), list(zip(LAYOUTS, LAYOUT_IDS)), ids=LAYOUT_IDS)
def test_layout_chunks_cover_every_layer_and_weight_once(reference, layouts, layout, layout_id):
    name, _, parallel = layout
    cfg = load_model_config(name)
    tp = parallel.tensor_model_parallel_size
    layers, names = [], set()
    for result in layouts:
        r = result[layout_id]
        groups = r["groups"]
        assert (groups["tp_size"], groups["pp_size"], groups["vpp_size"]) == (
            tp,
            parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size,
        )
        assert groups["dp_size"] == WORLD_SIZE // parallel.model_parallel_size
        assert len(r["chunks"]) == groups["num_model_chunks"]
        for i, chunk in enumerate(r["chunks"]):
            assert chunk["padded_vocab_size"] == parallel.padded_vocab_size(cfg.vocab_size)
            assert chunk["offset"] == chunk["megatron_offset"] == chunk["layers"][0]
            first = groups["is_first_stage"] and i == 0
            last = groups["is_last_stage"] and i == len(r["chunks"]) - 1
            assert (chunk["pre_process"], chunk["post_process"]) == (first, last)
            if groups["tp_rank"] == 0:
                layers += chunk["layers"]
                names |= set(chunk["names"])
    assert sorted(layers) == list(range(cfg.num_layers))  # each layer exactly once
    expected = set(reference[name]["state_dict"])
    if cfg.tie_word_embeddings and parallel.pipeline_model_parallel_size > 1:
        expected.add("output_layer.weight")  # the last stage's copy of the tied embedding
    assert {n for n in names if not n.endswith("_extra_state")} == expected
