"""Every recipe binds (``trainer.bind.build.bind``: names, arguments, layout, limits, files) at the world
size it is written for, and the r1-distill math recipes hold the published hyperparameters of the
ema-pg math runs (github.com/LunjunZhang/ema-pg, math/examples/deepscaler/*_ema_pg.sh)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_empg.config import RunConfig, load_config, load_model_config, read_yaml

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
R1 = "r1_distill_qwen_1.5b_math_ema_pg"
# The world each recipe is written for: the CPU demos run in one process, the GPU recipes on one
# node of 8 GPUs (their comments; the reference runs' layout), the 32k Qwen3-8B one on two, Qwen3-30B-A3B on four.
WORLD_SIZES = {
    "demo_cpu.yaml": 1,
    "demo_cpu_grpo.yaml": 1,
    "qwen3_8b_dapo_math_rpg_urkl_32k_cp4.yaml": 16,
    "qwen3_30b_a3b_dapo_math_ema_pg.yaml": 32,
}
CPU_RECIPES = ("demo_cpu.yaml", "demo_cpu_grpo.yaml")


def _record(config: RunConfig) -> dict:
    """A record with the recipe's prompt and answer keys (dotted keys nest)."""
    record: dict = {}
    for key, value in ((config.data.prompt_key, "What is 1+1?"), (config.data.answer_key, ["2"])):
        node = record
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return record


def _with_local_paths(path: Path, tmp_path: Path) -> RunConfig:
    """The recipe with its files (data, validation, init_from, continue_from, tokenizer) replaced by
    local stand-ins of the same kind: one-record JSONL files, HF directories with the model's
    config.json and tensors, a checkpoint of the model."""
    config = load_config(RunConfig, path)
    overrides = []
    if config.data.train_files:
        data = tmp_path / "train.jsonl"
        data.write_text(json.dumps(_record(config)) + "\n")
        overrides.append(f"data.train_files=[{data}]")
    if config.validation.files:
        val = tmp_path / "val.jsonl"
        val.write_text(json.dumps(_record(config)) + "\n")
        overrides.append(f"validation.files=[{val}]")
    import torch
    from safetensors.torch import save_file

    from megatron_empg.config import to_yaml
    from megatron_empg.mcore.checkpoint.files import MODEL_CONFIG_FILE
    from megatron_empg.weight_sync import mapping
    from tests.trainer.test_run_dir import _checkpoint

    model = config.model_config()
    for field in ("checkpoint.init_from", "checkpoint.continue_from", "tokenizer"):
        section, _, name = field.rpartition(".")
        if getattr(getattr(config, section) if section else config, name) is not None:
            directory = tmp_path / field
            if field == "checkpoint.continue_from":  # a checkpoint of the model
                _checkpoint(directory, 1)
                (directory / "step_00000001" / MODEL_CONFIG_FILE).write_text(to_yaml(model))
            else:  # a HF directory: its tensors of one element (the check reads names and sizes)
                directory.mkdir()
                (directory / "config.json").write_text(json.dumps(model.to_hf_config()))
                tensors = {n: torch.zeros(1) for n in mapping.hf_tensor_names(model)}
                save_file(tensors, str(directory / "model.safetensors"))
            overrides.append(f"{field}={directory}")
    if config.algorithm.distill is not None:  # the teacher: a HF directory of its model, the student's tokenizer
        teacher = load_config(RunConfig, read_yaml(path), overrides).algorithm.distill
        directory = tmp_path / "teacher"
        directory.mkdir()
        teacher_model = load_model_config(teacher.teacher.model)
        (directory / "config.json").write_text(json.dumps(teacher_model.to_hf_config()))
        save_file(
            {n: torch.zeros(1) for n in mapping.hf_tensor_names(teacher_model)}, str(directory / "model.safetensors")
        )
        overrides.append(f"algorithm.distill.teacher.checkpoint={directory}")
        tokenizer = json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": []})
        for source in (directory, tmp_path / "checkpoint.init_from", tmp_path / "tokenizer"):
            if source.is_dir():
                (source / "tokenizer.json").write_text(tokenizer)
    return load_config(RunConfig, read_yaml(path), overrides)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_binds_at_its_world_size(path, tmp_path):
    from megatron_empg.trainer.bind.build import bind

    components = bind(_with_local_paths(path, tmp_path), WORLD_SIZES.get(path.name, 8))
    assert components.layout.world_size == WORLD_SIZES.get(path.name, 8)


