"""The fault suite's cases for a run that restarts itself (``tools/faults.py`` runs them): each on
the demo recipe with a checkpoint every 3 steps, started by ``launchers/torchrun.sh`` and run to
its end by the launcher's own restart loop, nothing done by hand after the fault.

    engine_core_sigstop  the vLLM engine core (its own process) stopped mid-rollout
    engine_core_kill     the vLLM engine core killed (SIGKILL) mid-rollout
    rank_sigstop         2 ranks: rank 1 stopped (SIGSTOP) in step 5's update (a collective)
    rank_lost            2 ranks: rank 1's process group killed (SIGKILL) in step 5's old pass
    reward_hang          the reward hangs on one incorrect sample of step 5 (scored 0 at its timeout)
    nan_step             step 5's loss is NaN (the step refused on every rank, no restart)

Each reports the time from the fault to its detection (the log line that names it, or the first
line of the restart) and to the first step logged after it. The 2-rank cases compare with a 2-rank
reference run (the transformers engine); the others with the suite's one-process reference.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time
from pathlib import Path

FAULT_STEP = 5  # the step a fault hits: after the checkpoint of step 3, before that of step 6
HF = ("rollout.engine=hf", "rollout.in_process=true", "weight_sync.transport=in_process")
ENGINE_PROCESS = ("rollout.in_process=false", "weight_sync.transport=shm_file")
WATCHED = ("supervisor.heartbeat_interval_s=1", "supervisor.phase_timeout_s.update=20")

# A hook every process of a case imports (sitecustomize on PYTHONPATH), chosen by EMPG_FAULT_HOOK.
HOOK = '''
import os

# a rank's process only (torchrun has no RANK; a rank's engine processes inherit the mark)
hook = os.environ.get("EMPG_FAULT_HOOK") if "RANK" in os.environ and "EMPG_FAULT_HOOKED" not in os.environ else None
if hook is not None:
    os.environ["EMPG_FAULT_HOOKED"] = "1"
if hook == "reward_hang":
    import threading

    from megatron_empg.tasks import registry

    _reward, _calls, _stuck = registry.REWARDS["arithmetic"], [], set()

    def reward(responses, examples):
        """The training reward's 5th call (step 5's batch): its first incorrect response hangs."""
        if len(responses) > 1:
            _calls.append(1)
            if len(_calls) == int(os.environ["EMPG_FAULT_STEP"]) and not _stuck:
                scores = _reward(responses, examples).scores
                _stuck.update(r for r, s in zip(responses, scores) if s == 0 and not _stuck)
        if _stuck & set(responses):
            threading.Event().wait()  # for ever
        return _reward(responses, examples)

    registry.REWARDS["arithmetic"] = reward
elif hook == "nan_step":
    import dataclasses

    import megatron_empg.trainer.loop as loop
    from megatron_empg.core.aggregation import LossSum
    from megatron_empg.parallel.rl_loss import RLLoss

    _update = loop.Trainer.update

    def nan_loss(loss_fn):
        def loss(*args, **kwargs):
            out = loss_fn(*args, **kwargs)
            nan = out.loss.loss_sum * float("nan")
            return RLLoss(LossSum(nan, out.loss.count), {**out.metrics, "loss": LossSum(nan, out.loss.count)})
        return loss

    def update(self, minis):
        if self.step_index + 1 != int(os.environ["EMPG_FAULT_STEP"]):
            return _update(self, minis)
        components = self.components
        self.components = dataclasses.replace(components, loss_fn=nan_loss(components.loss_fn))
        try:
            return _update(self, minis)
        finally:
            self.components = components

    loop.Trainer.update = update
elif hook == "chaos":  # tools/chaos.py: faults from flag files the campaign writes
    import tools.chaos_hook
'''

DETECTED = re.compile(
    r"engine \d+ failed inside|hang: rank|restartable:|restarting after attempt|ran past .* scored 0|"
    r"refused"
)


def _beat(run: Path, rank: int) -> dict:
    try:
        return json.loads((run / "heartbeats" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _at_phase(suite, proc, name: str, rank: int, phase: str, step: int) -> bool:
    run = suite.work / name
    return suite.wait_for(
        proc, lambda: (_beat(run, rank).get("phase"), _beat(run, rank).get("step")) == (phase, step), poll_s=0.01
    )


def _engine_core(suite, name: str) -> int | None:
    """The pid of the case's vLLM engine core: a child of rank 0 (its heartbeat names its pid)
    whose title names it."""
    rank0 = _beat(suite.work / name, 0).get("pid")
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((pid_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == rank0 and b"EngineCore" in (pid_dir / "cmdline").read_bytes():
                return int(pid_dir.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def _log_times(log: Path, since: float) -> float | None:
    """The time of the first log line after ``since`` that names the fault's detection."""
    for line in log.read_text(errors="replace").splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
        if stamp and DETECTED.search(line):
            t = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
            t = t.replace(tzinfo=datetime.UTC).timestamp()
            if t >= since - 1:
                return t
        elif not stamp and DETECTED.search(line) and line.startswith(("restarting after", "not restarting")):
            return None  # (the decider's line has no time stamp: the hang line before it has)
    return None


