"""megatron-empg: RL post-training on Megatron-Core (EMA-PG, Top-k KL, RPG).

Importing the package imports nothing heavy; see README.md for the map of subpackages.
"""

__version__ = "0.1.0"
