"""``algorithm.router_replay`` at the bind step: refused, naming the field, where no engine routing
can be replayed (a dense model, multi-turn or partial rollouts); vLLM on a machine without a GPU
by the machine check on the run's nodes (before any engine starts: a login node without GPUs binds
the GPU recipes); accepted for the transformers engine, and for vLLM on a GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import ConfigError, RunConfig, load_config
from megatron_empg.trainer.bind.build import bind
from tests.trainer.demo_runs import DEMO_RECIPE

REPLAY = ("model=tiny-qwen3-moe", "algorithm.router_replay=rollout")
PARTIAL = (
    "rollout.placement=disaggregated",
    "rollout.engine_ranks=1",
    "rollout.max_staleness=1",
    "rollout.partial=true",
    "rollout.in_process=false",
    "weight_sync.transport=shm_file",
)


def config(tmp_path, *overrides: str) -> RunConfig:
    return load_config(RunConfig, DEMO_RECIPE, ["checkpoint.init_from=null", f"tokenizer={tmp_path}", *overrides])


@pytest.mark.parametrize(
    "overrides, world, gpu, words",
    [
        (("algorithm.router_replay=rollout",), 1, False, "model 'qwen2' has no experts: set it to none"),
        (
            (*REPLAY, "rollout.engine=hf", "rollout.search_agent={retriever_url: 'http://localhost:1'}"),
            1,
            False,
            "not built for the search agent",
        ),
        ((*REPLAY, *PARTIAL), 3, True, "cannot take rollout.partial"),
        (("algorithm.router_replay=always",), 1, False, "expected one of 'rollout', 'none', got 'always'"),
    ],
)
def test_router_replay_is_refused_where_nothing_can_be_replayed(tmp_path, monkeypatch, overrides, world, gpu, words):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)  # the check reads the device, nothing else
    with pytest.raises(ConfigError) as e:
        bind(config(tmp_path, *overrides), world)
    assert e.value.field == "algorithm.router_replay" and words in str(e.value), e.value


def test_router_replay_binds_for_the_transformers_engine_and_for_vllm_on_a_gpu(tmp_path, monkeypatch):
    from megatron_empg.trainer.bind.machine import check_machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hf = bind(config(tmp_path, *REPLAY, "rollout.engine=hf"), 1)
    assert hf.engine.target.endswith("HfEngine")
    check_machine(hf.config, hf.model, engine_rank=False)
    vllm = bind(config(tmp_path, *REPLAY), 1)  # a login node without GPUs binds the GPU recipe
    assert vllm.engine.target.endswith("VllmEngine")
    with pytest.raises(ConfigError) as e:  # the run's own node: before the engine starts
        check_machine(vllm.config, vllm.model, engine_rank=False)
    assert (
        e.value.field == "algorithm.router_replay"
        and "returns its routed experts on cpu (['hf']); rollout.engine 'vllm' returns them on ['cuda'] only"
        in str(e.value)
    ), e.value
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check reads the device, nothing else
    check_machine(vllm.config, vllm.model, engine_rank=False)
