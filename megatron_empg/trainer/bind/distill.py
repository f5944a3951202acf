"""``algorithm.distill`` resolved and checked at bind (``trainer.bind.build.bind``), nothing started:

- ``loss`` a name of ``core.distill.losses.DISTILL_LOSSES``, ``topk`` <= the vocabulary;
- ``placement``: a class of ``PLACEMENTS``, chosen here once (``trainer.teacher`` runs it);
- the teacher's model config: the student's vocabulary, positions for ``train.max_seq_len``; on the
  training ranks (``trainer``) also its heads / query groups / layers split by the run's TP / PP /
  CP (``ParallelConfig.validate_for``) and no experts; an ``engine`` teacher has its own layout,
  but needs engines colocated with training (no ``rollout.disaggregated``) and no ``offload``;
- with the paths: the teacher's weights (a HF directory of that model, or a checkpoint of it; an
  ``engine`` teacher a HF directory only) and its tokenizer's files equal to the student's
  ``tokenizer``'s (each error names both).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from megatron_empg.config import ConfigError, ModelConfig, RunConfig, load_model_config
from megatron_empg.core.distill.losses import DISTILL_LOSSES
from megatron_empg.core.distill.term import DistillTerm

FIELD = "algorithm.distill"
# The files of a Hugging Face tokenizer that define its token <-> id map.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class TrainerPlacement:
    """The teacher is a Megatron model on the training ranks at the student's TP / PP / CP,
    forward only (``trainer.distill.teacher``)."""

    name = "trainer"
    on_engines = False  # the engines score nothing


@dataclasses.dataclass(frozen=True)
class EngineTeacherPlacement:
    """The teacher is served by an engine beside each rollout engine (``trainer.engines.teacher``),
    scoring the samples with top-k prompt log-probs; its layout need not fit the student's."""

    name = "engine"
    on_engines = True  # each engine owner starts one teacher engine


PLACEMENTS: dict[str, type] = {"trainer": TrainerPlacement, "engine": EngineTeacherPlacement}


@dataclasses.dataclass(frozen=True)
class DistillBinding:
    """What ``bind_distill`` resolved: the update pass's ``term``, the teacher's ``model`` config,
    its ``placement`` and ``context``: the longest sample + 1, a teacher engine's ``max_model_len``
    (it scores a sample as a prompt, leaving one position for an output token, as vLLM does)."""

    term: DistillTerm
    model: ModelConfig
    placement: TrainerPlacement | EngineTeacherPlacement
    context: int


def bind_distill(config: RunConfig, model: ModelConfig, *, check_paths: bool = True) -> DistillBinding | None:
    """``algorithm.distill`` of ``config`` for the student ``model`` (module docstring), or None
    when there is none. Raises ``ConfigError`` naming the dotted field."""
    distill = config.algorithm.distill
    if distill is None:
        return None
    if distill.loss not in DISTILL_LOSSES:
        raise ConfigError(f"{FIELD}.loss", f"unknown name {distill.loss!r}; expected one of {sorted(DISTILL_LOSSES)}")
    placement = PLACEMENTS[distill.placement]()
    if placement.on_engines:
        _check_engine_teacher(config)
    if distill.topk > model.vocab_size:
        raise ConfigError(f"{FIELD}.topk", f"must be <= model.vocab_size={model.vocab_size}, got {distill.topk}")
    rollout = config.rollout
    longest = min(rollout.max_model_len or model.max_position_embeddings, config.train.max_seq_len)  # a sample's bound
    teacher = _teacher_model(config, model, placement, longest + 1)
    if check_paths:
        _check_teacher_paths(config, teacher, placement)
    term = DistillTerm.bind(
        distill.loss,
        topk=distill.topk,
        use_policy_gradient=distill.use_policy_gradient,
        use_task_rewards=distill.use_task_rewards,
        coef=distill.coef,
        loss_max_clamp=distill.loss_max_clamp,
        log_prob_min_clamp=None if distill.log_prob_floor is None else -distill.log_prob_floor,
        clip_eps_low=distill.clip_eps_low,
        clip_eps_high=distill.clip_eps_high,
        clip_c=distill.clip_c,
    )
    return DistillBinding(term, teacher, placement, longest + 1)


def _check_engine_teacher(config: RunConfig) -> None:
    """What a teacher on the engines needs of the run's other settings."""
    if config.rollout.disaggregated:
        raise ConfigError(
            f"{FIELD}.placement",
            "engine with rollout.placement disaggregated: a teacher beside disaggregated engines is not built yet; "
            "colocate the engines or use placement trainer",
        )
    teacher = config.algorithm.distill.teacher
    if config.rollout.gpu_memory_utilization + teacher.gpu_memory_utilization > 1:
        raise ConfigError(
            f"{FIELD}.teacher.gpu_memory_utilization",
            f"{teacher.gpu_memory_utilization} beside rollout.gpu_memory_utilization "
            f"{config.rollout.gpu_memory_utilization}: the teacher engine and the rollout engine share the GPU "
            "(their sum must be <= 1)",
        )
    if teacher.offload:
        raise ConfigError(
            f"{FIELD}.teacher.offload",
            "is the trainer placement's; an engine teacher sleeps between its calls with rollout.sleep_while_training",
        )


