"""A mixture of experts in the update pass: the scale of the router's auxiliary losses and the
routing metrics of a step.

Auxiliary-loss scale. Megatron adds the router's load-balancing loss (``moe_aux_loss_coeff``) and
z-loss (``moe_z_loss_coeff``) to the objective through ``MoEAuxLossAutoScaler``: their gradient is
``coeff x d(loss)`` times a scale that the schedule sets after every micro-batch's loss function
(``config.moe_grad_scale_func``, default 1 under ``calculate_per_token_loss``). Our gradients are
then divided once by the global loss count N (``mcore.optimizer``: tokens or sequences, summed
over micro-batches and DP), so at scale 1 the router's losses would weigh 1/N of their mean over
micro-batches: they would fade with the batch and depend on the aggregation mode. The intended
objective is ``policy loss + coeff x (the aux loss averaged over the step's M micro-batches of all
DP ranks)``, independent of the DP size, so ``set_aux_loss_scale`` sets the scale to N / M. N is
known before the pass: ``loss_units`` gives each micro-batch's count without the model (the
count the loss function will return). The routers must take Megatron's plain path (their
``calculate_per_token_loss`` False: ``mcore.optimizer.wrap_with_ddp`` sees to it), which would
otherwise multiply the loss by the micro-batch's tokens.

Metrics (``RouterRecorder``), from each router's logits and routing in the update pass, over the
step's micro-batches and reduced over DP x CP and the pipeline stages (EP ranks are DP ranks of
the router; TP ranks without sequence parallelism route the same tokens, so they are not summed):

    moe/aux_loss                    the load-balancing loss without its coefficient (Megatron's
                                    switch formula E * sum_e f_e P_e per micro-batch), mean over
                                    micro-batches and layers
    moe/z_loss                      mean over tokens of logsumexp(router logits)^2, mean over
                                    micro-batches and layers (when moe_z_loss_coeff is set)
    moe/expert_load_max_over_mean   per layer: max over experts of the tokens routed to it in the
                                    step / their mean over experts; the max over layers
    moe/dropped_tokens              fraction of the (token, top-k choice) pairs that the capacity
                                    dropped (when moe_expert_capacity_factor is set)

Sequence and context parallelism split a micro-batch's tokens over TP / CP ranks: the loads and
dropped pairs are then summed over those ranks, but ``moe/aux_loss`` and ``moe/z_loss`` are the
mean of the ranks' values on their own shares (Megatron's aux loss uses the micro-batch's counts:
not the same number; not verified on CPU, where neither runs with experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.parallel_state import ParallelGroups
from megatron_empg.parallel.collectives import collective_device

LossUnits = Callable[..., Tensor]
"""``loss_units(batch: MicroBatch[, cp_group]) -> []`` int: the count the update-pass loss function
returns for ``batch`` (``parallel.rl_loss.loss_units`` with the run's aggregation bound)."""


def has_router_losses(config) -> bool:
    """Whether the model's routers add an auxiliary loss (load balancing or z-loss) to the objective."""
    if not getattr(config, "num_moe_experts", None):
        return False
    return bool(config.moe_aux_loss_coeff) or bool(config.moe_z_loss_coeff)


def set_aux_loss_scale(
    config, microbatches: Sequence[MicroBatch], loss_units: LossUnits | None, groups: ParallelGroups
) -> float | None:
    """Set ``config.moe_grad_scale_func`` to N / M for this step (module docstring); returns the
    scale (None: the model has no router losses). One all-reduce over DP x CP."""
    if not has_router_losses(config):
        return None
    if loss_units is None:
        raise ValueError(
            "a mixture of experts with moe_aux_loss_coeff or moe_z_loss_coeff needs train_step's "
            "loss_units (the loss count of a micro-batch) to scale the router losses"
        )
    cp = {"cp_group": groups.cp_group} if groups.cp_size > 1 else {}
    units = sum(int(loss_units(batch, **cp)) for batch in microbatches)
    totals = torch.tensor([units, len(microbatches)], dtype=torch.float64, device=collective_device(groups.sum_group))
    if groups.sum_size > 1:
        dist.all_reduce(totals, group=groups.sum_group)
    units, counted = totals.tolist()
    # every CP rank of a replica counts its micro-batches; the aux loss of one is split over them
    scale = max(units, 1.0) / (counted / groups.cp_size)
    config.moe_grad_scale_func = lambda: scale
    return scale


def _routers(models) -> list[torch.nn.Module]:
    cpu_shims.import_megatron()
    from megatron.core.transformer.moe.router import Router

    return [m for model in models for m in model.modules() if isinstance(m, Router)]


def use_plain_aux_loss_path(models) -> None:
    """Routers read ``calculate_per_token_loss`` when built; keep them off Megatron's per-token
    aux-loss path (the scale is ``set_aux_loss_scale``'s)."""
    for router in _routers(models):
        router.calculate_per_token_loss = False


class RouterRecorder:
    """Per-layer routing sums of a step's micro-batches, from forward hooks on the routers.

    ``sums`` [num_layers, 5 + E] float64 on the routers' device (no host sync in the hooks), per
    global layer: the aux loss and the z-loss summed over micro-batches, the micro-batches, the
    token-choice pairs kept by the capacity and those the router chose, then the tokens routed
    to each expert.
    """

    AUX, Z, CALLS, ROUTED, WANTED, LOAD = 0, 1, 2, 3, 4, 5

    def __init__(self, models, num_layers: int) -> None:
        from megatron_empg.mcore.weights import global_layer_indices

        config = models[0].config
        self.sequence_parallel = config.sequence_parallel
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.z_loss, self.capacity = bool(config.moe_z_loss_coeff), config.moe_expert_capacity_factor is not None
        self.num_layers = num_layers
        self.device = next(models[0].parameters()).device
        self.active = False
        self.reset()
        for model in models:
            module = getattr(model, "module", model)
            layers = global_layer_indices(module)
            for router, layer in zip(_routers([module]), layers, strict=True):
                router.register_forward_hook(self._hook(layer))

    def reset(self) -> None:
        self.sums = torch.zeros(self.num_layers, self.LOAD + self.num_experts, dtype=torch.float64, device=self.device)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.reset()
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _hook(self, layer: int):
        def hook(router, args, output) -> None:
            # inside a backward: activation recomputation running the router again
            if not self.active or torch._C._current_graph_task_id() != -1:
                return
            hidden = args[0]
            _, routing_map = output  # [T, E], routing_map after the capacity
            with torch.no_grad():
                logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())  # [T, E]
                stats = routing_stats(logits, self.topk)
                load = routing_map.sum(0).double()
                row = self.sums[layer]
                row[self.AUX] += stats["aux_loss"].double()
                row[self.Z] += stats["z_loss"].double()
                row[self.CALLS] += 1
                row[self.ROUTED] += load.sum()
                row[self.WANTED] += logits.shape[0] * self.topk
                row[self.LOAD :] += load

        return hook

    def reduce(self, groups: ParallelGroups) -> dict[str, float]:
        """The step's ``moe/*`` metrics (module docstring), the same on every rank: all-reduces
        over DP x CP, over TP under sequence parallelism, and over the pipeline stages (each
        holds its own layers)."""
        flat = self.sums.to(collective_device(groups.sum_group))
        if groups.sum_size > 1:
            dist.all_reduce(flat, group=groups.sum_group)
        if self.sequence_parallel and groups.tp_size > 1:  # each TP rank routed its share of the tokens
            dist.all_reduce(flat, group=groups.tp_group)
        if groups.pp_size > 1:
            dist.all_reduce(flat, group=groups.pp_group)
        flat = flat.cpu()
        aux, z, calls = flat[:, self.AUX], flat[:, self.Z], flat[:, self.CALLS].clamp(min=1)
        routed, wanted, load = flat[:, self.ROUTED], flat[:, self.WANTED], flat[:, self.LOAD :]
        out = {"moe/aux_loss": (aux / calls).mean().item()}
        if self.z_loss:
            out["moe/z_loss"] = (z / calls).mean().item()
        out["moe/expert_load_max_over_mean"] = (load.max(1).values / load.mean(1).clamp(min=1e-12)).max().item()
        if self.capacity:
            out["moe/dropped_tokens"] = (1 - routed.sum() / wanted.sum().clamp(min=1)).item()
        return out


def routing_stats(logits: Tensor, topk: int) -> dict[str, Tensor]:
    """A micro-batch's router losses from its [T, E] float32 logits (softmax scores, before any
    capacity): ``aux_loss`` = E * sum_e f_e P_e with f_e = (tokens choosing e) / (T k) and
    P_e = mean_t softmax(logits)_te (Megatron's ``switch_load_balancing_loss_func``), ``z_loss`` =
    mean_t logsumexp(logits_t)^2 (its ``z_loss_func``); differentiable in ``logits`` (f is not)."""
    tokens, experts = logits.shape
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(scores).scatter_(1, scores.topk(topk, dim=-1).indices, 1.0)
    fraction = chosen.sum(0) / (tokens * topk)
    aux = experts * (fraction * scores.mean(0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return {"aux_loss": aux, "z_loss": z}


def router_recorder(models) -> RouterRecorder | None:
    """The recorder of ``models`` (DDP-wrapped chunks), made on first use; None without experts."""
    config = models[0].config
    if not getattr(config, "num_moe_experts", None):
        return None
    owner = getattr(models[0], "module", models[0])
    if getattr(owner, "_router_recorder", None) is None:
        owner._router_recorder = RouterRecorder(models, config.num_layers)
    return owner._router_recorder
