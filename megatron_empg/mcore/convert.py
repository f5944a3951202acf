"""Streaming conversion between full model tensors and checkpoints of ``mcore.checkpoint``, one
tensor in memory at a time (never the whole model).

Names are the full model's Megatron parameter names (local spec, global layer indices, TP1/PP1:
``decoder.layers.3.mlp.linear_fc1.weight``; experts one by one, ``decoder.layers.3.mlp.experts.
local_experts.<e>.linear_fc1.weight``, whatever ``model.moe_experts`` trains them: a stacked
``GroupedExperts`` weight is stored as these per-expert entries); a *full tensor* is the TP1 tensor
with the padded vocabulary rows. In one process::

    with megatron_session():                       # a 1-rank gloo group + Megatron's TP1/PP1 state
        shapes = full_tensor_shapes(model_cfg, parallel.padded_vocab_size(model_cfg.vocab_size))
        write_model_checkpoint(out, model_cfg, parallel, full_tensor, dtype=torch.bfloat16, hf_assets=hf_dir)

        reader = ModelCheckpointReader(path)       # model-only or training checkpoints
        for name in reader.names:
            tensor = reader.read(name)             # [*shape] in the stored dtype

``write_model_checkpoint`` writes a model-only checkpoint (no optimizer, scheduler, anchor or RNG;
step 0) that ``mcore.checkpoint.load_checkpoint`` loads at any TP/PP/VPP; ``full_tensor(name)`` is
called about once per name, in an order of the writer's choosing.

How. A GPTModel built at TP1/PP1 on the meta device (no memory) gives Megatron's own
``sharded_state_dict``: the checkpoint keys (the layers stacked along a prepended axis under
layer-free keys, the TE-style norm keys), global shapes and offsets, and the SwiGLU ``linear_fc1``
factory that stores [gate; up] as two chunks. The writer runs ``dist_checkpointing``'s save
preprocessing and its conversion to torch.distributed.checkpoint objects on those meta tensors,
then saves them with torch's ``FileSystemWriter`` (one thread: items are written in order, one at
a time) and a planner whose ``resolve_data`` cuts each chunk from ``full_tensor(name)``: a meta
chunk is a view of its meta parameter, and its size, stride and storage offset cut the same chunk
from the real tensor. Only the current full tensor is cached. The common state and
``metadata.json`` are written as ``dist_checkpointing.save`` writes them. The reader asks
``dist_checkpointing.load`` for one parameter's ShardedTensors at a time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_empg.config import ModelConfig, ParallelConfig
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    TMP_MARK,
    checkpoint_info,
    finish_checkpoint_dir,
    fsync_dir,
    read_checkpoint_info,
    read_model_config,
)
from megatron_empg.mcore.lora.model import is_adapter
from megatron_empg.mcore.model import build_gpt_model
from megatron_empg.mcore.parallel_state import ParallelGroups, destroy_model_parallel, initialize_model_parallel

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

EMBEDDING = "embedding.word_embeddings.weight"  # its rows are the padded vocabulary (name and checkpoint key)


class ConversionError(RuntimeError):
    """An input or output of a conversion is unusable; the message names what is wrong."""


class OutputDirError(ConversionError):
    """The output directory exists and is not empty, or the finished output cannot be moved there."""


# --------------------------------------------------------------------------------------------
# Process set-up and output directories.


@contextlib.contextmanager
def megatron_session() -> Iterator[ParallelGroups]:
    """This process as Megatron's whole TP1/PP1 world for a conversion.

    Creates a 1-rank gloo group (an existing default group must have one rank) and Megatron's
    parallel state; on exit tears down the parallel state and the group if it was created here.
    """
    created = False
    if not dist.is_initialized():
        import torch.distributed.nn  # noqa: F401  before the world: see parallel.link.start_worlds

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        raise ConversionError(
            f"a conversion runs in one process; the default process group has {dist.get_world_size()} ranks"
        )
    try:
        groups = initialize_model_parallel(ParallelConfig())
        try:
            yield groups
        finally:
            destroy_model_parallel()
    finally:
        if created:
            dist.destroy_process_group()


def output_dir_problem(out: str | os.PathLike) -> str | None:
    """Why ``out`` cannot receive a conversion's output (it exists and is not an empty directory),
    or None."""
    out = Path(out)
    if out.is_symlink() or out.exists():
        if not out.is_dir():
            return f"{out} exists and is not a directory"
        if next(out.iterdir(), None) is not None:
            return f"{out} exists and is not empty"
    return None


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A fresh temp directory next to ``out`` (``<out>.tmp-<nonce>``) that replaces ``out`` when the
    block ends without an exception and is removed when it raises, so a crash never leaves a
    half-written ``out``. ``out`` must not exist or be an empty directory (``OutputDirError``)."""
    out = Path(out)
    problem = output_dir_problem(out)
    if problem is not None:
        raise OutputDirError(f"refusing to write the output: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}{TMP_MARK}{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        try:
            os.replace(tmp, out)  # atomic; replaces an empty directory, fails on a non-empty one
        except OSError as e:
            raise OutputDirError(f"cannot move the finished output {tmp} to {out}: {e}") from e
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------------
# The model's tensors.


def meta_gpt_model(model: ModelConfig, padded_vocab_size: int, dtype: torch.dtype) -> GPTModel:
    """A TP1/PP1 ``GPTModel`` (local spec) on the meta device whose vocabulary has
    ``padded_vocab_size`` rows, parameters in ``dtype``. Needs ``megatron_session``."""
    if padded_vocab_size < model.vocab_size:
        raise ConversionError(f"padded_vocab_size={padded_vocab_size} is smaller than vocab_size={model.vocab_size}")
    # TP1 pads to a multiple of make_vocab_size_divisible_by: padded_vocab_size itself. The token
    # dispatcher is not part of the stored layout; allgather's needs no CUDA stream on the meta build.
    parallel = ParallelConfig(make_vocab_size_divisible_by=padded_vocab_size, moe_token_dispatcher_type="allgather")
    # Experts as SequentialMLP: one tensor per expert and projection, named as HF's per-expert
    # tensors map (weight_sync.mapping). Every model.moe_experts stores the same checkpoint entries
    # (mcore.moe.grouped), so this reads and writes the checkpoints of grouped and TE experts too.
    (chunk,) = build_gpt_model(
        model, parallel, params_dtype=dtype, attention_backend="unfused", moe_experts="sequential", meta_device=True
    )
    return chunk


def _parameters(chunk: GPTModel) -> dict[str, torch.Tensor]:
    """The state dict's tensors (``_extra_state`` entries left out)."""
    return {name: t for name, t in chunk.state_dict().items() if torch.is_tensor(t)}


def full_tensor_shapes(model: ModelConfig, padded_vocab_size: int) -> dict[str, torch.Size]:
    """Every full tensor a checkpoint of ``model`` holds, name -> shape, in Megatron's order (a
    tied output layer is the embedding: not listed). Needs ``megatron_session``."""
    chunk = meta_gpt_model(model, padded_vocab_size, torch.float32)
    return {name: t.shape for name, t in _parameters(chunk).items()}


# --------------------------------------------------------------------------------------------
# Writing.


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One stored chunk of the full tensor ``name``: Megatron's ShardedTensor for it (on meta
    data; checkpoint key, global shape and offset) and where it lies in the full tensor: the view
    (size, stride, storage offset) of it, reshaped to ``shape`` (with the prepended layer axes)."""

    name: str
    sharded: Any  # megatron.core.dist_checkpointing.mapping.ShardedTensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    shape: tuple[int, ...]

    @property
    def index(self) -> tuple[str, tuple[int, ...]]:
        """(checkpoint key, global offset): what identifies the chunk in the checkpoint."""
        return self.sharded.key, tuple(self.sharded.global_offset)

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """The chunk as a view of ``full`` (contiguous, storage offset 0), shaped ``shape``."""
        return full.as_strided(self.size, self.stride, self.offset).view(self.shape)


def _chunks(chunk: GPTModel) -> dict[str, list[_Chunk]]:
    """name -> the chunks that store the full tensor, from Megatron's sharded state dict of the
    meta model ``chunk`` (factories built), checking that they cover each tensor exactly once."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    params = _parameters(chunk)
    out: dict[str, list[_Chunk]] = {}
    covered = dict.fromkeys(params, 0)  # elements of each tensor in its chunks
    for name, entry in chunk.sharded_state_dict().items():
        if name not in params:  # _extra_state: ShardedObjects
            continue
        built = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
        param = params[name]
        for sharded in built if isinstance(built, list) else [built]:
            if not isinstance(sharded, ShardedTensor):
                raise ConversionError(f"{name}: unexpected sharded entry {type(sharded).__name__}")
            data = sharded.data  # a view of the meta parameter
            out.setdefault(name, []).append(
                _Chunk(
                    name=name,
                    sharded=sharded,
                    size=tuple(data.shape),
                    stride=tuple(data.stride()),
                    offset=data.storage_offset() - param.storage_offset(),
                    shape=(1,) * sharded.prepend_axis_num + tuple(sharded.local_shape),
                )
            )
            covered[name] += data.numel()
    wrong = {name: (n, params[name].numel()) for name, n in covered.items() if n != params[name].numel()}
    if wrong:
        raise ConversionError(f"Megatron's sharded state dict does not cover these tensors exactly once: {wrong}")
    return out


