"""The RPG recipes' data (``recipes/qwen3_4b_dapo_math_*.yaml``): DAPO-Math-17k deduplicated and
without its Chinese prompts, and the validation sets, as parquet files of one schema::

    {"problem": "...", "answer": "...", "data_source": "dapo_math_17k" | NAME}

    python tools/prepare_dapo_math.py --out /data/dapo_math \\
        --train DAPO-Math-17k/data/dapo-math-17k.parquet \\
        aime24=aime_2024/train.parquet aime25=aime_2025/train.parquet amc23=amc23/test-00000-of-00001.parquet:question

``--train`` is ``BytedTsinghua-SIA/DAPO-Math-17k``'s parquet: each row's ``prompt`` is one user
message, DAPO's instruction around the problem (``DAPO_PREFIX`` + problem + ``DAPO_SUFFIX``), and
``reward_model.ground_truth`` its answer. The problem is cut out of the instruction (a row whose
message is not of that form is an error naming it); the released file repeats every problem about
100 times, so rows are kept once per problem text (the first), and problems with CJK characters are
dropped (the English subset the RPG paper trains on; ~14k problems; the paper reports 13.9k). The
recipes put the instruction back with ``data.prompt_template``, so training and validation prompts
are formatted alike. Written to ``OUT/dapo_math_17k_en.parquet``.

Each ``NAME=PATH[:PROBLEM_KEY[:ANSWER_KEY]]`` (keys default to ``problem`` and ``answer``) is a
validation set, parquet or JSONL, written to ``OUT/NAME.parquet``; its answers become strings
(AIME's are integers in some copies). Files are written to a temporary name and renamed.

Exit codes: 0 written; 1 a malformed file or row (named); 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
TRAIN_NAME = "dapo_math_17k_en"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


class DataProblem(Exception):
    """A malformed input file or row (exit code 1)."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DataProblem(f"{path}: line {number}: not JSON ({error})") from None
        return rows
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def write_rows(rows: list[dict[str, str]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    temporary = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), temporary)
    os.replace(temporary, path)


def dapo_problem(row: dict[str, Any], where: str) -> tuple[str, str]:
    """(problem, answer) of one DAPO-Math-17k row."""
    messages, reward = row.get("prompt"), row.get("reward_model")
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict):
        raise DataProblem(f"{where}: prompt: expected one chat message, got {str(messages)[:80]!r}")
    content = messages[0].get("content")
    if not isinstance(content, str) or not content.startswith(DAPO_PREFIX) or not content.endswith(DAPO_SUFFIX):
        raise DataProblem(f"{where}: prompt: not DAPO's instruction around a problem: {str(content)[:80]!r}")
    answer = reward.get("ground_truth") if isinstance(reward, dict) else None
    if not isinstance(answer, (str, int)) or str(answer).strip() == "":
        raise DataProblem(f"{where}: reward_model.ground_truth: expected an answer, got {answer!r}")
    return content[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)].strip(), str(answer).strip()


def train_rows(path: Path) -> tuple[list[dict[str, str]], dict[str, int]]:
    """The English problems of DAPO-Math-17k, once each; counts of what was read and dropped."""
    rows, seen, chinese = [], set(), 0
    records = read_rows(path)
    for number, record in enumerate(records, start=1):
        problem, answer = dapo_problem(record, f"{path}: row {number}")
        if problem in seen:
            continue
        seen.add(problem)
        if CJK.search(problem):
            chinese += 1
            continue
        rows.append({"problem": problem, "answer": answer, "data_source": TRAIN_NAME})
    return rows, {"rows": len(records), "problems": len(seen), "chinese": chinese, "kept": len(rows)}


def validation_rows(name: str, path: Path, problem_key: str, answer_key: str) -> list[dict[str, str]]:
    rows = []
    for number, record in enumerate(read_rows(path), start=1):
        problem, answer = record.get(problem_key), record.get(answer_key)
        if not isinstance(problem, str) or not problem.strip():
            raise DataProblem(f"{path}: row {number}: {problem_key}: expected the problem's text, got {problem!r}")
        if not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise DataProblem(f"{path}: row {number}: {answer_key}: expected an answer, got {answer!r}")
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        rows.append({"problem": problem.strip(), "answer": str(answer).strip(), "data_source": name})
    return rows


def parse_validation(spec: str) -> tuple[str, Path, str, str]:
    name, sep, rest = spec.partition("=")
    if not sep or not NAME_PATTERN.fullmatch(name) or not rest:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=PATH[:PROBLEM_KEY[:ANSWER_KEY]]")
    path, *keys = rest.split(":")
    if len(keys) > 2:
        raise argparse.ArgumentTypeError(f"{spec!r}: at most two keys after the path")
    keys += ["problem", "answer"][len(keys) :]
    return name, Path(path), keys[0], keys[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the parquet files")
    parser.add_argument("--train", type=Path, help="DAPO-Math-17k's parquet (BytedTsinghua-SIA/DAPO-Math-17k)")
    parser.add_argument("validation", nargs="*", type=parse_validation, metavar="NAME=PATH[:PROBLEM_KEY[:ANSWER_KEY]]")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if args.train is None and not args.validation:
        parser.print_usage(sys.stderr)
        print("prepare_dapo_math: nothing to do: give --train and/or validation sets", file=sys.stderr)
        return 2
    for path in [args.train, *(v[1] for v in args.validation)]:
        if path is not None and not path.is_file():
            print(f"prepare_dapo_math: no such file: {path}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.train is not None:
            rows, counts = train_rows(args.train)
            write_rows(rows, args.out / f"{TRAIN_NAME}.parquet")
            print(
                f"{args.out / TRAIN_NAME}.parquet: {counts['kept']} problems ({counts['rows']} rows, "
                f"{counts['problems']} distinct problems, {counts['chinese']} Chinese dropped)"
            )
        for name, path, problem_key, answer_key in args.validation:
            rows = validation_rows(name, path, problem_key, answer_key)
            write_rows(rows, args.out / f"{name}.parquet")
            print(f"{args.out / name}.parquet: {len(rows)} problems")
    except DataProblem as problem:
        print(f"prepare_dapo_math: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
