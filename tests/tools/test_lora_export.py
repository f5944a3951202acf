"""A LoRA policy's checkpoint out to HF and back in: tools/convert_megatron_to_hf.py writes a PEFT
adapter (which ``peft`` loads onto the HF base) and the merged model (which ``transformers``
loads), both giving the trained Megatron model's logits; ``checkpoint.init_from`` takes the PEFT
adapter back on top of its base and gives the same logits again.

One spawned rank builds tiny-qwen3 with adapters on every projection from a random HF base, gives
the adapters random values (B too: zero B would hide a wrong B), saves an adapter checkpoint and
records its logits; then loads the PEFT export through ``load_initial_weights``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist import run_distributed
from tests.tools.test_convert import QUIET, _run_tool

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

MODEL = "tiny-qwen3"
LORA = ("lora.rank=4", "lora.alpha=8", "lora.targets=[all-linear]")
TOL = dict(rtol=1e-5, atol=1e-5)


def _ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(4))


def _megatron_logits(chunks, vocab: int) -> torch.Tensor:
    from megatron_empg.mcore import weights
    from megatron_empg.mcore.step import causal_mask

    ids = _ids()
    with torch.no_grad():
        logits = chunks[0](ids, torch.arange(ids.shape[1]).expand_as(ids), causal_mask(ids.shape[1]))
    return weights.gather_logits(logits, vocab)


def _build_from(init_from: str):
    from megatron_empg.config import ParallelConfig, RunConfig, load_config, load_model_config
    from megatron_empg.mcore.model import build_gpt_model
    from megatron_empg.trainer.run.start import load_initial_weights
    from tests.trainer.demo_runs import DEMO_RECIPE

    cfg = load_model_config(MODEL, LORA)
    run = load_config(RunConfig, DEMO_RECIPE, [f"model={MODEL}", f"checkpoint.init_from={init_from}"])
    chunks = build_gpt_model(cfg, ParallelConfig(), lora_seed=1)
    load_initial_weights(chunks, init_from, cfg, run, None)
    return cfg, chunks


def _worker(rank: int, world_size: int, work: str) -> dict:
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore import checkpoint as ckpt
    from megatron_empg.mcore.lora.base import base_record
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    work = Path(work)
    groups = initialize_model_parallel(ParallelConfig(), seed=5)
    try:
        cfg, chunks = _build_from(str(work / "base"))
        g = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for name, param in chunks[0].named_parameters():
                if ".lora." in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.1)
        logits = _megatron_logits(chunks, cfg.vocab_size)
        meta = ckpt.ModelMetadata(config=cfg, hf_assets=work / "base", base=base_record(work / "base"))
        ckpt.save_checkpoint(work / "run", ckpt.TrainState(3), ckpt.CheckpointParts(chunks), groups, model=meta)
    finally:
        destroy_model_parallel()
    return {"logits": logits}


def _reload_worker(rank: int, world_size: int, peft_dir: str) -> torch.Tensor:
    from megatron_empg.config import ParallelConfig
    from megatron_empg.mcore.parallel_state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=5)
    try:
        cfg, chunks = _build_from(peft_dir)
        return _megatron_logits(chunks, cfg.vocab_size)
    finally:
        destroy_model_parallel()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    from megatron_empg.config import load_model_config
    from tools.make_tiny_model import save_tiny_hf_model

    work = tmp_path_factory.mktemp("lora_export")
    save_tiny_hf_model(load_model_config(MODEL), work / "base", seed=2)
    out = run_distributed(_worker, 1, str(work), timeout=300)[0]
    out["work"] = work
    out["peft_tool"] = _run_tool("convert_megatron_to_hf", [str(work / "run"), str(work / "peft"), *QUIET])
    out["merged_tool"] = _run_tool(
        "convert_megatron_to_hf", [str(work / "run"), str(work / "merged"), "--merge", *QUIET]
    )
    return out


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def test_peft_loads_the_export_onto_the_base(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert exported["peft_tool"]["code"] == 0, exported["peft_tool"]["stderr"]
    work = exported["work"]
    config = json.loads((work / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and len(config["target_modules"]) == 7
    base = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32)
    plain = _hf_logits(base)
    model = PeftModel.from_pretrained(base, work / "peft")
    torch.testing.assert_close(_hf_logits(model), exported["logits"], **TOL)
    assert (plain - exported["logits"]).abs().max() > 1e-2  # the control: the adapters matter


def test_merged_export_gives_the_trained_logits(exported):
    from transformers import AutoModelForCausalLM

    assert exported["merged_tool"]["code"] == 0, exported["merged_tool"]["stderr"]
    model = AutoModelForCausalLM.from_pretrained(exported["work"] / "merged", dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(model), exported["logits"], **TOL)


def test_init_from_takes_the_peft_adapter_on_its_base(exported):
    logits = run_distributed(_reload_worker, 1, str(exported["work"] / "peft"), timeout=300)[0]
    torch.testing.assert_close(logits, exported["logits"], **TOL)


def test_merge_refuses_another_base(exported, tmp_path):
    from megatron_empg.config import load_model_config
    from tools.make_tiny_model import save_tiny_hf_model

    other = save_tiny_hf_model(load_model_config(MODEL), tmp_path / "other", seed=9)
    work = exported["work"]
    result = _run_tool(
        "convert_megatron_to_hf", [str(work / "run"), str(tmp_path / "out"), "--merge", "--base", str(other), *QUIET]
    )
    assert result["code"] == 2 and "--base" in result["stderr"] and "not the base" in result["stderr"]


@pytest.mark.parametrize(
    ("init_from", "overrides", "words"),
    [
        ("peft", LORA, None),  # the control: the adapter on its base binds
        ("peft", (), "is a PEFT LoRA adapter; the model has none"),
        ("peft", ("lora.rank=8", "lora.alpha=8", "lora.targets=[all-linear]"), "the PEFT adapter is lora.rank=4"),
        ("run", LORA, "holds a LoRA policy's adapters only"),  # adapters alone: no base to start from
    ],
    ids=["adapter", "no_lora", "other_rank", "adapter_checkpoint"],
)
def test_bind_checks_a_lora_init_from_naming_the_field(exported, tmp_path, init_from, overrides, words):
    from megatron_empg.config import ConfigError, RunConfig, load_config
    from megatron_empg.trainer.bind.build import bind
    from tests.trainer.demo_runs import DEMO_RECIPE

    work = exported["work"]
    config = load_config(
        RunConfig,
        DEMO_RECIPE,
        [
            f"model={MODEL}",
            f"model_overrides={json.dumps(list(overrides))}",
            f"checkpoint.init_from={work / init_from}",
            f"tokenizer={work / 'base'}",
            f"logging.dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'run' / 'checkpoints'}",
            "optimizer.use_distributed_optimizer=false",
        ],
    )
    if words is None:
        assert bind(config, 1).model.lora.rank == 4
        return
    with pytest.raises(ConfigError) as error:
        bind(config, 1)
    assert error.value.field == "checkpoint.init_from" and words in error.value.reason, error.value