class _FullTensorCache:
    """``full_tensor(name)`` checked against the model's shape and cast to the checkpoint dtype,
    keeping only the latest one (until ``release``); ``progress(name)`` after each new one."""

    def __init__(
        self,
        full_tensor: Callable[[str], torch.Tensor],
        shapes: Mapping[str, torch.Size],
        dtype: torch.dtype,
        progress: Callable[[str], None] | None,
    ) -> None:
        self._full_tensor, self._shapes, self._dtype, self._progress = full_tensor, shapes, dtype, progress
        self._name: str | None = None
        self._tensor: torch.Tensor | None = None
        self.fetched: set[str] = set()
        self.error: BaseException | None = None  # what full_tensor (or the check) raised

    def get(self, name: str) -> torch.Tensor:
        if name != self._name:
            self._name, self._tensor = None, None  # drop the previous tensor before making the next one
            try:
                tensor = self._full_tensor(name)
                if not torch.is_tensor(tensor) or tensor.shape != self._shapes[name]:
                    got = tuple(tensor.shape) if torch.is_tensor(tensor) else type(tensor).__name__
                    raise ConversionError(
                        f"{name}: got a full tensor of shape {got}, the model has {tuple(self._shapes[name])}"
                    )
            except BaseException as e:
                self.error = e
                raise
            tensor = tensor.detach().to(device="cpu", dtype=self._dtype).contiguous()
            if tensor.storage_offset():  # chunks are cut by absolute storage offsets
                tensor = tensor.clone()
            self._name, self._tensor = name, tensor
            if name not in self.fetched:
                self.fetched.add(name)
                if self._progress is not None:
                    self._progress(name)
        return self._tensor

    def release(self) -> None:
        """Drop the cached tensor (all its chunks have been copied)."""
        self._name, self._tensor = None, None


