"""HF <-> Megatron checkpoint converters (tools/convert_hf_to_megatron.py, convert_megatron_to_hf.py)
and their streaming core (``megatron_empg.mcore.convert``).

Round trip for each family, with tiny random HF models of tools/make_tiny_model.py (tiny-qwen2:
QKV biases, vocabulary 250 padded to 256; tiny-llama: tied embeddings; tiny-qwen3: q/k norms,
head_dim != hidden / heads; tiny-qwen3-moe: 8 experts in HF's per-expert tensors, loaded at expert
parallel size 2): HF -> Megatron checkpoint written for TP 1/2 x PP 1/2 -> loaded at that layout by 2 gloo ranks with ``load_checkpoint`` -> logits equal the HF model's (fp32, 1e-5)
-> back to HF -> every tensor bit-identical to the original safetensors, and transformers loads
the model (same logits) and the tokenizer. Also: a training checkpoint (optimizer, scheduler,
anchor, RNG; DP2 with the distributed optimizer) converts to its model's HF tensors; bf16;
sharded output; the streamed checkpoint's storage metadata equals ``dist_checkpointing.save``'s;
a failing write leaves nothing behind; every refusal exits with code 2 and names the problem.

Three spawns: ``_convert_all`` (1 rank: every HF -> Megatron conversion and the checks that need
Megatron), ``_load_all`` (2 ranks: every layout's load and forward, and the training run), and
``_back_all`` (1 rank: every Megatron -> HF conversion). Refusals that fail before Megatron is
imported run in the test process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_empg.config import ParallelConfig, load_model_config, to_yaml
from megatron_empg.mcore.checkpoint import TrainState
from tests.dist import run_distributed
from tests.mcore.test_model import MICRO_BATCH, NUM_MICROBATCHES, SEQ

pytestmark = [pytest.mark.dist, pytest.mark.megatron]

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"]
# (case, model, tp, pp, extra arguments of convert_hf_to_megatron.py); loaded on 2 ranks (DP = 2 / (TP x PP))
LAYOUT_CASES = [
    ("qwen2-tp2", "tiny-qwen2", 2, 1, []),
    ("qwen2-pp2", "tiny-qwen2", 1, 2, []),
    ("qwen3-tp2", "tiny-qwen3", 2, 1, []),
    ("llama-tp2", "tiny-llama", 2, 1, []),
    ("llama-pp2", "tiny-llama", 1, 2, []),  # the tied embedding on both stages
    ("llama-tp1pp1", "tiny-llama", 1, 1, []),
    ("qwen3moe-ep2", "tiny-qwen3-moe", 1, 1, []),  # loaded at EP 2: each rank its 4 of the 8 experts
]
BF16_CASE = ("qwen2-bf16", "tiny-qwen2", 1, 1, ["--dtype", "bfloat16"])  # converted both ways, not loaded
CASES = LAYOUT_CASES + [BF16_CASE]
SHARDED_CASE, SHARD_BYTES = "qwen3-tp2", 100_000  # converted back with --max-shard-size 100KB
TOL = dict(rtol=1e-5, atol=1e-5)
QUIET = ["--no-progress"]


# --------------------------------------------------------------------------------------------
# Running the tools in a process and capturing what they print.


def _run_tool(tool: str, argv: list[str]) -> dict:
    """``tools/<tool>.py``'s ``main(argv)``: exit code and stderr (argparse errors exit with 2)."""
    module = __import__(f"tools.{tool}", fromlist=["main"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = module.main(argv)
        except SystemExit as e:
            code = e.code
    return {"code": code, "stderr": err.getvalue()}


def _to_megatron(hf_dir: Path, out: Path, *args: str) -> list[str]:
    return [str(hf_dir), str(out), *args, *QUIET]


def _tool_error(tool: str, argv: list[str]) -> str:
    """Run a tool in this process; it must refuse (exit code 2); its stderr."""
    result = _run_tool(tool, argv)
    assert result["code"] == 2, result
    assert "Traceback" not in result["stderr"]
    return result["stderr"]


# --------------------------------------------------------------------------------------------
# Rank-side work.


def _convert_all(rank: int, world_size: int, work: str, hf_dirs: dict) -> dict:
    """Every HF -> Megatron conversion, the refusal found inside Megatron (shapes), a streaming
    write that counts its calls, one that fails midway, and a reference ``save_checkpoint``."""
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore.convert import full_tensor_shapes, megatron_session, write_model_checkpoint
    from megatron_empg.mcore.model import build_gpt_model

    work = Path(work)
    results = {}
    for case, name, tp, pp, extra in CASES:
        argv = _to_megatron(hf_dirs[name], work / f"mg-{case}", "--tp", str(tp), "--pp", str(pp), *extra)
        results[case] = _run_tool("convert_hf_to_megatron", argv)
    argv = _to_megatron(work / "hf-wrong-shape", work / "mg-wrong-shape", "--tp", "1", "--pp", "1")
    results["wrong_shape"] = _run_tool("convert_hf_to_megatron", argv)

    cfg = load_model_config("tiny-qwen3")
    with megatron_session() as groups:
        shapes = full_tensor_shapes(cfg, 384)
        calls: list[str] = []

        def zeros(name: str) -> torch.Tensor:
            calls.append(name)
            return torch.zeros(shapes[name])

        progress: list[str] = []
        write_model_checkpoint(
            work / "mg-zeros", cfg, ParallelConfig(), zeros, dtype=torch.float32, progress=progress.append
        )
        results["progress"] = progress
        results["calls"], results["names"] = list(calls), list(shapes)

        def failing(name: str) -> torch.Tensor:
            if len(calls) >= 3:
                raise RuntimeError("the disk is on fire")
            calls.append(name)
            return torch.zeros(shapes[name])

        calls.clear()
        try:
            write_model_checkpoint(work / "crash" / "mg", cfg, ParallelConfig(), failing, dtype=torch.float32)
            results["crash"] = "no error"
        except RuntimeError as e:
            results["crash"] = str(e)
        results["crash_leftovers"] = sorted(os.listdir(work / "crash"))

        (model,) = build_gpt_model(cfg, ParallelConfig(make_vocab_size_divisible_by=384))
        ckpt.save_checkpoint(work / "ref-save", ckpt.TrainState(0), ckpt.CheckpointParts([model]), groups)
    return results


def _load_all(rank: int, world_size: int, work: str, batches: dict, qwen2_hf_dir: str) -> dict:
    """Each converted checkpoint loaded at its layout (model config from the checkpoint), forward;
    then a DP2 training run with the distributed optimizer saves a checkpoint with everything."""
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel
    from tests.mcore.test_checkpoint import _Run
    from tests.mcore.test_model import _forward

    work = Path(work)
    results = {}
    for case, name, tp, pp, _ in LAYOUT_CASES:
        path = work / f"mg-{case}"
        cfg = ckpt.read_model_config(path)
        experts = dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather") if cfg.is_moe else {}
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **experts)
        groups = initialize_model_parallel(parallel, seed=7)
        chunks = build_gpt_model(cfg, parallel)
        state = ckpt.load_checkpoint(path, ckpt.CheckpointParts(chunks), groups)
        results[case] = {"state": state, "logits": _forward(chunks, batches[name], cfg.vocab_size)}
        destroy_model_parallel()

    run = _Run(1, True)  # tiny-qwen2, DP2, distributed optimizer, EMA anchor
    try:
        run.step()
        ckpt.save_checkpoint(
            work / "train",
            ckpt.TrainState(1, data={"cursor": 1}),
            run.parts(),
            run.groups,
            model=ckpt.ModelMetadata(config=run.cfg, hf_assets=qwen2_hf_dir),
        )
        results["train_params"] = {name: p for name, (p, _) in run.snapshot()["params"].items()}
    finally:
        run.close()
    return results


def _back_all(rank: int, world_size: int, work: str, hf_dirs: dict) -> dict:
    """Every Megatron -> HF conversion (the training run's root too), and the refusal found
    inside Megatron: a checkpoint that does not fit the model config given."""
    work = Path(work)
    results = {}
    for case, *_ in CASES:
        extra = ["--max-shard-size", "100KB"] if case == SHARDED_CASE else []
        results[case] = _run_tool(
            "convert_megatron_to_hf", [str(work / f"mg-{case}"), str(work / f"back-{case}"), *extra, *QUIET]
        )
    results["train"] = _run_tool("convert_megatron_to_hf", [str(work / "train"), str(work / "back-train"), *QUIET])
    argv = [
        str(work / "mg-qwen2-tp2"),
        str(work / "back-misfit"),
        "--model-config",
        str(work / "misfit.yaml"),
        "--hf-assets",
        str(work / "no-assets"),
        *QUIET,
    ]
    results["misfit"] = _run_tool("convert_megatron_to_hf", argv)
    return results


# --------------------------------------------------------------------------------------------
# Fixtures.


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert")


@pytest.fixture(scope="module")
def hf_dirs(work) -> dict[str, Path]:
    from tools.make_tiny_model import save_tiny_hf_model

    dirs = {name: save_tiny_hf_model(load_model_config(name), work / f"hf-{name}", seed=3) for name in FAMILIES}
    wrong = shutil.copytree(dirs["tiny-qwen2"], work / "hf-wrong-shape")  # config.json no longer fits the tensors
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    # a model config that does not fit a tiny-qwen2 checkpoint (q/k norms, other head_dim), and no HF files
    misfit = dataclasses.replace(load_model_config("tiny-qwen3"), name="misfit", vocab_size=250)
    (work / "misfit.yaml").write_text(to_yaml(misfit))
    (work / "no-assets").mkdir()
    return dirs


@pytest.fixture(scope="module")
def batches() -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        name: [
            {"tokens": torch.randint(0, load_model_config(name).vocab_size, (MICRO_BATCH, SEQ), generator=g)}
            for _ in range(NUM_MICROBATCHES)
        ]
        for name in FAMILIES
    }


