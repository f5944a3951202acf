"""A one-node Slurm cluster on this machine for the launcher tests: munged, slurmctld and slurmd
started by PID on a config in a temporary directory (nothing under /etc is used), and the job
queries the tests need. Slurm and munge come from Debian's packages (tools/ci_install_slurm.sh)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.dist import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "scancel", "sinfo", "squeue", "srun", "mungekey")
# Job states after which a job does not run again by itself (a requeued job goes back to PENDING).
# Job credentials' lifetime (Slurm's default 120 s, at least 5): also how long a requeued job waits before
# it starts again, until its first run's revoked credential has expired. Starting it sooner (scontrol update
# StartTime=now) races that revocation: slurmd may refuse the launch ("already killed"), failing the job.
# The scheduler's main loop, which starts it, runs every 2 s (SchedulerParameters=sched_interval, 60 s).
CRED_EXPIRE_S = 20
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _find(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def missing_programs() -> list[str]:
    """The Slurm and munge programs this machine lacks."""
    return [name for name in (*DAEMONS, *COMMANDS) if _find(name) is None]


class SlurmCluster:
    """munged, slurmctld and slurmd on one node named after this host, ``cpus`` CPUs (at least 2,
    taken from the config even on a smaller machine: ``SlurmdParameters=config_overrides``)."""

    def __init__(self, cpus: int | None = None) -> None:
        # Not under pytest's 0700 directories: munged wants its socket's directory reachable by all.
        self.root = Path(tempfile.mkdtemp(prefix="empg-slurm-"))
        self.root.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = max(2, cpus or os.cpu_count() or 2)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ daemons

    def start(self, timeout: float = 60) -> None:
        munge_dir = self.root / "munge"
        munge_dir.mkdir(mode=0o755)
        key = self.root / "munge.key.d" / "munge.key"
        key.parent.mkdir(mode=0o700)
        self._run(["mungekey", "--create", f"--keyfile={key}"])
        socket_path = munge_dir / "munge.socket"
        for name in ("state", "spool", "log"):
            (self.root / name).mkdir()
        self.conf.write_text(self._slurm_conf(socket_path))
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--seed-file={key.parent / 'munged.seed'}",
            ],
        )
        self._wait(socket_path.exists, timeout, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self._node_state() == "idle", timeout, f"node {self.node} idle in sinfo")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (SIGTERM, SIGKILL after 30 s), each by its PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                ["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30
            )
            deadline = time.monotonic() + 60
            while self.squeue() and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)

    def _slurm_conf(self, munge_socket: Path) -> str:
        r = self.root
        return f"""\
ClusterName=empgtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={r / "log" / "slurmctld.log"}
SlurmdLogFile={r / "log" / "slurmd.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("w")
        self.procs[name] = subprocess.Popen(
            [_find(command[0]), *command[1:]], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root
        )

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm test cluster: no {what} (exited: {dead}); logs:\n{self.logs()}")
            time.sleep(0.2)

    def _node_state(self) -> str:
        return self._run(["sinfo", "-h", "-N", "-o", "%T"]).stdout.strip()

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*")))

    def _run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [_find(command[0]), *command[1:]], env=self.env, capture_output=True, text=True, timeout=60, **kwargs
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
        return done

    # ------------------------------------------------------------------ jobs

    def scontrol(self, *args: str) -> str:
        return self._run(["scontrol", *args]).stdout

    def squeue(self) -> list[str]:
        return self._run(["squeue", "-h", "-o", "%i"]).stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s Key=Value fields (JobState, Restarts, ExitCode, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.scontrol("show", "job", job_id)))

    def wait_job(self, job_id: str, until, timeout: float, what: str, log: Path | None = None) -> dict[str, str]:
        """Poll the job until ``until(fields)``; an ``AssertionError`` with its state (and ``log``'s
        tail) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: not {what} after {timeout} s\n{self.report(job_id, log)}")
            time.sleep(0.5)

    def report(self, job_id: str, log: Path | None = None) -> str:
        """What a failed job assertion shows: the job's fields, its log's tail and the daemons' logs."""
        tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
        return f"{self.job(job_id)}\n== job log\n{tail}\n{self.logs()}"

    def wait_done(self, job_id: str, timeout: float, log: Path | None = None) -> dict[str, str]:
        return self.wait_job(job_id, lambda f: f["JobState"] in FINAL_STATES, timeout, "done", log)
