"""Convert FlashRAG QA files (``RUC-NLPIR/FlashRAG_datasets``) into one JSONL prompt file for the
search-agent recipes, with Search-R1's question normalisation and ids unique across datasets.

    python tools/prepare_search_data.py --out data/search/train.jsonl \\
        nq=FlashRAG_datasets/nq/train.jsonl hotpotqa=FlashRAG_datasets/hotpotqa/train.jsonl [--limit N] [--seed S]

Each ``NAME=PATH`` is a FlashRAG JSONL file, one row per line with ``id``, ``question`` and
``golden_answers`` (a list of strings; other fields such as ``metadata`` are ignored); NAME becomes
the rows' ``data_source``. Every row becomes, in argument order and file order::

    {"question": "...?", "golden_answers": ["..."], "data_source": "nq", "id": "nq/train/<row id>"}

where ``train`` is PATH's file name without ``.jsonl``. The question is stripped and gets a "?"
appended when it does not end with one (Search-R1's ``scripts/data_process/qa_search_*_merge.py``).
Search-R1 groups GRPO samples by a per-dataset row ``index``, so NQ and HotpotQA rows collide after
their merge; these ids do not (a repeated id is an error).

The test set is the same command over the seven evaluation files; Search-R1 takes each dataset's
``test`` split, else its ``dev`` split: nq/test, triviaqa/test, popqa/test, hotpotqa/dev,
2wikimultihopqa/dev, musique/dev, bamboogle/test.

``--limit N`` keeps N rows of each file (all of a shorter file), drawn uniformly without replacement
with ``--seed`` (default 0) and kept in file order; every row is still checked. OUT is written to a
temporary file next to it and renamed at the end, so it is complete or untouched.

Exit codes: 0 written; 1 a malformed file or row (the message names the file, the line and the
field); 2 a usage error (bad ``NAME=PATH``, a missing input, ``--limit`` < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
FIELDS = ("id", "question", "golden_answers")


class UsageError(Exception):
    """A bad command line (exit code 2)."""


class RowError(ValueError):
    """A malformed input file or row (exit code 1): ``PATH:LINE: reason``."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}")


@dataclass(frozen=True)
class Source:
    """One ``NAME=PATH`` argument: the data_source name, the file and its split (the file's stem)."""

    name: str
    path: Path

    @property
    def split(self) -> str:
        return self.path.name.removesuffix(".jsonl")


def parse_source(text: str) -> Source:
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise UsageError(f"expected NAME=PATH (e.g. nq=nq/train.jsonl), got {text!r}")
    if not NAME_PATTERN.fullmatch(name):
        raise UsageError(
            f"{text!r}: NAME must be letters, digits, '_', '.' or '-' (it goes into the ids), got {name!r}"
        )
    source = Source(name, Path(path))
    if not source.path.is_file():
        raise UsageError(f"{text!r}: no such file: {path}")
    if not source.split:
        raise UsageError(f"{text!r}: the file name gives an empty split")
    return source


def normalize_question(question: str) -> str:
    """Search-R1's: stripped, with "?" appended unless it already ends with one."""
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def convert_row(source: Source, line: int, row: Any) -> dict[str, Any]:
    """One FlashRAG row -> an output record; a ``RowError`` names the line and the field."""
    if not isinstance(row, dict):
        raise RowError(source.path, line, f"expected a JSON object, got {type(row).__name__}")
    for field in FIELDS:
        if field not in row:
            raise RowError(source.path, line, f"field {field!r} is missing (the row has {sorted(row)})")
    row_id = row["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or str(row_id).strip() == "":
        raise RowError(source.path, line, f"field 'id': expected a non-empty string or an int, got {row_id!r}")
    question = row["question"]
    if not isinstance(question, str) or not question.strip():
        raise RowError(source.path, line, f"field 'question': expected a non-empty string, got {question!r}")
    answers = row["golden_answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise RowError(
            source.path,
            line,
            f"field 'golden_answers': expected a non-empty list of non-empty strings, got {answers!r}",
        )
    return {
        "question": normalize_question(question),
        "golden_answers": list(answers),
        "data_source": source.name,
        "id": f"{source.name}/{source.split}/{row_id}",
    }


def read_source(source: Source) -> list[tuple[int, dict[str, Any]]]:
    """Every row of ``source`` as (1-based line, output record); blank lines are skipped."""
    records = []
    with open(source.path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                raise RowError(source.path, line, f"invalid JSON ({error.msg} at column {error.colno})") from None
            records.append((line, convert_row(source, line, row)))
    if not records:
        raise RowError(source.path, None, "no rows")
    return records


def subsample(records: list, limit: int | None, seed: int) -> list:
    """``limit`` of ``records`` drawn without replacement with ``seed``, in their original order."""
    if limit is None or limit >= len(records):
        return records
    keep = sorted(random.Random(seed).sample(range(len(records)), limit))
    return [records[i] for i in keep]


def prepare(sources: list[Source], out: Path, *, limit: int | None = None, seed: int = 0) -> dict[str, int]:
    """Write the converted rows of ``sources`` to ``out`` (atomically); returns rows per data_source."""
    seen: dict[str, tuple[int, Path, int]] = {}  # id -> (argument, file, line) of its first row
    rows: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for argument, source in enumerate(sources):
        records = read_source(source)
        for line, record in records:
            first = seen.setdefault(record["id"], (argument, source.path, line))
            if first != (argument, source.path, line):
                raise RowError(
                    source.path, line, f"field 'id': the id {record['id']!r} repeats that of {first[1]}:{first[2]}"
                )
        kept = subsample(records, limit, seed)
        rows.extend(record for _, record in kept)
        counts[source.name] = counts.get(source.name, 0) + len(kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_search_data.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sources", nargs="+", metavar="NAME=PATH", help="a FlashRAG JSONL file and its data_source")
    parser.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    parser.add_argument("--limit", type=int, default=None, help="keep at most N >= 1 rows of each file")
    parser.add_argument("--seed", type=int, default=0, help="the seed of --limit's draw (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a bad option
    try:
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"argument --limit: expected a positive integer, got {args.limit}")
        sources = [parse_source(text) for text in args.sources]
        if args.out.is_dir():
            raise UsageError(f"--out {args.out} is a directory")
        if any(args.out.resolve() == s.path.resolve() for s in sources):
            raise UsageError(f"--out {args.out} is one of the inputs")
    except UsageError as error:
        parser.error(str(error))  # exits 2
    try:
        counts = prepare(sources, args.out, limit=args.limit, seed=args.seed)
    except RowError as error:
        print(f"prepare_search_data.py: error: {error}", file=sys.stderr)
        return 1
    total = sum(counts.values())
    per_source = ", ".join(f"{name} {count}" for name, count in counts.items())
    print(f"wrote {total} rows to {args.out} ({per_source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
