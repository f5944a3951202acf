"""What the two converters (convert_hf_to_megatron.py, convert_megatron_to_hf.py) share: the dtype
option, refusals that name a command-line argument, the HF tensors of each Megatron tensor (the
checks of a HF directory and the comparison of two model configs are
``megatron_empg.weight_sync.hf_files``'s, which the bind step shares)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping

import torch

from megatron_empg.config import ModelConfig
from megatron_empg.weight_sync import mapping
from tools.safetensors_stream import PlannedTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


class ArgumentProblem(Exception):
    """A refusal: what is wrong, attributed to the command-line argument ``argument``."""

    def __init__(self, argument: str, message: str) -> None:
        self.argument, self.message = argument, message
        super().__init__(f"{argument}: {message}")


def run_cli(
    parser: argparse.ArgumentParser, argv: list[str] | None, convert: Callable[[argparse.Namespace], None]
) -> int:
    """Parse ``argv`` and run ``convert``; an ``ArgumentProblem`` becomes argparse's usage error
    (the message on stderr, exit code 2)."""
    args = parser.parse_args(argv)
    try:
        convert(args)
    except ArgumentProblem as e:
        parser.error(str(e))
    return 0


def resolve_dtype(option: str, stored: Iterable[torch.dtype], where: str) -> torch.dtype:
    """The dtype of ``--dtype``: a name of ``DTYPES``, or ``auto``: the one dtype of ``stored``."""
    if option != "auto":
        return DTYPES[option]
    found = sorted({str(d).removeprefix("torch.") for d in stored})
    if len(found) != 1:
        raise ArgumentProblem(
            "--dtype", f"auto needs a single dtype, but {where} holds {found}; pick one of {list(DTYPES)}"
        )
    return getattr(torch, found[0])


def hf_plan(model: ModelConfig, shapes: Mapping[str, torch.Size], dtype: torch.dtype) -> dict[str, list[PlannedTensor]]:
    """Megatron name -> the HF tensors ``mapping.to_hf`` makes of it (name, shape; ``dtype``), in
    the mapping's order, worked out on meta tensors of the full shapes ``shapes`` (a tied output
    layer makes none). The mapping's names must be exactly those of ``shapes``."""
    names = mapping.megatron_tensor_names(model)
    if set(names) != set(shapes):
        raise RuntimeError(
            f"the weight mapping and Megatron's model disagree on the tensors of {model.name}: only in the "
            f"mapping {sorted(set(names) - set(shapes))}, only in the model {sorted(set(shapes) - set(names))}"
        )
    plan = {}
    for name in names:
        meta = torch.empty(shapes[name], dtype=dtype, device="meta")
        plan[name] = [PlannedTensor(hf_name, tuple(t.shape), dtype) for hf_name, t in mapping.to_hf(name, meta, model)]
    return plan
