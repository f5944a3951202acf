"""What reaches the console of ``empg train`` from Python logging and warnings.

``configure_logging`` (called once, first thing, on every rank) sets up:

* **Ours** (``megatron_empg``): INFO on rank 0, WARNING on the other ranks (each rank of a
  torchrun/srun job writes to the same console), to stderr as ``time [rank N] LEVEL name: message``
  (the ``[rank N]`` prefix only when the world has several ranks).
* **Third-party libraries**: ``LoggingConfig.third_party_level`` (default WARNING, which hides
  their start-up INFO chatter) on every rank: the root logger, through which most libraries
  (Megatron-Core, torch.distributed, urllib3, httpx, filelock) log, and vLLM's logger. The
  libraries that are quieter by default (transformers, huggingface_hub, torch: WARNING) get that
  level only where it is quieter than WARNING (INFO would trace every file and compiled graph).
* **Processes started later** (vLLM's engine core when it runs in its own process, spawned, which
  configures its logging from the environment when it imports vLLM): ``VLLM_LOGGING_LEVEL``,
  ``TRANSFORMERS_VERBOSITY`` and ``HF_HUB_VERBOSITY`` are set to those levels, and
  ``VLLM_LOGGING_STREAM`` to stderr (vLLM logs to stdout by default, which carries the step lines);
  each only where the user has not set it, and a value the user set applies in this process too.
  torch resets its logger to WARNING when it is imported after this call.
* **Python warnings** go to logging: to the logger of the package whose code raised them (the
  ``warnings`` module names the file), so they obey that package's level. Deprecation, future and
  user warnings raised inside another package (``Apex is not installed``, deprecations of
  Megatron-Core's own API) are notes for that package's callers, not for the run's user: they are
  logged at INFO. Other categories (``RuntimeWarning`` ...) and warnings raised in our code or a
  script stay WARNING. Each place warns once, as Python's default filters have it.
* **vLLM warnings that repeat** on every weight sync or thread-count call are shown once
  (``rollout.vllm_logging``: in this process, and in an engine process of its own, where the
  weight-transfer backend installs the same filter). An engine in a process of its own gets the
  environment otherwise: its start-up warnings go as vLLM has them.

Errors (ERROR records, exceptions) stay visible at every ``third_party_level`` but CRITICAL. The
step lines and the end-of-run summary are ``metrics_log.MetricsLogger``'s, on stdout. This module
imports no third-party package, so it may run before torch, vLLM or Megatron are imported.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from megatron_empg.config import LOG_LEVELS, LoggingConfig
from megatron_empg.rollout.vllm_logging import show_repeating_warnings_once

OURS = __name__.split(".")[0]
OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # wherever it is installed from
# Loggers that set their own level (at import, from their own environment variable) or have
# handlers of their own, so that the root logger's level does not reach them.
OWN_LEVEL_LOGGERS = ("vllm", "transformers", "huggingface_hub", "torch")
# Of those, the ones quieter than INFO by default, which stay at least at WARNING: their INFO traces
# every file they read (transformers, huggingface_hub) and every graph torch compiles; their own
# variables (TRANSFORMERS_VERBOSITY, HF_HUB_VERBOSITY, TORCH_LOGS) make them more verbose.
QUIET_BY_DEFAULT = ("transformers", "huggingface_hub", "torch")
# logger -> (environment variable, its spelling of a level name): read by the library when it is
# imported (in this process, or in a child such as vLLM's engine core).
ENVIRONMENT_LEVELS = {
    "vllm": ("VLLM_LOGGING_LEVEL", str.upper),
    "transformers": ("TRANSFORMERS_VERBOSITY", str.lower),
    "huggingface_hub": ("HF_HUB_VERBOSITY", str.lower),
}
VLLM_STREAM = ("VLLM_LOGGING_STREAM", "ext://sys.stderr")
# Warnings that a package raises about its own API or set-up: addressed to its callers.
NOTE_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning, UserWarning)


def configure_logging(settings: LoggingConfig, *, rank: int, world_size: int) -> None:
    """Set up logging and warnings of this process for a run's rank ``rank`` of ``world_size``, as
    the module docstring says."""
    level = settings.third_party_level
    prefix = f"[rank {rank}] " if world_size > 1 else ""
    logging.basicConfig(format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    logging.getLogger(OURS).setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for name in OWN_LEVEL_LOGGERS:
        wanted = level
        if name in QUIET_BY_DEFAULT and logging.getLevelName(level) < logging.WARNING:
            wanted = "WARNING"
        if name in ENVIRONMENT_LEVELS:
            variable, spelling = ENVIRONMENT_LEVELS[name]
            os.environ.setdefault(variable, spelling(wanted))
            if os.environ[variable].upper() in LOG_LEVELS:  # else the library's own spelling (or error)
                wanted = os.environ[variable].upper()
        logging.getLogger(name).setLevel(wanted)
    os.environ.setdefault(*VLLM_STREAM)
    show_repeating_warnings_once()
    warnings.showwarning = _log_warning


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning``: one log record on the logger of the package of ``filename`` (see
    the module docstring); a warning written to an explicit ``file`` is written there as before."""
    if file is not None:
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    package = _package_of(filename)
    note = package not in (None, OURS) and issubclass(category, NOTE_CATEGORIES)
    logging.getLogger(package or "py.warnings").log(
        logging.INFO if note else logging.WARNING, "%s:%s: %s: %s", filename, lineno, category.__name__, message
    )


def _package_of(filename: str) -> str | None:
    """The top-level package (or module) that ``filename`` belongs to: ours by its directory, another
    from the longest entry of ``sys.path`` that holds it (site-packages lies inside a virtual
    environment that may lie in the repository); None for the script being run, ``<frozen ...>``
    or a file outside ``sys.path``."""
    path = os.path.abspath(filename)
    if path.startswith(OUR_DIR + os.sep):
        return OURS
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is not None and os.path.abspath(script) == path:
        return None
    roots = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    holding = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    if not holding:
        return None
    first = os.path.relpath(path, max(holding, key=len)).split(os.sep)[0]
    name = first[: -len(".py")] if first.endswith(".py") else first
    return name if name.isidentifier() else None
