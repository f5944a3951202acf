"""Damaged checkpoints and full disks (``mcore.checkpoint`` and ``mcore.checkpoint.files``).

The model, optimizer and RL step are ``test_checkpoint``'s (``_Run``: tiny-qwen2, Adam, EMA anchor).

Spawns::

    world 1  saves steps 1 and 2; copies of that root with the newest checkpoint damaged (a shard
             or .metadata truncated, one byte of a shard flipped, no manifest) are resumed with
             find_verified_checkpoint and loaded; a save under a low-space warning; a save whose
             writes fail (RLIMIT_FSIZE: EFBIG) and one whose commit fails (ENOSPC)
    world 2  TP2: a save and a verify whose files are split between the ranks; the world-1
             checkpoints verified at world 2; a save where only rank 1's writes fail

The pure-filesystem checks (sizes, ``find_latest_checkpoint``, ``remove_leftovers``) run in the
test process on copies of the world-1 checkpoints.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
from pathlib import Path

import pytest

from megatron_empg.mcore import checkpoint as ckpt
from megatron_empg.mcore.checkpoint import files as checkpoint_files
from megatron_empg.mcore.checkpoint import save as ckpt_save
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

SHARD = "__0_0.distcp"  # rank 0's first torch_dist shard file
DAMAGES = ("shard", "metadata", "flip")
FSIZE_LIMIT = 64 << 10  # bytes: below the tiny model's shards, above every small file of a save


# --------------------------------------------------------------------------------------------
# Damage (filesystem only).


def _damage(step_dir: Path, how: str) -> str:
    """Damage one file of ``step_dir``; returns its name."""
    if how == "flip":  # same size, other content: only the CRC32 sees it
        path = step_dir / SHARD
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return SHARD
    name = SHARD if how == "shard" else ".metadata"
    path = step_dir / name
    os.truncate(path, path.stat().st_size // 2)
    return name


def _drop_manifest(step_dir: Path) -> None:
    info_path = step_dir / ckpt.INFO_FILE
    info = json.loads(info_path.read_text())
    del info["files"]
    info_path.write_text(json.dumps(info))


# --------------------------------------------------------------------------------------------
# Worker side.


class _Records(logging.Handler):
    """The checkpoint modules' log records in this process, as (level name, message)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []
        logger = logging.getLogger("megatron_empg.mcore")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))

    def take(self) -> list[tuple[str, str]]:
        out, self.records = self.records, []
        return out


