"""An in-process VllmEngine's end of life: a failed weight update makes it refuse all work, and
shutdown() releases it, including the torch.distributed world vLLM created for it.

Its own engine (the other module's is shut down by then: one in-process engine per process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import RolloutConfig, SamplingConfig

pytestmark = pytest.mark.vllm

ROLLOUT = RolloutConfig(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=1)


def test_a_failed_update_disables_the_engine_and_shutdown_releases_it(require_vllm, tiny_model_dir):
    from megatron_empg.rollout.vllm_engine import VllmEngine

    assert not torch.distributed.is_initialized()
    engine = VllmEngine(tiny_model_dir, ROLLOUT)
    assert torch.distributed.is_initialized()  # vLLM's world of one
    sampling = SamplingConfig(n=1, max_tokens=2)
    assert len(engine.generate([[1, 2, 3]], sampling)[0][0].token_ids) == 2

    engine.begin_weight_update()
    with pytest.raises(ValueError, match="no module or parameter named 'bogus'"):
        engine.update_weights(named_tensors=[("model.bogus.weight", torch.zeros(3))])
    calls = {
        "generate": lambda: engine.generate([[1, 2, 3]], sampling),
        "score": lambda: engine.score([[1, 2, 3]]),
        "begin_weight_update": engine.begin_weight_update,
        "sleep": engine.sleep,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"{name}: a weight update failed \(update_weights raised ValueError"):
            call()

    engine.shutdown()
    assert not torch.distributed.is_initialized()
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: the engine was shut down"):
            call()
    engine.shutdown()  # a second shutdown does nothing
