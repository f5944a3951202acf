"""tools/make_demo_model.py: the CPU demo's warm-start model.

A short run (a 1-layer model, 40 steps of 16 problems, 32 held-out problems, no stopping rule)
writes a directory that transformers loads (its greedy answers score as ``demo_model.json``
says; the tokenizer renders the task's prompts as plain text), whose ``model_config.yaml``
matches its ``config.json``, whose ``demo_model.json`` is complete and shows the loss went down;
a second run with the same seed writes the same bytes. Training stops at the first validation
check that reaches the stop accuracy. Refused: a non-empty or non-directory OUT_DIR (exit code
2, nothing written), a head dimension vLLM's CPU attention does not run, bad settings. With vLLM
installed, an in-process ``VllmEngine`` loads the model and its greedy responses equal HF's (at
most one of 32 may differ: a near-tie).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_empg.config import ConfigError, load_model_config
from megatron_empg.tasks.arithmetic import ArithmeticTask, arithmetic_reward
from tools.make_demo_model import (
    TrainingStream,
    UsageError,
    data_config,
    demo_model_config,
    evaluation_examples,
    hf_generate,
    main,
    make_demo_model,
    restated,
    tiny_hf_model,
    train,
)
from tools.make_tiny_model import char_tokenizer

SHORT = dict(
    steps=40,
    batch_size=16,
    eval_problems=32,
    stop_accuracy=0.0,
    model_overrides=["num_layers=1", "ffn_hidden_size=256"],
)
HF_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "model"
    summary = make_demo_model(out, seed=3, lr=3e-3, log=lambda _: None, **SHORT)
    return out, summary


def test_short_run_writes_complete_files(short_run):
    out, summary = short_run
    assert sorted(p.name for p in out.iterdir()) == sorted(HF_FILES + ["model_config.yaml", "demo_model.json"])
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no temp directory left beside it
    written = json.loads((out / "demo_model.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["settings"] == {
        "steps": 40,
        "stop_accuracy": 0.0,
        "check_every": 50,
        "seed": 3,
        "digits": 2,
        "ops": ["+", "-"],
        "answer_noise": 0.3,
        "restate_fraction": 0.4,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup_steps": 4,
        "min_lr_ratio": 0.1,
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "init_std": 0.02,
        "model_overrides": ["num_layers=1", "ffn_hidden_size=256"],
        "torch_threads": torch.get_num_threads(),
    }
    training, evaluation = written["training"], written["evaluation"]
    assert training["steps_run"] == 40 and not training["stopped_early"] and training["problems_seen"] == 40 * 16
    assert training["validation"]["greedy_accuracy_at_step"] == []  # stop_accuracy 0: no checks
    assert len(training["losses_every_10"]) == 4
    assert training["loss_last"] < training["loss_first"] - 0.5, training  # the loss went down
    assert evaluation["problems"] == 32 and evaluation["held_out"] and evaluation["reward"] == "arithmetic"
    for key in ("greedy_accuracy", "sampled_accuracy", "sampled_restated"):
        assert 0.0 <= evaluation["hf"][key] <= 1.0
    assert "vllm" not in evaluation
    assert written["seconds"] > 0 and written["num_parameters"] > 0


def test_short_run_loads_in_transformers(short_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_empg.weight_sync.mapping import model_config_from_hf

    out, _ = short_run
    config = json.loads((out / "config.json").read_text())
    yaml_config = load_model_config(out / "model_config.yaml")
    assert model_config_from_hf(config, name=yaml_config.name) == yaml_config
    assert yaml_config.num_layers == 1 and yaml_config.kv_channels == 32 and yaml_config.family == "qwen2"
    assert config["eos_token_id"] == 0 and config["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == yaml_config.vocab_size
    assert all(p.dtype == torch.float32 for p in model.parameters())
    task = ArithmeticTask(data_config(0, 2, ["+", "-"]), tokenizer)
    example = task.example(0)
    assert tokenizer.decode(example.prompt_ids) == task.problem(0).text  # plain text, no chat template
    # the loaded model is the trained one: its greedy answers score as demo_model.json says
    examples = evaluation_examples(2, ["+", "-"], tokenizer, 32)
    responses = hf_generate(model, [e.prompt_ids for e in examples], eos_id=0, max_tokens=16, temperature=0.0)
    from megatron_empg.tasks.arithmetic import arithmetic_reward

    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    accuracy = sum(arithmetic_reward(texts, examples).correct) / len(examples)
    assert accuracy == json.loads((out / "demo_model.json").read_text())["evaluation"]["hf"]["greedy_accuracy"]


def test_same_seed_same_files(short_run, tmp_path):
    out, summary = short_run
    again = make_demo_model(tmp_path / "again", seed=3, lr=3e-3, log=lambda _: None, **SHORT)
    for name in HF_FILES + ["model_config.yaml"]:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    assert again["training"]["losses_every_10"] == summary["training"]["losses_every_10"]
    assert again["evaluation"]["hf"] == summary["evaluation"]["hf"]


def test_training_stops_at_the_first_check_that_reaches_stop_accuracy():
    config = demo_model_config(["num_layers=1", "ffn_hidden_size=128"])
    tokenizer = char_tokenizer(config.vocab_size)
    task = ArithmeticTask(data_config(0, 2, ["+", "-"]), tokenizer)
    accuracies = iter([0.1, 0.3, 0.6, 0.9])
    modes = []

    def validate() -> float:
        modes.append(model.training)
        return next(accuracies)

    model = tiny_hf_model(config, seed=0, std=0.02)
    stream = TrainingStream(task, tokenizer, excluded={task.problem(0).text})
    losses, checks = train(
        model,
        stream,
        steps=100,
        batch_size=4,
        lr=1e-3,
        validate=validate,
        stop_accuracy=0.5,
        check_every=5,
        log=lambda _: None,
    )
    assert checks == [(5, 0.1), (10, 0.3), (15, 0.6)] and len(losses) == 15
    assert modes == [False, False, False] and not model.training
    assert stream.next_index == 15 * 4 + 1  # problem 0 was skipped


@pytest.fixture(scope="module")
def clean_stream():
    """The demo's tokenizer and task, and the first 2000 training pairs without noise or restating."""
    tokenizer = char_tokenizer(demo_model_config().vocab_size)
    task = ArithmeticTask(data_config(0, 2, ["+", "-"]), tokenizer)
    return tokenizer, task, TrainingStream(task, tokenizer, set()).batch(2000)