def _teacher_model(config: RunConfig, model: ModelConfig, placement, context: int) -> ModelConfig:
    field = f"{FIELD}.teacher.model"
    name = config.algorithm.distill.teacher.model
    try:
        teacher = load_model_config(name)
    except ConfigError as error:
        raise ConfigError(field, f"{name}: {error.field + ': ' if error.field else ''}{error.reason}") from None
    if teacher.vocab_size != model.vocab_size:
        raise ConfigError(
            field,
            f"the teacher {teacher.name!r} has vocab_size {teacher.vocab_size}, the student model {model.name!r} "
            f"{model.vocab_size}: distillation compares log-probs of one vocabulary",
        )
    if teacher.max_position_embeddings < config.train.max_seq_len:
        raise ConfigError(
            field,
            f"the teacher {teacher.name!r} has max_position_embeddings {teacher.max_position_embeddings} < "
            f"train.max_seq_len {config.train.max_seq_len}",
        )
    if placement.on_engines and teacher.max_position_embeddings < context:
        raise ConfigError(
            field,
            f"the teacher {teacher.name!r} has max_position_embeddings {teacher.max_position_embeddings}; its engine "
            f"scores the longest sample ({context - 1} tokens) as a prompt with one position to spare: {context}",
        )
    if placement.on_engines:  # the engine runs it at its own layout
        return dataclasses.replace(teacher, attention_backend=model.attention_backend)
    try:
        config.parallel.validate_for(teacher)
    except ConfigError as error:
        raise ConfigError(
            field, f"the teacher {teacher.name!r} runs at the student's parallel.{error.field}: {error.reason}"
        ) from None
    if teacher.is_moe:
        raise ConfigError(
            field, f"the teacher {teacher.name!r} has experts: a mixture-of-experts teacher is not built yet"
        )
    return dataclasses.replace(teacher, attention_backend=model.attention_backend)


def _check_teacher_paths(config: RunConfig, teacher: ModelConfig, placement) -> None:
    """The teacher's weights exist (as ``checkpoint.init_from`` is checked; a HF directory for an
    engine, which loads nothing else) and its tokenizer is the student's, file by file."""
    from megatron_empg.trainer.bind.paths import check_model_source

    field, checkpoint = f"{FIELD}.teacher.checkpoint", Path(config.algorithm.distill.teacher.checkpoint)
    if placement.on_engines and checkpoint.is_dir() and not (checkpoint / "config.json").is_file():
        raise ConfigError(
            field,
            f"{checkpoint} has no config.json: placement engine loads the teacher from a Hugging Face model "
            "directory, not a Megatron checkpoint (convert it, or use placement trainer)",
        )
    check_model_source(field, checkpoint, teacher)
    check_teacher_tokenizer(config)


def check_teacher_tokenizer(config: RunConfig) -> None:
    """The teacher's tokenizer files (``teacher.tokenizer``, else ``teacher.checkpoint``) define the
    token <-> id map of the student's ``tokenizer``: a ``ConfigError`` naming both otherwise."""
    from megatron_empg.trainer.run.start import hf_assets, tokenizer_source

    spec = config.algorithm.distill.teacher
    field = f"{FIELD}.teacher.tokenizer"
    student = tokenizer_source(config)
    source = spec.tokenizer or hf_assets(spec.checkpoint)
    theirs, ours = tokenizer_fingerprint(source), tokenizer_fingerprint(student)
    if theirs is None:
        what = "teacher.tokenizer" if spec.tokenizer else "teacher.checkpoint (teacher.tokenizer is null)"
        raise ConfigError(field, f"{source} ({what}) holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    if theirs != ours:
        raise ConfigError(
            field,
            f"the teacher's tokenizer {source} differs from the student's tokenizer {student}: "
            "distillation needs one tokenizer",
        )


def tokenizer_fingerprint(directory: str | Path) -> str | None:
    """A digest of the token <-> id map of the HF tokenizer in ``directory`` (``tokenizer.json``'s
    model, added tokens, normalizer and pre-tokenizer; else the vocabulary files' bytes), or None
    when it holds none."""
    path = Path(directory)
    digest = hashlib.sha256()
    found = False
    fast = path / "tokenizer.json"
    if fast.is_file():
        data = json.loads(fast.read_text())
        keys = ("model", "added_tokens", "normalizer", "pre_tokenizer")
        digest.update(json.dumps({k: data.get(k) for k in keys}, sort_keys=True).encode())
        return digest.hexdigest()
    for name in _TOKENIZER_FILES[1:]:
        if (path / name).is_file():
            found = True
            digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    return digest.hexdigest() if found else None
