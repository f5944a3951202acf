"""The environment a vLLM engine reads when it starts, set from the config.

``VLLM_ENABLE_V1_MULTIPROCESSING`` from ``rollout.in_process``, on CPU ``VLLM_CPU_KVCACHE_SPACE``
from ``rollout.kv_cache_gib`` (without it vLLM claims 92 % of the machine's RAM and refuses to
start when that much is not free), and ``VLLM_NO_USAGE_STATS`` / ``VLLM_DO_NOT_TRACK`` (no
telemetry attempts) unless set. A value set by the user that contradicts the config is an error.
``TORCH_COMPILE_DISABLE`` where inductor cannot compile on this CPU (``_compile_environment``).
"""

from __future__ import annotations

import os

import torch

from megatron_empg.config import RolloutConfig

# For each environment variable an engine sets, it also records the value under this prefix, so
# that a later engine (in this process or in a child process, which inherits the environment) may
# change it, while a value the user set stays the user's.
SET_BY_ENGINE_PREFIX = "EMPG_ENGINE_SET_"


def _value_matches(current: str, wanted: str) -> bool:
    try:
        return int(current) == int(wanted)
    except ValueError:
        return current.strip() == wanted


def engine_environment(rollout: RolloutConfig, on_gpu: bool) -> dict[str, str]:
    """The environment variables to set for vLLM; raises if the user set a contradicting one."""
    from_config = {"VLLM_ENABLE_V1_MULTIPROCESSING": ("0" if rollout.in_process else "1", "rollout.in_process")}
    if not on_gpu:
        from_config["VLLM_CPU_KVCACHE_SPACE"] = (str(rollout.kv_cache_gib), "rollout.kv_cache_gib")
    to_set = {}
    for name, (value, field) in from_config.items():
        current = os.environ.get(name)
        if current is None or os.environ.get(SET_BY_ENGINE_PREFIX + name) == current:  # unset, or an engine's
            to_set[name] = value
        elif not _value_matches(current, value):
            raise ValueError(
                f"environment variable {name}={current!r} contradicts {field} (which needs "
                f"{name}={value!r}): unset it or change {field}"
            )
    for name, value in {**_compile_environment(on_gpu), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}.items():
        if name not in os.environ:  # no telemetry attempts; no inductor where it cannot compile
            to_set[name] = value
    return to_set


def _compile_environment(on_gpu: bool) -> dict[str, str]:
    """``TORCH_COMPILE_DISABLE=1`` on a CPU whose torch kernels run without a vector unit (capability
    ``DEFAULT``: no AVX2, or ``ATEN_CPU_CAPABILITY=default``): there inductor's generated C++ still
    uses ``at::vec`` and does not compile (torch 2.13), and vLLM compiles its sampler's helpers with
    inductor. Uncompiled, the engine is slower and computes the same numbers."""
    if on_gpu or torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        return {}
    return {"TORCH_COMPILE_DISABLE": "1"}


def apply_environment(environment: dict[str, str]) -> None:
    """Set ``environment`` (``engine_environment``'s), each value marked as the engine's."""
    os.environ.update(environment)
    os.environ.update({SET_BY_ENGINE_PREFIX + name: value for name, value in environment.items()})
    if environment.get("TORCH_COMPILE_DISABLE") == "1":  # this process read its dynamo config at import
        torch._dynamo.config.disable = True
