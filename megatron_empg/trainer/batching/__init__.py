"""Rollout samples -> the micro-batches of the Megatron passes: the layout of a micro-batch
(``batch``), balancing sequences over replicas and micro-batches (``balance``), the forward-only
passes' rows (``forward_batch``) and the batching stage of a step (``stage``)."""
