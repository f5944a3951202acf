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
    repeats x   plain write: one file of the checkpoint's byte count, written in pieces of the
                streaming writer's size (8 MiB) from one buffer of random bytes, one fsync at the
                end; then a save like save #0. Each checkpoint is removed (untimed) before the
                next plain write; every file is fsynced, so each measurement starts with no dirty
                pages of the previous one, and after a pause (``--settle``): without it, the plain
                writes right after the faster saves ran ~2x slower than those after the slower
                ones on this VM (its virtual disk drains writes behind the guest's fsync).

The plain write is the fastest measured on this VM: 16 MiB pieces, or pieces taken from a 256 MiB
buffer (memory, not cache, like a checkpoint's tensors), ran up to 2x slower (the first baseline,
commit 8f2cc8e's ``checkpoint_save_cpu_before.json``, used 16 MiB pieces and no pauses).

``ratio_to_plain_write`` = median save / median plain write (the issue's target: <= 2);
with ``--async-save`` also saves in the background (``measure_async``): ``checkpoint_blocking_s`` and
``checkpoint_persist_s`` (medians after the first save, which allocates the host buffers),
``step_slowdown_while_persisting`` (the stand-in step: the one RL step above, repeated, while the thread
writes, against 20 steps with no write; a short step, so the write's CPU use weighs more than in a
real step).
``ratio_pairs_median``: the median of each save over the plain write just before it.

Breakdown: every save runs with timers around the functions it goes through (``_probes``; those a
version of the code lacks are skipped: the before run of checkpoint_save_cpu.json was made on the
code before the streaming writer, with this script as it was then). The times are exclusive (a probe's time minus the probes
nested in it), so the phases and ``other`` sum to the save's time:

    state.model / optimizer / anchor_gather / anchor / rng   building the sharded state dict
    dist.preprocess     dist_checkpointing's factories and sharding validation
    dist.plan           torch DCP planning (local/global plans, metadata exchange)
    dist.stage_views    CPU tensors that are views (every parameter: a view of its DDP buffer):
                        cloned by Megatron's writer; given a storage of their own bytes by ours
    dist.d2h            Megatron's writer: every tensor to the host before writing (CUDA only)
    serialise           torch.save per tensor, less its file writes (zip framing, torch's CRC32s)
    file_write          write() calls on the files (page cache; blocks under dirty throttling),
                        with the streaming writer's waits for its CRC32 thread
    crc32               zlib.crc32 in the main thread: the manifest's CRC32s read back (before)
    fsync               every fsync (shards, metadata, manifest, directories)
    dist.finalize       write results gathered, ``.metadata`` written
    checksums           reading the files back for their CRC32s, less the CRC32 itself
    commit              completion marker, rename, ``latest`` (less its fsyncs)
    other               the rest of ``save_checkpoint`` and ``dist_checkpointing.save`` (on CUDA
                        with the streaming writer: the waits for the overlapped D2H copies)

``background.crc32``: the streaming writer's CRC32 thread, beside the writes (not in the sum).

``--recipes``: per GPU recipe (``recipes/``, at the world size of its comments: one node of 8 GPUs),
the bytes a save writes in total and per rank (``mcore.checkpoint.size.checkpoint_bytes``) and the
predicted save time at two rates: the one GPU run's (61 s for the 1.5B benchmark checkpoint with
Megatron's writer, ``benchmarks/results/train_step_gpu_d63de0f.json``) and a measured save of this script
(``--after-result``: the GPU result once there is one, else the CPU one), to
``benchmarks/results/checkpoint_recipes.json``.
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
import threading
import time
import zlib
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import commit, plain_write  # noqa: E402

from megatron_empg.config import load_model_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEFAULT_MODEL = "qwen2.5-1.5b"
DEFAULT_OVERRIDES = "num_layers=3 vocab_size=32768 bos_token_id=1 eos_token_id=2"


# --------------------------------------------------------------------------------------------
# Exclusive timers around named functions.


class Profile:
    """Wall time of named regions in the main thread, exclusive of the regions nested in them; a
    region entered in another thread (the streaming writer's CRC32 and copy threads) is timed whole
    in ``background`` (its waits show in the main thread's region that waits)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.background: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, start, time of nested regions]
        self._undo: list = []

    def region(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.background[name] += time.perf_counter() - start
            frame = [name, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[1]
                self.seconds[name] += elapsed - frame[2]
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
        """The exclusive main-thread times since the last ``take``, and ``background.<name>``."""
        out = {**self.seconds, **{f"background.{name}": t for name, t in self.background.items()}}
        self.seconds.clear()
        self.background.clear()
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

    from megatron_empg.mcore.checkpoint import save as checkpoint
    from megatron_empg.mcore.checkpoint import stream as checkpoint_stream

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
        (checkpoint_stream, "_own_storage", "dist.stage_views"),
        (filesystem_async.FileSystemWriterAsync, "preload_tensors", "dist.d2h"),
        (state_dict_saver, "save_state_dict_async_finalize", "dist.finalize"),
        (torch, "save", "serialise"),
        (zlib, "crc32", "crc32"),
        (os, "fsync", "fsync"),
        (checkpoint, "measure_on_all_ranks", "checksums"),
        (checkpoint, "_commit", "commit"),
    ]
    for owner, attr, name in probes:
        if owner is not None:  # profile.wrap skips the functions a version lacks
            profile.wrap(owner, attr, name)


# --------------------------------------------------------------------------------------------
# The policy, its optimizer and anchor after one RL step.


def build_and_step(model_cfg, dtype: torch.dtype):
    """Policy + DDP + Adam + scheduler + EMA anchor as ``benchmarks/train_step.py`` builds them, after
    one RL step (k3 KL, 2 sequences of 32 tokens) so that Adam has its state."""
    from train_step import Case, _micro_batches, _samples

    from megatron_empg.config import LossConfig, OptimizerConfig, ParallelConfig
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import initialize_model_parallel
    from megatron_empg.mcore.step import StatsRequest, forward_stats, train_step
    from megatron_empg.trainer.bind.build import bind_loss

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
    case = Case(tokens=32)  # two packed rows of one 32-token sequence each
    samples, advantages = _samples(vocab, case, 2 * case.tokens, "full", seed=0)
    mbs = _micro_batches(samples, advantages, case, device)
    for mb, stats in zip(mbs, forward_stats(ddp, mbs, StatsRequest(vocab_size=vocab, k=0), groups), strict=True):
        mb.old_logprobs = stats.logprobs
    request = StatsRequest(vocab_size=vocab, with_entropy=False)
    for mb, stats in zip(mbs, forward_stats(anchor.models, mbs, request, groups), strict=True):
        mb.anchor_logprobs = stats.logprobs

    def step() -> None:
        train_step(ddp, optimizer, scheduler, mbs, loss, groups=groups)
        anchor.update()

    step()
    return groups, ddp, optimizer, scheduler, anchor, step


# --------------------------------------------------------------------------------------------
# Measurements.


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed_save(root: Path, step: int, build, profile: Profile) -> tuple[float, dict[str, float], int]:
    """One ``save_checkpoint`` into ``root``: seconds, the exclusive breakdown, bytes on disk."""
    from megatron_empg.mcore.checkpoint import CheckpointParts, TrainState, checkpoint_bytes
    from megatron_empg.mcore.checkpoint.save import save_checkpoint  # where _probes times it

    groups, ddp, optimizer, scheduler, anchor, _ = build
    parts = CheckpointParts(ddp, optimizer=optimizer, scheduler=scheduler, anchor=anchor)
    _sync()
    start = time.perf_counter()
    path = save_checkpoint(root, TrainState(step), parts, groups)
    _sync()
    elapsed = time.perf_counter() - start
    return elapsed, profile.take(), checkpoint_bytes(path)


def _timed_step(step) -> float:
    _sync()
    start = time.perf_counter()
    step()
    _sync()
    return time.perf_counter() - start


def measure_async(build, work: Path, repeats: int, quiet_steps: int = 20) -> dict:
    """Saves in the background (``checkpoint.async_save``): per save the seconds training waits
    (``start_save`` with reused host buffers: the plan and the copy), the writing's own seconds and
    the steps run while it writes; against ``quiet_steps`` steps with no write, the step's slowdown."""
    from megatron_empg.mcore.checkpoint import CheckpointParts, HostStaging, TrainState, finish_save, start_save

    groups, ddp, optimizer, scheduler, anchor, step = build
    parts = CheckpointParts(ddp, optimizer=optimizer, scheduler=scheduler, anchor=anchor)
    quiet = [_timed_step(step) for _ in range(quiet_steps)]
    staging, saves = HostStaging(), []
    for i in range(repeats + 1):  # the first allocates the host buffers: reported apart
        _sync()
        pending = start_save(work / f"async_{i}", TrainState(i), parts, groups, staging=staging)
        during = []
        while not pending.written_here():
            during.append(_timed_step(step))
        start = time.perf_counter()
        finish_save(pending)
        saves.append(
            {
                "blocking_s": pending.blocking_s,
                "persist_s": pending.persist_s,
                "commit_s": time.perf_counter() - start,
                "steps_during": len(during),
                "step_s_during_median": statistics.median(during) if during else None,
                "staged_bytes": staging.bytes,
            }
        )
        shutil.rmtree(work / f"async_{i}")
    steady = saves[1:] or saves
    during = [s["step_s_during_median"] for s in steady if s["step_s_during_median"] is not None]
    quiet_s = statistics.median(quiet)
    return {
        "async_saves": saves,
        "checkpoint_blocking_s": statistics.median(s["blocking_s"] for s in steady),
        "checkpoint_persist_s": statistics.median(s["persist_s"] for s in steady),
        "first_blocking_s": saves[0]["blocking_s"],
        "step_s_quiet_median": quiet_s,
        "step_s_during_write_median": statistics.median(during) if during else None,
        "step_slowdown_while_persisting": statistics.median(during) / quiet_s - 1 if during else None,
    }


def _median_breakdown(breakdowns: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for b in breakdowns for name in b})
    return {name: statistics.median(b.get(name, 0.0) for b in breakdowns) for name in names}


def measure(args) -> dict:
    from megatron_empg.mcore.checkpoint.writer import start_checkpoint_writer

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
    saves, plains, breakdowns, loadavg = [], [], [], []
    try:
        first_s, first_breakdown, nbytes = timed_save(work / "save_0", 0, build, profile)
        shutil.rmtree(work / "save_0")
        for i in range(1, args.repeats + 1):
            loadavg.append(os.getloadavg()[0])
            time.sleep(args.settle)
            plains.append(plain_write(work / "plain.bin", nbytes))
            time.sleep(args.settle)
            seconds, breakdown, size = timed_save(work / f"save_{i}", i, build, profile)
            if abs(size - nbytes) > 4096:  # the step number and date in the JSON files differ
                raise RuntimeError(f"save {i} wrote {size} bytes, save 0 wrote {nbytes}")
            saves.append(seconds)
            breakdowns.append(breakdown)
            shutil.rmtree(work / f"save_{i}")
            print(f"repeat {i}: plain write {plains[-1]:.2f} s, save {seconds:.2f} s", flush=True)
        background = measure_async(build, work, args.repeats) if args.async_save else {}
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
        "checkpoint_gb": nbytes / 1e9,
        "plain_write_seconds": plains,
        "save_seconds": saves,
        "first_save_seconds": first_s,
        "first_save_breakdown_seconds": first_breakdown,
        "plain_write_seconds_median": plain_s,
        "save_seconds_median": save_s,
        "plain_write_gb_per_s": nbytes / plain_s / 1e9,
        "save_gb_per_s": nbytes / save_s / 1e9,
        "ratio_to_plain_write": save_s / plain_s,
        # each save over the plain write just before it: steadier on a shared disk whose speed drifts
        "ratio_pairs": [save / plain for save, plain in zip(saves, plains)],
        "ratio_pairs_median": statistics.median(save / plain for save, plain in zip(saves, plains)),
        "loadavg_1min_per_repeat": loadavg,
        "breakdown_seconds_median": _median_breakdown(breakdowns),
        "breakdown_seconds_all": breakdowns,
        "max_rss_bytes": {"after_build": rss_built, "after_saves": _max_rss()},
        **background,
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
    return {
        "path": str(path),
        "device": best[0],
        "mount": best[1],
        "type": best[2],
        "total_bytes": usage.total,
        "free_bytes": usage.free,
        "vm": vm,
    }


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


# --------------------------------------------------------------------------------------------
# The GPU recipes' checkpoints.

GPU_RECIPES = ("r1_distill_qwen_1.5b_math_ema_pg*.yaml", "qwen3_4b_*.yaml", "qwen2.5_3b_search_ema_pg.yaml")
RECIPE_WORLD_SIZE = 8  # "One node of 8 GPUs" in every GPU recipe's comments
GRACE_SECONDS = (120, 300)
SEVEN_B = ("model=qwen2.5-7b",)  # the issue's --signal=USR1@120; launchers/slurm/train.sbatch's B:USR1@300


def gpu_rate() -> dict:
    """Bytes per second of the one GPU save (``train_step_gpu.json``: Megatron's writer, one
    process): its checkpoint's bytes by ``checkpoint_bytes`` over its measured seconds."""
    from megatron_empg.config import OptimizerConfig, ParallelConfig
    from megatron_empg.mcore.checkpoint.size import checkpoint_bytes

    run = json.loads((REPO / "benchmarks/results/train_step_gpu_d63de0f.json").read_text())
    seconds = run["variants"][0]["stage_seconds_median"]["checkpoint"]
    model = load_model_config(run["params"]["model"])
    # train_step.py: TP = PP = DP = 1, OptimizerConfig() (not distributed), the anchor, bf16 params
    nbytes = checkpoint_bytes(
        model, ParallelConfig(), OptimizerConfig(), anchor=True, params_dtype="bfloat16", world_size=1
    ).total
    return {
        "source": "benchmarks/results/train_step_gpu_d63de0f.json",
        "device": run["machine"]["device"],
        "writer": "Megatron's FileSystemWriterAsync (before mcore.checkpoint.stream)",
        "model": model.name,
        "bytes": nbytes,
        "seconds": seconds,
        "bytes_per_second": nbytes / seconds,
    }


def recipe_rows(rates: dict[str, float]) -> list[dict]:
    """Per GPU recipe at its world size: checkpoint bytes (total, per rank) and the predicted save
    seconds at each rate of ``rates`` (bytes/s), for one writer (the total) and for the fully
    parallel save (the most loaded rank, if the storage gives every writer that rate)."""
    from megatron_empg.config import RunConfig, load_config, read_yaml
    from megatron_empg.mcore.checkpoint.size import checkpoint_bytes
    from megatron_empg.trainer.bind.build import bind

    rows = []
    paths = sorted({path for pattern in GPU_RECIPES for path in (REPO / "recipes").glob(pattern)})
    # The 7B: no recipe yet; the 1.5B EMA-PG recipe with the model swapped (TP1, DP8).
    extra = [(REPO / "recipes" / "r1_distill_qwen_1.5b_math_ema_pg.yaml", SEVEN_B)]
    for path, overrides in [(path, ()) for path in paths] + extra:
        config = load_config(RunConfig, read_yaml(path), overrides)
        components = bind(config, RECIPE_WORLD_SIZE, check_paths=False)
        layout = components.layout
        size = checkpoint_bytes(
            components.model,
            config.parallel,
            config.optimizer,
            anchor=components.stats.anchor,
            params_dtype=config.train.params_dtype,
            world_size=layout.training_ranks,
            optimizer_format=config.checkpoint.optimizer_format,
        )
        rows.append(
            {
                "recipe": path.name + "".join(f" {o}" for o in overrides),
                "model": components.model.name,
                "parameters": components.model.num_parameters(
                    padded_vocab_size=config.parallel.padded_vocab_size(components.model.vocab_size)
                ),
                "world_size": layout.world_size,
                "training_ranks": layout.training_ranks,
                "tp_pp_dp": [layout.tp, layout.pp, layout.dp],
                "distributed_optimizer": config.optimizer.use_distributed_optimizer,
                "anchor": components.stats.anchor,
                "bytes_total": size.total,
                "bytes_per_rank_max": size.max_per_rank,
                "parts_bytes": dict(size.parts),
                "seconds": {
                    name: {"one_writer": size.total / rate, "fully_parallel": size.max_per_rank / rate}
                    for name, rate in rates.items()
                },
            }
        )
    return rows


def measured_rate(path: Path) -> dict:
    """Bytes per second of the median save of a result of this benchmark (the streaming writer)."""
    run = json.loads(path.read_text())
    disk = run["machine"]["target_filesystem"]
    return {
        "source": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
        "device": f"{run['machine']['device']}, {disk['type']} on {disk['device']}",
        "writer": "mcore.checkpoint.stream",
        "model": run["model"],
        "bytes": run["bytes"],
        "seconds": run["save_seconds_median"],
        "bytes_per_second": run["bytes"] / run["save_seconds_median"],
        "ratio_to_plain_write": run["ratio_to_plain_write"],
    }


def recipes(args) -> None:
    gpu = gpu_rate()
    after = measured_rate(Path(args.after_result))
    rows = recipe_rows({"gpu_before": gpu["bytes_per_second"], "after": after["bytes_per_second"]})
    report = {
        "benchmark": "checkpoint_recipes",
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rates": {"gpu_before": gpu, "after": after},
        "grace_seconds": GRACE_SECONDS,
        "note": "seconds = bytes / rate. one_writer: the total through one writer (Megatron's writer wrote every "
        "replicated tensor from DP rank 0); fully_parallel: the most loaded rank's bytes, if the storage "
        "gives each of the ranks writing at once that rate. gpu_before: the one H100 save, Megatron's "
        "writer; after: the streaming writer where rates.after.device says (a CPU VM's disk until the "
        "GPU rerun). A signalled run also finishes its current step first.",
        "recipes": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"rates: before {gpu['bytes_per_second'] / 1e9:.2f} GB/s ({gpu['device']}), "
        f"after {after['bytes_per_second'] / 1e9:.2f} GB/s ({after['device']}); seconds: one writer / fully parallel"
    )
    for row in rows:
        before_s, after_s = row["seconds"]["gpu_before"], row["seconds"]["after"]
        print(
            f"{row['recipe']:<48} {row['bytes_total'] / 1e9:6.1f} GB, {row['bytes_per_rank_max'] / 1e9:5.1f} GB/rank: "
            f"before rate {before_s['one_writer']:4.0f} s / {before_s['fully_parallel']:3.0f} s, "
            f"after rate {after_s['one_writer']:4.0f} s / {after_s['fully_parallel']:3.0f} s"
        )
    print(f"wrote {args.out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--model-overrides",
        default=DEFAULT_OVERRIDES,
        help='dotted overrides of the model config, space separated ("": none)',
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the filesystem to measure")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds of pause before each plain write and each save (the disk drains the last one)",
    )
    p.add_argument(
        "--out", default=None, help="default benchmarks/results/checkpoint_save_cpu.json (_gpu.json on a CUDA machine)"
    )
    p.add_argument(
        "--before",
        default=None,
        help="a result of this benchmark before a change: its summary is copied into this one's JSON",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="also measure saves in the background: blocking and persist seconds, the step's slowdown while writing",
    )
    p.add_argument(
        "--recipes",
        action="store_true",
        help="write the GPU recipes' checkpoint bytes and predicted save times instead of measuring",
    )
    p.add_argument(
        "--after-result",
        default=None,
        help="with --recipes: the measured save whose rate the table uses (default: "
        "benchmarks/results/checkpoint_save_gpu.json if present, else _cpu.json)",
    )
    args = p.parse_args(argv)
    if args.recipes:
        args.out = args.out or str(REPO / "benchmarks/results/checkpoint_recipes.json")
        if args.after_result is None:
            gpu_result = REPO / "benchmarks/results/checkpoint_save_gpu.json"
            args.after_result = str(
                gpu_result if gpu_result.exists() else REPO / "benchmarks/results/checkpoint_save_cpu.json"
            )
        recipes(args)
        return
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
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "machine": _machine(Path(args.dir)),
        "params": vars(args),
        **result,
    }
    report["device"] = report["machine"]["device"]
    if args.before:
        before = json.loads(Path(args.before).read_text())
        keys = (
            "date_utc",
            "bytes",
            "save_seconds",
            "plain_write_seconds",
            "save_seconds_median",
            "plain_write_seconds_median",
            "ratio_to_plain_write",
            "first_save_seconds",
            "breakdown_seconds_median",
            "machine",
        )
        report["before"] = {"source": args.before, **{key: before[key] for key in keys}}
        report["before"]["ratio_pairs"] = [s / p for s, p in zip(before["save_seconds"], before["plain_write_seconds"])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{result['bytes'] / 1e9:.2f} GB: save {result['save_seconds_median']:.2f} s "
        f"({result['save_gb_per_s']:.2f} GB/s), plain write {result['plain_write_seconds_median']:.2f} s "
        f"({result['plain_write_gb_per_s']:.2f} GB/s): ratio {result['ratio_to_plain_write']:.2f} "
        f"(pairs: median {result['ratio_pairs_median']:.2f} of {[round(r, 2) for r in result['ratio_pairs']]})"
    )
    for name, seconds in sorted(result["breakdown_seconds_median"].items(), key=lambda item: -item[1]):
        print(f"  {name:<20} {seconds:7.3f} s")
    if args.async_save:
        slowdown = result["step_slowdown_while_persisting"]
        print(
            f"in the background: blocking {result['checkpoint_blocking_s']:.3f} s (first {result['first_blocking_s']:.3f}), "
            f"persist {result['checkpoint_persist_s']:.2f} s, step slowdown while writing "
            f"{'-' if slowdown is None else f'{100 * slowdown:.1f} %'}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
