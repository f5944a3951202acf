"""``tools.run_processes.processes_with``: what the fault suite and the pre-emption tests count as a
process left by a run."""

from __future__ import annotations

import os
import subprocess

from tools.run_processes import processes_with


def test_a_run_is_found_by_its_marker_or_its_session():
    marker = f"EMPG_TEST_RUN=processes-{os.getpid()}"
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, "EMPG_TEST_RUN": marker.split("=")[1]})
    # what vLLM's worker looks like: an environment without the marker, in the run's session
    unmarked = subprocess.Popen(["env", "-i", "sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"])  # neither: not the run's
    try:
        assert processes_with(marker, settle_s=0) == [marked.pid]
        assert processes_with("", {unmarked.pid}, settle_s=0) == [unmarked.pid]
        assert sorted(processes_with(marker, {unmarked.pid}, settle_s=0)) == sorted([marked.pid, unmarked.pid])
    finally:
        for proc in (marked, unmarked, other):
            proc.kill()
            proc.wait()
    assert processes_with(marker, {unmarked.pid}, settle_s=0) == []  # reaped: gone