def _hf_logits(model_dir: Path, batches: list[dict]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(b["tokens"]).logits for b in batches]


@pytest.fixture(scope="module")
def converted(work, hf_dirs) -> dict:
    return run_distributed(_convert_all, 1, str(work), hf_dirs, timeout=200)[0]


@pytest.fixture(scope="module")
def loaded(work, hf_dirs, converted, batches) -> list[dict]:
    return run_distributed(_load_all, 2, str(work), batches, str(hf_dirs["tiny-qwen2"]), timeout=200)


@pytest.fixture(scope="module")
def back(work, hf_dirs, loaded) -> dict:
    return run_distributed(_back_all, 1, str(work), hf_dirs, timeout=200)[0]


def _safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        part = load_file(file)
        assert not set(part) & set(tensors)
        tensors.update(part)
    return tensors


# --------------------------------------------------------------------------------------------
# HF -> Megatron.


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_conversion_to_megatron_succeeds_and_keeps_what_the_reverse_needs(converted, work, case):
    assert converted[case]["code"] == 0, converted[case]["stderr"]
    path = work / f"mg-{case}"
    info = json.loads((path / "empg_checkpoint.json").read_text())
    assert info["complete"] and info["step"] == 0
    assert info["parts"] == {
        "model": True,
        "optimizer": None,
        "optimizer_format": None,
        "scheduler": False,
        "anchor": False,
        "rng": False,
        "model_config": True,
        "hf_assets": True,
    }
    _, name, tp, pp, _ = next(c for c in CASES if c[0] == case)
    assert (info["layout"]["tp"], info["layout"]["pp"]) == (tp, pp)
    cfg = load_model_config(path / "model_config.yaml")
    assert info["padded_vocab_size"] == ParallelConfig(tensor_model_parallel_size=tp).padded_vocab_size(cfg.vocab_size)
    assets = sorted(p.name for p in (path / "hf").iterdir())
    assert "config.json" in assets and "tokenizer.json" in assets and not [a for a in assets if "safetensors" in a]
    assert not [p for p in work.iterdir() if ".tmp-" in p.name]


