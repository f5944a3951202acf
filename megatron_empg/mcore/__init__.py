"""Megatron-Core adapters: the only subpackage that imports megatron.core."""
