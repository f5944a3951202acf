"""The RL trainer: the loop (``loop.Trainer``), batching of rollout samples, metrics logging and the
``empg`` command line."""