def test_streaming_write_asks_for_each_tensor_once(converted):
    from megatron_empg.weight_sync.mapping import megatron_tensor_names

    calls = converted["calls"]  # in the order of the checkpoint's keys (one key holds a weight of every layer)
    assert len(calls) == len(set(calls)) and sorted(calls) == sorted(converted["names"])
    assert converted["progress"] == calls
    assert sorted(converted["names"]) == sorted(megatron_tensor_names(load_model_config("tiny-qwen3")))


def test_streamed_checkpoint_has_the_storage_layout_of_dist_checkpointing_save(converted, work):
    """Same keys, global shapes, dtypes and chunks as Megatron's own save of the same model."""
    from torch.distributed.checkpoint import FileSystemReader

    def layout(path: Path) -> dict:
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {
            key: (tuple(m.size), m.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
            if hasattr(m, "chunks")
            else "bytes"
            for key, m in metadata.items()
            if not key.startswith("rng_state")  # save_checkpoint adds the RNG states
        }

    ours, megatrons = layout(work / "mg-zeros"), layout(work / "ref-save" / "step_00000000")
    assert ours == megatrons
    layers = load_model_config("tiny-qwen3").num_layers
    assert len(ours["decoder.layers.mlp.linear_fc1.weight"][2]) == 2 * layers  # [gate; up]: 2 chunks per layer


def test_failed_write_leaves_no_output_and_no_temp_dir(converted):
    assert converted["crash"] == "the disk is on fire"
    assert converted["crash_leftovers"] == []


def test_hf_tensors_of_the_wrong_shape_are_refused_by_name(converted, work):
    result = converted["wrong_shape"]
    assert result["code"] == 2
    assert (
        "HF_DIR: 12 tensors have the wrong shape: model.layers.0.mlp.gate_proj.weight (128, 64) (config.json implies (96, 64))"
        in result["stderr"]
    )
    assert not (work / "mg-wrong-shape").exists()


# --------------------------------------------------------------------------------------------
# Loading at TP/PP layouts.


@pytest.mark.parametrize("case", [c[0] for c in LAYOUT_CASES])
def test_converted_checkpoint_loads_at_its_layout_with_the_hf_logits(hf_dirs, loaded, batches, case):
    _, name, tp, pp, _ = next(c for c in LAYOUT_CASES if c[0] == case)
    expected = _hf_logits(hf_dirs[name], batches[name])
    last_stage = [r[case] for r in loaded if r[case]["logits"] is not None]
    assert len(last_stage) == 2 // pp  # every rank of the last stage (TP ranks and DP replicas)
    for result in last_stage:
        assert result["state"] == TrainState(0)  # model-only: no loop state, every default
        for actual, want in zip(result["logits"], expected, strict=True):
            torch.testing.assert_close(actual, want, **TOL)


# --------------------------------------------------------------------------------------------
# Megatron -> HF.


@pytest.mark.parametrize("case", [c[0] for c in LAYOUT_CASES])
def test_round_trip_gives_bit_identical_hf_tensors_that_transformers_loads(hf_dirs, back, work, batches, case):
    from transformers import AutoTokenizer

    _, name, *_ = next(c for c in LAYOUT_CASES if c[0] == case)
    assert back[case]["code"] == 0, back[case]["stderr"]
    out = work / f"back-{case}"
    original, converted = _safetensors(hf_dirs[name]), _safetensors(out)
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        assert converted[key].dtype == tensor.dtype and torch.equal(converted[key], tensor), key
    for actual, want in zip(_hf_logits(out, batches[name]), _hf_logits(hf_dirs[name], batches[name]), strict=True):
        assert torch.equal(actual, want)
    text = "Hello, world!\n"
    assert (
        AutoTokenizer.from_pretrained(out)(text).input_ids
        == AutoTokenizer.from_pretrained(hf_dirs[name])(text).input_ids
    )
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dirs[name] / "config.json").read_text())
    assert (out / "generation_config.json").is_file()


