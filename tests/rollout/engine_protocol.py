"""The weight-update rules of ``rollout.engine.RolloutEngine``, asserted the same way for every
engine (``test_vllm_engine``, ``test_hf_engine``)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from megatron_empg.config import SamplingConfig


def assert_update_protocol_enforced(
    engine, prompts: Sequence[Sequence[int]], probes: Sequence[Sequence[int]], sampling: SamplingConfig
) -> None:
    """Each call out of order, and each bad argument of ``update_weights``, raises naming itself;
    leaves ``engine`` with an update begun that sent nothing."""
    with pytest.raises(RuntimeError, match="update_weights: no weight update in progress"):
        engine.update_weights(path="/nonexistent")
    with pytest.raises(RuntimeError, match="finish_weight_update: no weight update in progress"):
        engine.finish_weight_update("v")
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="begin_weight_update: a weight update is already in progress"):
        engine.begin_weight_update()
    with pytest.raises(ValueError, match="exactly one of named_tensors, path and ipc, got named_tensors and path"):
        engine.update_weights(named_tensors=[("lm_head.weight", torch.zeros(1))], path="/nonexistent")
    with pytest.raises(ValueError, match="exactly one of named_tensors, path and ipc, got none"):
        engine.update_weights()
    with pytest.raises(ValueError, match="named_tensors is empty"):
        engine.update_weights(named_tensors=[])
    with pytest.raises(TypeError, match=r"named_tensors\[0\]: expected a \(str, torch.Tensor\) pair"):
        engine.update_weights(named_tensors=[("lm_head.weight", [0.0])])
    with pytest.raises(FileNotFoundError, match="path '/nonexistent' is not a file"):
        engine.update_weights(path="/nonexistent")
    for method, call in [
        ("generate", lambda: engine.generate(prompts, sampling)),
        ("score", lambda: engine.score(probes)),
        ("score_topk", lambda: engine.score_topk(probes, 2)),
        ("sleep", engine.sleep),
    ]:
        with pytest.raises(RuntimeError, match=f"{method}: a weight update is in progress; call finish_weight_update"):
            call()
    with pytest.raises(ValueError, match="version must be a non-empty string"):
        engine.finish_weight_update("")
