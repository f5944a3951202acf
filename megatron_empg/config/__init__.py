"""The run's configuration: typed dataclasses, built from YAML or dicts, with dotted CLI overrides.

Pure Python and ``yaml``: nothing here imports torch or megatron, so any layer may import it.

The machinery is generic and works for any (nested) dataclass::

    cfg = load_config(ModelConfig, "model_configs/qwen2.5-7b.yaml", ["rope_theta=5e5"])
    cfg = from_dict(ModelConfig, {...})           # type-checked, unknown keys rejected
    data = to_dict(cfg)                           # from_dict(ModelConfig, data) == cfg

* ``from_dict`` checks every value against the field's type hint (``int``, ``float`` (an int is
  accepted), ``bool`` (only a real bool), ``str``, ``X | None``, unions, ``Literal[...]``,
  ``list[X]``, ``tuple[X, ...]``, ``dict``, nested dataclasses) and rejects unknown keys (listing
  the allowed ones) and missing required fields. Every error is a ``ConfigError`` whose message
  starts with the dotted path of the field, e.g. ``model.num_query_groups: expected int, got 'two'``.
* Every config class derives from ``Config``: constructing one, from YAML or directly, checks its
  ``Literal`` fields (a ``Literal`` is the one list of a field's choices) and runs its
  ``validate()``, innermost class first. A field that names a registry entry (an advantage
  estimator, a reward...) is a ``named_in`` field, checked by the bind step (``trainer.bind.build``).
* Each field is described by the string literal on the line after it (``field_docs``);
  ``tools/config_docs.py`` writes docs/configuration.md from them.
* ``read_yaml`` follows a top-level ``defaults: base.yaml`` (merged under the file's own keys).
* ``apply_overrides`` applies ``a.b.c=value`` strings to a dict; values are parsed as YAML (``1e-6``,
  ``true``, ``[1, 2]``, ``null``, ``{a: 1}``). A key that does not exist is an error, except under a
  free-form ``dict`` field.

The modules: ``schema`` (the machinery above; ``errors`` and ``yaml_files`` under it), ``model`` (``ModelConfig``, ``ParallelConfig``),
``algorithm`` (with ``distill``), ``rollout`` and ``run`` (the sections of ``RunConfig``). Import from the package.

Cross-field checks live on the dataclasses as ``validate()`` methods that raise
``ConfigError(field, reason)`` with the field name relative to the dataclass; ``from_dict`` adds the
dataclass's own path.
"""

from __future__ import annotations

from megatron_empg.config.algorithm import (  # noqa: F401
    ANCHOR_DTYPES,
    DYNAMIC_SAMPLING_METRICS,
    LR_DECAY_STYLES,
    AlgorithmConfig,
    AnchorConfig,
    DynamicSamplingConfig,
    LossConfig,
    OptimizerConfig,
)
from megatron_empg.config.distill import (  # noqa: F401
    DISTILL_PLACEMENTS,
    TEACHER_DTYPES,
    DistillConfig,
    TeacherConfig,
)
from megatron_empg.config.model import (  # noqa: F401
    FAMILIES,
    MODEL_CONFIG_DIR,
    Family,
    FamilySpec,
    ModelConfig,
    ParallelConfig,
    load_model_config,
    model_config_path,
    padded_vocab_size,
)
from megatron_empg.config.rollout import (  # noqa: F401
    RolloutConfig,
    SamplingConfig,
    SearchAgentConfig,
    WeightSyncConfig,
)
from megatron_empg.config.run import (  # noqa: F401
    ARITHMETIC_OPS,
    DATA_FILE_SUFFIXES,
    DATA_SOURCES,
    LOG_LEVELS,
    OPTIMIZER_FORMATS,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    PhaseTimeouts,
    RunConfig,
    SupervisorConfig,
    TrainConfig,
    ValidationConfig,
)
from megatron_empg.config.schema import (  # noqa: F401
    REGISTRY,
    REGISTRY_ALSO,
    Config,
    ConfigError,
    apply_overrides,
    field_docs,
    from_dict,
    join_path,
    literal_choices,
    load_config,
    named_in,
    parse_override,
    to_dict,
    to_yaml,
)
from megatron_empg.config.yaml_files import parse_yaml, read_yaml  # noqa: F401
