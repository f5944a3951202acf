"""A mixture of experts in the Megatron build, one module per concern:

    backends.py  the names of ``model.moe_experts`` (te, grouped, sequential) and what ``auto``
                 means on this machine
    layout.py    a mixture of experts' ``TransformerConfig`` fields; where a rank's experts lie
                 (EP offset, ETP split) and their global, per-expert names
    grouped.py   ``GroupedExperts``: the local experts as one stacked weight per projection,
                 through PyTorch's grouped GEMM (``model.moe_experts: grouped``)
    gemm.py      its arithmetic: the grouped GEMM and its exact per-expert fallback, the
                 device-side group offsets, the weighted SwiGLU (fused and compiled once)
    dispatch.py  ``GroupedMoELayer``: Megatron's MoE layer whose dispatcher reads nothing on the
                 host where the expert grid is one rank (``LocalTokenDispatcher``)
    routing.py   the router losses' scale and the ``moe/*`` metrics of the update pass
    replay.py    router replay (R3): each micro-batch's engine routing handed to Megatron's
                 RouterReplay in every pass

Imports: those of ``mcore`` (torch, megatron after ``mcore.cpu_shims``, ``core``, ``parallel``,
``config``, ``mcore``). This file imports nothing, and ``backends`` and ``gemm`` import no megatron
(the bind step and pure-torch tests use them cheaply).
"""
