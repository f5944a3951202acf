"""The RL trainer: the loop (``loop.Trainer``) and the ``empg`` command line (``cli``), over four
groups, lowest first: ``run`` (a run's lifecycle), ``bind`` (the bind step and the plans),
``batching`` (samples -> micro-batches) and ``engines`` (the rollout engines and a step's rollout).
A group imports only the groups below it (tests/test_import_layers.py)."""
