"""Fail loudly if the CPU virtual environment contains a CUDA torch or any nvidia-* package.

Run by `make venv` after installation; exits 1 with the offending packages listed.
"""

from __future__ import annotations

import sys
from importlib import metadata


def main() -> int:
    problems = []
    nvidia = sorted(
        d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].lower().startswith("nvidia")
    )
    if nvidia:
        problems.append(f"nvidia packages installed: {', '.join(nvidia)}")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        problems.append("torch is not installed")
    else:
        if not torch_version.endswith("+cpu"):
            problems.append(f"torch {torch_version} is not a CPU build (expected a '+cpu' version)")
    for name in ("apex",):  # the PyPI `apex` is an unrelated project; NVIDIA apex comes from NGC only
        try:
            metadata.version(name)
            problems.append(f"PyPI package {name!r} is installed; it is unrelated to NVIDIA apex")
        except metadata.PackageNotFoundError:
            pass
    if problems:
        print("check_cpu_venv: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check_cpu_venv: ok (torch {torch_version}, no nvidia packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
