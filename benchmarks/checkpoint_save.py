"""Checkpoint save time against a plain sequential write of the same bytes to the same disk, and
where the save's time goes. Writes JSON.

    python benchmarks/checkpoint_save.py                       # CPU: qwen2.5-1.5b cut to 3 layers,
                                                               # vocab 32768 (191M parameters), bf16
    python benchmarks/checkpoint_save.py --model deepseek-r1-distill-qwen-1.5b --model-overrides "" \
        --dir /scratch/ckpt --out benchmarks/results/checkpoint_save_gpu.json   # one GPU
    python benchmarks/checkpoint_save.py --recipes            # the GPU recipes' bytes and save times

One process (gloo on CPU, NCCL on CUDA), TP = PP = DP = 1. The policy, Megatron DDP (fp32 grad
buffers), Adam (fp32 main params for bf16) and the EMA anchor (fp32 master) are built as
``benchmarks/train_step.py`` builds them, and one RL step (old pass, anchor pass, update, EMA update)
gives Adam its state. Megatron's checkpoint writer process is started first, as the trainer does at
start-up. Then, in the target directory ``--dir`` (its filesystem is what is measured):

    save #0     ``save_checkpoint`` (policy, optimizer, scheduler, anchor, RNG; checksums on), the
                first save of the process: reported apart (``first_save_seconds``)
    repeats x   plain write: one file of the checkpoint's byte count, 16 MiB writes from one buffer
                of random bytes, one fsync at the end; then a save like save #0. Each checkpoint is
                removed (untimed) before the next plain write; every file is fsynced, so each
                measurement starts with no dirty pages of the previous one.

``ratio_to_plain_write`` = median save / median plain write (the issue's target: <= 2).

Breakdown: every save runs with timers around the functions it goes through (``_PROBES``; those a
version of the code lacks are skipped). The times are exclusive (a probe's time minus the probes
nested in it), so the phases and ``other`` sum to the save's time:

    state.model / optimizer / anchor_gather / anchor / rng   building the sharded state dict
    dist.preprocess     dist_checkpointing's factories and sharding validation
    dist.plan           torch DCP planning (local/global plans, metadata exchange)
    dist.stage_views    Megatron's writer clones CPU tensors that are views (the DDP param buffer)
    dist.d2h            device-to-host copies (CUDA only)
    serialise           torch.save per tensor, less its file writes (zip framing, torch's CRC32)
    file_write          write() calls on the files (page cache; blocks under dirty throttling)
    crc32_inline        CRC32s computed while writing (after the streaming writer)
    fsync               every fsync (shards, metadata, manifest, directories)
    dist.finalize       write results gathered, ``.metadata`` written
    checksums           the manifest's CRC32 pass reading the files back (before the streaming writer)
    commit              completion marker, rename, ``latest`` (less its fsyncs)
    other               the rest of ``save_checkpoint`` and ``dist_checkpointing.save``

``--recipes``: per GPU recipe (``recipes/``, at the world size of its comments: one node of 8 GPUs),
the bytes a save writes in total and per rank (``mcore.checkpoint_size.checkpoint_bytes``) and the
predicted save time at two rates: the one GPU run's (61 s for the 1.5B benchmark checkpoint,
``benchmarks/results/train_step_gpu.json``) and this machine's measured save rate
(``--cpu-result``), to ``benchmarks/results/checkpoint_recipes.json``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from megatron_empg.config import load_model_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEFAULT_MODEL = "qwen2.5-1.5b"
DEFAULT_OVERRIDES = "num_layers=3 vocab_size=32768 bos_token_id=1 eos_token_id=2"
PLAIN_CHUNK = 16 << 20


# --------------------------------------------------------------------------------------------
# Exclusive timers around named functions.


class Profile:
    """Wall time of named regions, exclusive of the regions nested in them (one thread)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, start, time of nested regions]
        self._undo: list = []

    def region(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            frame = [name, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                self.seconds[name] += elapsed - frame[2]
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][2] += elapsed

        return timed

    def replace(self, owner, attr: str, new) -> None:
        """Set ``owner.attr`` to ``new`` until ``restore``."""
        self._undo.append((owner, attr, inspect.getattr_static(owner, attr) if attr in vars(owner) else None))
        setattr(owner, attr, new)

    def wrap(self, owner, attr: str, name: str) -> bool:
        """Time ``owner.attr`` (a module function, a class's (static) method, an instance's bound
        method) as ``name`` until ``restore``; False if ``owner`` has no ``attr``."""
        try:
            static = inspect.getattr_static(owner, attr)
        except AttributeError:
            return False
        if isinstance(static, staticmethod):
            self.replace(owner, attr, staticmethod(self.region(name, static.__func__)))
        else:
            self.replace(owner, attr, self.region(name, getattr(owner, attr)))
        return True

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._undo.clear()

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        self.calls.clear()
        return out


class _TimedStream:
    """A file object whose ``write`` and ``flush`` are timed as ``file_write``."""

    def __init__(self, raw, profile: Profile) -> None:
        self.raw = raw
        self.write = profile.region("file_write", raw.write)
        self.flush = profile.region("file_write", raw.flush)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _probes(profile: Profile, optimizer, anchor) -> None:
    """Put the breakdown's timers in place (module docstring)."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from torch.distributed.checkpoint import filesystem as dcp_filesystem

    from megatron_empg.mcore import checkpoint

    def timed_stream(original):
        def transform_save_stream(self, write_item, raw_stream):
            return original(self, write_item, _TimedStream(raw_stream, profile))

        return transform_save_stream

    transforms = dcp_filesystem._StorageWriterTransforms
    profile.replace(transforms, "transform_save_stream", timed_stream(transforms.transform_save_stream))
    probes = [
        (checkpoint, "save_checkpoint", "other"),
        (checkpoint, "model_sharded_state", "state.model"),
        (optimizer, "sharded_state_dict", "state.optimizer"),
        (anchor, "full_master_state", "state.anchor_gather"),
        (checkpoint, "anchor_sharded_state", "state.anchor"),
        (checkpoint, "get_rng_state", "state.rng"),
        (checkpoint, "rng_sharded_object", "state.rng"),
        (serialization, "save", "other"),
        (serialization, "save_preprocess", "dist.preprocess"),
        (state_dict_saver, "save_state_dict_async_plan", "dist.plan"),
        (filesystem_async.FileSystemWriterAsync, "prepare_write_data", "dist.stage_views"),
        (filesystem_async.FileSystemWriterAsync, "preload_tensors", "dist.d2h"),
        (state_dict_saver, "save_state_dict_async_finalize", "dist.finalize"),
        (torch, "save", "serialise"),
        (os, "fsync", "fsync"),
        (checkpoint, "measure_on_all_ranks", "checksums"),
        (checkpoint, "_commit", "commit"),
    ]
    for owner, attr, name in probes:
        profile.wrap(owner, attr, name)


# --------------------------------------------------------------------------------------------
# The policy, its optimizer and anchor after one RL step.


def build_and_step(model_cfg, dtype: torch.dtype):
    """Policy + DDP + Adam + scheduler + EMA anchor as ``benchmarks/train_step.py`` builds them, after
    one RL step (k3 KL, 2 sequences of 32 tokens) so that Adam has its state."""
    from train_step import _batch

    from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.build import bind_loss

    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    policy = build_gpt_model(model_cfg, parallel, params_dtype=dtype)
    settings = OptimizerConfig(lr=1e-6, clip_grad=1.0)
    ddp = wrap_with_ddp(policy, settings)
    optimizer = build_optimizer(ddp, settings)
    scheduler = build_scheduler(optimizer, settings)
    anchor = EmaAnchor.from_configs(model_cfg, parallel, ddp, optimizer, tau=0.99, period=1, compute_dtype=dtype)
    vocab = model_cfg.vocab_size
    loss, _ = bind_loss(LossConfig(kl="k3", kl_coef=0.05), vocab_size=vocab, topk=0)
    device = torch.device("cuda") if CUDA else torch.device("cpu")
    mbs = _batch(vocab, 2, 32, 2, device)
    for mb, stats in zip(mbs, forward_stats(ddp, mbs, StatsRequest(vocab_size=vocab, k=0), groups), strict=True):
        mb.old_logprobs = stats["logprobs"]
    request = StatsRequest(vocab_size=vocab, with_entropy=False)
    for mb, stats in zip(mbs, forward_stats(anchor.models, mbs, request, groups), strict=True):
        mb.anchor_logprobs = stats["logprobs"]
    train_step(ddp, optimizer, scheduler, mbs, loss, groups=groups)
    anchor.update()
    return groups, ddp, optimizer, scheduler, anchor


# --------------------------------------------------------------------------------------------
# Measurements.


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def plain_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` in ``PLAIN_CHUNK`` writes from one
    buffer of random bytes, fsync included; the file is removed afterwards (untimed)."""
    view = memoryview(os.urandom(PLAIN_CHUNK))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(view[: min(PLAIN_CHUNK, left)])
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def timed_save(root: Path, step: int, build, profile: Profile) -> tuple[float, dict[str, float], int]:
    """One ``save_checkpoint`` into ``root``: seconds, the exclusive breakdown, bytes on disk."""
    from megatron_empg.mcore.checkpoint import checkpoint_bytes, save_checkpoint

    groups, ddp, optimizer, scheduler, anchor = build
    _sync()
    start = time.perf_counter()
    path = save_checkpoint(
        root, step, models=ddp, optimizer=optimizer, scheduler=scheduler, anchor=anchor, groups=groups,
    )  # fmt: skip
    _sync()
    elapsed = time.perf_counter() - start
    return elapsed, profile.take(), checkpoint_bytes(path)


def _median_breakdown(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for b in breakdowns for name in b})
    return {name: statistics.median(b.get(name, 0.0) for b in breakdowns) for name in names}