@pytest.mark.parametrize(
    "path", [p for p in sorted(RECIPES.glob("*.yaml")) if p.name not in CPU_RECIPES], ids=lambda p: p.name
)
def test_every_gpu_recipe_plans_within_an_h100_at_its_world_size(path, tmp_path):
    """``empg plan``'s numbers (``trainer.bind.memory_plan``) for one 80 GB H100 per rank; the recipes'
    comments quote them."""
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_plan import DEFAULT_DEVICE_BYTES, plan_memory

    plan = plan_memory(bind(_with_local_paths(path, tmp_path), WORLD_SIZES.get(path.name, 8), check_paths=False))
    assert plan.device_bytes == DEFAULT_DEVICE_BYTES and plan.fits, plan.describe()
    assert {"rollout", "update", "old_pass"} <= set(plan.ranks[0].phases)


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


@pytest.mark.parametrize(
    ("stage", "response", "seed", "continues_from"),
    [
        ("", 8192, 6725, None),
        ("_16k", 16384, 986, "8k/checkpoints/step_00000480"),
        ("_24k", 24576, 986, "16k/checkpoints/step_00000800"),
    ],
)
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


SEARCH = "qwen2.5_3b_search_ema_pg"
# Search-R1's make_prefix(template_type="base") (scripts/data_process/nq_search.py), verbatim
SEARCH_R1_BASE_PREFIX = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> "
    "and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> and "
    "</answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)


