"""Policy weights out of Megatron: HF names and layouts (``mapping``), TP/PP gathering, buckets and
transports into a rollout engine, and the trainer/engine log-prob consistency gate."""
