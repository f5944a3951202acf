"""The configuration documents itself: every field of every config class has a description where
it is declared, docs/configuration.md is what ``tools/config_docs.py`` generates from them, every
class checks its choices on construction as YAML does, and a field that names a registry entry
names the registry that the bind step checks it against."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from megatron_empg.config import (
    REGISTRY,
    Config,
    ConfigError,
    DistillConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    SearchAgentConfig,
    TeacherConfig,
    field_docs,
    from_dict,
    literal_choices,
    load_config,
    load_model_config,
    to_dict,
)
from tests.trainer.demo_runs import DEMO_RECIPE
from tools import config_docs
from tools.config_docs import REPO, registry_names, sections

CLASSES = [cls for _, cls in sections()] + [ModelConfig]
# What a class needs besides its defaults to be valid (its required fields).
REQUIRED = {
    RunConfig: {"model": "tiny-qwen2", "tokenizer": "/tmp/tokenizer"},
    SearchAgentConfig: {"retriever_url": "http://127.0.0.1:8000"},
    DistillConfig: {"teacher": {"model": "tiny-qwen2", "checkpoint": "/tmp/teacher"}},
    TeacherConfig: {"model": "tiny-qwen2", "checkpoint": "/tmp/teacher"},
    ModelConfig: to_dict(load_model_config("tiny-qwen2")),
}


def _marked_fields() -> list[tuple[str, dataclasses.Field]]:
    """(dotted path, field) of every field marked with a registry (``named_in``)."""
    tree = [*sections(), ("model", ModelConfig)]
    return [
        (f"{prefix}.{f.name}" if prefix else f.name, f)
        for prefix, cls in tree
        for f in dataclasses.fields(cls)
        if REGISTRY in f.metadata
    ]


def test_the_tree_has_every_config_class_and_each_checks_itself_the_one_way():
    names = {cls.__name__ for cls in CLASSES}
    assert {"RunConfig", "LossConfig", "PhaseTimeouts", "SearchAgentConfig", "ModelConfig", "ParallelConfig"} <= names
    assert len(CLASSES) == 22
    for cls in CLASSES:
        assert issubclass(cls, Config) and "__post_init__" not in vars(cls), cls  # Config's, not its own


def test_every_field_has_a_description_where_it_is_declared():
    missing = [f"{cls.__name__}.{name}" for cls in CLASSES for name, doc in field_docs(cls).items() if not doc]
    assert not missing, missing
    assert (
        field_docs(OptimizerConfig)["clip_grad"] == "Largest global gradient norm (L2) before clipping; 0: no clipping."
    )


def test_docs_configuration_md_is_what_the_tool_generates(tmp_path, capsys):
    # in a process of its own: this one's registries may hold a test's entries
    command = [sys.executable, "tools/config_docs.py", "--check"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{done.stderr.strip()}: docs/configuration.md is out of date"
    stale = tmp_path / "stale.txt"
    stale.write_text((REPO / "docs/configuration.md").read_text().replace("Largest global", "Largest"))
    assert config_docs.main(["--check", "--output", str(stale)]) == 1
    assert capsys.readouterr().err == f"{stale} is out of date: run {config_docs.COMMAND}\n"


def test_every_choice_and_registry_name_is_in_its_fields_row():
    links = {cls: "x" for cls in CLASSES}
    checked = 0
    for cls in CLASSES:
        hints = typing.get_type_hints(cls)
        rows = {row.split(" | ")[0].strip("| `"): row for row in config_docs.table(cls, links)[2:]}
        for field in dataclasses.fields(cls):
            choices = list(literal_choices(hints[field.name]))
            if REGISTRY in field.metadata:
                choices += registry_names(field.metadata[REGISTRY])
            for choice in choices:
                assert f"`{choice}`" in rows[field.name], (cls.__name__, field.name, choice)
                checked += 1
    assert checked > 60
    row = next(r for r in config_docs.table(OptimizerConfig, links) if r.startswith("| `lr_decay_style`"))
    assert "`constant`, `linear`, `cosine`, `inverse-square-root`" in row


def _bad_choice(tp) -> object:
    """A value outside the ``Literal`` choices of type ``tp``, of the choices' own type."""
    choices = literal_choices(tp)
    bad = 99 if isinstance(choices[0], int) else "bogus"
    return [bad] if typing.get_origin(tp) is list else bad