def measure(args) -> dict:
    from megatron_empg.mcore.checkpoint_writer import start_checkpoint_writer

    model_cfg = load_model_config(args.model, shlex.split(args.model_overrides))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    start_checkpoint_writer()
    t0 = time.perf_counter()
    build = build_and_step(model_cfg, dtype)
    build_s = time.perf_counter() - t0
    rss_built = _max_rss()
    profile = Profile()
    _probes(profile, build[2], build[4])
    target = Path(args.dir)
    target.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="checkpoint_save_", dir=target))
    saves, plains, breakdowns = [], [], []
    try:
        first_s, first_breakdown, nbytes = timed_save(work / "save_0", 0, build, profile)
        shutil.rmtree(work / "save_0")
        for i in range(1, args.repeats + 1):
            plains.append(plain_write(work / "plain.bin", nbytes))
            seconds, breakdown, size = timed_save(work / f"save_{i}", i, build, profile)
            if abs(size - nbytes) > 4096:  # the step number and date in the JSON files differ
                raise RuntimeError(f"save {i} wrote {size} bytes, save 0 wrote {nbytes}")
            saves.append(seconds)
            breakdowns.append(breakdown)
            shutil.rmtree(work / f"save_{i}")
            print(f"repeat {i}: plain write {plains[-1]:.2f} s, save {seconds:.2f} s", flush=True)
    finally:
        profile.restore()
        shutil.rmtree(work, ignore_errors=True)
    save_s, plain_s = statistics.median(saves), statistics.median(plains)
    return {
        "model": model_cfg.name,
        "model_overrides": args.model_overrides,
        "parameters": model_cfg.num_parameters(),
        "params_dtype": args.dtype,
        "build_and_step_seconds": build_s,
        "bytes": nbytes,
        "plain_write_seconds": plains,
        "save_seconds": saves,
        "first_save_seconds": first_s,
        "first_save_breakdown_seconds": first_breakdown,
        "plain_write_seconds_median": plain_s,
        "save_seconds_median": save_s,
        "plain_write_gb_per_s": nbytes / plain_s / 1e9,
        "save_gb_per_s": nbytes / save_s / 1e9,
        "ratio_to_plain_write": save_s / plain_s,
        "breakdown_seconds_median": _median_breakdown(breakdowns),
        "breakdown_seconds_all": breakdowns,
        "max_rss_bytes": {"after_build": rss_built, "after_saves": _max_rss()},
    }


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _filesystem(path: Path) -> dict:
    """Mount point, device, type and free space of the filesystem holding ``path``."""
    path = path.resolve()
    best = ("", "", "")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best[1]):
                best = (device, mount, fstype)
    usage = shutil.disk_usage(path)
    vm = {}
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            vm[name] = int(Path(f"/proc/sys/vm/{name}").read_text())
        except OSError:
            pass
    return {"path": str(path), "device": best[0], "mount": best[1], "type": best[2], "total_bytes": usage.total,
            "free_bytes": usage.free, "vm": vm}  # fmt: skip


