"""``trainer.bind.build.bind`` and ``trainer.bind.layout``: every setting resolved and checked before anything
starts, each error naming the dotted field; ``empg check`` and ``empg train`` exiting 2 on them
without importing an engine or Megatron."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from megatron_empg.config import ConfigError, RunConfig, from_dict, load_config, load_model_config
from megatron_empg.trainer.bind.build import StatsPlan, bind, bind_loss
from megatron_empg.trainer.bind.layout import check_layout
from tests.trainer.demo_runs import DEMO_RECIPE, REPO


def demo(tmp_path, *overrides: str) -> RunConfig:
    """The demo recipe with a local tokenizer directory instead of its warm start."""
    return load_config(RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", f"tokenizer={tmp_path}", *overrides])


# --------------------------------------------------------------------------------------------
# The layout (torch-free: launch_check runs it on a login node).


def test_layout_splits_the_step_over_replicas():
    base = {
        "model": "tiny-qwen2",
        "tokenizer": "/tmp/tokenizer",
        "train": {"prompts_per_step": 4, "micro_batch_size": 4},
        "rollout": {"in_process": False, "sampling": {"n": 4}},
        "weight_sync": {"transport": "shm_file"},
    }

    def config(**sections):
        data = yaml.safe_load(yaml.safe_dump(base))
        for section, values in sections.items():
            data.setdefault(section, {}).update(values)
        return from_dict(RunConfig, data)

    model = load_model_config("tiny-qwen2")  # 4 heads, 2 query groups, 4 layers
    layout = check_layout(config(), model, 2)
    assert (layout.dp, layout.prompts_per_replica, layout.samples_per_replica, layout.micro_batches_per_replica) == (
        2,
        2,
        8,
        2,
    )
    assert layout.engines == 2  # rollout.engines: per_replica
    tp2 = check_layout(
        config(parallel={"tensor_model_parallel_size": 2}, rollout={"tensor_parallel_size": 2}), model, 4
    )
    assert (tp2.dp, tp2.engines) == (2, 2)
    assert check_layout(config(rollout={"engines": "single"}), model, 2).engines == 1
    assert check_layout(config(rollout={"engines": 2}, train={"prompts_per_step": 8}), model, 4).engines == 2
    for world, sections, field, words in [
        (
            3,
            {"parallel": {"tensor_model_parallel_size": 2}},
            "parallel.tensor_model_parallel_size",
            "world of 3 processes is not divisible by parallel.tensor_model_parallel_size x "
            "parallel.pipeline_model_parallel_size = 2 x 1",
        ),
        (
            3,
            {"parallel": {"tensor_model_parallel_size": 3}},
            "parallel.tensor_model_parallel_size",
            "does not divide model.num_attention_heads=4",
        ),
        (
            3,
            {"parallel": {"pipeline_model_parallel_size": 3}},
            "parallel.pipeline_model_parallel_size",
            "does not divide model.num_layers=4",
        ),
        (8, {}, "train.prompts_per_step", "divisible by the data-parallel size 8 (world 8 / (TP 1 x PP 1)"),
        (
            4,
            {"train": {"micro_batch_size": 8}},
            "train.micro_batch_size",
            "train.prompts_per_step / 4 x rollout.sampling.n = 4",
        ),
        (
            4,
            {"algorithm": {"mini_batches": 2}},
            "algorithm.mini_batches",
            "each data-parallel replica's 1 micro-batches",
        ),
        (
            1,
            {"rollout": {"in_process": False, "tensor_parallel_size": 3}},
            "rollout.tensor_parallel_size",
            "does not divide model.num_attention_heads=4",
        ),
        (
            1,
            {"train": {"recompute": "full", "recompute_num_layers": 5}},
            "train.recompute_num_layers",
            "5 exceeds the 4 layers of each model chunk",
        ),
        (
            2,
            {
                "parallel": {"pipeline_model_parallel_size": 2},
                "train": {"recompute": "full", "recompute_num_layers": 3},
            },
            "train.recompute_num_layers",
            "3 exceeds the 2 layers of each model chunk",
        ),
        (
            4,
            {"rollout": {"engines": 3}, "train": {"prompts_per_step": 12}},
            "rollout.engines",
            "3 engines must divide the data-parallel size 4",
        ),
        (
            4,
            {"parallel": {"tensor_model_parallel_size": 2}},
            "rollout.tensor_parallel_size",
            "1 must equal parallel.tensor_model_parallel_size=2 with 2 engines",
        ),
        (
            1,
            {"rollout": {"in_process": True}, "weight_sync": {"transport": "cuda_ipc"}},
            "rollout.in_process",
            "true cannot take weight_sync.transport=cuda_ipc",
        ),
        (
            2,
            {
                "parallel": {"tensor_model_parallel_size": 2},
                "rollout": {"tensor_parallel_size": 2},
                "weight_sync": {"transport": "cuda_ipc"},
            },
            "weight_sync.transport",
            "cuda_ipc serves engines of rollout.tensor_parallel_size 1 for now (got 2",
        ),
        (
            4,
            {"parallel": {"tensor_model_parallel_size": 2}, "rollout": {"engines": 2, "tensor_parallel_size": 1}},
            "rollout.tensor_parallel_size",
            "must equal parallel.tensor_model_parallel_size=2",
        ),
        (
            2,
            {"algorithm": {"dynamic_sampling": {"prompts_per_gen_batch": 3}}},
            "algorithm.dynamic_sampling.prompts_per_gen_batch",
            "divisible by the data-parallel size 2",
        ),
        (
            2,
            {"algorithm": {"dynamic_sampling": {"prompts_per_gen_batch": 2, "max_num_gen_batches": 1}}},
            "algorithm.dynamic_sampling.prompts_per_gen_batch",
            "= 2 prompts cannot fill train.prompts_per_step=4",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            check_layout(config(**sections), model, world)
        assert e.value.field == field and words in str(e.value), (world, sections, e.value)
    for world in (0, 1.0, True):
        with pytest.raises(ValueError, match="world_size"):
            check_layout(config(), model, world)


def test_forward_budget_must_hold_the_updates_widest_row():
    """``train.max_tokens_per_forward_microbatch``: forward rows hold whole update rows, so a budget
    below the widest one is refused at the bind step, not when a step builds its rows."""
    model = load_model_config("tiny-qwen2")

    def layout(**train):
        config = {
            "model": "tiny-qwen2",
            "tokenizer": "/tmp/tokenizer",
            "rollout": {"in_process": False},
            "weight_sync": {"transport": "shm_file"},
            "train": {"prompts_per_step": 8, **train},
        }
        return check_layout(from_dict(RunConfig, config), model, 1)

    # without a budget: micro_batch_size sequences of max_seq_len per row
    assert layout(micro_batch_size=4, max_seq_len=100, max_tokens_per_forward_microbatch=400).dp == 1
    # a budget of 1001 makes rows of up to 1008 (a multiple of 8)
    assert layout(max_seq_len=1000, max_tokens_per_microbatch=1001, max_tokens_per_forward_microbatch=1008).dp == 1
    for train, words in [
        (
            {"micro_batch_size": 4, "max_seq_len": 100, "max_tokens_per_forward_microbatch": 399},
            "399 cannot hold the update's widest packed row, train.micro_batch_size=4 x train.max_seq_len=100 rounded up "
            "to a multiple of 8 = 400 tokens",
        ),
        (
            {"max_seq_len": 1000, "max_tokens_per_microbatch": 1001, "max_tokens_per_forward_microbatch": 1007},
            "train.max_tokens_per_microbatch=1001 rounded up to a multiple of 8 = 1008 tokens; set it to at least that",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            layout(**train)
        assert e.value.field == "train.max_tokens_per_forward_microbatch" and words in str(e.value), e.value
    with pytest.raises(ConfigError) as e:
        layout(packing=False, max_tokens_per_forward_microbatch=10_000)
    assert e.value.field == "train.max_tokens_per_forward_microbatch" and "needs packing: true" in str(e.value)


def test_layout_module_imports_no_torch():
    code = "import sys; import megatron_empg.trainer.bind.layout, megatron_empg.trainer.bind.launch_check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# Names, arguments, limits, paths.


@pytest.mark.parametrize(
    "overrides, world, field, words",
    [
        (["algorithm.advantage=rpg_group_mean"], 1, "algorithm.advantage", "unknown name 'rpg_group_mean'"),
        (["algorithm.behavior_is=ais"], 1, "algorithm.behavior_is", "unknown name 'ais'"),
        (["rollout.placement=disaggregated", "rollout.engine_ranks=3"], 2, "rollout.engine_ranks", "no training rank"),
        (
            [
                "rollout.placement=disaggregated",
                "rollout.engine_ranks=2",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            3,
            "rollout.engine_ranks",
            "must divide",
        ),
        (["rollout.engine_ranks=1"], 2, "rollout.engine_ranks", "needs placement disaggregated"),
        (["rollout.max_staleness=1"], 1, "rollout.max_staleness", "needs placement disaggregated"),
        (["rollout.max_staleness=-1"], 1, "rollout.max_staleness", "must be >= 0"),
        (["rollout.mode=one_step_off"], 1, "rollout.mode", "one_step_off is 1"),
        (["rollout.partial=true"], 1, "rollout.partial", "needs max_staleness >= 1"),
        (
            ["rollout.placement=disaggregated", "rollout.engine_ranks=1", "rollout.engines=single"],
            3,
            "rollout.engines",
            "is for placement colocated",
        ),
        (["rollout.placement=disaggregated", "rollout.engine_ranks=1"], 3, "rollout.in_process", "engine rank"),
        (
            [
                "parallel.tensor_model_parallel_size=3",
                "train.prompts_per_step=3",
                "train.micro_batch_size=8",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            3,
            "parallel.tensor_model_parallel_size",
            "does not divide model.num_attention_heads=4",
        ),
        (
            ["weight_sync.transport=nccl"],
            1,
            "weight_sync.transport",
            "expected one of ['cuda_ipc', 'in_process', 'shm_file']",
        ),
        (["algorithm.loss.policy_loss=ppo"], 1, "algorithm.loss.policy_loss", "unknown name 'ppo'"),
        (
            ["algorithm.loss.policy_loss_args={clip_eps_low: -5}"],
            1,
            "algorithm.loss.policy_loss_args.clip_eps_low",
            "must lie in [0, 1)",
        ),
        (
            ["algorithm.loss.policy_loss_args={clip: 0.2}"],
            1,
            "algorithm.loss.policy_loss_args",
            "unexpected keyword argument 'clip'",
        ),
        (
            ["algorithm.loss.policy_loss_args={logprobs: 0}"],
            1,
            "algorithm.loss.policy_loss_args.logprobs",
            "is set by the trainer",
        ),
        (["algorithm.loss.policy_loss=rpg"], 1, "algorithm.loss.policy_loss_args", "'divergence'"),
        (
            ["algorithm.loss.policy_loss=rpg", "algorithm.loss.policy_loss_args={divergence: kl, beta: 0.1}"],
            1,
            "algorithm.loss.policy_loss_args.divergence",
            "divergence='kl'",
        ),
        (
            ["algorithm.loss.policy_loss=rpg", "algorithm.loss.policy_loss_args={divergence: rkl, kl_coef: 0.1}"],
            1,
            "algorithm.loss.policy_loss_args.kl_coef",
            "was renamed to beta (RPG's coefficient of the divergence inside the policy loss",
        ),
        (["algorithm.loss.kl_args.tail_grad=bogus"], 1, "algorithm.loss.kl_args.tail_grad", "'bogus'"),
        (["algorithm.loss.kl_args.direction=sideways"], 1, "algorithm.loss.kl_args.direction", "reverse or forward"),
        (
            ["algorithm.loss.kl_args={direction: reverse, importance_weight: 1}"],
            1,
            "algorithm.loss.kl_args.importance_weight",
            "true or false",
        ),
        (["algorithm.loss.kl=k6"], 1, "algorithm.loss.kl", "unknown name 'k6'"),
        (
            ["algorithm.loss.kl=k3", "algorithm.loss.kl_args={tail: true}"],
            1,
            "algorithm.loss.kl_args",
            "unexpected keyword argument 'tail'",
        ),
        (["algorithm.loss.agg_mode=token-sum"], 1, "algorithm.loss.agg_mode", "unknown name 'token-sum'"),
        (
            ["algorithm.loss.kl=rpg_urkl", "algorithm.loss.kl_args={importance_weight: true}"],
            1,
            "algorithm.loss.kl_args.importance_weight",
            "does not apply to rpg_urkl",
        ),
        (
            ["algorithm.loss.kl=rpg_urkl", "algorithm.loss.kl_args={divergence: fkl}"],
            1,
            "algorithm.loss.kl_args.divergence",
            "is set by the trainer",
        ),
        (
            ["algorithm.loss.kl=grpo_corrected", "algorithm.loss.kl_args={direction: reverse}"],
            1,
            "algorithm.loss.kl_args",
            "unexpected keyword argument 'direction'",
        ),
        (["algorithm.loss.kl=rpg_kl", "algorithm.loss.kl_args={}"], 1, "algorithm.loss.kl", "unknown name 'rpg_kl'"),
        (["algorithm.overlong_buffer=48"], 1, "algorithm.overlong_buffer", "must be < rollout.sampling.max_tokens"),
        (["algorithm.overlong_buffer=-1"], 1, "algorithm.overlong_buffer", "must be >= 0"),
        (
            ["train.max_tokens_per_forward_microbatch=2000"],
            1,
            "train.max_tokens_per_forward_microbatch",
            "train.micro_batch_size=64 x train.max_seq_len=32 rounded up to a multiple of 8 = 2048 tokens",
        ),
        (["algorithm.topk=300"], 1, "algorithm.topk", "<= model.vocab_size"),
        (
            ["data.reward=math_verify", "data.source=files", "data.train_files=[x.jsonl]"],
            1,
            "data.reward",
            "unknown name 'math_verify'",
        ),
        (["rollout.engine=sglang"], 1, "rollout.engine", "expected one of ['hf', 'vllm']"),
        (
            ["rollout.engine=hf", "rollout.in_process=false", "weight_sync.transport=shm_file"],
            1,
            "rollout.in_process",
            "runs in its own process",
        ),
        (
            ["train.prompts_per_step=2", "train.micro_batch_size=8"],
            2,
            "rollout.in_process",
            "true needs a world of one process with engine 'vllm'",
        ),
        (["weight_sync.probe_length=120"], 1, "weight_sync.probe_length", "must be <= rollout.max_model_len - 1 = 127"),
        (["rollout.sampling.max_tokens=40"], 1, "rollout.sampling.max_tokens", "leaves no room for a prompt"),
        (["rollout.max_model_len=100000"], 1, "rollout.max_model_len", "exceeds the model's max_position_embeddings"),
        (
            [
                "optimizer.use_distributed_optimizer=true",
                "algorithm.anchor.compute_dtype=float8_e4m3fn",
                "algorithm.anchor.fp8=te",
            ],
            1,
            "algorithm.anchor.fp8",
            "distributed optimizer",
        ),
        (
            [
                "model=tiny-qwen3-moe",
                "parallel.expert_model_parallel_size=3",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            3,
            "parallel.expert_model_parallel_size",
            "does not divide model.num_experts=8",
        ),
        (
            [
                "model=tiny-qwen3-moe",
                "parallel.expert_model_parallel_size=4",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            2,
            "parallel.expert_model_parallel_size",
            "training ranks are not divisible by parallel.expert_tensor_parallel_size x",
        ),
        (
            [
                "model=tiny-qwen3-moe",
                "parallel.expert_model_parallel_size=2",
                "parallel.moe_token_dispatcher_type=allgather",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            2,
            "parallel.moe_token_dispatcher_type",
            "use alltoall",
        ),
        (
            ["parallel.expert_model_parallel_size=2", "rollout.in_process=false", "weight_sync.transport=shm_file"],
            2,
            "parallel.expert_model_parallel_size",
            "has no experts",
        ),
        (
            [
                "model=tiny-qwen3-moe",
                "parallel.tensor_model_parallel_size=2",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            2,
            "parallel.sequence_parallel",
            "only with sequence parallelism",
        ),
    ],
)
def test_bind_names_the_field_of_each_bad_setting(tmp_path, overrides, world, field, words):
    with pytest.raises(ConfigError) as e:
        bind(demo(tmp_path, *overrides), world)
    assert e.value.field == field and words in str(e.value), e.value


def test_partial_rollouts_need_an_engine_that_updates_mid_generation(tmp_path, monkeypatch):
    """Both shipped engines do (vLLM and transformers); one registered without it is refused."""
    from megatron_empg.rollout.engines import ENGINES, EngineKind

    monkeypatch.setitem(
        ENGINES,
        "paused",
        EngineKind("x:Y", own_process=True, in_process_beside_training=False, updates_mid_generation=False),
    )
    partial = (
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "rollout.in_process=false",
        "weight_sync.transport=shm_file",
    )
    assert bind(demo(tmp_path, *partial), 3).engine.target.endswith("VllmEngine")
    with pytest.raises(ConfigError) as e:
        bind(demo(tmp_path, *partial, "rollout.engine=paused"), 3)
    assert e.value.field == "rollout.partial" and "(['hf', 'vllm']); 'paused' does not" in str(e.value), e.value


def test_bind_resolves_the_registries_and_what_the_passes_compute(tmp_path):
    components = bind(demo(tmp_path), 1)
    assert components.stats == StatsPlan(old_topk=8, anchor_at_old_topk=True, anchor=True)  # reverse Top-k KL, k 8
    assert components.engine.target.endswith("VllmEngine") and components.layout.micro_batches_per_replica == 2
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(
        components.advantage(rewards, torch.tensor([0, 0, 1, 1])),
        torch.tensor([0.7071, -0.7071, 0.0, 0.0]),
        atol=1e-4,
        rtol=0,
    )
    forward = bind(demo(tmp_path, "algorithm.loss.kl_args.direction=forward"), 1).stats
    assert forward == StatsPlan(anchor_topk=8, anchor=True)
    assert bind(demo(tmp_path, "algorithm.loss.kl=k3", "algorithm.loss.kl_args={}"), 1).stats == StatsPlan(anchor=True)
    for rpg_kl in ("rpg_fkl", "rpg_urkl", "grpo_corrected"):  # RPG's terms need the anchor's log-probs only
        assert bind(
            demo(tmp_path, f"algorithm.loss.kl={rpg_kl}", "algorithm.loss.kl_args={max_abs_value: 20}"), 1
        ).stats == StatsPlan(anchor=True)
    assert (
        bind(demo(tmp_path, "algorithm.loss.kl=null", "algorithm.loss.kl_coef=0", "algorithm.loss.kl_args={}"), 1).stats
        == StatsPlan()
    )


def test_the_bound_loss_is_rl_loss_with_the_configs_arguments(tmp_path):
    from megatron_empg.core.microbatch import MicroBatch
    from megatron_empg.parallel.rl_loss import rl_loss

    config = demo(
        tmp_path,
        "algorithm.loss.kl=k3",
        "algorithm.loss.kl_args={importance_weight: true}",
        "algorithm.loss.policy_loss_args={clip_eps_low: 0.1, clip_c: 3.0}",
        "algorithm.loss.entropy_coef=0.01",
        "algorithm.loss.agg_mode=seq-mean-token-mean",
    )
    loss_fn, _ = bind_loss(config.algorithm.loss, vocab_size=256, topk=8)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 256, generator=g)
    targets = torch.randint(0, 256, (2, 5), generator=g)
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    batch = MicroBatch(
        targets,
        targets,
        torch.rand(2, 5, generator=g) > 0.3,
        torch.randn(2, 5, generator=g),
        old_logprobs=logprobs + 0.1 * torch.randn(2, 5, generator=g),
        anchor_logprobs=logprobs - 0.2,
    )
    got = loss_fn(logits.clone(), batch, vocab_start=0, tp_group=None)
    want = rl_loss(
        logits.clone(),
        batch,
        vocab_start=0,
        vocab_size=256,
        tp_group=None,
        policy_loss="ppo_clip",
        policy_loss_args={"clip_eps_low": 0.1, "clip_c": 3.0},
        kl="k3",
        kl_coef=0.001,
        kl_args={"importance_weight": True},
        entropy_coef=0.01,
        agg_mode="seq-mean-token-mean",
    )
    assert got.loss.loss_sum.item() == want.loss.loss_sum.item() and got.loss.count.item() == want.loss.count.item()


def test_bind_reads_every_record_of_each_file_and_the_init_from_config(tmp_path):
    files = ["data.source=files", "data.reward=qa_em", "data.prompt_key=question", "data.answer_key=golden.answers"]
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    record = json.dumps({"question": "who?", "golden": {"answers": ["me"]}})
    good.write_text(record + "\n")
    bad.write_text(f"{record}\n{record}\n" + json.dumps({"question": "who?", "answer": "me"}) + "\n")  # row 3
    lengths = ["data.max_prompt_tokens=16", "rollout.sampling.max_tokens=12"]
    bind(demo(tmp_path, *files, *lengths, f"data.train_files=[{good}]"), 1)
    with pytest.raises(ConfigError) as e:
        bind(demo(tmp_path, *files, *lengths, f"data.train_files=[{good}, {bad}]"), 1)
    assert e.value.field == "data.train_files[1]"
    assert str(e.value).startswith(f"data.train_files[1]: {bad}: row 3: missing key 'golden.answers'"), e.value
    with pytest.raises(ConfigError, match=rf"^validation.files\[0\]: {bad}: row 3: missing key"):
        bind(
            demo(
                tmp_path,
                *files,
                *lengths,
                f"data.train_files=[{good}]",
                f"validation.files=[{bad}]",
                "validation.at_start=true",
            ),
            1,
        )
    with pytest.raises(ConfigError) as e:
        bind(
            demo(
                tmp_path,
                *files,
                *lengths,
                f"data.train_files=[{good}]",
                f"validation.files=[{tmp_path / 'no.jsonl'}]",
                "validation.at_start=true",
            ),
            1,
        )
    assert e.value.field == "validation.files[0]" and "no such file" in str(e.value)
    with pytest.raises(ConfigError, match=r"^train.max_seq_len: 32 is shorter than the longest sample, .* = 40"):
        bind(
            demo(
                tmp_path,
                *files,
                "data.max_prompt_tokens=28",
                "rollout.sampling.max_tokens=12",
                f"data.train_files=[{good}]",
            ),
            1,
        )
    model = demo(tmp_path).model_config()
    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text(json.dumps({**model.to_hf_config(), "hidden_size": 2 * model.hidden_size}))
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint.init_from: .*/config.json describes another model than 'demo-qwen2': hidden_size: 256 != 128",
    ):
        bind(demo(tmp_path, f"checkpoint.init_from={init}", "tokenizer=null"), 1)
    with pytest.raises(ConfigError, match=r"^checkpoint.init_from: /nonexistent is not a directory"):
        bind(demo(tmp_path, "checkpoint.init_from=/nonexistent"), 1)
    bind(demo(tmp_path, "checkpoint.init_from=/nonexistent"), 1, check_paths=False)


# --------------------------------------------------------------------------------------------
# The command line: exit 2 in seconds, nothing started.

_RUN = textwrap.dedent(
    """
    import sys
    from megatron_empg.trainer.cli import main
    status = main(sys.argv[1:])
    import torch.distributed as dist
    print("started:", sorted(m for m in ("vllm", "megatron") if m in sys.modules), dist.is_initialized())
    sys.exit(status)
    """
)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["algorithm.advantage=rpg_group_mean"], 1, "empg: error: algorithm.advantage: unknown name 'rpg_group_mean'"),
        (
            [
                "parallel.tensor_model_parallel_size=3",
                "train.prompts_per_step=3",
                "train.micro_batch_size=8",
                "rollout.in_process=false",
                "weight_sync.transport=shm_file",
            ],
            3,
            "empg: error: parallel.tensor_model_parallel_size: tensor_model_parallel_size=3 does not divide",
        ),
        (["weight_sync.transport=nccl"], 1, "empg: error: weight_sync.transport: unknown name 'nccl'"),
        (["algorithm.loss.policy_loss=ppo"], 1, "empg: error: algorithm.loss.policy_loss: unknown name 'ppo'"),
        (
            ["algorithm.loss.policy_loss_args={clip_eps_high: -1}"],
            1,
            "empg: error: algorithm.loss.policy_loss_args.clip_eps_high: clip_eps_high=-1 must be >= 0",
        ),
        (["algorithm.loss.kl_args.tail_grad=bogus"], 1, "empg: error: algorithm.loss.kl_args.tail_grad:"),
    ],
)
def test_train_exits_2_before_starting_anything(tmp_path, overrides, world, message):
    env = {"WORLD_SIZE": str(world), "RANK": "0", "PATH": "/usr/bin:/bin"}
    args = [
        "train",
        str(DEMO_RECIPE),
        "checkpoint.init_from=null",
        f"tokenizer={tmp_path}",
        f"logging.dir={tmp_path}/run",
        f"checkpoint.dir={tmp_path}/run/checkpoints",
        *overrides,
    ]
    out = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr[-2000:]
    assert "started: [] False" in out.stdout  # no engine, no Megatron, no process group
    assert not (tmp_path / "run").exists()


def test_train_on_a_bad_data_row_exits_2_naming_the_file_and_row_before_starting_anything(tmp_path):
    """Row 40,000 of a parquet file lacks its answer: every row is checked at the bind step, so the
    run stops before a process group, an engine or Megatron (13-15 s on the demo) would start."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "answer": "3"}] * 50_000
    rows[39_999] = {"prompt": "1+2=", "answer": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet", row_group_size=10_000)
    env = {"WORLD_SIZE": "1", "RANK": "0", "PATH": "/usr/bin:/bin"}
    args = [
        "train",
        str(DEMO_RECIPE),
        "checkpoint.init_from=null",
        f"tokenizer={tmp_path}",
        f"logging.dir={tmp_path}/run",
        f"checkpoint.dir={tmp_path}/run/checkpoints",
        "data.source=files",
        "data.reward=math",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        "data.max_prompt_tokens=16",
        "rollout.sampling.max_tokens=12",
    ]
    out = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=REPO, env=env, capture_output=True, text=True)
    message = f"empg: error: data.train_files[0]: {tmp_path / 'train.parquet'}: row 40000: missing key 'answer'"
    assert out.returncode == 2 and out.stderr.startswith(message), out.stderr[-2000:]
    assert "started: [] False" in out.stdout  # no engine, no Megatron, no process group
    assert not (tmp_path / "run").exists()  # nor a run directory


def test_check_prints_the_layout_or_the_error(tmp_path):
    command = [
        sys.executable,
        "-m",
        "megatron_empg.trainer.cli",
        "check",
        str(DEMO_RECIPE),
        "checkpoint.init_from=null",
        f"tokenizer={tmp_path}",
    ]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ok: demo-qwen2 on 1 ranks (TP 1 x PP 1 x DP 1)"), out.stderr
    assert "128 samples in 2 packed micro-batches; advantage" in out.stdout
    out = subprocess.run(
        [*command, "train.max_tokens_per_forward_microbatch=4096"], cwd=REPO, capture_output=True, text=True
    )
    assert (
        out.returncode == 0
        and "128 samples in 2 packed micro-batches (old and anchor passes: their rows back to "
        "back, at most 4096 tokens); advantage"
        in out.stdout
    ), out.stdout + out.stderr
    out = subprocess.run([*command, "--world-size", "2"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "empg: error: rollout.in_process: true needs a world of one process" in out.stderr
    out = subprocess.run(
        [*command, "rollout.in_process=false", "weight_sync.transport=shm_file", "--world-size", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "(TP 1 x PP 1 x DP 2); per replica and step 8 prompts, 64 samples" in out.stdout
