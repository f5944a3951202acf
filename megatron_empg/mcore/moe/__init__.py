"""A mixture of experts in the Megatron build, one module per concern:

    layout.py    a mixture of experts' ``TransformerConfig`` fields; where a rank's experts lie
                 (EP offset, ETP split) and their global, per-expert names
    routing.py   the router losses' scale and the ``moe/*`` metrics of the update pass
    replay.py    router replay (R3): each micro-batch's engine routing handed to Megatron's
                 RouterReplay in every pass

Imports: those of ``mcore`` (torch, megatron after ``mcore.cpu_shims``, ``core``, ``parallel``,
``config``, ``mcore``); this file imports nothing, so importing a module of the package costs only
that module.
"""