def test_answer_noise_shifts_that_fraction_of_training_answers_by_one(clean_stream):
    tokenizer, task, clean = clean_stream
    noisy_stream = TrainingStream(task, tokenizer, set(), answer_noise=0.3, noise_seed=7)
    noisy = noisy_stream.batch(2000)

    def value(answer_ids: list[int]) -> int:
        assert answer_ids[-1] == tokenizer.eos_token_id
        return int(tokenizer.decode(answer_ids[:-1]).strip())

    shifts = [value(n[1]) - value(c[1]) for c, n in zip(clean, noisy)]
    assert [c[0] for c in clean] == [n[0] for n in noisy]  # the prompts are the task's, unchanged
    assert set(shifts) == {-1, 0, 1}
    assert abs(sum(s != 0 for s in shifts) / len(shifts) - 0.3) < 0.04  # 2000 draws: 3 sigma ~ 0.031
    assert all(value(n[1]) >= 0 for n in noisy)
    # deterministic per problem index: a second stream gives the same answers
    assert TrainingStream(task, tokenizer, set(), answer_noise=0.3, noise_seed=7).batch(2000) == noisy
    assert [noisy_stream.training_answer(i, 0) for i in range(200)].count(-1) == 0  # never negative


def test_restate_fraction_prefixes_that_fraction_of_training_responses_with_the_problem(clean_stream):
    tokenizer, task, clean = clean_stream
    stream = TrainingStream(task, tokenizer, set(), restate_fraction=0.4, noise_seed=7)
    restating = stream.batch(2000)
    assert [c[0] for c in clean] == [r[0] for r in restating]  # the prompts are the task's, unchanged
    count = 0
    for index, (prompt, clean_answer), (_, answer) in zip(range(2000), clean, restating):
        problem = task.problem(index).text
        if answer == clean_answer:
            assert not stream.restates(index)
            continue
        count += 1
        assert stream.restates(index)
        assert tokenizer.decode(answer[:-1]) == f"{problem}{task.problem(index).answer}\n"
        assert answer[-1] == tokenizer.eos_token_id
    assert abs(count / 2000 - 0.4) < 0.04  # 2000 draws: 3 sigma ~ 0.033
    # the demo's reward scores a restated answer 0 and the plain one 1
    example = task.example(0)
    texts = [f"{example.meta['problem']}{example.answer}\n", f"{example.answer}\n"]
    assert arithmetic_reward(texts, [example, example]).correct == [False, True]
    assert restated(
        tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], [example, example]
    ) == [True, False]
    # with answer noise too, deterministic per problem index
    both = TrainingStream(task, tokenizer, set(), answer_noise=0.3, restate_fraction=0.4, noise_seed=7).batch(500)
    assert both == TrainingStream(task, tokenizer, set(), answer_noise=0.3, restate_fraction=0.4, noise_seed=7).batch(
        500
    )


