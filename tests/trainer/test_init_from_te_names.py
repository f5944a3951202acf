"""``checkpoint.init_from`` a HF directory into a model with Transformer Engine's parameter names.

With TE importable (the NGC container) the TE layer spec is picked, whose fused-norm parameters are
``...self_attention.linear_qkv.layer_norm_weight`` and ``...mlp.linear_fc1.layer_norm_weight``.
There is no TE here, so a TE-named view of a real local-spec ``GPTModel`` stands in for the chunk:
the same ``Parameter`` objects registered under TE's names (the layout TE gives them is the same).
The trainer's loader must map the names (without the mapping: the ``KeyError`` of a first GPU run),
and after it the real model's logits equal transformers' logits of the HF directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_empg.config import RunConfig, load_config, load_model_config
from megatron_empg.weight_sync.mapping import TE_NAME_ALIASES
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen2"


class _Node(torch.nn.Module):
    pass


def _te_named_view(chunk: torch.nn.Module) -> torch.nn.Module:
    """A module holding ``chunk``'s parameters under the TE spec's names, with the attributes the
    loader reads (layer numbers, tied embeddings)."""
    local_to_te = {local: te for te, local in TE_NAME_ALIASES.items()}
    view = _Node()
    view.share_embeddings_and_output_weights = chunk.share_embeddings_and_output_weights
    for name, param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            suffix = ".".join(parts[3:])
            parts = parts[:3] + local_to_te.get(suffix, suffix).split(".")
        node = view
        for depth, part in enumerate(parts[:-1]):
            if not hasattr(node, part):
                node.add_module(part, torch.nn.ModuleList() if part == "layers" else _Node())
            if part == "layers":
                layers, index = getattr(node, part), int(parts[depth + 1])
                while len(layers) <= index:
                    layers.append(_Node())
                    layers[-1].layer_number = chunk.decoder.layers[len(layers) - 1].layer_number
            node = getattr(node, part) if not isinstance(node, torch.nn.ModuleList) else node[int(part)]
        node.register_parameter(parts[-1], param)
    return view


def _load(rank: int, world_size: int, hf_dir: str) -> dict:
    from megatron_empg.mcore import parallel_state
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.weights import shard_full_state_dict
    from megatron_empg.trainer.run.start import load_initial_weights
    from megatron_empg.weight_sync import mapping

    config = load_config(RunConfig, {"model": MODEL, "tokenizer": hf_dir, "train": {"params_dtype": "float32"}})
    model = config.model_config()
    groups = parallel_state.initialize_model_parallel(config.parallel, 0)
    (chunk,) = build_gpt_model(model, config.parallel)
    view = _te_named_view(chunk)
    te_names = sorted(n for n, _ in view.named_parameters() if "layer_norm_weight" in n)
    hf = mapping.to_megatron_state_dict(_hf_state(hf_dir), model, config.parallel.padded_vocab_size(model.vocab_size))
    try:
        shard_full_state_dict(view, hf, 0, 1, 0, vocab_size=model.vocab_size)  # verbatim names: the GPU crash
        unmapped = "no error"
    except KeyError as error:
        unmapped = str(error)
    load_initial_weights([view], hf_dir, model, config, groups)  # what the trainer does
    ids = torch.arange(12).reshape(1, 12) % model.vocab_size
    with torch.no_grad():
        logits = chunk(ids, torch.arange(12)[None], torch.ones(1, 1, 12, 12, dtype=torch.bool).triu_(1))
    parallel_state.destroy_model_parallel()
    return {"te_names": te_names, "unmapped": unmapped, "logits": logits[..., : model.vocab_size], "ids": ids}


def _hf_state(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(hf_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def test_init_from_a_hf_directory_loads_te_named_parameters(tmp_path):
    from transformers import AutoModelForCausalLM

    from tools.make_tiny_model import save_tiny_hf_model

    hf_dir = save_tiny_hf_model(load_model_config(MODEL), tmp_path / MODEL, seed=3)
    (result,) = run_distributed(_load, 1, str(hf_dir))
    assert len(result["te_names"]) == 2 * load_model_config(MODEL).num_layers  # qkv and fc1 norms, each layer
    assert (
        "linear_qkv.layer_norm_weight" in result["unmapped"]
        and "is missing from the full state dict" in result["unmapped"]
    )
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(result["ids"]).logits
    torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)