def _machine(target: Path) -> dict:
    from train_step import _machine as train_step_machine

    info = train_step_machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    info["cpu_model"] = cpu
    info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    info["target_filesystem"] = _filesystem(target)
    info["loadavg"] = os.getloadavg()
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--model-overrides", default=DEFAULT_OVERRIDES,
                   help="dotted overrides of the model config, space separated (\"\": none)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the filesystem to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/checkpoint_save_cpu.json (_gpu.json on a CUDA machine)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(REPO / f"benchmarks/results/checkpoint_save_{'gpu' if CUDA else 'cpu'}.json")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
    try:
        result = measure(args)
    finally:
        dist.destroy_process_group()
    report = {
        "benchmark": "checkpoint_save",
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(Path(args.dir)),
        "params": vars(args),
        **result,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{result['bytes'] / 1e9:.2f} GB: save {result['save_seconds_median']:.2f} s "
          f"({result['save_gb_per_s']:.2f} GB/s), plain write {result['plain_write_seconds_median']:.2f} s "
          f"({result['plain_write_gb_per_s']:.2f} GB/s): ratio {result['ratio_to_plain_write']:.2f}")
    for name, seconds in sorted(result["breakdown_seconds_median"].items(), key=lambda item: -item[1]):
        print(f"  {name:<20} {seconds:7.3f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
