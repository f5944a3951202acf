"""Fixtures of the rollout-engine tests: the tiny model on disk, and a skip when vLLM is missing."""

from __future__ import annotations

import pytest

from megatron_empg.config import ModelConfig, load_model_config

TINY_MODEL = "tiny-qwen3"  # head_dim 32: one of the head sizes vLLM's CPU attention supports
TINY_MODEL_SEED = 0  # the weights written to the model directory


@pytest.fixture(scope="session")
def tiny_model() -> ModelConfig:
    return load_model_config(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tmp_path_factory) -> str:
    """A Hugging Face directory (config, fp32 safetensors, character tokenizer) of ``tiny_model``."""
    from tools.make_tiny_model import save_tiny_hf_model

    return str(save_tiny_hf_model(tiny_model, tmp_path_factory.mktemp(TINY_MODEL), seed=TINY_MODEL_SEED))


@pytest.fixture(scope="session")
def require_vllm() -> None:
    """Skip (with the reason) where ``import vllm`` fails."""
    try:
        import vllm  # noqa: F401
    except Exception as error:  # not installed, or broken (e.g. CUDA-linked torchvision)
        pytest.skip(f"vLLM is not importable: {type(error).__name__}: {error}")
