"""Training prompts: records of parquet or JSONL files -> tokenized prompts with their gold answers,
and a deterministic, resumable, data-parallel-sharded iterator over batches of them.

    check_records(path, config.data)                          # every row checked, streamed (the bind step)
    source = load_prompt_dataset(config.data, tokenizer)    # every row read, checked, tokenized
    batches = PromptBatches(source, batch_size=64, rank=dp_rank, world_size=dp_size)
    examples = next(batches)                                  # 64 // dp_size PromptExamples
    state = batches.state_dict()                              # {"cursor": batches served, ...}
    batches.load_state_dict(state)                            # continues exactly there

Batches are global: batch ``step`` is the same ``batch_size`` examples whatever the world size, and
rank ``r`` gets its ``r``-th contiguous block of ``batch_size // world_size``, so the ranks' prompts
are disjoint and together make up the batch, and a checkpoint resumes at another world size too. A
file dataset serves epochs: each epoch is a permutation of the dataset drawn from (seed, epoch) (or
the file order without ``shuffle``), cut into ``len // batch_size`` batches; the last
``len % batch_size`` examples of an epoch's order wait for a later epoch's permutation. Any
``PromptSource`` is served the same way: ``tasks.arithmetic``'s is an infinite one. Which source a
config gets is ``tasks.registry.build_prompt_source``'s choice (tasks import this module, never
the reverse).

Records: ``prompt_key`` holds a string or a list of chat messages (``{role, content}``),
``answer_key`` a string, an int or a non-empty list of strings; a dotted key reaches into nested
records (verl's ``reward_model.ground_truth``). A malformed record (missing key, wrong type, empty
prompt, invalid JSON line) is a ``DataError`` naming the file and the 1-based row (JSONL: the line
number; blank lines are skipped). The tokenizer is anything with ``transformers``' ``__call__``,
``apply_chat_template`` and ``chat_template``; this module imports no tokenizer library, and
pyarrow only when it reads a parquet file.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from megatron_empg.config import DataConfig

log = logging.getLogger(__name__)

ChatMessages = list[dict[str, str]]
Prompt = str | ChatMessages


@dataclass(frozen=True)
class PromptExample:
    """One training prompt.

    ``prompt_ids``: ``[P]`` token ids of the rendered prompt (what the engine continues).
    ``answer``: the gold answer, or a list of acceptable ones (QA). ``meta``: where it came from:
    a file record ``{"file", "row" (1-based), "index" (in the dataset), "columns" (the record's
    fields other than ``prompt_key`` and ``answer_key``)}``; an arithmetic problem ``{"index", "problem"}``.
    """

    prompt_ids: list[int]
    answer: str | list[str]
    meta: dict[str, Any]


class DataError(ValueError):
    """A data file or one of its records is malformed. ``row``: 1-based (JSONL: line); None: the file."""

    def __init__(self, file: str | Path, row: int | None, reason: str) -> None:
        self.file, self.row, self.reason = str(file), row, reason
        super().__init__(f"{file}: row {row}: {reason}" if row is not None else f"{file}: {reason}")


class PromptSource(Protocol):
    """What ``PromptBatches`` serves: examples by index, and which indices make up each batch."""

    def example(self, index: int) -> PromptExample: ...

    def batch_indices(self, step: int, batch_size: int) -> list[int]:
        """The ``batch_size`` example indices of global batch ``step`` (0-based)."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpointed cursor is only valid for (sizes, seeds); plain JSON values."""
        ...


# --------------------------------------------------------------------------------------------
# Rendering prompts.


