"""Saves written in the background (``mcore.checkpoint.async_save``) on two CPU ranks (DP 2, the
distributed optimizer, the fully parallel writer), against the synchronous save of the same state:

- the state is the one at the save's start: training steps taken while the thread writes change
  nothing in it (the loaded model, optimizer and anchor equal the state then and a blocking save
  of it, whose shard files have the same sizes);
- until the commit the previous checkpoint is the newest complete one (``find_verified_checkpoint``,
  what a crash in the middle leaves), then the new one is;
- the host buffers are kept and reused by the next save (the same tensors);
- a write that fails in the thread (the disk full: ``RLIMIT_FSIZE``'s EFBIG on one rank) fails the
  commit on every rank together with the usual error, removes the partial save and keeps the last
  checkpoint;
- a rank killed (SIGKILL) while its thread writes leaves the previous checkpoint the newest complete
  one and a temp directory that the next start removes.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]


def _state(run) -> dict:
    snap = run.snapshot()
    return {"params": {k: v for k, (v, _) in snap["params"].items()}, "optim": snap["optim"]}


def _equal(a: dict, b: dict) -> bool:
    same = a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][k], b["params"][k]) for k in a["params"]
    )
    for x, y in zip(a["optim"], b["optim"], strict=True):
        for i in x:
            same &= all(torch.equal(x[i][k], y[i][k]) if torch.is_tensor(x[i][k]) else x[i][k] == y[i][k] for k in x[i])
    return bool(same)


def _worker(rank: int, world: int, root: str) -> dict:
    from megatron_empg.mcore import checkpoint as ckpt
    from tests.mcore.test_checkpoint import _Run

    out: dict = {}
    run = _Run(1, True)
    try:
        run.step()
        run.save(f"{root}/async2")  # step 1, synchronous: the previous checkpoint
        run.step()
        before = _state(run)  # step 2's state
        master = {k: v.clone() for k, v in run.anchor.full_master_state().items()}
        staging = ckpt.HostStaging()

        def start(where: str):
            return ckpt.start_save(
                f"{root}/{where}",
                ckpt.TrainState(run.cursor, data={"cursor": run.cursor}),
                run.parts(),
                run.groups,
                model=ckpt.ModelMetadata(name=run.model_name),
                staging=staging,
            )

        sync = run.save(f"{root}/sync2")  # the same state, saved the blocking way
        pending = start("async2")
        buffers = [b.data_ptr() for b in staging._buffers]
        out["background"] = pending.in_background
        out["staged_bytes"] = staging.bytes
        run.step()  # training goes on while the thread writes
        run.step()
        out["moved"] = not _equal(before, _state(run))
        found = ckpt.find_verified_checkpoint(f"{root}/async2")
        out["before_commit"] = None if found is None else found.step
        pending.wait()
        path = ckpt.finish_save(pending)
        out["committed"] = path.name
        out["after_commit"] = ckpt.find_verified_checkpoint(f"{root}/async2").step
        out["blocking_s"], out["persist_s"] = pending.blocking_s, pending.persist_s

        # the next save reuses the buffers
        second = start("async3")
        out["buffers_reused"] = [b.data_ptr() for b in staging._buffers] == buffers
        ckpt.finish_save(second)

        # load the background save: step 2's state, not what training did meanwhile
        run.load(path)
        out["loaded_equals_start"] = _equal(before, _state(run))
        loaded_master = run.anchor.full_master_state()
        out["master_equal"] = all(torch.equal(loaded_master[k], master[k]) for k in master)
        out["loaded_cursor"] = run.cursor
        run.load(sync)  # the blocking save of the same state: the same content
        out["sync_equals_async"] = _equal(before, _state(run)) and all(
            torch.equal(run.anchor.full_master_state()[k], loaded_master[k]) for k in master
        )
        out["shard_sizes_equal"] = sorted(p.stat().st_size for p in sync.glob("*.distcp")) == sorted(
            p.stat().st_size for p in path.glob("*.distcp")
        )

        # a write failing in the thread on rank 1 (a full disk: EFBIG past the size limit)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        pending = None
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        try:
            pending = start("async2")  # step 2 again over the committed one
            pending.wait()
        finally:
            if rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        try:
            ckpt.finish_save(pending)
            out["full_error"] = None
        except ckpt.CheckpointError as e:
            out["full_error"] = str(e)
        out["full_listing"] = sorted(os.listdir(f"{root}/async2"))
        out["full_resume"] = ckpt.find_verified_checkpoint(f"{root}/async2").step
        return out
    finally:
        run.close()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("async")), timeout=300)


def test_the_saved_state_is_the_one_at_the_start(results):
    for r in results:
        assert r["background"] and r["staged_bytes"] > 0
        assert r["moved"], "training did not move the state while the thread wrote"
        assert r["loaded_equals_start"] and r["master_equal"] and r["loaded_cursor"] == 2
        assert r["sync_equals_async"] and r["shard_sizes_equal"]  # the blocking save holds the same


def test_the_previous_checkpoint_is_the_newest_until_the_commit(results):
    for r in results:
        assert r["before_commit"] == 1  # what a crash while the thread writes leaves: step 1
        assert r["committed"] == "step_00000002" and r["after_commit"] == 2


def test_the_host_buffers_are_reused(results):
    assert all(r["buffers_reused"] for r in results)


def test_a_write_failing_in_the_thread_fails_the_commit_everywhere(results):
    for r in results:
        assert r["full_error"] is not None and "failed" in r["full_error"], r["full_error"]
        assert "step_00000002" in r["full_error"] and "is kept" in r["full_error"]
        assert not any(".tmp-" in name for name in r["full_listing"]), r["full_listing"]
        assert r["full_resume"] == 2


_KILLED_WHILE_WRITING = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    import torch.distributed as dist
    from tests.dist import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore.checkpoint import stream
    from megatron_empg.mcore.checkpoint.writer import start_checkpoint_writer
    from tests.mcore.test_checkpoint import _Run

    start_checkpoint_writer()  # its process dies with this one
    run = _Run(1, False)
    run.step()
    run.save({root!r})  # step 1: the previous checkpoint
    run.step()
    write = stream._Sink.write
    stream._Sink.write = lambda self, data: (time.sleep(0.05), write(self, data))[1]  # a slow disk
    state = ckpt.TrainState(run.cursor, data={{"cursor": run.cursor}})
    pending = ckpt.start_save({root!r}, state, run.parts(), run.groups, staging=ckpt.HostStaging())
    time.sleep(0.3)
    print("writing" if not pending.written_here() else "written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the rank dies while its thread writes step 2
    """
)


def test_a_kill_while_the_thread_writes_falls_back_to_the_previous_checkpoint(tmp_path):
    from megatron_empg.mcore import checkpoint as ckpt

    root = tmp_path / "ckpt"
    code = _KILLED_WHILE_WRITING.format(repo=str(Path(__file__).resolve().parents[2]), root=str(root))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert done.stdout.strip().endswith("writing"), done.stdout  # killed mid-write, not after
    names = sorted(p.name for p in root.iterdir())
    assert any(n.startswith("step_00000002.tmp-") for n in names) and "step_00000002" not in names, names
    found = ckpt.find_latest_checkpoint(root)
    assert found.step == 1 and ckpt.checkpoint_problem(found.path) is None
    ckpt.remove_leftovers(root)  # what the next empg train does first
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
