"""Rollout engines: sampling responses and scoring sequences with the policy's current weights.

``engine`` holds the engine protocol (``RolloutEngine``) and its result type (``Completion``);
``vllm_engine.VllmEngine`` implements it with vLLM's offline ``LLM``, and
``vllm_weight_transfer`` is the weight-transfer backend that engine registers inside vLLM.
Importing this package imports no engine: vLLM is imported only when an engine is built.
``retriever`` is the local search retriever of the search-agent tasks (Search-R1 wire format,
BM25 and dense e5 backends) with its HTTP client; ``search_agent`` runs their multi-turn episodes.
``data`` (prompt datasets and batches) and ``rewards`` (what a reward is) are the generic pieces
the tasks of ``megatron_empg.tasks`` build on; nothing here imports a task.
"""