class PromptFormatter:
    """Prompts -> text -> token ids, with the tokenizer's chat template when it has one.

    With ``apply_chat_template`` and a tokenizer whose ``chat_template`` is set, a prompt becomes the
    messages ``[system?, user]`` (or its own message list) rendered with the generation prompt and
    tokenized without added special tokens (the template writes them). Otherwise plain text,
    ``system_prompt + "\\n" + prompt``, tokenized with the tokenizer's special tokens (a bos, if it
    adds one); a message list then cannot be rendered. ``prompt_template`` (``"... {prompt} ..."``)
    rewrites a string prompt, or the content of a message list's last user message, before that.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        apply_chat_template: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.uses_chat_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def render(self, prompt: Prompt) -> str:
        """The prompt's text; a ``ValueError`` says why a prompt cannot be rendered."""
        prompt = apply_prompt_template(self.prompt_template, prompt)
        if not self.uses_chat_template:
            if not isinstance(prompt, str):
                raise ValueError(
                    "a list of chat messages needs a tokenizer with a chat template "
                    "(and data.apply_chat_template: true)"
                )
            return prompt if self.system_prompt is None else f"{self.system_prompt}\n{prompt}"
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.system_prompt is not None:
            if messages[0]["role"] == "system":
                raise ValueError("the prompt has its own system message and data.system_prompt is set too")
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # the template's own refusal: jinja2's TemplateError (raise_exception), ...
            raise ValueError(f"the tokenizer's chat template failed on it: {type(error).__name__}: {error}") from error

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered prompts: ``[len(texts)]`` lists of ints."""
        if not texts:
            return []
        encoded = self.tokenizer(texts, add_special_tokens=not self.uses_chat_template)["input_ids"]
        return [list(ids) for ids in encoded]


def apply_prompt_template(template: str | None, prompt: Prompt) -> Prompt:
    """``prompt`` rewritten by ``data.prompt_template`` (None: as it is): a string prompt, or the
    content of a message list's last user message (a ``ValueError`` if it has none)."""
    if template is None:
        return prompt
    if isinstance(prompt, str):
        return template.format(prompt=prompt)
    users = [i for i, message in enumerate(prompt) if message["role"] == "user"]
    if not users:
        raise ValueError("data.prompt_template is set but the messages have no user message")
    last = users[-1]
    return [
        *prompt[:last],
        {**prompt[last], "content": template.format(prompt=prompt[last]["content"])},
        *prompt[last + 1 :],
    ]


# --------------------------------------------------------------------------------------------
# Reading records.


def read_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row, record)`` for each record of a ``.parquet`` or ``.jsonl`` file; rows are 1-based.

    Streamed: a parquet file ``_PARQUET_BATCH_ROWS`` rows at a time, a JSONL file a line at a time,
    so a file of millions of rows is checked (``check_records``) without holding it in memory."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "no such file")
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    else:
        raise DataError(path, None, f"expected a .parquet or .jsonl file, got suffix {path.suffix!r}")


_PARQUET_BATCH_ROWS = 8192  # rows turned into Python dicts at a time (a row group is read whole)


def _read_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow): {error}") from error
    row = 0
    try:
        with pq.ParquetFile(path) as file:
            for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    row += 1
                    yield row, record
    except (OSError, pa.ArrowException) as error:  # the footer, or a row group past `row`, is unreadable
        where = f" after row {row}" if row else ""
        raise DataError(path, None, f"cannot read it as parquet{where}: {error}") from None


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as file:  # bytes, so a decoding error is found on its own line
        for line_number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                raise DataError(path, line_number, f"not UTF-8 text: {error}") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(path, line_number, f"invalid JSON: {error.msg} at column {error.colno}") from None
            if not isinstance(record, dict):
                raise DataError(path, line_number, f"expected a JSON object, got {type(record).__name__}")
            yield line_number, record


_MISSING = object()


def _lookup(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``; a dotted key not in ``record`` reads nested mappings (``a.b``: ``record["a"]["b"]``).

    Missing keys and None (a parquet null) give the ``_MISSING`` sentinel.
    """
    if key in record:
        value = record[key]
    else:
        value = record
        for part in key.split("."):
            if not isinstance(value, Mapping) or part not in value:
                return _MISSING
            value = value[part]
    return _MISSING if value is None else value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def parse_prompt(value: Any) -> Prompt:
    """A record's prompt: a non-empty string or a non-empty list of ``{role: str, content: str}``."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("empty prompt")
        return value
    if not isinstance(value, list):
        raise ValueError(f"expected a string or a list of chat messages, got {_describe(value)}")
    if not value:
        raise ValueError("empty prompt (no messages)")
    messages = []
    for i, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"message {i}: expected {{role: str, content: str}}, got {_describe(message)}")
        messages.append({"role": message["role"], "content": message["content"]})
    if not any(message["content"].strip() for message in messages):
        raise ValueError("empty prompt (every message is empty)")
    return messages


