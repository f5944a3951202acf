"""Convert a Megatron distributed checkpoint (ours: converted or saved by training) into a Hugging
Face model directory, one tensor in memory at a time.

    python tools/convert_megatron_to_hf.py CKPT OUT [--dtype auto] [--max-shard-size 5GB]

CKPT is a checkpoint directory of ``megatron_empg.mcore.checkpoint`` (or a training run's root:
its newest complete checkpoint is taken). Only the model is read: optimizer, scheduler, anchor
and RNG parts are ignored, and the layout it was saved at does not matter. A LoRA policy's
checkpoint (its adapters) becomes a PEFT adapter, or with ``--merge`` the base (``--base``, default
the one it records) with the adapters merged in (``tools/lora_export.py``). OUT gets safetensors
(sharded with ``model.safetensors.index.json`` above ``--max-shard-size``), config.json,
generation_config.json and the tokenizer files, such that ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained(OUT)`` load it. The model config comes from the checkpoint's
``model_config.yaml`` (or ``--model-config``), config.json and the tokenizer from its ``hf/``
copy (or ``--hf-assets``). OUT is written in a temp directory next to it and renamed at the end;
it must not exist or be empty.

Refused, with exit code 2 and a message naming the argument: an incomplete checkpoint, one
without a model config, missing tensors or shapes that differ from the model config (named), HF
files whose config.json describes another architecture, mixed dtypes with ``--dtype auto``, an
existing non-empty OUT.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_empg.weight_sync.hf_files import architecture_differences  # noqa: E402
from tools.conversion import DTYPE_CHOICES, ArgumentProblem, hf_plan, resolve_dtype, run_cli  # noqa: E402
from tools.safetensors_stream import PlannedTensor, parse_size  # noqa: E402

if TYPE_CHECKING:
    from megatron_empg.config import ModelConfig
    from megatron_empg.mcore.convert import ModelCheckpointReader


def size_option(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_megatron_to_hf.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("ckpt", metavar="CKPT", type=Path, help="checkpoint directory (or a training run's root)")
    parser.add_argument(
        "out", metavar="OUT", type=Path, help="HF model directory to create (must not exist or be empty)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto", help="dtype of the written weights; auto: the checkpoint's"
    )
    parser.add_argument(
        "--max-shard-size",
        type=size_option,
        default="5GB",
        help="largest safetensors file, e.g. 500MB, 5GB, 2GiB (default 5GB)",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="model config (a name in model_configs/ or a YAML path) for a checkpoint without model_config.yaml",
    )
    parser.add_argument(
        "--hf-assets",
        type=Path,
        default=None,
        help="directory with the HF config and tokenizer files (default: the checkpoint's hf/)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write the base with the adapters merged in (default: a PEFT adapter)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        default=None,
        help="a LoRA checkpoint's base HF directory (default: the one the checkpoint records)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _checkpoint_dir(path: Path) -> Path:
    """``path`` if it is a complete checkpoint, else the newest complete one under it (a run's root)."""
    from megatron_empg.mcore.checkpoint import CheckpointError, checkpoint_problem, find_latest_checkpoint

    problem = checkpoint_problem(path)
    if problem is None:
        return path
    if path.is_dir() and not (path / "empg_checkpoint.json").exists():
        try:
            found = find_latest_checkpoint(path)
        except CheckpointError as e:
            raise ArgumentProblem("CKPT", str(e)) from e
        if found is not None:
            print(f"note: {path} is a checkpoint root; converting {found.path} ({found.reason})", file=sys.stderr)
            return found.path
    raise ArgumentProblem("CKPT", f"not a complete checkpoint: {problem}")


def convert(args: argparse.Namespace) -> None:
    from megatron_empg.config import ConfigError, load_model_config
    from megatron_empg.mcore.checkpoint import HF_ASSETS_DIR, CheckpointError, read_model_config
    from megatron_empg.mcore.convert import output_dir_problem

    problem = output_dir_problem(args.out)
    if problem is not None:
        raise ArgumentProblem("OUT", f"refusing to write: {problem}")
    ckpt = _checkpoint_dir(args.ckpt)
    try:
        model = load_model_config(args.model_config) if args.model_config else read_model_config(ckpt)
    except ConfigError as e:
        raise ArgumentProblem("--model-config", str(e)) from e
    except CheckpointError as e:
        raise ArgumentProblem("CKPT", f"{e} (pass --model-config)") from e
    assets = args.hf_assets if args.hf_assets is not None else ckpt / HF_ASSETS_DIR
    assets_option = "--hf-assets" if args.hf_assets is not None else "CKPT"
    if args.hf_assets is not None and not assets.is_dir():
        raise ArgumentProblem("--hf-assets", f"{assets} is not a directory")
    hf_config = _hf_config(model, assets, assets_option)
    if not any(assets.glob("tokenizer*")):
        print(f"warning: no tokenizer files in {assets}: AutoTokenizer will not load {args.out}", file=sys.stderr)
    _write(args, ckpt, model, assets, hf_config)


def _hf_config(model: ModelConfig, assets: Path, assets_option: str) -> dict:
    """config.json for OUT: the HF assets' own (checked against ``model``), else made from ``model``."""
    from megatron_empg.config import ConfigError
    from megatron_empg.weight_sync import mapping

    path = assets / "config.json"
    if not path.is_file():
        return dict(model.to_hf_config())
    try:
        hf_config = json.loads(path.read_text())
        differences = architecture_differences(mapping.model_config_from_hf(hf_config, name=model.name), model)
    except (ValueError, ConfigError) as e:
        raise ArgumentProblem(assets_option, f"{path}: {e}") from e
    if differences:
        raise ArgumentProblem(
            assets_option,
            f"{path} describes another model than the checkpoint's model config: {'; '.join(differences)}",
        )
    return hf_config


def _write(args: argparse.Namespace, ckpt: Path, model: ModelConfig, assets: Path, hf_config: dict) -> None:
    """Check the checkpoint against the model config, then convert it into OUT."""
    from megatron_empg.mcore.convert import ConversionError, ModelCheckpointReader, OutputDirError, megatron_session

    with megatron_session():
        try:
            reader = ModelCheckpointReader(ckpt, model)
        except ConversionError as e:
            raise ArgumentProblem("CKPT", str(e)) from e
        if reader.adapters_only:  # a LoRA policy's checkpoint: tools/lora_export.py
            from tools import lora_export

            write = lora_export.write_merged if args.merge else lora_export.write_peft
            try:
                print(write(args, reader, model))
            except OutputDirError as e:
                raise ArgumentProblem("OUT", str(e)) from e
            return
        if args.merge or args.base is not None:
            raise ArgumentProblem("--merge" if args.merge else "--base", f"{ckpt} holds no LoRA adapters")
        dtype = resolve_dtype(args.dtype, reader.dtypes.values(), f"checkpoint {ckpt}")
        plan = hf_plan(model, reader.shapes, dtype)
        try:
            files = _write_hf(args.out, reader, plan, assets, hf_config, args.max_shard_size, not args.no_progress)
        except OutputDirError as e:
            raise ArgumentProblem("OUT", str(e)) from e
    total = sum(t.nbytes for tensors in plan.values() for t in tensors)
    print(
        f"wrote {args.out}: {model.name} ({model.family}), {total / 1e9:.3f} GB of {str(dtype).removeprefix('torch.')} "
        f"in {len(files)} safetensors file(s)"
    )


def _write_hf(
    out: Path,
    reader: ModelCheckpointReader,
    plan: dict[str, list[PlannedTensor]],
    assets: Path,
    hf_config: dict,
    max_shard_size: int,
    progress: bool,
) -> list[str]:
    """Stream the tensors of ``plan`` from ``reader`` into safetensors in ``out`` (atomically), with
    config.json (``hf_config``, its dtype set), the HF assets and generation_config.json. Returns
    the safetensors files (and index) written."""
    from tqdm import tqdm

    from megatron_empg.mcore.checkpoint import copy_hf_assets
    from megatron_empg.mcore.convert import atomic_output_dir
    from megatron_empg.weight_sync import mapping
    from tools.safetensors_stream import SafetensorsShardWriter

    planned = [t for tensors in plan.values() for t in tensors]
    dtype = planned[0].dtype
    with atomic_output_dir(out) as tmp:
        writer = SafetensorsShardWriter(tmp, planned, max_shard_size)
        for name in tqdm(plan, desc="converting", unit="tensor", disable=not progress):
            if not plan[name]:  # a tied output layer: its tensor is the embedding, written already
                continue
            for hf_name, tensor in mapping.to_hf(name, reader.read(name), reader.model):
                writer.write(hf_name, tensor.to(dtype))
        files = writer.close()
        hf_config = {**hf_config, "dtype": str(dtype).removeprefix("torch.")}
        if "torch_dtype" in hf_config:  # the spelling of transformers < 5
            hf_config["torch_dtype"] = hf_config["dtype"]
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if assets.is_dir():
            copy_hf_assets(assets, tmp, exclude=("config.json",))
        if not (tmp / "generation_config.json").exists():
            _write_generation_config(tmp, hf_config)
    return files


def _write_generation_config(out: Path, hf_config: dict) -> None:
    """generation_config.json from config.json's token ids (as transformers' save_pretrained does)."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "transformers_version"})
    GenerationConfig.from_model_config(config).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv, convert)


if __name__ == "__main__":
    sys.exit(main())
