"""HfEngine weight updates of a mixture of experts (tiny-qwen3-moe, float32, CPU): the per-expert
checkpoint names land in transformers' fused expert parameters.

Reference: ``from_pretrained`` of a saved model (transformers' own per-expert -> fused loading);
the update's tensors are that model's checkpoint file as ``save_pretrained`` wrote it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import RolloutConfig, load_model_config
from megatron_empg.rollout.hf_engine import HfEngine
from tests.rollout.test_hf_engine import hf_score, random_sequences

ROLLOUT = RolloutConfig(dtype="float32")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tools.make_tiny_model import save_tiny_hf_model

    model = load_model_config("tiny-qwen3-moe")
    root = tmp_path_factory.mktemp("moe")
    return model, save_tiny_hf_model(model, root / "engine", seed=9), save_tiny_hf_model(model, root / "new", seed=5)


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (file,) = model_dir.glob("*.safetensors")
    return load_file(str(file))


def test_per_expert_updates_fill_the_fused_experts_and_count_for_completeness(dirs):
    from transformers import AutoModelForCausalLM

    model, engine_dir, new_dir = dirs
    reference = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    sequences = random_sequences(model.vocab_size, [17, 9, 30], seed=3)
    expected = [hf_score(reference, s) for s in sequences]
    checkpoint = _checkpoint(new_dir)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in checkpoint  # on disk: one tensor per expert

    engine = HfEngine(engine_dir, ROLLOUT)
    before = engine.score(sequences)
    assert max(abs(a - b) for x, y in zip(before, expected) for a, b in zip(x, y)) > 0.1
    engine.sleep(level=2)
    engine.wake_up()
    names = sorted(checkpoint)
    engine.begin_weight_update()
    half = len(names) // 2  # two buckets: each expert's gate/up/down may come in any bucket
    engine.update_weights(named_tensors=[(n, checkpoint[n]) for n in names[:half]])
    engine.update_weights(named_tensors=[(n, checkpoint[n]) for n in names[half:]])
    engine.finish_weight_update("v1")
    for got, want in zip(engine.score(sequences), expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want, dtype=torch.float32), rtol=0, atol=TOLERANCE)

    # After a level-2 sleep every expert's every tensor must be written: one missing is named.
    engine.sleep(level=2)
    engine.wake_up()
    engine.begin_weight_update()
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    engine.update_weights(named_tensors=[(n, checkpoint[n]) for n in names if n != missing])
    with pytest.raises(RuntimeError, match=rf"1 were not written: {missing}$"):
        engine.finish_weight_update("v2")
    engine.shutdown()


def test_an_expert_tensor_of_the_wrong_shape_is_refused(dirs):
    model, engine_dir, _ = dirs
    engine = HfEngine(engine_dir, ROLLOUT)
    engine.begin_weight_update()
    bad = torch.zeros(model.hidden_size, model.moe_ffn_hidden_size)  # down's shape, sent as gate
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight' has shape \[64, 32\]"):
        engine.update_weights(named_tensors=[("model.layers.0.mlp.experts.0.gate_proj.weight", bad)])
    engine.shutdown()