def _streaming_planner(sources: Mapping[tuple[str, tuple[int, ...]], _Chunk], cache: _FullTensorCache):
    """Megatron's save planner, with each tensor chunk made on demand from ``cache``.

    torch's ``FileSystemWriter`` keeps a reference to every tensor it has written (a dict used only
    by its safetensors format), so each chunk is handed out as a copy whose memory is released
    when the next tensor is asked for: by then the writer (serial loader: ``per_thread_copy_ahead=0``)
    has written it. The full tensor is released once its last chunk is copied, before that chunk
    is written (the chunks of a tensor come one after the other; if not, it would be made again).
    """
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    chunks_left = collections.Counter(source.name for source in sources.values())

    class StreamingSavePlanner(MCoreSavePlanner):
        written: torch.Tensor | None = None  # the chunk handed out last

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:  # ShardedObjects: serialized already
                return super().resolve_data(write_item)
            if self.written is not None:
                self.written.untyped_storage().resize_(0)
            source = sources[(write_item.index.fqn, tuple(write_item.index.offset))]
            self.written = source.of(cache.get(source.name)).clone()
            chunks_left[source.name] -= 1
            if chunks_left[source.name] == 0:
                cache.release()
            return self.written

    # as TorchDistSaveShardedStrategy: megatron deduplicates by replica id, the state is flat
    return StreamingSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False)