def _run_with_fault(
    suite,
    name: str,
    extra: tuple[str, ...],
    fault,
    *,
    nproc: int,
    hook: str | None = None,
    reference: str = "reference",
) -> dict:
    """Start the case through the launcher, apply ``fault(proc) -> description`` once, wait for the
    launcher to end; the times and what the run directory says."""
    suite.config(name)
    env = {"EMPG_FAULT_STEP": str(FAULT_STEP)}
    if hook:
        env["EMPG_FAULT_HOOK"] = hook
    proc = suite.start(name, *extra, launcher=True, nproc=nproc, env=env)
    description = fault(proc)
    t_fault = time.time()
    logged_at_fault = suite.logged(name)
    first_after = None
    while proc.poll() is None:
        if first_after is None and suite.logged(name) > logged_at_fault:
            first_after = time.time()
        time.sleep(0.05)
    code = suite.finish(proc)
    if first_after is None and suite.logged(name) > logged_at_fault:
        first_after = time.time()  # (logged in the last poll's interval)
    run = suite.work / name
    detected = _log_times(suite.work / f"{name}.log", t_fault)
    history = (
        [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
        if (run / "restarts.jsonl").exists()
        else []
    )
    return {
        "fault": description,
        "exit_code": code,
        "restarts": [(r["cause"], r["restart"]) for r in history],
        "seconds_to_detection": None if detected is None else round(detected - t_fault, 1),
        "seconds_to_next_step": None if first_after is None else round(first_after - t_fault, 1),
        "hang_dirs": sorted(p.name for p in run.glob("hang-*")),
        "steps_lost": 0,
        "compare_with": reference,
    }


def engine_core(suite, name: str, sig: int) -> dict:
    def fault(proc) -> str:
        _at_phase(suite, proc, name, 0, "rollout", FAULT_STEP)  # the rollout's generate starts at once
        pid = _engine_core(suite, name)
        if pid is None:
            return "no engine core found"
        os.kill(pid, sig)
        return f"{signal.Signals(sig).name} to the engine core (pid {pid}) in step {FAULT_STEP}'s rollout"

    result = _run_with_fault(suite, name, ENGINE_PROCESS, fault, nproc=1)
    result["ignore"] = ["rollout/engine_restarts", "sync/gate_max_logprob_diff"]  # 0 in the reference
    return result


def rank_fault(suite, name: str, how: str) -> dict:
    def fault(proc) -> str:
        phase = "update" if how == "stop" else "old_pass"
        _at_phase(suite, proc, name, 1, phase, FAULT_STEP)
        pid = _beat(suite.work / name, 1)["pid"]
        if how == "stop":
            os.kill(pid, signal.SIGSTOP)
            return f"SIGSTOP to rank 1 (pid {pid}) in step {FAULT_STEP}'s {phase}"
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        return f"SIGKILL to rank 1's process group (pid {pid}) in step {FAULT_STEP}'s {phase}"

    return _run_with_fault(suite, name, (*HF, *WATCHED), fault, nproc=2, reference="reference_2ranks")


def reward_hang(suite, name: str) -> dict:
    def fault(proc) -> str:
        _at_phase(suite, proc, name, 0, "rollout", FAULT_STEP)
        return f"the reward hangs on step {FAULT_STEP}'s first incorrect response (data.reward_timeout_s 5)"

    result = _run_with_fault(suite, name, (), fault, nproc=1, hook="reward_hang")
    step = next((r for r in suite.metrics(name) if r["step"] == FAULT_STEP), {})
    # the timed-out sample's own reward metrics (e.g. reward/malformed) are not counted
    result.update(
        reward_timeouts_at_fault_step=step.get("reward/timeouts"), ignore=["reward/timeouts", "reward/malformed"]
    )
    return result


def nan_step(suite, name: str) -> dict:
    def fault(proc) -> str:
        _at_phase(suite, proc, name, 0, "update", FAULT_STEP)
        return f"step {FAULT_STEP}'s loss NaN"

    result = _run_with_fault(suite, name, (), fault, nproc=1, hook="nan_step")
    records = suite.metrics(name)
    reference = {r["step"]: r for r in suite.reference}
    result["skipped_steps"] = [r.get("train/skipped_steps") for r in records]
    result["steps_before_identical"] = all(
        all(r.get(k) == reference[r["step"]].get(k) for k in r if not k.startswith(suite.timing))
        for r in records
        if r["step"] < FAULT_STEP
    )
    result["after_differs_by_design"] = True  # the refused step's update is not applied: later steps differ
    return result


def cases(suite) -> dict:
    return {
        "engine_core_sigstop": lambda n: engine_core(suite, n, signal.SIGSTOP),
        "engine_core_kill": lambda n: engine_core(suite, n, signal.SIGKILL),
        "rank_sigstop": lambda n: rank_fault(suite, n, "stop"),
        "rank_lost": lambda n: rank_fault(suite, n, "kill"),
        "reward_hang": lambda n: reward_hang(suite, n),
        "nan_step": lambda n: nan_step(suite, n),
    }