def test_large_output_is_sharded_with_an_index(back, work):
    out = work / f"back-{SHARDED_CASE}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    sizes = {f: 0 for f in files}
    tensors = _safetensors(out)
    for key, file in index["weight_map"].items():
        sizes[file] += tensors[key].numel() * tensors[key].element_size()
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert all(size <= SHARD_BYTES for size in sizes.values())


def test_bf16_conversion_rounds_once_and_round_trips(hf_dirs, back, work):
    assert back["qwen2-bf16"]["code"] == 0
    assert json.loads((work / "mg-qwen2-bf16" / "empg_checkpoint.json").read_text())["dtype"] == "bfloat16"
    original, converted = _safetensors(hf_dirs["tiny-qwen2"]), _safetensors(work / "back-qwen2-bf16")
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        assert converted[key].dtype == torch.bfloat16 and torch.equal(converted[key], tensor.to(torch.bfloat16)), key
    assert json.loads((work / "back-qwen2-bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_training_checkpoint_converts_to_its_model(back, loaded, work):
    from megatron_empg.weight_sync import mapping

    assert back["train"]["code"] == 0, back["train"]["stderr"]
    assert "converting " + str(work / "train" / "step_00000001") in back["train"]["stderr"]
    info = json.loads((work / "train" / "step_00000001" / "empg_checkpoint.json").read_text())
    assert info["parts"]["optimizer"] == "saved" and info["parts"]["anchor"] and info["parts"]["rng"]
    cfg = load_model_config("tiny-qwen2")
    expected = {}
    for name, param in loaded[0]["train_params"].items():
        expected.update(mapping.to_hf(name, param, cfg))
    converted = _safetensors(work / "back-train")
    assert sorted(converted) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(converted[key], tensor), key


def test_checkpoint_that_does_not_fit_the_model_config_is_refused_by_name(back, work):
    result = back["misfit"]
    assert result["code"] == 2
    assert "CKPT: checkpoint" in result["stderr"] and "does not fit its model config (misfit)" in result["stderr"]
    assert "tensors missing: decoder.layers.0.self_attention.q_layernorm.weight (key " in result["stderr"]
    assert (
        "shapes differ: embedding.word_embeddings.weight: the checkpoint's embedding.word_embeddings.weight is "
        "(256, 64), the model config implies (256, 64)"
    ) not in result["stderr"]  # equal shapes are not listed
    assert (
        "decoder.layers.0.self_attention.linear_qkv.weight: the checkpoint's "
        "decoder.layers.self_attention.linear_qkv.weight is (4, 128, 64), the model config implies (2, 256, 64)"
    ) in result["stderr"]
    assert not (work / "back-misfit").exists()


# --------------------------------------------------------------------------------------------
# Refusals before any conversion work (in this process).


def test_refusals_of_convert_hf_to_megatron(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = hf_dirs["tiny-qwen2"]
    out = tmp_path / "out"
    tool = "convert_hf_to_megatron"
    nonempty = tmp_path / "nonempty"
    nonempty.mkdir()
    (nonempty / "x").write_text("x")
    assert "OUT: refusing to write: " + f"{nonempty} exists and is not empty" in _tool_error(
        tool, _to_megatron(hf, nonempty, "--tp", "1", "--pp", "1")
    )
    assert "HF_DIR: " + f"{tmp_path} has no config.json" in _tool_error(
        tool, _to_megatron(tmp_path, out, "--tp", "1", "--pp", "1")
    )
    assert "--pp: pipeline_model_parallel_size=3 does not divide model.num_layers=4" in _tool_error(
        tool, _to_megatron(hf, out, "--tp", "1", "--pp", "3")
    )
    assert "--tp: tensor_model_parallel_size=3 does not divide model.num_attention_heads=4" in _tool_error(
        tool, _to_megatron(hf, out, "--tp", "3", "--pp", "1")
    )
    assert "--tp: expected a positive integer, got 0" in _tool_error(
        tool, _to_megatron(hf, out, "--tp", "0", "--pp", "1")
    )

    def variant(
        label: str, config: dict | None = None, drop: str | None = None, bf16: str | None = None, cut: int = 0
    ) -> Path:
        """A copy of the tiny-qwen2 HF dir with a changed config.json or safetensors."""
        d = shutil.copytree(hf, tmp_path / label)
        if config is not None:
            (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
        if drop or bf16:
            tensors = load_file(d / "model.safetensors")
            tensors.pop(drop, None)
            if bf16:
                tensors[bf16] = tensors[bf16].to(torch.bfloat16)
            save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        if cut:
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[:-cut])
        return d

    unknown = variant("unknown", config={"architectures": ["GPT2LMHeadModel"]})
    assert (
        "config.json: architectures: expected exactly one of ['LlamaForCausalLM', 'Qwen2ForCausalLM', "
        in _tool_error(tool, _to_megatron(unknown, out, "--tp", "1", "--pp", "1"))
    )
    missing = variant("missing", drop="model.layers.1.mlp.up_proj.weight")
    assert "HF_DIR: tensors missing from the safetensors (1 of 51): model.layers.1.mlp.up_proj.weight" in _tool_error(
        tool, _to_megatron(missing, out, "--tp", "1", "--pp", "1")
    )
    truncated = variant("truncated", cut=10)
    assert "is truncated: " in _tool_error(tool, _to_megatron(truncated, out, "--tp", "1", "--pp", "1"))
    mixed = variant("mixed", bf16="model.norm.weight")
    assert "--dtype: auto needs a single dtype, but" in _tool_error(
        tool, _to_megatron(mixed, out, "--tp", "1", "--pp", "1")
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_refusals_of_convert_megatron_to_hf(converted, hf_dirs, work, tmp_path):
    source = work / "mg-qwen2-tp2"
    out = tmp_path / "out"
    tool = "convert_megatron_to_hf"
    incomplete = shutil.copytree(source, tmp_path / "incomplete")
    (incomplete / "empg_checkpoint.json").unlink()
    message = _tool_error(tool, [str(incomplete), str(out), *QUIET])
    assert (
        "CKPT: not a complete checkpoint: " in message
        and "(the completion marker written last by save_checkpoint): incomplete" in message
    )
    no_config = shutil.copytree(source, tmp_path / "no-config")
    (no_config / "model_config.yaml").unlink()
    info = json.loads((no_config / "empg_checkpoint.json").read_text())  # saved without it: not in the manifest
    del info["files"]["model_config.yaml"]
    (no_config / "empg_checkpoint.json").write_text(json.dumps(info))
    message = _tool_error(tool, [str(no_config), str(out), *QUIET])
    assert "CKPT: " in message and "has no model_config.yaml" in message and "(pass --model-config)" in message
    message = _tool_error(tool, [str(source), str(out), "--hf-assets", str(hf_dirs["tiny-llama"]), *QUIET])
    assert (
        "--hf-assets: " in message
        and "describes another model than the checkpoint's model config: family: 'llama' != 'qwen2'" in message
    )
    assert "argument --max-shard-size: expected a size such as 500MB, 5GB or 2GiB, got 'big'" in _tool_error(
        tool, [str(source), str(out), "--max-shard-size", "big"]
    )
    nonempty = work / "mg-qwen2-pp2"
    assert f"OUT: refusing to write: {nonempty} exists and is not empty" in _tool_error(
        tool, [str(source), str(nonempty), *QUIET]
    )
    assert not out.exists()


def test_cli_refusal_is_a_usage_message_with_exit_code_2(hf_dirs, tmp_path):
    script = REPO / "tools" / "convert_hf_to_megatron.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(hf_dirs["tiny-qwen2"]), str(tmp_path / "out"), "--tp", "2", "--pp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: convert_hf_to_megatron.py")
    assert "error: --pp: pipeline_model_parallel_size=3 does not divide model.num_layers=4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_atomic_output_dir_replaces_only_on_success(tmp_path):
    from megatron_empg.mcore.convert import OutputDirError, atomic_output_dir

    out = tmp_path / "out"
    with pytest.raises(KeyError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half").write_text("written")
            raise KeyError("crash")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()  # an empty directory is replaced
    with atomic_output_dir(out) as tmp:
        (tmp / "done").write_text("complete")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "done").read_text() == "complete"
    with pytest.raises(OutputDirError, match="exists and is not empty"):
        with atomic_output_dir(out):
            pass