def write_model_checkpoint(
    out_dir: str | os.PathLike,
    model: ModelConfig,
    parallel: ParallelConfig,
    full_tensor: Callable[[str], torch.Tensor],
    *,
    dtype: torch.dtype,
    hf_assets: str | os.PathLike | None = None,
    provenance: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a model-only checkpoint of ``model`` to ``out_dir`` (atomically), streaming tensors.

    ``full_tensor(name)`` returns the full tensor of a name of ``full_tensor_shapes`` (any dtype;
    stored as ``dtype``). ``parallel`` is the layout the checkpoint is meant for: it is validated
    against ``model`` and sets the padded vocabulary; the checkpoint loads at any layout that pads
    the vocabulary to as many rows (Megatron zero-fills or drops extra padding rows). Also stored:
    ``model_config.yaml``, the HF config/tokenizer files of ``hf_assets`` (``hf/``) and
    ``provenance`` (in ``empg_checkpoint.json``). ``progress(name)`` is called when a tensor has been
    made (e.g. to advance a progress bar). Needs ``megatron_session``; returns ``out_dir``.
    """
    cpu_shims.import_megatron()
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import _CONTENT_METADATA_KEY
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    parallel.validate_for(model)
    padded_vocab_size = parallel.padded_vocab_size(model.vocab_size)
    chunk = meta_gpt_model(model, padded_vocab_size, dtype)
    params = _parameters(chunk)

    # dist_checkpointing.save's steps, on meta tensors
    sources = {c.index: c for chunks in _chunks(chunk).values() for c in chunks}
    state = {
        "model0": chunk.sharded_state_dict(),
        _CONTENT_METADATA_KEY: {"format": FORMAT, "format_version": FORMAT_VERSION},
    }
    sharded, common = save_preprocess(state, validate_access_integrity=True)
    sharded["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=0)
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica=True)
    pyt_state = mcore_to_pyt_state_dict(flat, is_loading=False)
    strategy = TorchDistSaveShardedStrategy()

    layout = {
        "tp": parallel.tensor_model_parallel_size,
        "pp": parallel.pipeline_model_parallel_size,
        "vpp": parallel.virtual_pipeline_model_parallel_size,
        "dp": 1,
        "world_size": parallel.model_parallel_size,
    }
    parts = {
        "model": True,
        "optimizer": None,
        "optimizer_format": None,
        "scheduler": False,
        "anchor": False,
        "rng": False,
        "model_config": True,
        "hf_assets": hf_assets is not None,
    }
    info = checkpoint_info(
        step=0,
        model_name=model.name,
        layout=layout,
        model_chunks=1,
        parts=parts,
        padded_vocab_size=padded_vocab_size,
        dtype=str(dtype).removeprefix("torch."),
        converted_from=dict(provenance or {}),
    )
    shapes = {name: p.shape for name, p in params.items()}
    with atomic_output_dir(out_dir) as tmp:
        cache = _FullTensorCache(full_tensor, shapes, dtype, progress)
        writer = FileSystemWriter(
            tmp, single_file_per_rank=True, sync_files=True, thread_count=1, per_thread_copy_ahead=0
        )
        try:
            dcp_save(pyt_state, storage_writer=writer, planner=_streaming_planner(sources, cache), no_dist=True)
        except BaseException:
            if cache.error is not None:  # torch.distributed.checkpoint wraps it in a CheckpointException
                raise cache.error
            raise
        if cache.fetched != set(params):
            raise ConversionError(f"tensors never written: {sorted(set(params) - cache.fetched)}")
        save_config(CheckpointingConfig(strategy.backend, strategy.version), str(tmp))
        finish_checkpoint_dir(tmp, info, model_config=model, hf_assets=hf_assets)
    return Path(out_dir)


# --------------------------------------------------------------------------------------------
# Reading.


class ModelCheckpointReader:
    """The full tensors of the model in a checkpoint of ``mcore.checkpoint`` (model-only or a
    training checkpoint, whose optimizer, anchor and RNG parts are ignored), one at a time.

    ``model`` defaults to the checkpoint's ``model_config.yaml``. On construction every tensor of
    the model is checked against the checkpoint's metadata (``ConversionError`` naming the
    missing ones and the shape mismatches). Needs ``megatron_session``.
    """

    def __init__(self, path: str | os.PathLike, model: ModelConfig | None = None) -> None:
        cpu_shims.import_megatron()
        from megatron.core import dist_checkpointing

        self.path = Path(path)
        self.info = read_checkpoint_info(self.path)
        self.model = model if model is not None else read_model_config(self.path)
        stored = dist_checkpointing.load_tensors_metadata(str(self.path))  # key -> ShardedTensor without data
        # a LoRA policy's checkpoint holds its adapters only (mcore.lora): those are the tensors read
        self.adapters_only = self.info.get("lora_base") is not None
        if self.adapters_only and self.model.lora is None:
            raise ConversionError(f"checkpoint {self.path} holds LoRA adapters, but its model config has no lora")
        if self.adapters_only:
            self.padded_vocab_size = ParallelConfig().padded_vocab_size(self.model.vocab_size)  # no vocab stored
        elif EMBEDDING not in stored:
            raise ConversionError(f"checkpoint {self.path} has no {EMBEDDING}: not a model checkpoint")
        else:
            self.padded_vocab_size = stored[EMBEDDING].global_shape[0]
        if self.padded_vocab_size < self.model.vocab_size:
            raise ConversionError(
                f"checkpoint {self.path} has {self.padded_vocab_size} vocabulary rows, fewer than the model config's "
                f"vocab_size={self.model.vocab_size} ({self.model.name}): it holds another model"
            )
        dtype = torch.float32 if self.adapters_only else stored[EMBEDDING].dtype
        chunk = meta_gpt_model(self.model, self.padded_vocab_size, dtype)
        wanted = {name for name in _parameters(chunk) if is_adapter(name) == self.adapters_only}
        self.shapes: dict[str, torch.Size] = {name: p.shape for name, p in _parameters(chunk).items() if name in wanted}
        self.dtypes: dict[str, torch.dtype] = {}
        self._chunks = {name: chunks for name, chunks in _chunks(chunk).items() if name in wanted}
        missing, mismatched = [], []
        for name, chunks in self._chunks.items():
            for sharded in {c.sharded.key: c.sharded for c in chunks}.values():  # fc1: two chunks, one key
                found = stored.get(sharded.key)
                if found is None:
                    missing.append(f"{name} (key {sharded.key})")
                elif tuple(found.global_shape) != tuple(sharded.global_shape):
                    mismatched.append(
                        f"{name}: the checkpoint's {sharded.key} is {tuple(found.global_shape)}, the model config "
                        f"implies {tuple(sharded.global_shape)}"
                    )
                else:
                    self.dtypes[name] = found.dtype
        if missing or mismatched:
            raise ConversionError(
                f"checkpoint {self.path} does not fit its model config ({self.model.name}): "
                + "; ".join(
                    ([f"{len(missing)} tensors missing: {', '.join(missing)}"] if missing else [])
                    + ([f"{len(mismatched)} shapes differ: {', '.join(mismatched)}"] if mismatched else [])
                )
            )

    @property
    def names(self) -> list[str]:
        """The model's tensor names, in Megatron's order."""
        return list(self._chunks)

    def read(self, name: str) -> torch.Tensor:
        """The full tensor ``name``: ``self.shapes[name]`` in its stored dtype ``self.dtypes[name]``.

        Each stored chunk is requested as a plain ShardedTensor (its layer axis as an ordinary
        dimension of size 1) on a view of the result: Megatron's legacy path for prepended axes
        expects every layer of the stack in the request.
        """
        from megatron.core import dist_checkpointing

        if name not in self._chunks:
            raise KeyError(f"{name} is not a tensor of the model {self.model.name}; known: {self.names}")
        dtype = self.dtypes[name]
        full = torch.empty(self.shapes[name], dtype=dtype)
        request = [
            dataclasses.replace(c.sharded, data=c.of(full), dtype=dtype, local_shape=c.shape, prepend_axis_num=0)
            for c in self._chunks[name]
        ]
        dist_checkpointing.load({name: request}, str(self.path), validate_access_integrity=False)
        return full
