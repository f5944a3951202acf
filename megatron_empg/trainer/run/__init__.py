"""A run's lifecycle: its directories (``run_dir``), what it starts from (``start``), the signals
that stop it (``signals``), hangs found (``watchdog``) and restarts decided (``restarts``), refused
steps (``bad_steps``), and what reaches the console and the metrics files (``console``,
``metrics_log``). The lowest trainer group: it imports no other."""
