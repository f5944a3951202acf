"""Every recipe loads, and the r1-distill math recipes hold the published hyperparameters of the
ema-pg math runs (../shared/research/ema-pg.md, section 8.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_empg.config import RunConfig, load_config

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
R1 = "r1_distill_qwen_1.5b_math_ema_pg"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_loads(path):
    config = load_config(RunConfig, path)
    assert config.model_config().name


def test_r1_math_recipe_has_the_published_hyperparameters():
    config = load_config(RunConfig, RECIPES / f"{R1}.yaml")
    assert config.model_config().hf_model_id == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    opt = config.optimizer
    assert (opt.lr, opt.lr_warmup_steps, opt.lr_decay_style) == (1e-6, 0, "constant")
    assert (opt.adam_beta1, opt.adam_beta2, opt.weight_decay, opt.clip_grad) == (0.9, 0.999, 0.01, 1.0)
    assert config.train.prompts_per_step * config.rollout.sampling.n == 128 * 8
    assert config.algorithm.mini_batches == 2  # mini-batch of 64 prompts
    loss = config.algorithm.loss
    assert loss.policy_loss == "ppo_clip" and loss.agg_mode == "seq-mean-token-mean" and loss.entropy_coef == 0
    assert loss.policy_loss_args == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 3.0}
    assert (loss.kl, loss.kl_coef) == ("k3", 0.001)
    anchor = config.algorithm.anchor
    # tau 0.95 every 10 steps of 2 optimizer steps each; the EMA master is float32 by construction
    assert (anchor.tau, anchor.period) == (0.95, 10 * config.algorithm.mini_batches)
    assert config.rollout.sampling.temperature == 1.0 and config.rollout.sampling.top_p == 1.0
    assert config.algorithm.mask_truncated


@pytest.mark.parametrize(("stage", "response", "seed", "continues_from"), [
    ("", 8192, 6725, None),
    ("_16k", 16384, 986, "8k/checkpoints/step_00000480"),
    ("_24k", 24576, 986, "16k/checkpoints/step_00000800"),
])  # fmt: skip
def test_r1_math_stages_lengths_seeds_and_continuation(stage, response, seed, continues_from):
    config = load_config(RunConfig, RECIPES / f"{R1}{stage}.yaml")
    assert config.rollout.sampling.max_tokens == response
    assert config.train.max_seq_len == config.rollout.max_model_len == 4096 + response
    assert config.data.max_prompt_tokens == 4096 and config.data.seed == seed
    if continues_from is None:
        assert config.checkpoint.init_from and config.checkpoint.continue_from is None
    else:
        assert config.checkpoint.init_from is None and config.checkpoint.continue_from.endswith(continues_from)
    # the stages only change lengths, seeds, directories and the truncation mask
    base = load_config(RunConfig, RECIPES / f"{R1}.yaml")
    assert config.algorithm.loss == base.algorithm.loss and config.optimizer == base.optimizer
    assert config.algorithm.anchor == base.algorithm.anchor
