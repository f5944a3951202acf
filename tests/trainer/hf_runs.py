"""``empg train`` runs on the transformers-based engine (``rollout.engine: hf``): no vLLM, so they
run on a CPU in seconds and on a GPU machine without vLLM (``tests/gpu``). A random demo-sized model
stands in for the demo's warm start."""

from __future__ import annotations

from pathlib import Path

from megatron_empg.config import load_model_config
from tests.trainer.demo_runs import demo_config


def random_demo_model(out: Path, seed: int = 0) -> Path:
    """A random HF model of the demo's size (``model_configs/demo-qwen2.yaml``) with its tokenizer."""
    from tools.make_tiny_model import save_tiny_hf_model

    return save_tiny_hf_model(load_model_config("demo-qwen2"), out, seed=seed)


def hf_engine_config(tmp: Path, name: str, model_dir: Path, steps: int = 2) -> dict:
    """The demo recipe on ``model_dir`` with the transformers engine: ``steps`` steps of 4 prompts x
    4 samples, micro-batches of 8 in 2 mini-batches (an optimizer step each), a checkpoint per step."""
    config = demo_config(tmp, name, model_dir, steps=steps)
    config["train"].update(prompts_per_step=4, micro_batch_size=4)
    config["rollout"].update(engine="hf", sampling={**config["rollout"]["sampling"], "n": 4})
    config["algorithm"]["mini_batches"] = 2
    return config
