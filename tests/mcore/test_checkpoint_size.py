"""``mcore.checkpoint.size.checkpoint_bytes`` against the bytes ``save_checkpoint`` writes.

A 2-layer tiny-qwen2 widened to hidden 256 (1.7M parameters, vocabulary padded from 1000 to 1024)
is saved after one Adam step, in fresh processes (``tests.dist``):

    world 1: bf16 params with an EMA anchor; fp32 params without one (no main params saved)
    world 2: DP2 with the distributed optimizer, bf16, anchor: fully_reshardable (every tensor
             given to one DP rank by the fully parallel save) and dp_reshardable (each rank its
             own optimizer shard)

The prediction leaves out the zip framing (~4 KiB per tensor entry), ``.metadata`` and the small
JSON and RNG entries, under 1% here: it must lie within ``TOLERANCE`` below the bytes on disk,
in total and for each rank's shard file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_empg.config import OptimizerConfig, ParallelConfig, load_model_config
from megatron_empg.mcore.checkpoint.size import checkpoint_bytes
from tests.dist import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

MODEL = "tiny-qwen2"
OVERRIDES = ("hidden_size=256", "ffn_hidden_size=512", "vocab_size=1000", "num_layers=2")
TOLERANCE = 0.02
REPO = Path(__file__).resolve().parents[2]


def _save(root: str, *, dtype: torch.dtype, distopt: bool, anchor: bool, optimizer_format: str) -> dict:
    """Build, take one Adam step, save into ``root``; the sizes of the checkpoint's files."""
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore.anchor import EmaAnchor
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.optimizer import build_optimizer, build_scheduler, wrap_with_ddp
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    cfg = load_model_config(MODEL, OVERRIDES)
    parallel = ParallelConfig()
    groups = initialize_model_parallel(parallel, seed=0)
    try:
        settings = OptimizerConfig(lr=1e-3, use_distributed_optimizer=distopt)
        ddp = wrap_with_ddp(build_gpt_model(cfg, parallel, params_dtype=dtype), settings)
        optimizer = build_optimizer(ddp, settings)
        ema = (
            EmaAnchor.from_configs(cfg, parallel, ddp, optimizer, tau=0.5, period=1, compute_dtype=dtype)
            if anchor
            else None
        )
        for module in ddp:
            for param in module.parameters():
                param.main_grad.normal_()
        optimizer.step()
        if ema is not None:
            ema.update()
        path = ckpt.save_checkpoint(
            root,
            ckpt.TrainState(1),
            ckpt.CheckpointParts(ddp, optimizer=optimizer, scheduler=build_scheduler(optimizer, settings), anchor=ema),
            groups,
            options=ckpt.SaveOptions(optimizer_format=optimizer_format),
        )
        return {"path": str(path), "files": ckpt.list_files(path)}
    finally:
        destroy_model_parallel()


def _world1(rank: int, world_size: int, root: str) -> dict:
    return {
        "bf16_anchor": _save(
            f"{root}/bf16", dtype=torch.bfloat16, distopt=False, anchor=True, optimizer_format="fully_reshardable"
        ),
        "fp32_no_anchor": _save(
            f"{root}/fp32", dtype=torch.float32, distopt=False, anchor=False, optimizer_format="fully_reshardable"
        ),
    }


