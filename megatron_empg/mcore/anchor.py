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
             parameters (``anchor_storage.main_params``). Without the distributed optimizer every rank holds a full float32 copy of its TP/PP shard of the
             model (as the optimizer does); with it, only this DP rank's ranges, so the update
             reads only local memory. ``master_on_cpu`` keeps it in (pinned) host memory on a GPU
             machine (each update then copies the main params to the host, each refresh copies
             the master back); on a CPU machine it changes nothing.

Distributed optimizer: the refresh's all-gather of the anchor's flat buffers (``anchor_storage``).

Mixture of experts. The anchor's chunks have the policy's expert layout (EP, ETP): each rank's
master and weights cover its local experts, under their local names (``local_experts.<j>``; the
checkpoint's ``sharded_state_dict`` gives them their global index). Without the distributed
optimizer nothing is communicated. With it, Megatron DDP keeps the experts in separate
expert-parallel buffers sharded over the expert-DP group: the anchor mirrors those too, and
gathers (and, emulated FP8, reduces the amaxes) over each buffer's own group, one coalesced
collective per group. Transformer Engine FP8 with experts is refused (its re-quantization takes
one group).

FP8 (``compute_dtype=torch.float8_e4m3fn``), two paths:
    Transformer Engine  the builder made TE FP8 parameters (``fp8_param``, GPU): each refresh
             re-quantizes them from the float32 master through Megatron's TE wrappers
             (``fp8_utils.quantize_param_shard``, i.e. TE's ``cast_master_weights_to_fp8``, which
             all-reduces the amax over DP: fresh scales with current (tensorwise) scaling, TE's amax
             history with delayed scaling), then gathers the raw FP8 bytes and runs
             ``post_all_gather_processing``; without the distributed optimizer each parameter is
             re-quantized whole (``copy_tensor_to_quantized_param``). The other parameters (norms,
             embeddings) stay in the builder's dtype, as TE's fp8_param keeps them. With the
             distributed optimizer the policy must be built with fp8_param too (its DDP buffers
             then separate FP8 from other parameters, and the anchor mirrors them). NOT TESTED
             here (no GPU, no TE).
    emulated  plain parameters (CPU, or GPU without TE): every parameter is stored as
             ``float8_e4m3fn`` with a per-tensor scale, ``scale = 448 / amax(master)`` (1 when the
             tensor is zero), recomputed from the master at every refresh (with the distributed
             optimizer the per-tensor amaxes are combined by one all-reduce(MAX) over DP, as TE
             does, before the FP8 bytes are gathered). The model's parameters, in the builder's
             dtype, hold the dequantized weights ``fp8 * (1 / scale)`` that the forward reads: this
             path checks the quantization arithmetic and the sharded re-quantization, it saves no
             memory (``fp8_weights()`` returns the FP8 tensors and their inverse scales).

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

from megatron.core import fp8_utils, tensor_parallel  # noqa: E402  (after the pre-import shims)

from megatron_empg.mcore.anchor_storage import (  # noqa: E402
    Entry,
    Flat,
    Param,
    gather_flats,
    main_params,
    te_fp8_model_init,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from megatron_empg.config import ModelConfig, ParallelConfig

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """Building the anchor's chunks must not move the policy run's random streams."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = {name: state.clone() for name, state in tracker.get_states().items()}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            tracker.set_states(states)


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
        master_on_cpu: bool = False,
    ) -> None:
        super().__init__(EmaSchedule(tau=tau, period=period, first_update=first_update))
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        self.compute_dtype = compute_dtype
        policy_models = list(policy_models)
        ddp_configs = {getattr(m, "ddp_config", None) is not None for m in policy_models}
        if ddp_configs != {True}:
            raise TypeError("policy_models must be the policy's chunks wrapped in Megatron DistributedDataParallel")
        with _rng_preserved():
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
        self.mode = self._pick_mode()
        self._params: list[Param] = []
        self._flats: list[Flat] = []
        self.dp_group = None
        self._build_layout(policy_models, mains)
        if self.mode == "emulated":
            self._init_fp8_storage()
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
        master_on_cpu: bool = False,
        fp8_forward_dtype: torch.dtype | None = None,
        te_fp8: bool = False,
        **build_kwargs: Any,
    ) -> EmaAnchor:
        """Build the anchor's chunks with ``mcore.model.build_gpt_model(model_cfg, parallel, ...)``
        (no random initialization: the refresh writes every weight).

        Parameters in ``compute_dtype``. For ``torch.float8_e4m3fn`` the chunks are built in
        ``fp8_forward_dtype`` (default: the policy's parameter dtype) and, by default, take the
        emulated FP8 path; ``te_fp8=True`` instead builds Transformer Engine FP8 parameters
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
                    if self.mode == "te":
                        raise NotImplementedError(
                            "Transformer Engine FP8 anchor parameters with expert-parallel "
                            "DDP buffers (the FP8 re-quantization is over one DP group)"
                        )
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
                self._params.append(
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
        index = len(self._flats)
        params = [anchor_params[name_of[p]] for p in buffer.params]
        te = [fp8_utils.is_float8tensor(p) for p in params]
        policy_fp8 = buffer.param_dtype == torch.uint8
        if any(te) and not (all(te) and policy_fp8):
            raise NotImplementedError(
                "with the distributed optimizer, Transformer Engine FP8 anchor parameters need an FP8 "
                "(fp8_param) policy: the anchor mirrors the policy's DDP buffers, which then hold FP8 "
                "parameters apart from the others"
            )
        if any(te):
            dtype = torch.uint8  # TE FP8 raw bytes
        elif self.mode == "emulated":
            dtype = torch.float8_e4m3fn  # FP8 storage beside the forward weights
        elif self.mode == "te":
            dtype = params[0].dtype  # the parameters TE keeps in high precision
        else:
            dtype = self.compute_dtype
        device = params[0].device
        data = torch.zeros(buffer.numel, dtype=dtype, device=device)
        self._flats.append(Flat(data=data, buckets=buckets, group=buffer.data_parallel_group))
        placed = {}
        for policy_param, anchor_param, is_te in zip(buffer.params, params, te):
            start, end, _ = buffer.param_index_map[policy_param]
            view = data[start:end].view(anchor_param.shape)
            if is_te:
                fp8_utils.modify_underlying_storage(anchor_param, view)
            elif dtype != torch.float8_e4m3fn:
                if anchor_param.dtype != dtype:
                    raise ValueError(
                        f"{name_of[policy_param]}: the anchor's parameter is {anchor_param.dtype}, its DDP bucket "
                        f"neighbours' {dtype}"
                    )
                anchor_param.data = view  # values: refresh()
            placed[name_of[policy_param]] = (index, start)
        return placed

    def _pick_mode(self) -> str:
        """ "plain" (bf16/fp16/fp32 weights), "te" (Transformer Engine FP8 parameters) or "emulated"."""
        params = [(n, p) for model in self.models for n, p in model.named_parameters()]
        te = any(fp8_utils.is_float8tensor(p) for _, p in params)
        if self.compute_dtype != torch.float8_e4m3fn:
            if te:
                raise ValueError(
                    "the anchor's parameters are Transformer Engine FP8 tensors; pass compute_dtype=torch.float8_e4m3fn"
                )
            for name, p in params:
                if p.dtype != self.compute_dtype:
                    raise ValueError(
                        f"{name}: the anchor's parameter is {p.dtype}; build the anchor with "
                        f"params_dtype={self.compute_dtype} (compute_dtype)"
                    )
            return "plain"
        return "te" if te else "emulated"

    def _init_fp8_storage(self) -> None:
        """Emulated FP8: each parameter's FP8 values, a view into the flat buffers (distributed
        optimizer) or its own tensor, and the per-tensor inverse scales."""
        for p in self._params:
            if p.buffer is not None:
                flat = self._flats[p.buffer].data
                p.fp8 = flat[p.offset : p.offset + p.param.numel()].view(p.param.shape)
            else:
                p.fp8 = torch.zeros(p.param.shape, dtype=torch.float8_e4m3fn, device=p.param.device)
        self._fp8_scale_inv = torch.ones(len(self._params), dtype=torch.float32, device=self._params[0].param.device)

    def _init_master(self, mains: dict, master_on_cpu: bool) -> None:
        pin = master_on_cpu and torch.cuda.is_available()
        self._entries: list[Entry] = []
        for i, p in enumerate(self._params):
            policy_param, p.policy = p.policy, None
            if policy_param not in mains:  # sharded: entirely on other DP ranks
                continue
            main, start, end = mains[policy_param]
            device = torch.device("cpu") if master_on_cpu else main.device
            master = torch.empty(end - start, dtype=torch.float32, device=device, pin_memory=pin)
            master.copy_(main)
            offset = None if p.offset is None else p.offset + start
            p.entry = Entry(key=p.key, index=i, main=main, master=master, start=start, end=end, flat_offset=offset)
            self._entries.append(p.entry)
        self._master_elsewhere = any(e.master.device != e.main.device for e in self._entries)

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
            check_finite(**{e.key: e.main for e in self._entries})
            for e in self._entries:
                ema_update_([e.master], [e.main.to(e.master.device)], self.tau, validate=False)
        else:
            ema_update_([e.master for e in self._entries], [e.main for e in self._entries], self.tau)
        self.num_updates += 1
        if self.tau != 1:
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the master into the compute weights (with the distributed optimizer: each rank its
        ranges, then one coalesced all-gather over DP; emulated FP8 adds one all-reduce of the
        per-tensor amaxes before it)."""
        if self.mode == "plain":
            for e in self._entries:
                self._store(e).copy_(e.master)
        elif self.mode == "emulated":
            self._quantize_emulated()
        else:
            self._quantize_te()
        self._gather()
        if self.mode == "emulated":
            for i, p in enumerate(self._params):
                p.param.copy_(p.fp8.float().mul_(self._fp8_scale_inv[i]))
        elif self.mode == "te" and self.sharded:
            fp8_utils.post_all_gather_processing([p.param for p in self._params if p.te_fp8])

    def _store(self, e: Entry) -> Tensor:
        """Where entry ``e``'s cast values go (1-D, numel end - start)."""
        p = self._params[e.index]
        if self.sharded:
            flat = self._flats[p.buffer].data
            return flat[e.flat_offset : e.flat_offset + e.end - e.start]
        target = p.fp8 if self.mode == "emulated" else p.param.data
        return target.view(-1)[e.start : e.end]

    def _gather(self) -> None:
        if self.sharded:
            gather_flats([(flat, flat.data) for flat in self._flats], as_bytes=True)

    def _quantize_emulated(self) -> None:
        amax = torch.zeros(len(self._params), dtype=torch.float32, device=self._fp8_scale_inv.device)
        for e in self._entries:
            if e.master.numel():
                amax[e.index] = e.master.abs().max().to(amax.device)
        if self.sharded:  # each parameter's amax over the ranks sharing its buffer
            for group, indices in self._params_by_group().items():
                if group.size() > 1:
                    part = amax[indices]
                    dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
                    amax[indices] = part
        scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
        self._fp8_scale_inv.copy_(scale.reciprocal())
        for e in self._entries:
            s = scale[e.index].to(e.master.device)
            q = (e.master * s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            self._store(e).copy_(q)

    def _params_by_group(self) -> dict[Any, Tensor]:
        """Data-parallel group -> [n] int64 indices of the parameters in that group's buffers."""
        by_group: dict[Any, list[int]] = {}
        for i, p in enumerate(self._params):
            by_group.setdefault(self._flats[p.buffer].group, []).append(i)
        device = self._fp8_scale_inv.device
        return {group: torch.tensor(indices, device=device) for group, indices in by_group.items()}

    def _quantize_te(self) -> None:
        te_params, te_masters, te_starts = [], [], []
        for p in self._params:
            e = p.entry
            master = None if e is None else e.master.to(p.param.device)
            if not p.te_fp8:
                if e is not None:
                    self._store(e).copy_(master)
            elif self.sharded:
                te_params.append(p.param)
                te_masters.append(master)
                te_starts.append(None if e is None else e.start)
            else:
                fp8_utils.copy_tensor_to_quantized_param(p.param, master.view(p.param.shape))
        if te_params:
            fp8_utils.quantize_param_shard(te_params, te_masters, te_starts, self.dp_group)

    # ------------------------------------------------------------------ inspection and checkpoints

    def fp8_weights(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Emulated FP8 path: key -> (float8_e4m3fn tensor in the parameter's shape, inverse scale)."""
        if self.mode != "emulated":
            raise RuntimeError(f"fp8_weights() is for the emulated FP8 path; this anchor is {self.mode!r}")
        return {p.key: (p.fp8, self._fp8_scale_inv[i]) for i, p in enumerate(self._params)}

    def master_shards(self) -> dict[str, tuple[Tensor, int, int]]:
        """This rank's float32 master pieces: key -> (1-D tensor, start, end) in the flattened
        parameter (the whole parameter without the distributed optimizer). No communication;
        the tensors are the live master (do not modify)."""
        return {e.key: (e.master, e.start, e.end) for e in self._entries}

    def full_master_state(self, *, copy: bool = True) -> dict[str, Tensor]:
        """key ``"<chunk>.<name>"`` -> float32 master in the parameter's local TP/PP shape (a copy).

        With the distributed optimizer the DP ranks' ranges are gathered (one coalesced
        all-gather over DP, through float32 buffers the size of the anchor's flat buffers).
        ``copy=False`` without it: views of the master itself (no second float32 copy of the
        model: a checkpoint save, which reads them before the next update), changed by ``update``.
        """
        if not self.sharded:
            views = {e.key: e.master.view(self._params[e.index].param.shape) for e in self._entries}
            return {key: view.clone() for key, view in views.items()} if copy else views
        device = self._flats[0].data.device if self._flats else torch.device("cpu")
        fulls = [torch.zeros(flat.data.numel(), dtype=torch.float32, device=device) for flat in self._flats]
        for e in self._entries:
            fulls[self._params[e.index].buffer][e.flat_offset : e.flat_offset + e.end - e.start].copy_(e.master)
        gather_flats(list(zip(self._flats, fulls)))
        out = {}
        for p in self._params:
            n = p.param.numel()
            out[p.key] = fulls[p.buffer][p.offset : p.offset + n].view(p.param.shape)
        return out

    def load_full_master_state(self, state: Mapping[str, Tensor]) -> None:
        """Set the master from ``full_master_state()``'s format (this rank's ranges are taken),
        then ``refresh()``. No communication besides the refresh's."""
        expected = {p.key for p in self._params}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
            raise KeyError(f"anchor master state: missing {missing[:8]}, unexpected {extra[:8]}")
        for p in self._params:
            if tuple(state[p.key].shape) != tuple(p.param.shape):
                raise ValueError(f"{p.key}: shape {tuple(state[p.key].shape)}, the anchor's is {tuple(p.param.shape)}")
        for e in self._entries:
            src = state[e.key].reshape(-1)[e.start : e.end]
            e.master.copy_(src.to(dtype=torch.float32))
        self.refresh()