def parse_answer(value: Any) -> str | list[str]:
    """A record's gold answer: a non-empty string, an int (as its decimal string) or a non-empty list of strings."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("empty answer")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return list(value)
    raise ValueError(f"expected a string, an int or a non-empty list of non-empty strings, got {_describe(value)}")


# --------------------------------------------------------------------------------------------
# Datasets and batches.


class PromptDataset:
    """Prompts of data files, served in epochs (a ``PromptSource``).

    ``examples``: the dataset in file order; ``num_dropped_long``: rows dropped as longer than
    ``max_prompt_tokens``. Epoch ``e``'s order is ``range(len)`` shuffled by
    ``random.Random(f"{seed}:{e}")`` (string seeds are hashed with SHA-512: the same order in every
    process and Python version), or the file order without ``shuffle``.
    """

    def __init__(self, examples: list[PromptExample], *, shuffle: bool, seed: int, num_dropped_long: int = 0) -> None:
        if not examples:
            raise ValueError("PromptDataset: no examples")
        self.examples = examples
        self.shuffle, self.seed = shuffle, seed
        self.num_dropped_long = num_dropped_long
        self._order_cache: tuple[int, list[int]] | None = None  # (epoch, its order)

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, index: int) -> PromptExample:
        return self.examples[index]

    def epoch_order(self, epoch: int) -> list[int]:
        """The example indices of ``epoch`` in serving order (a permutation of ``range(len(self))``)."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def steps_per_epoch(self, batch_size: int) -> int:
        steps = len(self.examples) // batch_size
        if steps == 0:
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(self.examples)} prompts)")
        return steps

    def batch_indices(self, step: int, batch_size: int) -> list[int]:
        epoch, index_in_epoch = divmod(step, self.steps_per_epoch(batch_size))
        start = index_in_epoch * batch_size
        return self.epoch_order(epoch)[start : start + batch_size]

    def fingerprint(self) -> dict[str, Any]:
        return {"source": "files", "num_examples": len(self.examples), "shuffle": self.shuffle, "seed": self.seed}


def check_records(path: str | Path, config: DataConfig) -> int:
    """Check every record of ``path`` as ``load_prompt_dataset`` will (``data.prompt_key`` and
    ``answer_key`` present and well formed: the same ``_parse_fields``), streamed and without a
    tokenizer; returns the number of records. A ``DataError`` naming the file and row otherwise:
    what a run would otherwise find only after its engine and model have started. What needs the
    tokenizer (rendering, the prompt's length) is checked when the dataset is loaded."""
    num_records = 0
    for row, record in read_records(path):
        _parse_fields(str(path), row, record, config)
        num_records += 1
    if not num_records:
        raise DataError(path, None, "no records")
    return num_records


def _parse_fields(file: str, row: int, record: dict[str, Any], config: DataConfig) -> dict[str, Any]:
    """The record's parsed ``prompt`` and ``answer``; the prompt takes ``data.prompt_template``
    (checked here too, so that the bind step finds a prompt it cannot take)."""
    fields = {}
    for name, key, parse in (("prompt", config.prompt_key, parse_prompt), ("answer", config.answer_key, parse_answer)):
        value = _lookup(record, key)
        if value is _MISSING:
            raise DataError(file, row, f"missing key {key!r} (data.{name}_key); the record's keys: {sorted(record)}")
        try:
            fields[name] = parse(value)
            if name == "prompt":
                apply_prompt_template(config.prompt_template, fields[name])
        except ValueError as error:
            raise DataError(file, row, f"{key!r}: {error}") from None
    return fields


def _parse_record(
    file: str, row: int, record: dict[str, Any], config: DataConfig, formatter: PromptFormatter
) -> tuple[str, str | list[str], dict[str, Any]]:
    """One record -> (rendered prompt text, gold answer, the record's other columns)."""
    fields = _parse_fields(file, row, record, config)
    try:
        text = formatter.render(fields["prompt"])
    except ValueError as error:
        raise DataError(file, row, f"{config.prompt_key!r}: {error}") from None
    columns = {k: v for k, v in record.items() if k not in (config.prompt_key, config.answer_key)}
    return text, fields["answer"], columns


