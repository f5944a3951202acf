"""The repository's documents point only inside it: every relative link of a tracked Markdown file
resolves, every ``*.md`` a tracked file names exists, and no file names a place outside the
repository (a fresh clone has only what is tracked); no file holds a merge conflict marker."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT = re.compile(r"\.(py|md|yaml|yml|sh|toml|cfg|txt)$|(^|/)(Makefile|Dockerfile)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
MD_NAME = re.compile(r"(?<![\w./:-])([\w./-]+\.md)\b")  # "repo:path.md" names another project's file
OUTSIDE = re.compile(r"\.\./shared|shared/research|/work/|\.library/")


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.split() if TEXT.search(name)]


def _resolves(target: str, where: Path) -> bool:
    path = target.split("#", 1)[0]
    return not path or (where.parent / path).exists() or (REPO / path).exists()


def test_every_relative_link_of_a_markdown_file_resolves():
    broken = []
    for doc in (p for p in _tracked() if p.suffix == ".md"):
        for target in LINK.findall(doc.read_text()):
            if not re.match(r"[a-z]+:", target) and not _resolves(target, doc):
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_markdown_file_a_file_names_exists():
    missing = []
    for path in _tracked():
        for name in MD_NAME.findall(path.read_text(errors="replace")):
            if not _resolves(name, path):
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_no_file_names_a_place_outside_the_repository():
    outside = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in _tracked()
        if p.name != "test_docs.py"
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not outside, outside


def test_no_tracked_file_holds_a_merge_conflict_marker():
    marker = re.compile(r"^(<{7} |>{7} )", re.M)
    found = [
        str(path.relative_to(REPO))
        for path in _tracked()
        if path.is_file() and marker.search(path.read_text(errors="replace"))
    ]
    assert not found, found
