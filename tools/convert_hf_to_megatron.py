"""Convert a Hugging Face model (config.json + safetensors) into a Megatron distributed checkpoint
that the trainer starts from, one tensor in memory at a time.

    python tools/convert_hf_to_megatron.py HF_DIR OUT --tp 2 --pp 2 [--dtype auto] [--name NAME]

OUT becomes a model-only checkpoint of ``megatron_empg.mcore.checkpoint`` (no optimizer,
scheduler, anchor or RNG state; step 0): ``load_checkpoint(OUT, CheckpointParts(chunks), groups)``
loads it into ``build_gpt_model`` chunks at any TP/PP/VPP. ``--tp``/``--pp`` (and ``--vpp``) are
the layout it is written for: they are checked against the model (heads, layers) and set the
padded vocabulary (``ParallelConfig.padded_vocab_size``). OUT also holds ``model_config.yaml``
and a copy of HF_DIR's config and tokenizer files (``hf/``), so that convert_megatron_to_hf.py
needs nothing but the checkpoint. OUT is written in a temp directory next to it and renamed at the
end; it must not exist or be empty.

Refused, with exit code 2 and a message naming the argument: an unknown architecture or an
unsupported config field, a layout that does not divide the model, missing or unreadable
safetensors, missing HF tensors (named), shapes that differ from what config.json implies
(named), mixed dtypes with ``--dtype auto``, an existing non-empty OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_empg.config import ConfigError, ParallelConfig  # noqa: E402
from megatron_empg.weight_sync.hf_files import listed  # noqa: E402
from tools.conversion import DTYPE_CHOICES, ArgumentProblem, hf_plan, resolve_dtype, run_cli  # noqa: E402

if TYPE_CHECKING:
    import torch

    from megatron_empg.config import ModelConfig
    from tools.safetensors_stream import SafetensorsDirectory

# ParallelConfig field -> the option that sets it
PARALLEL_OPTIONS = {
    "tensor_model_parallel_size": "--tp",
    "pipeline_model_parallel_size": "--pp",
    "virtual_pipeline_model_parallel_size": "--vpp",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_hf_to_megatron.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "hf_dir", metavar="HF_DIR", type=Path, help="HF model directory: config.json, *.safetensors, tokenizer"
    )
    parser.add_argument(
        "out", metavar="OUT", type=Path, help="checkpoint directory to create (must not exist or be empty)"
    )
    parser.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size the checkpoint is for")
    parser.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel size the checkpoint is for")
    parser.add_argument("--vpp", type=positive_int, default=None, help="virtual pipeline stages per pipeline rank")
    parser.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="Megatron's vocabulary padding multiple (times TP); default 128",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="dtype of the stored weights; auto: the safetensors' dtype",
    )
    parser.add_argument("--name", default=None, help="model name recorded in the checkpoint (default: HF_DIR's name)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def convert(args: argparse.Namespace) -> None:
    from megatron_empg.mcore.convert import output_dir_problem
    from megatron_empg.weight_sync import mapping
    from megatron_empg.weight_sync.hf_files import HFDirectoryError, check_hf_directory

    problem = output_dir_problem(args.out)
    if problem is not None:
        raise ArgumentProblem("OUT", f"refusing to write: {problem}")
    try:  # the bind step's check of checkpoint.init_from too
        model, stored = check_hf_directory(args.hf_dir, args.name)
    except HFDirectoryError as e:
        raise ArgumentProblem("HF_DIR", str(e)) from e
    try:
        parallel = ParallelConfig(
            tensor_model_parallel_size=args.tp,
            pipeline_model_parallel_size=args.pp,
            virtual_pipeline_model_parallel_size=args.vpp,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        )
        parallel.validate_for(model)
    except ConfigError as e:
        raise ArgumentProblem(PARALLEL_OPTIONS.get(e.field, "--tp/--pp"), e.reason) from e
    needed = mapping.hf_tensor_names(model)
    unused = sorted(set(stored.tensors) - set(needed))
    if unused:
        print(f"note: ignoring {len(unused)} tensors the model does not use: {listed(unused)}", file=sys.stderr)
    dtype = resolve_dtype(args.dtype, (stored.tensors[name].dtype for name in needed), f"{args.hf_dir}'s safetensors")
    _write(args, model, parallel, stored, dtype)


def _write(
    args: argparse.Namespace,
    model: ModelConfig,
    parallel: ParallelConfig,
    stored: SafetensorsDirectory,
    dtype: torch.dtype,
) -> None:
    """Check the HF tensors' shapes against the model, then stream them into the checkpoint."""
    from tqdm import tqdm

    from megatron_empg.mcore.convert import OutputDirError, full_tensor_shapes, megatron_session, write_model_checkpoint
    from megatron_empg.weight_sync import mapping
    from tools.safetensors_stream import SafetensorsError

    padded = parallel.padded_vocab_size(model.vocab_size)
    with megatron_session():
        plan = hf_plan(model, full_tensor_shapes(model, padded), dtype)
        wrong = [
            f"{t.name} {stored.tensors[t.name].shape} (config.json implies {t.shape})"
            for tensors in plan.values()
            for t in tensors
            if stored.tensors[t.name].shape != t.shape
        ]
        if wrong:
            raise ArgumentProblem("HF_DIR", f"{len(wrong)} tensors have the wrong shape: {listed(wrong)}")

        def full_tensor(name: str) -> torch.Tensor:
            hf = {hf_name: stored.read(hf_name) for hf_name in mapping.hf_names_of(name, model)}
            return mapping.to_megatron(name, hf, model, padded)

        provenance = {"hf_dir": str(args.hf_dir.resolve()), "architecture": mapping.architecture(model).hf_architecture}
        try:
            with tqdm(total=len(plan), desc="converting", unit="tensor", disable=args.no_progress) as bar:
                write_model_checkpoint(
                    args.out,
                    model,
                    parallel,
                    full_tensor,
                    dtype=dtype,
                    hf_assets=args.hf_dir,
                    provenance=provenance,
                    progress=lambda name: bar.update(),
                )
        except SafetensorsError as e:  # e.g. a file truncated inside a tensor
            raise ArgumentProblem("HF_DIR", str(e)) from e
        except OutputDirError as e:
            raise ArgumentProblem("OUT", str(e)) from e
    count = model.num_parameters(padded_vocab_size=padded)
    print(
        f"wrote {args.out}: {model.name} ({model.family}), {count:,} parameters in {str(dtype).removeprefix('torch.')}, "
        f"vocabulary padded {model.vocab_size} -> {padded} for TP{parallel.tensor_model_parallel_size} "
        f"PP{parallel.pipeline_model_parallel_size}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv, convert)


if __name__ == "__main__":
    sys.exit(main())
