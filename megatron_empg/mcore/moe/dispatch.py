"""Routing without host syncs where the expert grid is one rank: ``LocalTokenDispatcher``, and
``GroupedMoELayer``, Megatron's ``MoELayer`` that uses it under grouped experts.

Megatron's dispatchers read the token counts on the host once per layer and pass: the alltoall
dispatcher copies them to the host on a side stream and waits for the copy before sorting the
tokens by local expert (``sort_chunks_by_idxs`` splits by host sizes) and before returning the
counts; the allgather dispatcher calls ``.cpu()`` on them. Each wait stalls the CPU until the GPU
has finished the router, so the kernels after it launch late (a bubble per layer and pass).
``SequentialMLP`` and TE's grouped linears need the counts on the host; ``GroupedExperts`` does
not (``mcore.moe.gemm.group_offsets`` takes a device cumsum).

Where the expert grid (expert TP x EP, Megatron's ``tp_ep`` group) is this one rank, nothing crosses
ranks and the host needs no count. ``LocalTokenDispatcher`` then does Megatron's dropless alltoall
dispatch with every host read removed:

    preprocess          tokens_per_expert = routing_map.sum(0) on the device [E] int64; the
                        permuted size is static: tokens x top-k (``num_out_tokens``)
    dispatch_preprocess Megatron's (``moe_utils.permute``: a stable argsort of the routing map,
                        expert-major, tokens ascending within an expert: the order ``SequentialMLP``
                        and ``GroupedExperts`` take; fixed output size)
    token_dispatch      nothing (no EP all-to-all)
    dispatch_postprocess nothing: with one source rank the tokens already lie in local expert
                        order (Megatron's chunk sort is the identity here, a split and a copy)
    combine_preprocess, token_combine   nothing
    combine_postprocess Megatron's (``unpermute``: a scatter-add into the token rows)

Everything else (router, probs, aux losses, router replay, the ``moe/*`` metrics) is Megatron's and
reads nothing on the host. The same dropless invariant as Megatron's: each token is routed to
exactly top-k experts (``num_out_tokens``). Expert parallelism keeps Megatron's dispatchers:
NCCL's all-to-all takes its split sizes on the host, so EP > 1 syncs once per layer and pass.

``GroupedMoELayer`` is ``MoELayer`` with one change: after Megatron builds its dispatcher, the
layer swaps in a ``LocalTokenDispatcher`` where ``local_dispatch_unsupported`` says nothing
against it. ``mcore.model`` builds it for ``model.moe_experts: grouped``.
"""

from __future__ import annotations

from torch import Tensor

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.moe.grouped import GroupedExperts

cpu_shims.install_pre_import()

from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import (  # noqa: E402
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's dropless alltoall dispatcher for an expert grid of one rank, without host reads
    (module docstring): ``dispatch_postprocess`` returns ``tokens_per_expert`` [E] int64 on the
    tokens' device."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        if (why := local_dispatch_unsupported(config, pg_collection)) is not None:
            raise ValueError(f"LocalTokenDispatcher: {why}")

    def preprocess(self, routing_map: Tensor) -> Tensor:
        """``routing_map [T, E]`` bool -> the tokens of each expert ``[E]`` int64, on its device."""
        self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
        return routing_map.sum(dim=0)

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Tensor | None = None) -> Tensor | None:
        return tokens_per_expert  # nothing goes to the host

    def token_dispatch(self, permutated_local_input_tokens: Tensor, permuted_probs: Tensor) -> tuple[Tensor, Tensor]:
        return permutated_local_input_tokens, permuted_probs

    def dispatch_postprocess(self, global_input_tokens: Tensor, global_probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states

    def token_combine(self, hidden_states: Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        return hidden_states


def local_dispatch_unsupported(config, pg_collection) -> str | None:
    """Why ``LocalTokenDispatcher`` cannot stand in for Megatron's dispatcher of a layer with
    ``config`` on ``pg_collection``'s groups, or None."""
    if pg_collection.tp_ep.size() != 1:
        return f"the expert grid spans {pg_collection.tp_ep.size()} ranks (expert TP x EP)"
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        return f"moe_token_dispatcher_type {config.moe_token_dispatcher_type!r}"
    if config.moe_expert_capacity_factor is not None or config.moe_router_padding_for_quantization:
        return "token dropping or padding (a data-dependent permuted size)"
    if config.moe_shared_expert_overlap:
        return "moe_shared_expert_overlap (the dispatcher runs the shared experts)"
    if config.transformer_impl == "inference_optimized":
        return "the inference-optimized layer"
    return None


class GroupedMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with ``LocalTokenDispatcher`` where it applies (module docstring);
    ``MoELayer``'s signature and modules otherwise."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs) -> None:
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
        if (
            isinstance(self.experts, GroupedExperts)
            and type(self.token_dispatcher) in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher)
            and local_dispatch_unsupported(config, pg_collection) is None
        ):
            self.token_dispatcher = LocalTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config, pg_collection
            )