def test_search_recipe_has_the_published_hyperparameters():
    """docs/design/ema-pg.md section 8.1 (search/train_grpo_ema_pg.sh), in optimizer steps where ours count them."""
    config = load_config(RunConfig, RECIPES / f"{SEARCH}.yaml")
    assert config.model_config().hf_model_id == "Qwen/Qwen2.5-3B"
    assert config.train.steps == 1005
    mini = config.algorithm.mini_batches
    assert mini == 10  # 10 optimizer steps per step (ppo_mini_batch 256 of 2560 trajectories)
    assert (config.train.prompts_per_step, config.rollout.sampling.n) == (512, 5)
    opt = config.optimizer
    assert (opt.lr, opt.lr_decay_style, opt.lr_decay_steps) == (1e-6, "constant", None)
    assert opt.lr_warmup_steps == int(0.285 * 1005) * mini  # verl's scheduler steps once per step
    assert (opt.adam_beta1, opt.adam_beta2, opt.weight_decay, opt.clip_grad) == (0.9, 0.95, 0.01, 1.0)
    loss = config.algorithm.loss
    assert loss.policy_loss == "ppo_clip" and loss.agg_mode == "token-mean" and loss.entropy_coef == 0
    assert loss.policy_loss_args == {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
    assert (loss.kl, loss.kl_coef, config.algorithm.topk) == ("topk", 0.001, 32)
    assert loss.kl_args == {"direction": "reverse", "tail": True, "tail_grad": "unbiased", "importance_weight": True}
    assert (config.algorithm.anchor.tau, config.algorithm.anchor.period) == (0.9, 10 * mini)
    assert config.algorithm.advantage == "grpo" and not config.algorithm.mask_truncated
    sampling = config.rollout.sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (1.0, 0.95, 500)
    agent = config.rollout.search_agent
    assert (agent.retriever_url, agent.topk, agent.max_turns, agent.max_obs_tokens) == (
        "http://127.0.0.1:8000",
        3,
        4,
        500,
    )
    data = config.data
    assert (data.reward, data.prompt_key, data.answer_key) == ("qa_em", "question", "golden_answers")
    assert data.prompt_template.format(prompt="who wrote hamlet?") == SEARCH_R1_BASE_PREFIX.format(
        question="who wrote hamlet?"
    )
    assert data.apply_chat_template and data.system_prompt is None and data.max_prompt_tokens == 2048
    # a whole episode fits: the prompt, max_turns + 1 turns of max_tokens, max_turns observations
    episode = (
        data.max_prompt_tokens + (agent.max_turns + 1) * sampling.max_tokens + agent.max_turns * agent.max_obs_tokens
    )
    assert episode == 6548 and config.train.max_seq_len == config.rollout.max_model_len == 6656
    assert not config.rollout.in_process and config.weight_sync.transport == "shm_file"
    assert config.rollout.dtype == config.train.params_dtype == "bfloat16"
    val = config.validation  # the 7 test sets every 50 steps and before training, greedy
    assert (val.files, val.interval, val.at_start) == (["data/search/test.jsonl"], 50, True)
    # capped: the whole test set (~51k episodes) on the engine's rank would outlast the collectives' timeout
    assert val.max_prompts_per_source == 500 and config.distributed.timeout_minutes == 120
    assert val.sampling(sampling) == dataclasses.replace(sampling, n=1, temperature=0.0, top_p=1.0)


RPG = "qwen3_4b_dapo_math_rpg"


@pytest.mark.parametrize("variant", ["urkl", "reinforce"])
def test_rpg_recipes_have_the_papers_hyperparameters(variant):
    """arXiv 2505.17508 section 5 and App. H, and its released scripts: Qwen3-4B, DAPO-Math-17k, 512 prompts x 16, mini-batch
    32 prompts, AdamW wd 0.1, clip (0.2, 0.28) with c = 10, beta 1e-4, 2048 + 2048 tokens, DAPO's
    dynamic sampling and overlong punishment, 400 steps, AIME/AMC validation at Mean@32."""
    config = load_config(RunConfig, RECIPES / f"{RPG}_{variant}.yaml")
    assert config.model_config().hf_model_id == "Qwen/Qwen3-4B"
    assert (config.train.steps, config.train.prompts_per_step, config.rollout.sampling.n) == (400, 512, 16)
    assert config.train.prompts_per_step // config.algorithm.mini_batches == 32  # prompts per optimizer step
    assert (config.data.max_prompt_tokens, config.rollout.sampling.max_tokens, config.train.max_seq_len) == (
        2048,
        2048,
        4096,
    )
    opt = config.optimizer
    assert (opt.weight_decay, opt.clip_grad, opt.lr_decay_style) == (0.1, 1.0, "constant")
    assert opt.lr_warmup_steps == 10 * config.algorithm.mini_batches  # 10 RL steps
    assert config.algorithm.advantage == "rpg" and config.data.reward == "math_dapo"
    assert (config.algorithm.overlong_buffer, config.algorithm.overlong_penalty) == (512, 1.0)
    dynamic = config.algorithm.dynamic_sampling
    assert (dynamic.metric, dynamic.prompts_per_gen_batch, dynamic.max_num_gen_batches) == ("acc", 1536, 20)
    loss = config.algorithm.loss
    assert loss.agg_mode == "token-mean" and loss.entropy_coef == 0
    clip = {k: loss.policy_loss_args[k] for k in ("clip_eps_low", "clip_eps_high", "clip_c")}
    assert clip == {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "clip_c": 10.0}
    if variant == "urkl":  # dual-clip PPO + beta * rpg_urkl to the iterative reference
        assert (loss.policy_loss, loss.kl, loss.kl_coef, opt.lr) == ("ppo_clip", "rpg_urkl", 1e-4, 1e-6)
        # tau 0 once per step (after its mini_batches optimizer steps): the anchor is the next pi_old
        assert (config.algorithm.anchor.tau, config.algorithm.anchor.period) == (0.0, config.algorithm.mini_batches)
        assert config.algorithm.anchor_is_behaviour_policy  # so no anchor model (core.kl_term.StatsPlan)
    else:  # RPG-Style Clip; the KL is to pi_old inside the loss, so no anchor
        assert (loss.policy_loss, loss.kl, opt.lr) == ("rpg_reinforce_clip", None, 5e-7)
        assert loss.policy_loss_args["divergence"] == "urkl" and loss.policy_loss_args["beta"] == 1e-4
    validation = config.validation
    assert [Path(f).stem for f in validation.files] == ["aime24", "aime25", "amc23"]
    assert (validation.n, validation.temperature, validation.interval) == (32, 1.0, 10)


def test_one_step_off_recipe_puts_half_the_gpus_on_engines(tmp_path):
    from megatron_empg.trainer.bind.build import bind

    path = RECIPES / f"{R1}_one_step_off.yaml"
    layout = bind(_with_local_paths(path, tmp_path), 8).layout
    assert (layout.training_ranks, layout.engine_ranks, layout.dp, layout.engines) == (4, 4, 4, 4)
    config = load_config(RunConfig, path)
    assert (config.rollout.max_staleness, config.rollout.sleep_while_training) == (1, False)
    assert (config.algorithm.behavior_is, config.algorithm.behavior_is_cap) == ("tis", 2.0)
    base = load_config(RunConfig, RECIPES / f"{R1}.yaml")
    assert (config.algorithm.loss, config.optimizer, config.train) == (base.algorithm.loss, base.optimizer, base.train)


def test_the_lora_recipe_fits_where_full_fine_tuning_does_not(tmp_path):
    """Qwen3-8B on 8 H100s: with LoRA the frozen base needs no gradients, optimizer state or second
    anchor model; full fine-tuning of the same recipe does not fit, the distributed optimizer
    notwithstanding."""
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.bind.memory_plan import plan_memory

    path = RECIPES / "qwen3_8b_dapo_math_ema_pg_lora.yaml"
    components = bind(_with_local_paths(path, tmp_path), 8, check_paths=False)
    lora = plan_memory(components)
    assert components.model.lora.rank == 64 and lora.fits, lora.describe()
    full_overrides = ["model_overrides=[attention_backend=sdpa]", "optimizer.use_distributed_optimizer=true"]
    full = plan_memory(bind(load_config(RunConfig, read_yaml(path), full_overrides), 8, check_paths=False))
    assert not full.fits
    ours, theirs = lora.ranks[0].resident, full.ranks[0].resident
    for term in ("gradients", "adam", "anchor_weights"):  # where the frozen base saves
        assert theirs[term] > 5 * ours[term], term
