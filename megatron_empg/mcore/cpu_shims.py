"""Stand-ins for the CUDA-only calls megatron-core makes, so it runs on a CPU build of torch over gloo.

For tests and CPU CI only. Each shim is a small function naming the megatron-core call site that
fails without it; ``tests/mcore/test_cpu_shims.py`` shows each of those failures::

    cpu_shims.install_pre_import()    # before the first `import megatron`
    import megatron.core
    torch.distributed.init_process_group("gloo", ...)
    cpu_shims.install_post_import()   # in every rank, after init_process_group

Both entry points do nothing when CUDA is available, may be called again (every shim is
idempotent), and take ``skip``: names of shims to leave out. A shim is applied only if the
installed megatron-core version is in its range. The shims were verified on megatron-core 0.19.2;
with another version a warning is logged once and the shims whose range contains it are applied.
"""

import functools
import importlib.metadata
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Collection
from typing import NamedTuple

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

VERIFIED_VERSION = Version("0.19.2")
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _paged_stash_stub() -> None:
    # 0.19 imports the MoE paged-stash triton kernels on its main import path (distributed ->
    # pipeline_parallel.schedules -> transformer.moe.paged_stash -> moe.ops.paged_stash), so without
    # triton `import megatron.core` raises ModuleNotFoundError. Replace only that kernel module (a
    # fake global `triton` breaks `import torch._inductor`). Does nothing when triton is installed.
    if importlib.util.find_spec("triton") is not None or _PAGED_STASH_OPS in sys.modules:
        return

    class _NeedsTriton:
        def __getitem__(self, grid):  # kernels are launched as kernel[grid](...)
            raise RuntimeError("the MoE paged stash needs CUDA and triton")

    stub = types.ModuleType(_PAGED_STASH_OPS)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _NeedsTriton()
    sys.modules[_PAGED_STASH_OPS] = stub


def _current_device() -> None:
    # ~200 call sites pass device=torch.cuda.current_device(), e.g. RotaryEmbedding.get_emb (every
    # GPT forward) and the TP layers' weights when use_cpu_initialization=False.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _synchronize() -> None:
    # p2p_communication._communicate calls torch.cuda.synchronize() after batch_isend_irecv (the
    # default batch_p2p_comm=True) in every pipeline schedule with PP>1; dist_checkpointing too.
    torch.cuda.synchronize = lambda device=None: None


def _current_stream() -> None:
    # 0.19's DDP bucket group calls torch.cuda.current_stream() in start_grad_sync (reached from
    # finish_grad_sync / finalize_model_grads) to wait for CUDA-graph gradient events.
    null_stream = types.SimpleNamespace(wait_event=lambda event: None, wait_stream=lambda stream: None)
    torch.cuda.current_stream = lambda device=None: null_stream


def _rng_tracker() -> None:
    # CudaRNGStatesTracker.add (model_parallel_cuda_manual_seed) and fork() (entered by every
    # DotProductAttention forward, even with dropout 0) get and set torch.cuda RNG states. Keep the
    # tracked states as CPU generator states instead.
    import megatron.core.tensor_parallel.random as mrandom

    def add(self, name: str, seed: int) -> None:  # the original's checks, then a CPU state
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.CudaRNGStatesTracker.add = add
    # fork() warns "CPU RNG state changed within GPU RNG context" when the CPU generator moved inside
    # it, which on CPU is every attention-dropout draw (dropout > 0).
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


class _NullEvent:
    def synchronize(self) -> None:
        pass