class _Reads:
    """The files whose CRC32 this process computed (``checkpoint_files.file_crc32`` wrapped)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        original = checkpoint_files.file_crc32

        def recording(path):
            self.paths.append(Path(path).name)
            return original(path)

        checkpoint_files.file_crc32 = recording

    def take(self) -> list[str]:
        out, self.paths = sorted(self.paths), []
        return out


def _errors(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _with_file_size_limit(limit: int, fn):
    """``fn()`` with writes past ``limit`` bytes failing (EFBIG: Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _world1(rank: int, world_size: int, root: str) -> dict:
    from tests.mcore.test_checkpoint import _Run

    logs = _Records()
    root = Path(root)
    base = root / "base"
    out: dict = {}
    run = _Run(1, False)
    try:
        for _ in range(2):
            run.step()
            run.save(str(base))
        logs.take()
        out["base_info"] = ckpt.read_checkpoint_info(base / "step_00000002")

        for how in (*DAMAGES, "no_manifest"):
            case = root / how
            shutil.copytree(base, case)
            if how == "no_manifest":
                _drop_manifest(case / "step_00000002")
            else:
                _damage(case / "step_00000002", how)
            found = ckpt.find_verified_checkpoint(case)
            state = run.load(found.path)
            out[how] = {"step": found.step, "reason": found.reason, "loaded": state.step, "logs": logs.take()}

        # a save while the filesystem has less free space than the last checkpoint takes
        low = root / "low"
        shutil.copytree(base, low)
        real = shutil.disk_usage
        shutil.disk_usage = lambda path: real(path)._replace(free=1000)
        try:
            run.save(str(low))  # step 2 again: the free space is not really short
        finally:
            shutil.disk_usage = real
        out["low_space_logs"] = logs.take()

        # a save whose shard writes fail (EFBIG), then one whose commit fails (ENOSPC)
        full = root / "full"
        shutil.copytree(base, full)
        run.step()
        out["full_error"] = _with_file_size_limit(FSIZE_LIMIT, lambda: _errors(run.save, str(full)))
        out["full_listing"] = sorted(os.listdir(full))
        original = ckpt_save.write_atomic  # what the commit calls

        def no_space(path, text):
            if path.name == ckpt.INFO_FILE:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            original(path, text)

        ckpt_save.write_atomic = no_space
        try:
            out["commit_error"] = _errors(run.save, str(full))
        finally:
            ckpt_save.write_atomic = original
        out["commit_listing"] = sorted(os.listdir(full))
        found = ckpt.find_verified_checkpoint(full)
        out["full_resume"] = {"step": found.step, "loaded": run.load(found.path).step}
    finally:
        run.close()
    return out


def _world2(rank: int, world_size: int, root: str) -> dict:
    from tests.mcore.test_checkpoint import _Run

    reads = _Reads()
    root = Path(root)
    tp2 = root / "tp2"
    out: dict = {}
    run = _Run(2, False)
    try:
        run.step()
        run.save(str(tp2))
        out["save_reads"] = reads.take()
        found = ckpt.find_verified_checkpoint(tp2)
        out["verify_step"] = found.step
        out["verify_reads"] = reads.take()
        # the world-1 checkpoints, saved by one rank, verified by two
        for how in ("flip", "shard"):
            found = ckpt.find_verified_checkpoint(root / how)
            out[f"{how}_step"] = found.step
            out[f"{how}_reads"] = reads.take()
        # only rank 1's writes fail: both ranks raise, the partial save is removed
        run.step()
        if rank == 1:
            out["full_error"] = _with_file_size_limit(FSIZE_LIMIT, lambda: _errors(run.save, str(tp2)))
        else:
            out["full_error"] = _errors(run.save, str(tp2))
        out["full_listing"] = sorted(os.listdir(tp2))
    finally:
        run.close()
    return out


# --------------------------------------------------------------------------------------------
# Parent side.


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("integrity")
    out = {"root": root, "world1": run_distributed(_world1, 1, str(root), timeout=240)[0]}
    out["world2"] = run_distributed(_world2, 2, str(root), timeout=240)
    return out


def _warnings(logs) -> str:
    return "\n".join(message for level, message in logs if level == "WARNING")


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_newest_checkpoint_is_named_and_skipped(results, how):
    case = results["world1"][how]
    assert case["step"] == 1 and case["loaded"] == 1
    name = SHARD if how != "metadata" else ".metadata"
    warned = _warnings(case["logs"])
    assert f"step_00000002/{name}" in warned, warned
    assert "resuming from" in warned and "step_00000001" in warned
    if how == "flip":
        info = results["world1"]["base_info"]
        assert f"expected {info['files'][SHARD]['crc32']:08x}" in warned and "crc32" in warned
    else:
        size = results["world1"]["base_info"]["files"][name]["size"]
        assert f"has {size // 2} bytes, expected {size}" in warned


def test_checkpoint_without_manifest_loads_unchecked(results):
    case = results["world1"]["no_manifest"]
    assert case["step"] == 2 and case["loaded"] == 2
    assert any(level == "INFO" and "no file manifest" in message for level, message in case["logs"])
    assert any("resuming from" in message and "files not verified" in message for _, message in case["logs"])
    assert not _warnings(case["logs"])


def test_manifest_lists_every_file_with_size_and_crc32(results):
    directory = Path(results["root"]) / "base" / "step_00000002"
    files = results["world1"]["base_info"]["files"]
    assert files.keys() == checkpoint_files.list_files(directory, exclude=(ckpt.INFO_FILE,)).keys()
    assert {SHARD, ".metadata", "metadata.json"} <= files.keys() and ckpt.INFO_FILE not in files
    for name, entry in files.items():
        assert checkpoint_files.file_crc32(directory / name) == (entry["size"], entry["crc32"]), name


def test_sizes_alone_fall_back_without_collectives(results, tmp_path, caplog):
    """``find_latest_checkpoint`` (no collectives) sees truncated and missing files, not a flipped byte."""
    for how in DAMAGES:
        root = tmp_path / how
        shutil.copytree(Path(results["root"]) / "base", root)
        name = _damage(root / "step_00000002", how)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_empg.mcore"):
            found = ckpt.find_latest_checkpoint(root)
        if how == "flip":
            assert found.step == 2 and not caplog.records
            continue
        assert found.step == 1
        assert f"{root / 'step_00000002' / name} has" in caplog.text and "truncated" in caplog.text
        with pytest.raises(ckpt.CheckpointError, match="damaged"):
            ckpt.read_checkpoint_info(root / "step_00000002")  # load_checkpoint's first check
    root = tmp_path / "missing"
    shutil.copytree(Path(results["root"]) / "base", root)
    (root / "step_00000002" / SHARD).unlink()
    found = ckpt.find_latest_checkpoint(root)
    assert found.step == 1 and f"{SHARD} is missing, expected" in found.reason
    (root / "step_00000001" / SHARD).unlink()  # nothing intact, but latest says one was committed
    with pytest.raises(ckpt.CheckpointError, match="Refusing to start from scratch"):
        ckpt.find_latest_checkpoint(root)


def test_verify_splits_the_files_between_the_ranks(results):
    w2 = results["world2"]
    tp2 = Path(results["root"]) / "tp2" / "step_00000001"
    files = ckpt.read_checkpoint_info(tp2)["files"]
    for phase in ("save_reads", "verify_reads"):
        reads = [w2[rank][phase] for rank in range(2)]
        assert reads[0] and reads[1] and not set(reads[0]) & set(reads[1]), (phase, reads)
    # at save every file but the ones rank 0 writes at commit (model config, HF assets: none here)
    assert sorted(w2[0]["verify_reads"] + w2[1]["verify_reads"]) == sorted(Path(n).name for n in files)
    assert w2[0]["verify_step"] == w2[1]["verify_step"] == 1
    # a checkpoint saved by one rank, verified by two: both ranks skip the damaged one
    assert [w2[rank]["flip_step"] for rank in range(2)] == [1, 1]
    assert [w2[rank]["shard_step"] for rank in range(2)] == [1, 1]
    assert w2[0]["flip_reads"] and w2[1]["flip_reads"]
    assert SHARD in w2[0]["flip_reads"] + w2[1]["flip_reads"]


def test_assign_files_balances_by_size():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    shares = checkpoint_files.assign_files(sizes, 2)
    assert shares == [["a", "d", "e"], ["b", "c"]]  # 110 and 110 bytes
    assert checkpoint_files.assign_files(sizes, 1) == [sorted(sizes)]
    assert checkpoint_files.assign_files({"a": 1}, 3) == [["a"], [], []]


def test_file_crc32_reads_in_chunks(tmp_path, monkeypatch):
    import zlib

    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(checkpoint_files, "CHUNK_BYTES", 4096)  # several reads and a short last one
    assert checkpoint_files.file_crc32(tmp_path / "f") == (len(data), zlib.crc32(data))


def test_low_free_space_warns_before_the_save(results):
    warned = _warnings(results["world1"]["low_space_logs"])
    assert "1000 B free" in warned and "last checkpoint step_00000002" in warned, warned
    assert "likely fail for lack of space" in warned


def test_failed_write_says_why_and_keeps_the_last_checkpoint(results):
    w1 = results["world1"]
    root = Path(results["root"]) / "full"
    error = w1["full_error"]
    assert error is not None and f"saving step_00000003 into {root} failed" in error
    # a SaveError (the trainer exits restartable on it), on one line: the writer's cause, not its traceback
    assert error.startswith("SaveError: ") and "\n" not in error and "File too large" in error, error
    assert "Free on its filesystem:" in error and "after removing the partial save step_00000003.tmp-" in error
    assert "The last checkpoint, step_00000002 (" in error and "is kept" in error
    assert f"writing {root}/step_00000003.tmp-" in error and "CheckpointException" in error, error
    assert w1["full_listing"] == ["latest", "step_00000001", "step_00000002"]  # no temp directory left
    assert "No space left on device" in w1["commit_error"] and "step_00000002" in w1["commit_error"]
    assert w1["commit_listing"] == ["latest", "step_00000001", "step_00000002"]
    assert w1["full_resume"] == {"step": 2, "loaded": 2}


def test_write_failing_on_one_rank_fails_the_save_on_every_rank(results):
    w2 = results["world2"]
    for rank in range(2):
        error = w2[rank]["full_error"]
        assert error is not None and "saving step_00000002" in error and "step_00000001" in error, (rank, error)
        assert w2[rank]["full_listing"] == ["latest", "step_00000001"]
    assert w2[0]["full_error"] == w2[1]["full_error"]


def test_remove_leftovers(tmp_path, caplog):
    root = tmp_path / "ckpts"
    keep = ["latest", "step_00000002", ".empg.lock", "notes.tmp-1234", "step_00000001"]
    gone = ["step_00000003.tmp-1f2e3d4c", "step_00000001.trash-00ab", "latest.tmp-deadbeef"]
    for name in keep + gone:
        if name.startswith("step_"):
            (root / name).mkdir(parents=True)
            (root / name / "x").write_bytes(b"0" * 10)
        else:
            root.mkdir(exist_ok=True)
            (root / name).write_text("x")
    with caplog.at_level(logging.WARNING, logger="megatron_empg.mcore"):
        removed = ckpt.remove_leftovers(root)
    assert sorted(removed) == sorted(gone)
    assert sorted(os.listdir(root)) == sorted(keep)
    assert "step_00000003.tmp-1f2e3d4c (10 B)" in caplog.text
    assert ckpt.remove_leftovers(tmp_path / "nothing") == []