@pytest.mark.parametrize("cls", [cls for cls in CLASSES], ids=lambda cls: cls.__name__)
def test_a_bad_choice_fails_on_direct_construction_as_from_yaml(cls):
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if literal_choices(hints[f.name])]
    cls(**REQUIRED.get(cls, {}))  # valid as it is
    for name in fields:
        values = {**REQUIRED.get(cls, {}), name: _bad_choice(hints[name])}
        with pytest.raises(ConfigError) as direct:
            cls(**values)
        with pytest.raises(ConfigError) as from_yaml:
            from_dict(cls, values)
        assert str(direct.value) == str(from_yaml.value), name
        assert direct.value.field.startswith(name) and "expected one of" in direct.value.reason, direct.value
    if cls is OptimizerConfig:
        with pytest.raises(ConfigError, match="lr_decay_style: expected one of 'constant', 'linear'"):
            OptimizerConfig(lr_decay_style="bogus")


def test_a_nested_classs_error_names_its_dotted_path():
    with pytest.raises(ConfigError) as error:
        from_dict(RunConfig, {**REQUIRED[RunConfig], "algorithm": {"anchor": {"tau": 2.0}}})
    assert error.value.field == "algorithm.anchor.tau" and "must be in [0, 1]" in error.value.reason
    with pytest.raises(ConfigError) as error:
        from_dict(RunConfig, {**REQUIRED[RunConfig], "rollout": {"sampling": {"n": 0}}})
    assert error.value.field == "rollout.sampling.n"


# --------------------------------------------------------------------------------------------
# Registry names: the mark names the registry the bind step checks against.

# What a marked field's check needs of the rest of the config: data.reward a source that takes
# any reward (the files are not read with check_paths=False); algorithm.loss.kl no arguments of the
# demo's Top-k KL.
CONTEXT = {
    "data.reward": ["data.source=files", "data.train_files=[train.jsonl]"],
    "algorithm.loss.kl": ["algorithm.loss.kl_args={}"],
    "algorithm.distill.loss": ["algorithm.distill={teacher: {model: demo-qwen2, checkpoint: /tmp/teacher}}"],
}


def _bind_error(tmp_path, path: str, name: str) -> ConfigError | None:
    from megatron_empg.trainer.bind.build import bind

    setting = f"model_overrides=[{path.split('.', 1)[1]}={name}]" if path.startswith("model.") else f"{path}={name}"
    overrides = ["checkpoint.init_from=null", f"tokenizer={tmp_path}", *CONTEXT.get(path, []), setting]
    try:
        bind(load_config(RunConfig, DEMO_RECIPE, overrides), world_size=1, check_paths=False)
    except ConfigError as error:
        return error
    return None


def test_the_marked_fields_are_the_registry_names():
    assert {path for path, _ in _marked_fields()} == {
        "algorithm.advantage",
        "algorithm.loss.policy_loss",
        "algorithm.loss.kl",
        "algorithm.loss.agg_mode",
        "algorithm.behavior_is",
        "algorithm.distill.loss",
        "rollout.engine",
        "weight_sync.transport",
        "weight_sync.lora_mode",
        "data.reward",
        "model.attention_backend",
        "model.moe_experts",
    }


@pytest.mark.parametrize(("path", "field"), _marked_fields(), ids=[path for path, _ in _marked_fields()])
def test_bind_checks_a_marked_field_against_its_registry(tmp_path, path, field):
    names = registry_names(field.metadata[REGISTRY])
    error = _bind_error(tmp_path, path, "bogus")
    assert error is not None and error.field == path, error
    assert "unknown name 'bogus'" in error.reason and str(names) in error.reason, error  # the registry's names
    for name in names:  # each is accepted by the name check (a later check may still refuse it)
        error = _bind_error(tmp_path, path, name)
        assert error is None or error.field != path or "unknown name" not in error.reason, (name, error)
