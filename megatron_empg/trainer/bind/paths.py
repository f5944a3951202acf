"""The bind step's checks of what a run reads and writes on disk (``bind(check_paths=True)``, ``empg
check``): the data and validation files, ``tokenizer``, what the policy starts from
(``checkpoint.init_from``: a HF directory or a checkpoint; ``checkpoint.continue_from``: a
checkpoint) and the run's directories. Each problem is a ``ConfigError`` naming the field and the
file, so that ``empg train`` never meets it in the middle of building the models.

A HF directory is checked as tools/convert_hf_to_megatron.py checks one (``weight_sync.hf_files``:
``config.json`` readable and of a known architecture, the safetensors' headers complete, every
tensor present) and its model compared with the run's field by field; a checkpoint must be complete
(``mcore.checkpoint.checkpoint_problem``, as tools/convert_megatron_to_hf.py requires) and its saved
model config equal the run's (``check_checkpoint_model``, also run for ``--resume``).
"""

from __future__ import annotations

from pathlib import Path

from megatron_empg.config import ConfigError, ModelConfig, RunConfig


def check_paths_of(config: RunConfig, model: ModelConfig) -> None:
    """Every path of ``config`` (module docstring); ``model``: the run's resolved model."""
    from megatron_empg.rollout.data import DataError, check_records
    from megatron_empg.trainer.run.run_dir import check_run_directories

    check_run_directories(config)
    for field, files in (("data.train_files", config.data.train_files), ("validation.files", config.validation.files)):
        for i, path in enumerate(files):
            try:
                check_records(path, config.data)
            except (DataError, ImportError) as error:
                raise ConfigError(f"{field}[{i}]", str(error)) from None
    checkpoint = config.checkpoint
    for field, path in (
        ("checkpoint.init_from", checkpoint.init_from),
        ("checkpoint.continue_from", checkpoint.continue_from),
        ("tokenizer", config.tokenizer),
    ):
        if path is not None and not Path(path).is_dir():
            raise ConfigError(field, f"{path} is not a directory")
    if checkpoint.init_from is not None:
        if (Path(checkpoint.init_from) / "config.json").is_file():
            _check_hf_directory("checkpoint.init_from", Path(checkpoint.init_from), model)
        else:
            _check_checkpoint("checkpoint.init_from", Path(checkpoint.init_from), model)
    if checkpoint.continue_from is not None:
        _check_checkpoint("checkpoint.continue_from", Path(checkpoint.continue_from), model)


def _check_hf_directory(field: str, path: Path, model: ModelConfig) -> None:
    from megatron_empg.weight_sync.hf_files import (
        HFDirectoryError,
        architecture_differences,
        check_hf_directory,
        read_hf_config,
    )

    try:
        differences = architecture_differences(read_hf_config(path, model.name), model)
        if differences:  # before the safetensors: the likelier mistake, and cheaper to say
            raise ConfigError(
                field, f"{path / 'config.json'} describes another model than {model.name!r}: {'; '.join(differences)}"
            )
        check_hf_directory(path, model.name)
    except HFDirectoryError as error:
        raise ConfigError(field, str(error)) from None


def _check_checkpoint(field: str, path: Path, model: ModelConfig) -> None:
    """``path``: a complete checkpoint, or a root with one, of ``model``."""
    from megatron_empg.mcore.checkpoint import CheckpointError, checkpoint_problem, find_latest_checkpoint

    problem = checkpoint_problem(path)
    if problem is not None:
        try:
            found = find_latest_checkpoint(path)
        except CheckpointError as error:
            raise ConfigError(field, str(error)) from None
        if found is None:
            what = "a Hugging Face model directory (no config.json) nor " if field.endswith("init_from") else ""
            raise ConfigError(field, f"{path} is neither {what}a complete checkpoint nor a root holding one: {problem}")
        path = found.path
    check_checkpoint_model(field, path, model)


def check_checkpoint_model(field: str, directory: Path, model: ModelConfig) -> None:
    """The model config saved in the checkpoint ``directory`` must equal ``model`` in every field
    that decides the tensors (``weight_sync.hf_files.ARCHITECTURE_FIELDS``); a checkpoint saved
    without one is checked by name only, when it loads."""
    from megatron_empg.mcore.checkpoint.files import MODEL_CONFIG_FILE, read_model_config
    from megatron_empg.weight_sync.hf_files import architecture_differences

    if not (directory / MODEL_CONFIG_FILE).is_file():
        return
    try:
        saved = read_model_config(directory)
    except ConfigError as error:
        raise ConfigError(field, f"{directory / MODEL_CONFIG_FILE}: {error}") from None
    differences = architecture_differences(saved, model)
    if differences:
        raise ConfigError(
            field,
            f"{directory} holds model {saved.name!r} of other shapes than this run's model {model.name!r} "
            f"(saved != this run's): {'; '.join(differences)}",
        )