def load_prompt_dataset(config: DataConfig, tokenizer: Any) -> PromptDataset:
    """Read, check and tokenize every record of ``config.train_files`` (in order) into a ``PromptDataset``."""
    if config.source != "files":
        raise ValueError(f"load_prompt_dataset: data.source is {config.source!r}, not 'files'")
    formatter = PromptFormatter(
        tokenizer,
        system_prompt=config.system_prompt,
        prompt_template=config.prompt_template,
        apply_chat_template=config.apply_chat_template,
    )
    if config.apply_chat_template and not formatter.uses_chat_template:
        log.info("the tokenizer has no chat template: prompts are tokenized as plain text")
    texts: list[str] = []
    records: list[tuple[str, int, str | list[str], dict[str, Any]]] = []  # file, row, answer, other columns
    for file in config.train_files:
        num_before = len(records)
        for row, record in read_records(file):
            text, answer, columns = _parse_record(file, row, record, config, formatter)
            texts.append(text)
            records.append((file, row, answer, columns))
        if len(records) == num_before:
            raise DataError(file, None, "no records")
    examples: list[PromptExample] = []
    num_dropped_long = 0
    for (file, row, answer, columns), prompt_ids in zip(records, formatter.encode(texts), strict=True):
        if not prompt_ids:
            raise DataError(file, row, "the prompt has no tokens")
        if len(prompt_ids) > config.max_prompt_tokens:
            if not config.drop_long_prompts:
                raise DataError(
                    file,
                    row,
                    f"the prompt has {len(prompt_ids)} tokens, more than data.max_prompt_tokens="
                    f"{config.max_prompt_tokens} (data.drop_long_prompts: true drops such rows)",
                )
            num_dropped_long += 1
            continue
        meta = {"file": file, "row": row, "index": len(examples), "columns": columns}
        examples.append(PromptExample(prompt_ids=prompt_ids, answer=answer, meta=meta))
    if num_dropped_long:
        log.warning(
            "dropped %d of %d prompts longer than data.max_prompt_tokens=%d",
            num_dropped_long,
            len(records),
            config.max_prompt_tokens,
        )
    if not examples:
        raise DataError(", ".join(config.train_files), None, "every prompt is longer than data.max_prompt_tokens")
    return PromptDataset(examples, shuffle=config.shuffle, seed=config.seed, num_dropped_long=num_dropped_long)


def load_validation_sets(
    config: DataConfig, files: list[str], tokenizer: Any, max_per_source: int | None = None
) -> dict[str, list[PromptExample]]:
    """The prompts of ``files``, read like ``config``'s training files, by data source (a record's
    ``data_source`` column, else its file's name without suffix), in file order: the first
    ``max_per_source`` of each source (None: all). Sources appear in the order first met."""
    dataset = load_prompt_dataset(replace(config, source="files", train_files=list(files)), tokenizer)
    sets: dict[str, list[PromptExample]] = {}
    for example in dataset.examples:
        source = str(example.meta["columns"].get("data_source") or Path(example.meta["file"]).stem)
        examples = sets.setdefault(source, [])
        if max_per_source is None or len(examples) < max_per_source:
            examples.append(example)
    return sets


class PromptBatches:
    """An endless iterator over this data-parallel rank's share of the global prompt batches.

    ``next()`` returns ``batch_size // world_size`` ``PromptExample``s: block ``rank`` of global
    batch ``cursor``, then advances ``cursor``. ``state_dict()`` is the same on every rank;
    ``load_state_dict`` continues from it, and refuses a state of another source or batch size.
    """

    def __init__(self, source: PromptSource, *, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        for name, value in (("batch_size", batch_size), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PromptBatches: {name} must be an int >= 1, got {value!r}")
        if batch_size % world_size:
            raise ValueError(f"PromptBatches: batch_size={batch_size} is not divisible by world_size={world_size}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"PromptBatches: rank must be an int in [0, world_size={world_size}), got {rank!r}")
        self.source = source
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.cursor = 0  # global batches served so far

    def batch(self, step: int) -> list[PromptExample]:
        """This rank's block of global batch ``step``, without moving the cursor."""
        per_rank = self.batch_size // self.world_size
        indices = self.source.batch_indices(step, self.batch_size)
        return [self.source.example(i) for i in indices[self.rank * per_rank : (self.rank + 1) * per_rank]]

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> list[PromptExample]:
        examples = self.batch(self.cursor)
        self.cursor += 1
        return examples

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "batch_size": self.batch_size, **self.source.fingerprint()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = {"batch_size": self.batch_size, **self.source.fingerprint()}
        for key in sorted(set(state) - {"cursor"} | set(expected)):
            if state.get(key, _MISSING) != expected.get(key, _MISSING):
                saved = state.get(key, "(absent)")
                raise ValueError(
                    f"data state: {key} is {saved!r} in the checkpoint but {expected.get(key, '(absent)')!r} "
                    "here: its cursor does not describe these batches"
                )
        cursor = state.get("cursor")
        if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"data state: cursor must be an int >= 0, got {cursor!r}")
        self.cursor = cursor