def test_refuses_non_empty_out_dir(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main([str(out), "--steps", "1"])
    assert exit_info.value.code == 2
    assert f"OUT_DIR {out} exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    with pytest.raises(UsageError, match="exists and is not empty"):
        make_demo_model(out, steps=1)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(SystemExit):
        main([str(a_file)])
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--steps", "0"], "steps must be an int >= 1"),
        (["--stop-accuracy", "1.5"], "stop_accuracy must be in [0, 1]"),
        (["--answer-noise", "1"], "answer_noise must be in [0, 1)"),
        (["--restate-fraction", "-0.1"], "restate_fraction must be in [0, 1)"),
        (["--digits", "0"], "arithmetic_digits"),
        (["--ops", "/"], "arithmetic_ops"),
        (["num_attention_heads=8"], "head dimension 16"),
        (["vocab_size=64"], "below the character tokenizer"),
        (["no_such_field=1"], "no_such_field"),
    ],
)
def test_refuses_bad_arguments(tmp_path, capsys, arguments, message):
    out = tmp_path / "model"
    with pytest.raises(SystemExit) as exit_info:
        main([str(out), *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_demo_model_config_head_dims():
    assert demo_model_config().kv_channels == 32
    assert demo_model_config(["num_attention_heads=2", "num_query_groups=1"]).kv_channels == 64
    with pytest.raises(UsageError, match=r"head dimension 16 .* expected one of \(32, 64\)"):
        demo_model_config(["num_attention_heads=8"])
    with pytest.raises(ConfigError):
        demo_model_config(["num_query_groups=3"])


@pytest.mark.vllm
def test_short_run_loads_in_vllm(short_run):
    try:
        import vllm  # noqa: F401
    except Exception as error:  # not installed, or broken (e.g. CUDA-linked torchvision)
        pytest.skip(f"vLLM is not importable: {type(error).__name__}: {error}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_empg.config import RolloutConfig, SamplingConfig
    from megatron_empg.rollout.vllm_engine import VllmEngine

    out, _ = short_run
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = [e.prompt_ids for e in evaluation_examples(2, ["+", "-"], tokenizer, 32)]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = hf_generate(model, prompts, eos_id=0, max_tokens=16, temperature=0.0)
    engine = VllmEngine(out, RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=128, in_process=True))
    try:
        outputs = engine.generate(prompts, SamplingConfig(n=1, temperature=0.0, max_tokens=16))
    finally:
        engine.shutdown()
    got = [c[0].token_ids for c in outputs]
    differ = [
        (tokenizer.decode(p), tokenizer.decode(a), tokenizer.decode(b))
        for p, a, b in zip(prompts, got, expected)
        if a != b
    ]
    assert len(differ) <= 1, differ  # fp32 on both sides: a near-tie may flip one argmax, not more