class _NullStream:
    """A CUDA stream's methods that megatron-core calls, doing nothing (CPU work is synchronous)."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _NullEvent:
        return _NullEvent()


def _dtoh_stream() -> None:
    # MoEAlltoAllTokenDispatcher.__init__ creates its class-wide side stream for the device-to-host
    # copies of the token splits with torch.cuda.Stream() when it is still None (RuntimeError on a
    # CPU build); _maybe_dtoh_and_synchronize then waits on it, enters it and records an event.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()


def _alltoall_splits() -> None:
    # The alltoall dispatcher turns its input/output split sizes into numpy arrays with
    # maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA tensors: on CPU the
    # splits stay int64 tensors, which ProcessGroup.all_to_all_single (_AllToAll.forward) rejects
    # with a TypeError. Convert CPU tensors too, as the original does after its copy to the host.
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "cpu_shim", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        moved = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return moved.numpy() if as_numpy and torch.is_tensor(moved) else moved

    maybe_move_tensor_to_cpu.cpu_shim = True
    dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _uneven_split_collectives() -> None:
    # With expert TP > 1 and EP > 1 the alltoall dispatcher all-gathers the tokens over the
    # expert-TP group in splits of unequal size (gather_from_sequence_parallel_region with
    # output_splits_tp; backward, and the combine's reduce_scatter_to_sequence_parallel_region:
    # the reduce-scatter with those input splits). torch.distributed.all_gather and reduce_scatter
    # of tensors of unequal sizes are NCCL-only: gloo's allgather raises "invalid tensor size".
    # Pad to the longest split and gather; reduce-scatter as an all-reduce and a slice.
    import megatron.core.tensor_parallel.mappings as mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "cpu_shim", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]]

    _gather_along_first_dim.cpu_shim = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites the CUDA-only torch calls named in ``rewrites`` (added by the three shims below)."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if "device_kwarg" in self.rewrites and isinstance(device, (str, torch.device)):
            if torch.device(device).type == "cuda":
                kwargs = {**kwargs, "device": torch.device("cpu")}
        if "tensor_cuda" in self.rewrites and func is torch.Tensor.cuda:
            return args[0]
        if "tensor_type" in self.rewrites and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@functools.cache
def _mode() -> _CudaToCpuMode:
    mode = _CudaToCpuMode()
    mode.__enter__()  # stays on for the rest of the process, in the calling thread only
    return mode


def _device_kwarg() -> None:
    # Literal device="cuda": every schedule starts with torch.zeros([], device="cuda")
    # (forward_backward_no_pipelining and the PP ones); also clip_grads and the grad scaler.
    _mode().rewrites.add("device_kwarg")


def _tensor_cuda() -> None:
    # Tensor.cuda(): LanguageModule.setup_embeddings_and_output_layer does weight.data.cuda() for
    # tied embeddings at PP>1; also tensor_parallel.broadcast_data and dist_checkpointing exchanges.
    _mode().rewrites.add("tensor_cuda")


def _tensor_type() -> None:
    # The distributed and the fp16/bf16 optimizers accept only params whose .type() is
    # 'torch.cuda.{Float,Half,BFloat16}Tensor' (TypeError "Wrapped parameters must be one of ...").
    _mode().rewrites.add("tensor_type")


class Shim(NamedTuple):
    apply: Callable[[], None]
    versions: SpecifierSet  # the megatron-core versions it is applied to
    pre_import: bool  # applied by install_pre_import, else by install_post_import


SHIMS: dict[str, Shim] = {
    "paged_stash_stub": Shim(_paged_stash_stub, SpecifierSet(">=0.19,<0.20"), pre_import=True),
    "current_device": Shim(_current_device, SpecifierSet(">=0.16"), pre_import=False),
    "synchronize": Shim(_synchronize, SpecifierSet(">=0.16"), pre_import=False),
    "current_stream": Shim(_current_stream, SpecifierSet(">=0.19,<0.20"), pre_import=False),
    "rng_tracker": Shim(_rng_tracker, SpecifierSet(">=0.16"), pre_import=False),
    "device_kwarg": Shim(_device_kwarg, SpecifierSet(">=0.16"), pre_import=False),
    "tensor_cuda": Shim(_tensor_cuda, SpecifierSet(">=0.16"), pre_import=False),
    "tensor_type": Shim(_tensor_type, SpecifierSet(">=0.16"), pre_import=False),
    "dtoh_stream": Shim(_dtoh_stream, SpecifierSet(">=0.19,<0.20"), pre_import=False),
    "alltoall_splits": Shim(_alltoall_splits, SpecifierSet(">=0.19,<0.20"), pre_import=False),
    "uneven_split_collectives": Shim(_uneven_split_collectives, SpecifierSet(">=0.19,<0.20"), pre_import=False),
}


@functools.cache
def _megatron_version() -> Version | None:
    try:
        version = Version(importlib.metadata.version("megatron-core"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if version != VERIFIED_VERSION:
        logger.warning("CPU shims were verified on megatron-core %s, found %s", VERIFIED_VERSION, version)
    return version


def _install(pre_import: bool, skip: Collection[str]) -> None:
    if unknown := set(skip) - SHIMS.keys():
        raise ValueError(f"unknown shim names: {sorted(unknown)}")
    if torch.cuda.is_available() or (version := _megatron_version()) is None:
        return
    for name, shim in SHIMS.items():
        if shim.pre_import == pre_import and name not in skip:
            if shim.versions.contains(version, prereleases=True):
                shim.apply()


def install_pre_import(skip: Collection[str] = ()) -> None:
    """Apply the shims needed before the first ``import megatron``; imports no megatron itself."""
    _install(pre_import=True, skip=skip)


def import_megatron() -> None:
    """``import megatron.core`` with the pre-import shims applied: the one way this package imports it."""
    install_pre_import()
    import megatron.core  # noqa: F401


def install_post_import(skip: Collection[str] = ()) -> None:
    """Apply the runtime shims; call in every rank after ``torch.distributed.init_process_group``."""
    _install(pre_import=False, skip=skip)
