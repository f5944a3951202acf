"""Config files and override values that are wrong as text: unreadable files, YAML syntax errors,
repeated keys, YAML 1.1's readings, numbers out of range. Each is one ``ConfigError`` naming the
file (and line) or the field; each test also shows the right input accepted."""

from __future__ import annotations

import pytest

from megatron_empg.config import ConfigError, RunConfig, load_config, read_yaml

BASE = {"model": "tiny-qwen2", "tokenizer": "/tmp/tokenizer"}


def _refused(function, *args) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        function(*args)
    assert "\n" not in str(refused.value)
    return refused.value


def test_a_file_that_cannot_be_read_is_named(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("model: tiny-qwen2\ntokenizer: /tmp/tokenizer\n")
    assert load_config(RunConfig, good).model == "tiny-qwen2"

    assert f"{tmp_path} is a directory, not a YAML file" in str(_refused(read_yaml, tmp_path))
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model: tiny-qwen2\n# caf\xe9\n".encode("latin-1"))
    assert f"{latin1} is not UTF-8 text" in str(_refused(read_yaml, latin1))
    assert f"{tmp_path / 'missing.yaml'} does not exist" in str(_refused(read_yaml, tmp_path / "missing.yaml"))


@pytest.mark.parametrize("which", ["recipe", "defaults", "model"])
def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, which):
    broken = "num_layers: 2\nhidden_size: [64\n"
    model = tmp_path / "model.yaml"
    base = tmp_path / "base.yaml"
    recipe = tmp_path / "recipe.yaml"
    model.write_text(broken if which == "model" else _TINY_MODEL)
    base.write_text(broken if which == "defaults" else "train: {steps: 3}\n")
    recipe.write_text(
        f"defaults: base.yaml\nmodel: {model}\ntokenizer: /tmp/tokenizer\n"
        + ("logging: {dir: [\n" if which == "recipe" else "")
    )
    if which == "model":
        error = _refused(lambda: load_config(RunConfig, recipe).model_config())
        assert error.field == "model" and f"{model}: line 3, column 1:" in error.reason
    else:
        error = _refused(load_config, RunConfig, recipe)
        name = recipe if which == "recipe" else base
        assert str(error).startswith(f"{name}: line ")
    # the negative control: the same files without the error
    model.write_text(_TINY_MODEL)
    base.write_text("train: {steps: 3}\n")
    recipe.write_text(f"defaults: base.yaml\nmodel: {model}\ntokenizer: /tmp/tokenizer\n")
    config = load_config(RunConfig, recipe)
    assert config.train.steps == 3 and config.model_config().num_layers == 2


_TINY_MODEL = """\
name: tiny
family: qwen2
num_layers: 2
hidden_size: 64
ffn_hidden_size: 128
num_attention_heads: 4
num_query_groups: 2
vocab_size: 256
max_position_embeddings: 512
rope_theta: 10000.0
norm_epsilon: 1.0e-6
add_qkv_bias: true
qk_layernorm: false
tie_word_embeddings: true
"""


def test_a_repeated_key_is_refused_naming_the_file_the_key_and_both_lines(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: tiny-qwen2\ntrain:\n  steps: 3\ntokenizer: /t\ntrain:\n  seed: 1\n")
    error = _refused(read_yaml, recipe)
    assert str(error) == (
        f"{recipe}: line 5, column 1: duplicate key 'train' (first at line 2; "
        "a repeated key would drop the first one's value)"
    )
    recipe.write_text("model: tiny-qwen2\ntrain: {steps: 3, steps: 4}\n")
    assert "duplicate key 'steps'" in str(_refused(read_yaml, recipe))
    error = _refused(load_config, RunConfig, BASE, ["train={steps: 3, steps: 4}"])
    assert error.field == "train" and "duplicate key 'steps'" in error.reason
    # the same key in two mappings is no repetition
    recipe.write_text("model: tiny-qwen2\ntokenizer: /t\ntrain: {seed: 3}\ndata: {seed: 4}\n")
    assert read_yaml(recipe)["data"] == {"seed": 4}


def test_yaml_1_1_words_and_leading_zeros_are_text(tmp_path):
    """``off`` and ``010`` are read as written (YAML 1.2): a str field takes the text, a bool or
    int field refuses it saying what to write; true/false, 10 and 0x10 read as before."""
    config = load_config(RunConfig, BASE, ["logging.wandb_project=off", "logging.wandb_run_name=010"])
    assert (config.logging.wandb_project, config.logging.wandb_run_name) == ("off", "010")
    error = _refused(load_config, RunConfig, BASE, ["train.packing=yes"])
    assert error.field == "train.packing" and "write true or false" in error.reason
    error = _refused(load_config, RunConfig, BASE, ["logging.interval=010"])
    assert error.field == "logging.interval" and "a leading 0 is not octal here" in error.reason
    config = load_config(RunConfig, BASE, ["train.packing=false", "train.steps=10", "train.seed=0x10"])
    assert (config.train.packing, config.train.steps, config.train.seed) == (False, 10, 16)


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("optimizer.adam_beta1=1.0", "optimizer.adam_beta1", "must be in [0, 1)"),
        ("optimizer.adam_beta2=-0.1", "optimizer.adam_beta2", "must be in [0, 1)"),
        ("optimizer.adam_eps=0", "optimizer.adam_eps", "must be > 0"),
        ("optimizer.weight_decay=-0.01", "optimizer.weight_decay", "must be >= 0"),
        ("optimizer.lr=.inf", "optimizer.lr", "expected a finite number, got inf"),
        ("algorithm.loss.kl_coef=.nan", "algorithm.loss.kl_coef", "expected a finite number, got nan"),
        ("distributed.timeout_minutes=1e12", "distributed.timeout_minutes", "minutes > 0 and <= 1.67e+07"),
        ("supervisor.phase_timeout_s.update=1e10", "supervisor.phase_timeout_s.update", "seconds"),
        ("checkpoint.dir=''", "checkpoint.dir", "expected a non-empty str"),
    ],
)
def test_numbers_out_of_range_and_empty_text_are_refused(override, field, words):
    error = _refused(load_config, RunConfig, BASE, [override])
    assert error.field == field and words in error.reason


def test_the_edges_of_the_ranges_are_accepted():
    config = load_config(
        RunConfig,
        BASE,
        [
            "optimizer.adam_beta1=0",
            "optimizer.adam_beta2=0.9999",
            "optimizer.weight_decay=0",
            "distributed.timeout_minutes=1e7",
            "supervisor.phase_timeout_s.update=1e9",
            "checkpoint.dir=.",
        ],
    )
    assert config.optimizer.adam_beta1 == 0 and config.checkpoint.dir == "."


def test_a_directly_built_config_obeys_the_same_rules():
    from megatron_empg.config import CheckpointConfig, OptimizerConfig

    assert _refused(OptimizerConfig, float("nan")).field == "lr"
    assert _refused(CheckpointConfig, "").field == "dir"
    assert OptimizerConfig(lr=1e-5).lr == 1e-5
