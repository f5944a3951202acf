"""The rollout engines as the loop sees them: their placements (``placements``: colocated or
disaggregated), the rollout stage on an engine's rank (``rollout``), a step's rollout collected
(``collect``, ``dynamic_sampling``) and its per-sample metrics (``metrics``), and the two sides of
disaggregated engines (``remote`` on the training ranks, ``engine_rank`` on the engines' own)."""
