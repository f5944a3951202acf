"""The bind step's checks of what a run reads and writes on disk (``bind(check_paths=True)``, ``empg
check``): the data and validation files, ``tokenizer``, what the policy starts from
(``checkpoint.init_from``: a HF directory, a PEFT LoRA adapter on its base, or a checkpoint of a
whole model; ``checkpoint.continue_from``: a checkpoint) and the run's directories. Each problem is a ``ConfigError`` naming the field and the
file, so that ``empg train`` never meets it in the middle of building the models.

A HF directory is checked as tools/convert_hf_to_megatron.py checks one (``weight_sync.hf_files``:
``config.json`` readable and of a known architecture, the safetensors' headers complete, every
tensor present) and its model compared with the run's field by field; a checkpoint must be complete
(``mcore.checkpoint.checkpoint_problem``, as tools/convert_megatron_to_hf.py requires) and its saved
model config equal the run's (``trainer.run.run_dir.check_checkpoint_model``, also run for
``--resume``).
"""

from __future__ import annotations

from pathlib import Path

from megatron_empg.config import ConfigError, ModelConfig, RunConfig
from megatron_empg.config.peft import CONFIG_FILE as PEFT_CONFIG


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
        init = Path(checkpoint.init_from)
        if (init / PEFT_CONFIG).is_file():
            _check_peft_adapter("checkpoint.init_from", init, model)
        elif (init / "config.json").is_file():
            _check_hf_directory("checkpoint.init_from", init, model)
        else:
            _check_checkpoint("checkpoint.init_from", init, model)
    if checkpoint.continue_from is not None:
        _check_checkpoint("checkpoint.continue_from", Path(checkpoint.continue_from), model)


def check_model_source(field: str, path: str | Path, model: ModelConfig) -> None:
    """The weights of another model of the run (a distillation teacher) at ``path``: a Hugging
    Face directory of ``model`` or a checkpoint (or a root holding one) of it."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(field, f"{path} is not a directory")
    if (path / "config.json").is_file():
        _check_hf_directory(field, path, model)
    else:
        _check_checkpoint(field, path, model)


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


def _check_peft_adapter(field: str, path: Path, model: ModelConfig) -> None:
    """A PEFT LoRA adapter directory: a LoRA policy (``model.lora``) of the same rank, alpha,
    dropout and targets, adapter tensors only, on a local base that is checked as a HF directory."""
    from megatron_empg.config.peft import WEIGHTS_FILE, is_peft_key, lora_overrides
    from megatron_empg.mcore.lora.base import base_path, peft_adapter

    try:
        wanted = lora_overrides(peft_adapter(path), str(path / PEFT_CONFIG))
        base = base_path(path)
    except (ValueError, OSError) as error:
        raise ConfigError(field, str(error)) from None
    if model.lora is None:
        raise ConfigError(field, f"{path} is a PEFT LoRA adapter; the model has none: set model_overrides {wanted}")
    lora = model.lora
    targets = list(lora.resolved_targets(moe=model.is_moe))
    ours = {"peft_type": "LORA", "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout}
    have = lora_overrides({**ours, "target_modules": targets}, "model.lora")
    if have != wanted:
        raise ConfigError(field, f"the PEFT adapter is {', '.join(wanted)}; model.lora is {', '.join(have)}")
    weights = path / WEIGHTS_FILE
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            others = [key for key in f.keys() if not is_peft_key(key)]
    except (OSError, RuntimeError, ValueError) as error:  # missing, truncated or not safetensors
        raise ConfigError(field, f"{weights}: {error}") from None
    if others:
        raise ConfigError(field, f"{weights} holds tensors that are not LoRA adapters of {targets}: {others[:3]}")
    _check_hf_directory(field, base, model)


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
    if field.endswith("init_from") and _lora_base(path) is not None:
        raise ConfigError(
            field,
            f"{path} holds a LoRA policy's adapters only: start from their base ({_lora_base(path)}) and take "
            "the adapters with checkpoint.continue_from",
        )
    from megatron_empg.trainer.run.run_dir import check_checkpoint_model

    check_checkpoint_model(field, path, model)


def _lora_base(directory: Path) -> str | None:
    """The base a LoRA checkpoint's adapters were trained on, or None (a whole model)."""
    from megatron_empg.mcore.checkpoint import read_checkpoint_info

    base = read_checkpoint_info(directory).get("lora_base")
    return None if base is None else base["path"]
