"""Router replay (R3, ``algorithm.router_replay: rollout``): Megatron's routers take the experts
the rollout engine chose for each token instead of their own top-k.

A model built with ``moe_enable_routing_replay`` (``mcore.model.transformer_config(routing_replay=
True)``) has a ``RouterReplay`` in every ``TopKRouter``; ``install`` puts a forward pre-hook on
each that picks its action per call. The passes (``mcore.step``) call ``set_micro_batch`` before
each micro-batch's forward of each model chunk and ``clear`` after the pass:

    set_micro_batch  every router of the chunk gets its layer's [tokens, k] column of the micro-
                     batch's ``routed_experts`` ([b, s, layers, k], by the router's global layer
                     number: a pipeline stage replays only its own layers), in the router's token
                     order (s-major: Megatron's [s, b] flattened; under sequence parallelism this
                     TP rank's share of s)
    forward          ``REPLAY_FORWARD``: the router gathers its scores at the replayed experts (the
                     weights keep their gradient; only the choice is the engine's)
    recompute        with full recompute (``train.recompute: full``) the layers run again in the
                     backward pass, with gradients on, after later micro-batches' forwards (1F1B):
                     ``REPLAY_BACKWARD`` takes that router's targets first in, first out
                     (Megatron runs the backward passes in the forwards' order per chunk)
    no targets       a forward without ``routed_experts`` (the weight-sync gate's scoring) routes
                     as the router decides

Megatron's global ``RouterReplay`` list holds the routers of every model built in the process (the
policy's and the anchor's); the chunks' own routers are walked instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from megatron_empg.core.microbatch import MicroBatch
from megatron_empg.mcore import cpu_shims

cpu_shims.install_pre_import()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402


def routers(model: torch.nn.Module) -> Iterator[TopKRouter]:
    """The chunk's (or a DDP wrapper's) routers that replay (built with ``moe_enable_routing_replay``)."""
    return (m for m in model.modules() if isinstance(m, TopKRouter) and m.router_replay is not None)


def install(chunks: Iterable[torch.nn.Module]) -> None:
    """The action hook (module docstring) on every replaying router of ``chunks``."""
    for chunk in chunks:
        for router in routers(chunk):
            router.register_forward_pre_hook(_choose_action)


def _choose_action(router: TopKRouter, _inputs) -> None:
    replay = router.router_replay
    if torch.is_grad_enabled() and router.config.recompute_granularity == "full" and router.training:
        # the update pass's forward runs inside the checkpoint without gradients; this is the recompute
        action = RouterReplayAction.REPLAY_BACKWARD if replay.replay_backward_list else None
    else:
        action = RouterReplayAction.REPLAY_FORWARD if replay.target_topk_idx is not None else None
    replay.router_replay_action = action


def token_routing(batch: MicroBatch, *, sequence_parallel: bool = False) -> Tensor | None:
    """``batch.routed_experts`` [b, s, layers, k] in Megatron's router order: [tokens, layers, k]
    int64, tokens s-major (this TP rank's share of s under ``sequence_parallel``); None without."""
    routed = batch.routed_experts
    if routed is None:
        return None
    routed = routed.transpose(0, 1)  # [s, b, layers, k]
    if sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        share = routed.shape[0] // tp
        routed = routed[rank * share : (rank + 1) * share]
    return routed.reshape(-1, *routed.shape[2:]).long()


def set_micro_batch(model: torch.nn.Module, batch: MicroBatch) -> None:
    """Each replaying router of ``model`` (one chunk) takes its layer's experts of ``batch`` for
    its next forward (and, under full recompute, its recompute); nothing without ``routed_experts``."""
    found = list(routers(model))
    if batch.routed_experts is None or not found:
        return
    tokens = token_routing(batch, sequence_parallel=found[0].config.sequence_parallel)
    layers = tokens.shape[1]
    for router in found:
        index = router.layer_number - 1  # global, 1-based
        if not 0 <= index < layers:
            raise ValueError(f"router of layer {router.layer_number}: the micro-batch routes {layers} layers")
        target = tokens[:, index]
        if router.config.recompute_granularity == "full":
            router.router_replay.set_target_indices(target)  # also queued for the recompute
        else:
            router.router_replay.target_topk_idx = target


def clear(models: Iterable[torch.nn.Module]) -> None:
    """Drop every router's targets and action (after a pass: the next routes on its own)."""
    for model in models:
        for router in routers(model):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
