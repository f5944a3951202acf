"""What the two converters (convert_hf_to_megatron.py, convert_megatron_to_hf.py) share: the dtype
option, refusals that name a command-line argument, the HF tensors of each Megatron tensor, and
the comparison of two model configs' architectures."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from megatron_empg.config import ModelConfig
from megatron_empg.weight_sync import mapping
from tools.safetensors_stream import PlannedTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# ModelConfig fields that decide the tensors' names, shapes and meaning.
ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "norm_epsilon",
    "add_qkv_bias",
    "qk_layernorm",
    "tie_word_embeddings",
)
MAX_LISTED = 12  # names listed in one message


class ArgumentProblem(Exception):
    """A refusal: what is wrong, attributed to the command-line argument ``argument``."""

    def __init__(self, argument: str, message: str) -> None:
        self.argument, self.message = argument, message
        super().__init__(f"{argument}: {message}")


def listed(names: Sequence[str]) -> str:
    """The first ``MAX_LISTED`` names, and how many more."""
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


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


def architecture_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """``"field: a != b"`` for every architecture field in which ``a`` and ``b`` differ."""
    return [
        f"{f}: {getattr(a, f)!r} != {getattr(b, f)!r}" for f in ARCHITECTURE_FIELDS if getattr(a, f) != getattr(b, f)
    ]