def _world2(rank: int, world_size: int, root: str) -> dict:
    return {
        fmt: _save(f"{root}/{fmt}", dtype=torch.bfloat16, distopt=True, anchor=True, optimizer_format=fmt)
        for fmt in ("fully_reshardable", "dp_reshardable")
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("checkpoint_size")
    return {1: run_distributed(_world1, 1, str(root / "w1"))[0], 2: run_distributed(_world2, 2, str(root / "w2"))[0]}


CASES = {  # id: (world size, saved case, params dtype, distributed optimizer, anchor, optimizer format)
    "dp1_bf16_anchor": (1, "bf16_anchor", "bfloat16", False, True, "fully_reshardable"),
    "dp1_fp32_no_anchor": (1, "fp32_no_anchor", "float32", False, False, "fully_reshardable"),
    "dp2_distopt_fully_reshardable": (2, "fully_reshardable", "bfloat16", True, True, "fully_reshardable"),
    "dp2_distopt_dp_reshardable": (2, "dp_reshardable", "bfloat16", True, True, "dp_reshardable"),
}


def _within(predicted: int, actual: int) -> bool:
    return actual * (1 - TOLERANCE) <= predicted <= actual


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_predicted_bytes_match_the_files_written(saved, case):
    world, key, dtype, distopt, anchor, fmt = CASES[case]
    files = saved[world][key]["files"]
    predicted = checkpoint_bytes(
        load_model_config(MODEL, OVERRIDES),
        ParallelConfig(),
        OptimizerConfig(use_distributed_optimizer=distopt),
        anchor=anchor,
        params_dtype=dtype,
        world_size=world,
        optimizer_format=fmt,
    )
    total = sum(files.values())
    assert _within(predicted.total, total), (predicted.total, total, files)
    shards = [files[f"__{rank}_0.distcp"] for rank in range(world)]  # one file per rank (thread_count 1)
    assert all(_within(p, a) for p, a in zip(predicted.per_rank, shards, strict=True)), (predicted.per_rank, shards)


def test_fp32_params_save_no_main_params_and_no_anchor_saves_no_master():
    cfg, parallel = load_model_config(MODEL, OVERRIDES), ParallelConfig()
    n = cfg.num_parameters(padded_vocab_size=parallel.padded_vocab_size(cfg.vocab_size))
    plain = checkpoint_bytes(cfg, parallel, OptimizerConfig(), anchor=False, params_dtype="float32", world_size=1)
    assert dict(plain.parts) == {"model": 4 * n, "main_params": 0, "adam": 8 * n, "anchor": 0}
    distributed = checkpoint_bytes(
        cfg,
        parallel,
        OptimizerConfig(use_distributed_optimizer=True),
        anchor=True,
        params_dtype="bfloat16",
        world_size=8,
    )
    assert dict(distributed.parts) == {"model": 2 * n, "main_params": 4 * n, "adam": 8 * n, "anchor": 4 * n}
    assert sum(distributed.per_rank) == distributed.total and distributed.max_per_rank < distributed.total / 7


def test_tp_and_pp_split_the_parameters_without_loss():
    cfg = load_model_config("qwen2.5-1.5b")
    one = checkpoint_bytes(cfg, ParallelConfig(), OptimizerConfig(), anchor=True, params_dtype="bfloat16", world_size=1)
    split = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    four = checkpoint_bytes(cfg, split, OptimizerConfig(), anchor=True, params_dtype="bfloat16", world_size=4)
    assert one.total == 18 * cfg.num_parameters()  # 151936 rows: a multiple of 128, no padding at TP1
    # TP2 pads the vocabulary to a multiple of 2 x 128: 152064 rows; tied: the embedding is saved once.
    assert four.total == 18 * cfg.num_parameters(padded_vocab_size=152064)
    assert len(four.per_rank) == 4 and sum(four.per_rank) == four.total


@pytest.mark.parametrize(
    "layout,world",
    [
        ({}, 1),
        ({"expert_model_parallel_size": 2}, 2),
        ({"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}, 4),
        (
            {
                "expert_model_parallel_size": 4,
                "expert_tensor_parallel_size": 1,
                "tensor_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
            },
            8,
        ),
    ],
)
def test_experts_are_saved_once_at_any_expert_layout(layout, world):
    cfg = load_model_config("qwen3-30b-a3b")
    parallel = ParallelConfig(**layout)
    saved = checkpoint_bytes(cfg, parallel, OptimizerConfig(), anchor=True, params_dtype="bfloat16", world_size=world)
    assert saved.total == 18 * cfg.num_parameters(padded_vocab_size=parallel.padded_vocab_size(cfg.vocab_size))
    assert len(saved.per_rank) == world and sum(saved.per_rank) == pytest.approx(saved.total, abs=world * 18)


def test_module_imports_neither_torch_nor_megatron():
    code = "import sys, megatron_empg.mcore.checkpoint.size; print(sorted({'torch', 'megatron'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"


def test_every_rank_records_the_crc32s_of_the_files_it_wrote(saved):
    from megatron_empg.mcore.checkpoint import files as checkpoint_files

    for fmt in ("fully_reshardable", "dp_reshardable"):
        path = Path(saved[2][fmt]["path"])
        manifest = checkpoint_files.read_manifest(path)
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= manifest.keys()
        for name, entry in manifest.items():
            assert checkpoint_files.file_crc32(path / name) == (entry["size"], entry["crc32"]), (fmt, name)
