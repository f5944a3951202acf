"""LoRA policies in the Megatron build (``model.lora``; docs/lora.md), one module per concern:

    layers.py   Megatron's column- and row-parallel linears with adapters, sharded as their base
    model.py    the layer spec with adapted linears, the frozen base, the adapters' names
    init.py     the adapters' first values, the same in every layout
    weights.py  the merged weights ``W + (alpha / r) B A`` (the merged weight sync, a merged export)
    anchor.py   the EMA anchor over the adapters (the policy's base with averaged adapters)
    sync.py     what a LoRA policy's weight sync pushes (``weight_sync.lora_mode``)
    base.py     the base a LoRA run adapts: its path and fingerprint, a PEFT ``init_from``'s base

Imports: those of ``mcore``; ``model``, ``weights`` and ``sync`` import megatron lazily (the model
builder and ``mcore.weights`` import them).
"""
