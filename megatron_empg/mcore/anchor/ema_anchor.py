"""The EMA anchor: a second ``GPTModel`` whose weights follow the policy as a float32 EMA.

EMA-PG's KL reference (docs/design/architecture.md "One RL step"; docs/design/ema-pg.md section 7).
After the optimizer step of every step ``t`` with ``schedule.should_update(t)``::

    master  <- tau * master + (1 - tau) * policy_main      (float32, elementwise, no communication)
    weights <- cast(master)                                 (compute dtype; one DP all-gather with
                                                             the distributed optimizer)

``tau = 1`` keeps the initial policy (GRPO's fixed reference); ``tau = 0`` with ``period = 1`` resets
the anchor to the policy after every step (RPG's iterative reference).

Pieces:
    models   the anchor's compute weights: plain ``GPTModel`` chunks built by the caller with the
             policy's config and sharding (same TP/PP/VPP layout, same parameter names), in eval
             mode, ``requires_grad=False``, no DDP, no optimizer, no gradient buffers. They are
             what ``mcore.step.forward_stats`` runs for the anchor pass. The anchor is never
             synced to the rollout engine and costs no weight-sync time.
    master   float32 accumulator. It pairs element for element with the optimizer's float32 main
             parameters (``anchor.layout.main_params``). Without the distributed optimizer every rank holds a full float32 copy of its TP/PP shard of the
             model (as the optimizer does); with it, only this DP rank's ranges, so the update
             reads only local memory. ``master_on_cpu`` keeps it in (pinned) host memory on a GPU
             machine (each update then copies the main params to the host, each refresh copies
             the master back); on a CPU machine it changes nothing.

Distributed optimizer: the refresh's all-gather of the anchor's flat buffers (``anchor.layout``).

Mixture of experts. The anchor's chunks have the policy's expert layout (EP, ETP): each rank's
master and weights cover its local experts, under their local names (``local_experts.<j>``; the
checkpoint's ``sharded_state_dict`` gives them their global index). Without the distributed
optimizer nothing is communicated. With it, Megatron DDP keeps the experts in separate
expert-parallel buffers sharded over the expert-DP group: the anchor mirrors those too, and
gathers (and, emulated FP8, reduces the amaxes) over each buffer's own group, one coalesced
collective per group. Transformer Engine FP8 with experts is refused (its re-quantization takes
one group).

FP8 (``compute_dtype=torch.float8_e4m3fn``): the storage kinds of ``anchor.storage`` (``emulated``,
``torch``: FP8 values with one scale per row, the decoder's linears multiplying in FP8; ``te``:
Transformer Engine FP8 parameters), each re-quantized from the float32 master at every refresh.

Checkpoints: ``full_master_state()`` (keys ``"<chunk>.<parameter name>"``, float32 tensors in the
parameter's local TP/PP shape; one DP all-gather with the distributed optimizer) and
``load_full_master_state``; ``master_shards()`` gives this rank's float32 pieces and their ranges
in the flattened parameters (as the distributed optimizer's own sharded checkpoints use) without
communication. The anchor's parameter names are the policy's, and ``models`` have their own
``sharded_state_dict()`` metadata for dist_checkpointing.

Build the anchor after the optimizer, and again if the optimizer is rebuilt: it keeps references to
the optimizer's main parameters. Loading an optimizer checkpoint in place (``load_state_dict``) is
fine. Non-learned buffers (rotary ``inv_freq``) are not averaged: both models compute them alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.core.checks import check_finite
from megatron_empg.core.ema import EmaSchedule, ScheduledEma, ema_update_
from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core import fp8_utils  # noqa: E402  (after the pre-import shims)

from megatron_empg.mcore.anchor.layout import (  # noqa: E402
    Entry,
    Flat,
    Param,
    gather_flats,
    main_params,
    te_fp8_model_init,
)
from megatron_empg.mcore.anchor.storage import STORAGES, AnchorStorage, RowwiseFp8  # noqa: E402
from megatron_empg.mcore.parallel_state import rng_preserved  # noqa: E402

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from megatron_empg.config import ModelConfig, ParallelConfig

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_KINDS = ("emulated", "torch")  # without TE parameters; ``te`` is chosen by the builder's


class EmaAnchor(ScheduledEma):
    """EMA anchor of a Megatron policy (see the module docstring).

    Args:
        policy_models: the policy's model chunks, wrapped in Megatron DDP (``wrap_with_ddp``).
        optimizer: the policy's ``MegatronOptimizer`` (``get_megatron_optimizer``), built on them.
        build_models: called once (random streams preserved) to build the anchor's chunks: same
            ``TransformerConfig`` settings, layer spec and parallel layout as the policy, parameters
            in ``compute_dtype`` (for the emulated FP8 path: in the dtype the forward should use),
            e.g. ``lambda: build_gpt_model(model_cfg, parallel, params_dtype=torch.bfloat16,
            perform_initialization=False)``. ``from_configs`` does this.
        tau, period, first_update: the ``core.ema.EmaSchedule``.
        compute_dtype: torch.bfloat16, torch.float16, torch.float32 or torch.float8_e4m3fn.
        fp8: with float8_e4m3fn and no Transformer Engine parameters, the storage kind
            (``anchor.storage``): ``emulated`` or ``torch``.
        fp8_output_layer: those kinds: an untied output layer in FP8 too.
        master_on_cpu: keep the float32 master in pinned host memory (GPU machines only).

    At construction the master is a float32 copy of the optimizer's current main parameters and
    the compute weights are its cast: the anchor starts as the current policy.
    """

    def __init__(
        self,
        policy_models: Sequence[torch.nn.Module],
        optimizer,
        build_models: Callable[[], Sequence[torch.nn.Module]],
        *,
        tau: float,
        period: int,
        first_update: int | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        fp8: str = "emulated",
        fp8_output_layer: bool = False,
        master_on_cpu: bool = False,
    ) -> None:
        super().__init__(EmaSchedule(tau=tau, period=period, first_update=first_update))
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        if fp8 not in FP8_KINDS:
            raise ValueError(f"fp8={fp8!r} must be one of {FP8_KINDS}")
        self.compute_dtype = compute_dtype
        policy_models = list(policy_models)
        ddp_configs = {getattr(m, "ddp_config", None) is not None for m in policy_models}
        if ddp_configs != {True}:
            raise TypeError("policy_models must be the policy's chunks wrapped in Megatron DistributedDataParallel")
        with rng_preserved():
            self.models: list[GPTModel] = list(build_models())
        if len(self.models) != len(policy_models):
            raise ValueError(f"build_models made {len(self.models)} chunks; the policy has {len(policy_models)}")
        for model in self.models:
            model.eval()
            model.requires_grad_(False)

        mains, self.sharded = main_params(optimizer)
        use_distopt = {m.ddp_config.use_distributed_optimizer for m in policy_models}
        if use_distopt != {self.sharded}:
            raise ValueError(
                f"the policy's DDP use_distributed_optimizer={use_distopt} does not match the optimizer "
                f"({'distributed' if self.sharded else 'not distributed'})"
            )
        self.storage = self._pick_storage(fp8, fp8_output_layer)
        self.params: list[Param] = []
        self.flats: list[Flat] = []
        self.dp_group = None
        self._build_layout(policy_models, mains)
        self.storage.attach(self)
        self._init_master(mains, master_on_cpu)
        self.refresh()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_configs(
        cls,
        model_cfg: ModelConfig,
        parallel: ParallelConfig,
        policy_models: Sequence[torch.nn.Module],
        optimizer,
        *,
        tau: float,
        period: int,
        first_update: int | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        fp8: str = "emulated",
        fp8_output_layer: bool = False,
        master_on_cpu: bool = False,
        fp8_forward_dtype: torch.dtype | None = None,
        te_fp8: bool = False,
        **build_kwargs: Any,
    ) -> EmaAnchor:
        """Build the anchor's chunks with ``mcore.model.build_gpt_model(model_cfg, parallel, ...)``
        (no random initialization: the refresh writes every weight).

        Parameters in ``compute_dtype``. For ``torch.float8_e4m3fn`` the chunks are built in
        ``fp8_forward_dtype`` (default: the policy's parameter dtype) and stored as ``fp8``
        (``emulated`` or ``torch``); ``te_fp8=True`` instead builds Transformer Engine FP8 parameters
        (``fp8_param``, inside TE's ``fp8_model_init`` with current scaling where TE has it; GPU
        and TE only, a RuntimeError otherwise; NOT TESTED here). ``build_kwargs`` go to
        ``build_gpt_model`` (config overrides: pass the policy's, so that both models compute alike).
        """
        from megatron_empg.mcore.model import TE_MISSING, build_gpt_model

        if compute_dtype == torch.float8_e4m3fn:
            params_dtype = fp8_forward_dtype or policy_models[0].config.params_dtype
        else:
            params_dtype = compute_dtype
        kwargs = {"perform_initialization": False, **build_kwargs}
        init_context = contextlib.nullcontext
        if te_fp8:
            if compute_dtype != torch.float8_e4m3fn:
                raise ValueError("te_fp8=True needs compute_dtype=torch.float8_e4m3fn")
            init_context = te_fp8_model_init(TE_MISSING)
            kwargs = {"attention_backend": "te", "fp8": "e4m3", "fp8_param": True, "fp8_recipe": "tensorwise", **kwargs}

        def build():
            with init_context():
                return build_gpt_model(model_cfg, parallel, params_dtype=params_dtype, **kwargs)

        return cls(
            policy_models,
            optimizer,
            build,
            tau=tau,
            period=period,
            first_update=first_update,
            compute_dtype=compute_dtype,
            fp8=fp8,
            fp8_output_layer=fp8_output_layer,
            master_on_cpu=master_on_cpu,
        )

    def _build_layout(self, policy_models: list, mains: dict) -> None:
        """Pair anchor and policy parameters by name; with the distributed optimizer, give the
        anchor a flat buffer per policy DDP buffer and make its parameters views into it."""
        for c, (ddp, anchor) in enumerate(zip(policy_models, self.models, strict=True)):
            policy_params = dict(ddp.module.named_parameters())
            anchor_params = dict(anchor.named_parameters())
            if policy_params.keys() != anchor_params.keys():
                diff = sorted(policy_params.keys() ^ anchor_params.keys())
                raise ValueError(f"chunk {c}: the anchor's parameter names differ from the policy's: {diff[:8]}")
            placed: dict[str, tuple[int, int]] = {}
            if self.sharded:
                name_of = {p: n for n, p in policy_params.items()}
                for buffer in ddp.buffers:
                    if self.dp_group is None:
                        self.dp_group = buffer.data_parallel_group
                    elif dist.get_process_group_ranks(buffer.data_parallel_group) != dist.get_process_group_ranks(
                        self.dp_group
                    ):
                        raise NotImplementedError("policy DDP buffers over different data-parallel groups")
                    placed.update(self._mirror_buffer(buffer, name_of, anchor_params))
                # a mixture of experts: the experts' buffers are sharded over the expert-DP group
                for buffer in getattr(ddp, "expert_parallel_buffers", []):
                    self.storage.check_expert_buffer()
                    placed.update(self._mirror_buffer(buffer, name_of, anchor_params))
            for name, policy_param in policy_params.items():
                ap = anchor_params[name]
                if ap.shape != policy_param.shape:
                    shapes = f"anchor {tuple(ap.shape)}, policy {tuple(policy_param.shape)}"
                    raise ValueError(f"chunk {c} {name}: shapes differ: {shapes}")
                if policy_param not in mains and not self.sharded:
                    raise ValueError(
                        f"chunk {c} {name}: the optimizer has no main parameter for it (frozen?); "
                        "EmaAnchor averages trained parameters only"
                    )
                if self.sharded and name not in placed:
                    raise ValueError(f"chunk {c} {name}: not in the policy's DDP buffers (frozen?)")
                buffer, offset = placed.get(name, (None, None))
                self.params.append(
                    Param(
                        key=f"{c}.{name}",
                        param=ap,
                        buffer=buffer,
                        offset=offset,
                        te_fp8=fp8_utils.is_float8tensor(ap),
                        policy=policy_param,
                    )
                )

    def _mirror_buffer(self, buffer, name_of: dict, anchor_params: dict) -> dict[str, tuple[int, int]]:
        dp_size = buffer.data_parallel_group.size()
        buckets = [tuple(b) for b in buffer.bucket_indices]
        for start, end in buckets:
            if (end - start) % dp_size:
                raise RuntimeError(f"DDP bucket [{start}, {end}) does not split into {dp_size} equal shards")
        index = len(self.flats)
        params = [anchor_params[name_of[p]] for p in buffer.params]
        dtype = self.storage.flat_dtype(params, buffer.param_dtype)
        data = torch.zeros(buffer.numel, dtype=dtype, device=params[0].device)
        self.flats.append(Flat(data=data, buckets=buckets, group=buffer.data_parallel_group))
        placed = {}
        for policy_param, anchor_param in zip(buffer.params, params, strict=True):
            start, end, _ = buffer.param_index_map[policy_param]
            self.storage.place(name_of[policy_param], anchor_param, data[start:end].view(anchor_param.shape))
            placed[name_of[policy_param]] = (index, start)
        return placed

    def _pick_storage(self, fp8: str, output_layer: bool) -> AnchorStorage:
        """The storage kind: ``te`` where the builder made Transformer Engine FP8 parameters,
        ``fp8`` for float8_e4m3fn without them, else ``plain``; checked against the parameters."""
        params = [(n, p) for model in self.models for n, p in model.named_parameters()]
        if self.compute_dtype != torch.float8_e4m3fn:
            kind = "plain"
        elif any(fp8_utils.is_float8tensor(p) for _, p in params):
            kind = "te"
        else:
            kind = fp8
        storage = STORAGES[kind](self.compute_dtype, output_layer=output_layer)
        storage.check(params)
        return storage

    def _init_master(self, mains: dict, master_on_cpu: bool) -> None:
        pin = master_on_cpu and torch.cuda.is_available()
        self.entries: list[Entry] = []
        for i, p in enumerate(self.params):
            policy_param, p.policy = p.policy, None
            if policy_param not in mains:  # sharded: entirely on other DP ranks
                continue
            main, start, end = mains[policy_param]
            device = torch.device("cpu") if master_on_cpu else main.device
            master = torch.empty(end - start, dtype=torch.float32, device=device, pin_memory=pin)
            master.copy_(main)
            offset = None if p.offset is None else p.offset + start
            p.entry = Entry(key=p.key, index=i, main=main, master=master, start=start, end=end, flat_offset=offset)
            self.entries.append(p.entry)
        self._master_elsewhere = any(e.master.device != e.main.device for e in self.entries)

    # ------------------------------------------------------------------ the EMA

    def averages(self, name: str) -> bool:
        """Whether the master holds the parameter ``name`` (a chunk's local name): every one."""
        return True

    @contextlib.contextmanager
    def forward_models(self) -> Iterator[list[GPTModel]]:
        """The chunks the anchor pass runs: the anchor's own."""
        yield self.models

    def update(self) -> None:
        """``master <- tau * master + (1 - tau) * main`` (float32; local), then ``refresh()``.

        Raises ValueError (before changing anything) if a main parameter is not finite.
        """
        if self._master_elsewhere:  # master on the host: validate on the device, then one tensor at a time
            check_finite(**{e.key: e.main for e in self.entries})
            for e in self.entries:
                ema_update_([e.master], [e.main.to(e.master.device)], self.tau, validate=False)
        else:
            ema_update_([e.master for e in self.entries], [e.main for e in self.entries], self.tau)
        self.num_updates += 1
        if self.tau != 1:
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the master into the compute weights (with the distributed optimizer: each rank its
        ranges, then one coalesced all-gather over DP; the FP8 kinds add one all-reduce of the row
        maxima before it)."""
        self.storage.write(self)
        if self.sharded:
            gather_flats([(flat, flat.data) for flat in self.flats], as_bytes=True)
        self.storage.finish(self)

    def range_of(self, e: Entry, target: Tensor) -> Tensor:
        """Where entry ``e``'s stored values go (1-D, numel ``end - start``): its range of the flat
        buffer with the distributed optimizer, else of ``target`` (its parameter-shaped storage)."""
        if self.sharded:
            flat = self.flats[self.params[e.index].buffer].data
            return flat[e.flat_offset : e.flat_offset + e.end - e.start]
        return target.view(-1)[e.start : e.end]

    # ------------------------------------------------------------------ inspection and checkpoints

    def fp8_weights(self) -> dict[str, tuple[Tensor | None, Tensor]]:
        """Row-wise FP8 storage: key -> (float8_e4m3fn in the parameter's shape, or None where only
        the dequantized values are kept; float32 ``scale_inv`` per row)."""
        if not isinstance(self.storage, RowwiseFp8):
            raise RuntimeError(f"fp8_weights() is for row-wise FP8 storage; this anchor's is {self.storage.name!r}")
        return self.storage.fp8_weights(self)

    def master_shards(self) -> dict[str, tuple[Tensor, int, int]]:
        """This rank's float32 master pieces: key -> (1-D tensor, start, end) in the flattened
        parameter (the whole parameter without the distributed optimizer). No communication;
        the tensors are the live master (do not modify)."""
        return {e.key: (e.master, e.start, e.end) for e in self.entries}

    def full_master_state(self, *, copy: bool = True) -> dict[str, Tensor]:
        """key ``"<chunk>.<name>"`` -> float32 master in the parameter's local TP/PP shape (a copy).

        With the distributed optimizer the DP ranks' ranges are gathered (one coalesced
        all-gather over DP, through float32 buffers the size of the anchor's flat buffers).
        ``copy=False`` without it: views of the master itself (no second float32 copy of the
        model: a checkpoint save, which reads them before the next update), changed by ``update``.
        """
        if not self.sharded:
            views = {e.key: e.master.view(self.params[e.index].param.shape) for e in self.entries}
            return {key: view.clone() for key, view in views.items()} if copy else views
        device = self.flats[0].data.device if self.flats else torch.device("cpu")
        fulls = [torch.zeros(flat.data.numel(), dtype=torch.float32, device=device) for flat in self.flats]
        for e in self.entries:
            fulls[self.params[e.index].buffer][e.flat_offset : e.flat_offset + e.end - e.start].copy_(e.master)
        gather_flats(list(zip(self.flats, fulls)))
        out = {}
        for p in self.params:
            n = p.param.numel()
            out[p.key] = fulls[p.buffer][p.offset : p.offset + n].view(p.param.shape)
        return out

    def load_full_master_state(self, state: Mapping[str, Tensor]) -> None:
        """Set the master from ``full_master_state()``'s format (this rank's ranges are taken),
        then ``refresh()``. No communication besides the refresh's."""
        expected = {p.key for p in self.params}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise KeyError(f"anchor master state: missing {missing[:8]}, unexpected {extra[:8]}")
        for p in self.params:
            if tuple(state[p.key].shape) != tuple(p.param.shape):
                raise ValueError(f"{p.key}: shape {tuple(state[p.key].shape)}, the anchor's is {tuple(p.param.shape)}")
        for e in self.entries:
            src = state[e.key].reshape(-1)[e.start : e.end]
            e.master.copy_(src.to(dtype=torch.float32))
        self.refresh()
