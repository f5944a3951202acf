"""The input contract (docs/faults-and-restarts.md): a bad config file, override, option, path or run
directory is one line naming the field or the file, exit code 2, before any work starts and
before anything is written; never a traceback. The command line's cases run in one process (the
exit codes and stderr are what is tested); the paths' checks are the bind step's, in this one.
Each class has its negative control: the right input accepted."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_empg.config import ConfigError, RunConfig, load_config, to_yaml
from megatron_empg.mcore.checkpoint.files import DIST_CKPT_FILES, CheckpointError, find_latest_checkpoint
from megatron_empg.trainer.bind.build import bind
from megatron_empg.weight_sync import mapping
from tests.trainer.test_run_dir import _checkpoint

REPO = Path(__file__).resolve().parents[2]
DEMO_RECIPE = REPO / "recipes" / "demo_cpu.yaml"

# Runs ``main`` once per case (a JSON list of argv lists) and prints one JSON line per case: the
# exit status and stderr.
_CASES = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from megatron_empg.trainer.cli import main
    for argv in json.loads(sys.argv[1]):
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                status = main(argv)
            except SystemExit as exit:
                status = exit.code
        print(json.dumps({"status": status, "stderr": err.getvalue(), "stdout": out.getvalue()}), flush=True)
    """
)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` and its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.mark.process
def test_bad_input_on_the_command_line_is_one_line_exit_2_and_nothing_written(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    base = [str(DEMO_RECIPE), "checkpoint.init_from=null", f"tokenizer={tokenizer}"]
    run = tmp_path / "run"
    dirs = [f"logging.dir={run}", f"checkpoint.dir={run}/checkpoints"]
    broken = tmp_path / "broken.yaml"
    broken.write_text("defaults: " + str(DEMO_RECIPE) + "\ntrain: {steps: [3}\n")
    twice = tmp_path / "twice.yaml"
    twice.write_text(f"defaults: {DEMO_RECIPE}\ntrain: {{steps: 3}}\ntrain: {{seed: 1}}\n")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"model: demo-qwen2 # caf\xe9\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    # an earlier run: its metrics, and the lock that says its checkpoints are in run/checkpoints
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    lock = {"pid": 1, "host": "h", "checkpoint_dir": str(earlier / "checkpoints"), "logging_dir": str(earlier)}
    (earlier / ".empg.lock").write_text(json.dumps(lock) + "\n")
    typo = ["train", *base, f"logging.dir={earlier}", f"checkpoint.dir={earlier}/checkpionts", "--resume"]
    finished = tmp_path / "finished"
    _checkpoint(finished / "checkpoints", 4)
    resume_finished = [
        "train",
        *base,
        f"logging.dir={finished}",
        f"checkpoint.dir={finished}/checkpoints",
        "train.steps=4",
    ]
    cases = [  # (argv, status, what stderr starts with: one line; or what stdout holds)
        (["check", *base, "--world-size", "1", "train.steps=3", "--skip-paths"], 0, "ok: demo-qwen2"),
        (["check", *base, "--world-size", "1", "train.steps=.nan"], 2, "empg: error: train.steps: expected int"),
        (["check", str(broken), "--world-size", "1"], 2, f"empg: error: {broken}: line 2, column 18:"),
        (["check", str(twice)], 2, f"empg: error: {twice}: line 3, column 1: duplicate key 'train'"),
        (["check", str(latin1)], 2, f"empg: error: {latin1} is not UTF-8 text"),
        (["check", str(tmp_path)], 2, f"empg: error: {tmp_path} is a directory, not a YAML file"),
        (["check", *base, "--gpu-memory-gib", "0.001"], 2, "empg: error: --gpu-memory-gib: expected one GPU's"),
        (["check", *base, f"checkpoint.dir={a_file}"], 2, f"empg: error: checkpoint.dir: {a_file} is a file"),
        (["check", *base, f"logging.dir={a_file}/logs"], 2, f"empg: error: logging.dir: {a_file}/logs cannot be"),
        (["check", *base, "checkpoint.dir=''"], 2, "empg: error: checkpoint.dir: expected a non-empty str"),
        (["train", *base, f"checkpoint.dir={a_file}", f"logging.dir={run}"], 2, "empg: error: checkpoint.dir: "),
        (["train", *base, *dirs, "rollout.sampling.top_p=.inf"], 2, "empg: error: rollout.sampling.top_p: expected"),
        (typo, 2, "empg: error: --resume: checkpoint.dir="),
        (typo, 2, "empg: error: --resume: checkpoint.dir="),  # a retry is refused alike
        ([*resume_finished, "--resume"], 0, "empg: nothing to do: the newest checkpoint, "),
    ]
    before = _tree(earlier)
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CASES, json.dumps([argv for argv, _, _ in cases])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), done.stderr[-3000:]
    for (argv, status, start), result in zip(cases, results):
        assert result["status"] == status, (argv, result)
        if status == 0:
            assert start in result["stdout"], (argv, result)
            continue
        assert result["stderr"].startswith(start) and result["stderr"].count("\n") == 1, (argv, result["stderr"])
    assert "Traceback" not in done.stderr
    assert not run.exists() and a_file.read_text() == "not a directory\n"
    assert _tree(earlier) == before  # the refused --resume changed nothing: not even the lock
    assert sorted(_tree(finished)) == [
        "checkpoints",
        *(f"checkpoints/{p}" for p in sorted(_tree(finished / "checkpoints"))),
    ]


def test_resume_with_steps_left_is_not_nothing_to_do(tmp_path):
    """The negative control of the command line's "nothing to do" case above."""
    from megatron_empg.trainer.cli import _nothing_to_do

    _checkpoint(tmp_path / "ckpt", 4)
    config = load_config(RunConfig, DEMO_RECIPE, [f"checkpoint.dir={tmp_path}/ckpt", "train.steps=5"])
    assert _nothing_to_do(config) is None
    assert "is at step 4 and train.steps is 4" in _nothing_to_do(dataclasses.replace(config, train=_steps(config, 4)))
    # its only checkpoint damaged: not for this check to say (it raised a traceback here; the resume names it)
    (tmp_path / "ckpt" / "step_00000004" / DIST_CKPT_FILES[0]).unlink()
    damaged = dataclasses.replace(config, train=_steps(config, 4))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_latest_checkpoint(damaged.checkpoint.dir)
    assert _nothing_to_do(damaged) is None


def _steps(config: RunConfig, steps: int):
    return dataclasses.replace(config.train, steps=steps)


# --------------------------------------------------------------------------------------------
# What a run starts from: checked by the bind step (empg check) as the converters check it.


def _demo(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", f"tokenizer={tmp_path}", *overrides])


def _hf_dir(path: Path, model, **config) -> Path:
    """A HF directory of ``model``: its config.json (with ``config`` changed) and one safetensors
    file holding every tensor it needs (one element each: only names and sizes are checked)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**model.to_hf_config(), **config}))
    save_file({name: torch.zeros(1) for name in mapping.hf_tensor_names(model)}, str(path / "model.safetensors"))
    return path


def _refused(config: RunConfig) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        bind(config, 1)
    assert "\n" not in str(refused.value)
    return refused.value


def test_a_bad_init_from_is_named_by_the_check(tmp_path):
    model = _demo(tmp_path).model_config()
    good = _hf_dir(tmp_path / "good", model)
    bind(_demo(tmp_path, f"checkpoint.init_from={good}"), 1)  # the negative control

    broken = _hf_dir(tmp_path / "broken", model)
    (broken / "config.json").write_text('{"hidden_size": ')
    error = _refused(_demo(tmp_path, f"checkpoint.init_from={broken}"))
    assert error.field == "checkpoint.init_from" and f"{broken}/config.json is not readable JSON" in error.reason
    (broken / "config.json").write_text("[1, 2]")
    assert "holds a JSON list, not an object" in _refused(_demo(tmp_path, f"checkpoint.init_from={broken}")).reason
    (broken / "config.json").write_text(json.dumps({**model.to_hf_config(), "architectures": ["GPT2LMHeadModel"]}))
    assert f"{broken}/config.json: architectures:" in _refused(_demo(tmp_path, f"checkpoint.init_from={broken}")).reason
    wider = _hf_dir(tmp_path / "wider", model, num_hidden_layers=model.num_layers + 1)
    error = _refused(_demo(tmp_path, f"checkpoint.init_from={wider}"))
    assert f"describes another model than 'demo-qwen2': num_layers: {model.num_layers + 1} != {model.num_layers}" in (
        error.reason
    )

    truncated = _hf_dir(tmp_path / "truncated", model)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert f"{weights} is truncated" in _refused(_demo(tmp_path, f"checkpoint.init_from={truncated}")).reason

    empty = tmp_path / "empty"
    empty.mkdir()
    error = _refused(_demo(tmp_path, f"checkpoint.init_from={empty}"))
    assert f"{empty} is neither a Hugging Face model directory (no config.json) nor a complete checkpoint" in (
        error.reason
    )
    error = _refused(_demo(tmp_path, f"checkpoint.continue_from={empty}"))
    assert error.field == "checkpoint.continue_from" and "is neither a complete checkpoint" in error.reason


def test_a_checkpoint_of_other_shapes_is_refused_naming_the_field(tmp_path):
    """A checkpoint saved by a model of the same name but other shapes: refused by the check
    (``continue_from``) and at a ``--resume`` (``check_start``), naming the field that differs."""
    from megatron_empg.mcore.checkpoint.files import MODEL_CONFIG_FILE
    from megatron_empg.trainer.run.run_dir import check_start

    model = _demo(tmp_path).model_config()
    _checkpoint(tmp_path / "ckpt", 2)
    saved = tmp_path / "ckpt" / "step_00000002" / MODEL_CONFIG_FILE
    saved.write_text(to_yaml(model))
    config = _demo(tmp_path, f"checkpoint.dir={tmp_path}/ckpt", f"logging.dir={tmp_path}/run")
    check_start(config, resume=True, overwrite=False, previous=None)  # the same model: resumes
    bind(_demo(tmp_path, f"checkpoint.continue_from={tmp_path}/ckpt"), 1)

    saved.write_text(to_yaml(dataclasses.replace(model, ffn_hidden_size=2 * model.ffn_hidden_size)))
    with pytest.raises(ConfigError) as refused:
        check_start(config, resume=True, overwrite=False, previous=None)
    assert refused.value.field == "checkpoint.dir"
    assert f"ffn_hidden_size: {2 * model.ffn_hidden_size} != {model.ffn_hidden_size}" in refused.value.reason
    error = _refused(_demo(tmp_path, f"checkpoint.continue_from={tmp_path}/ckpt"))
    assert error.field == "checkpoint.continue_from" and "holds model 'demo-qwen2' of other shapes" in error.reason
