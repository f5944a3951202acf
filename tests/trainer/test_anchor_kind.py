"""Which storage the EMA anchor takes (``trainer.bind.anchor_kind``): ``algorithm.anchor.fp8`` and
the machine (TE, a GPU that multiplies in FP8), resolved once by ``bind`` and said by ``empg
check``; ``fp8: torch`` on a GPU without FP8 matmul is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from megatron_empg.config import ConfigError, RunConfig, load_config, load_model_config
from megatron_empg.trainer.bind import anchor_kind, machine

DEMO = "recipes/demo_cpu.yaml"
FP8 = ["algorithm.anchor.compute_dtype=float8_e4m3fn"]


def _config(*overrides: str) -> RunConfig:
    return load_config(RunConfig, DEMO, list(overrides))


def _gpu(monkeypatch, capability: tuple[int, int], te: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(anchor_kind, "te_fp8_possible", lambda: te)


def test_this_cpu_machine():
    assert anchor_kind.anchor_storage(_config()) == ("plain", "compute_dtype float32")
    kind, why = anchor_kind.anchor_storage(_config(*FP8))
    assert kind == "emulated" and why == "auto: no Transformer Engine; no GPU (the FP8 arithmetic, computed in float32)"
    assert anchor_kind.anchor_storage(_config(*FP8, "algorithm.anchor.fp8=torch")) == ("torch", "algorithm.anchor.fp8")


@pytest.mark.parametrize(
    ("capability", "te", "distopt", "expected"),
    [
        ((9, 0), False, False, ("torch", "auto: no Transformer Engine; this GPU (sm90) multiplies in FP8")),
        ((9, 0), True, True, ("torch", "auto: the distributed optimizer; this GPU (sm90) multiplies in FP8")),
        ((9, 0), True, False, ("te", "auto: Transformer Engine and a GPU")),
        (
            (8, 0),
            False,
            False,
            (
                "emulated",
                "auto: no Transformer Engine; a GPU without FP8 matmul (the FP8 arithmetic, computed in float32)",
            ),
        ),
    ],
)
def test_auto_on_gpus(monkeypatch, capability, te, distopt, expected):
    _gpu(monkeypatch, capability, te)
    config = _config(*FP8, f"optimizer.use_distributed_optimizer={str(distopt).lower()}")
    assert anchor_kind.anchor_storage(config) == expected


def test_torch_needs_an_fp8_gpu(monkeypatch):
    model = load_model_config("tiny-qwen2")
    config = _config(*FP8, "algorithm.anchor.fp8=torch")
    _gpu(monkeypatch, (8, 0), False)
    monkeypatch.setattr(machine, "fp8_matmul_possible", anchor_kind.fp8_matmul_possible)
    with pytest.raises(ConfigError) as e:
        machine.check_machine(config, model, engine_rank=False)
    assert e.value.field == "algorithm.anchor.fp8" and "sm80" in str(e.value) and "sm89 or newer" in str(e.value)
    _gpu(monkeypatch, (9, 0), False)
    machine.check_machine(config, model, engine_rank=False)  # an H100 / H200 takes it


def test_bind_resolves_it_and_empg_check_says_it():
    from megatron_empg.trainer.bind.build import bind
    from megatron_empg.trainer.cli import _describe

    components = bind(_config(*FP8), 1, check_paths=False)
    assert components.anchor_storage[0] == "emulated"
    assert "anchor FP8 storage emulated (auto: no Transformer Engine; no GPU" in _describe(components)
    assert "anchor FP8" not in _describe(bind(_config(), 1, check_paths=False))


def test_the_fp8_output_layer_is_for_the_row_wise_kinds():
    assert _config(*FP8, "algorithm.anchor.fp8_output_layer=true").algorithm.anchor.fp8_output_layer
    for overrides in (
        ["algorithm.anchor.fp8_output_layer=true"],
        [*FP8, "algorithm.anchor.fp8=te", "algorithm.anchor.fp8_output_layer=true"],
    ):
        with pytest.raises(ConfigError) as e:
            _config(*overrides)
        assert e.value.field == "algorithm.anchor.fp8_output_layer" and "row-wise FP8 kinds" in str(e.value)


def test_only_auto_goes_without_the_fp8_dtype():
    for kind in ("te", "torch", "emulated"):
        with pytest.raises(ConfigError) as e:
            _config(f"algorithm.anchor.fp8={kind}")
        assert e.value.field == "algorithm.anchor.fp8" and "needs compute_dtype float8_e4m3fn" in str(e.value)
