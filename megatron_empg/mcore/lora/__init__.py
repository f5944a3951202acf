"""LoRA policies in the Megatron build (``model.lora``; docs/lora.md), one module per concern:

    layers.py   Megatron's column- and row-parallel linears with adapters, sharded as their base
    model.py    the layer spec with adapted linears, the frozen base, the adapters' first values
                and names

Imports: those of ``mcore``; ``model`` imports megatron lazily (the model builder imports it).
"""
