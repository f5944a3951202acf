"""A model chunk's weights under the full model's names: layer and expert numbering across
pipeline and expert-parallel ranks, tensor-parallel shards, and full (TP1/PP1) state dicts in and out.

Layer names: each chunk numbers its layers ``decoder.layers.0 ..`` locally; ``layer_offset(chunk)``
and ``global_name`` map them to the full model's indices (checkpoints and weight sync use the global
names). Experts are named one by one: a ``GroupedExperts`` weight stacking a rank's experts
(``mlp.experts.linear_fc1.weight`` [E_local, ...]) is, row by row, the per-expert tensors
``mlp.experts.local_experts.<j>.linear_fc1.weight`` that ``SequentialMLP`` holds (``split_experts``),
so full state dicts, the weight sync and HF conversion see the same names whichever
``model.moe_experts`` built the model. Megatron is imported lazily (after the CPU shims): the
pure-torch helpers (``tp_slice``, ``global_name``, ``split_experts``) work without it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron_empg.mcore import cpu_shims
from megatron_empg.mcore.lora.model import is_adapter
from megatron_empg.mcore.lora.weights import merged_weights
from megatron_empg.mcore.moe.layout import expert_offset, is_expert_parameter, shift_experts, stacked_expert_names

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

# Parameters whose rows are the (padded) vocabulary, sharded over TP along dim 0.
VOCAB_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


# --------------------------------------------------------------------------------------------
# Layer numbering across pipeline stages.


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """``decoder.layers.<i>.`` is numbered per model chunk, and experts per expert-parallel rank:
    shift both to the full model's indices."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name)
    return shift_experts(name, expert_offset) if expert_offset else name


def local_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """Inverse of ``global_name``."""
    return global_name(name, -layer_offset, -expert_offset)


def megatron_layer_offset(config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    """Megatron's global index of the first layer of (``pp_rank``, ``vp_stage``); current rank by default."""
    cpu_shims.import_megatron()
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)


def global_layer_indices(chunk: GPTModel) -> list[int]:
    """The full model's (0-based) index of each of ``chunk``'s ``decoder.layers``."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]


def layer_offset(chunk: GPTModel) -> int:
    """Global index of ``chunk``'s ``decoder.layers.0`` (its layers are consecutive)."""
    indices = global_layer_indices(chunk)
    if not indices:
        return megatron_layer_offset(chunk.config, getattr(chunk, "vp_stage", None))
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise RuntimeError(f"layers of a model chunk are not consecutive: {indices}")
    return indices[0]


def global_names(chunk: GPTModel) -> dict[str, str]:
    """``chunk``'s state-dict keys -> the full model's names. A stacked expert weight keeps its
    own (layer-shifted) name: ``split_experts`` names its rows."""
    offset, experts = layer_offset(chunk), expert_offset(chunk)
    return {name: global_name(name, offset, experts) for name in chunk.state_dict()}


# --------------------------------------------------------------------------------------------
# Loading a full (TP1/PP1) state dict.


def tp_partition(param: torch.Tensor | None) -> tuple[int, int] | None:
    """(partition_dim, partition_stride) of a TP-sharded parameter; None if replicated over TP."""
    if getattr(param, "tensor_model_parallel", False):
        return param.partition_dim, param.partition_stride
    return None


def split_experts(
    name: str, tensor: torch.Tensor, partition: tuple[int, int] | None = None
) -> list[tuple[str, torch.Tensor, tuple[int, int] | None]]:
    """``(name, tensor, partition)`` as per-expert entries: a stacked ``GroupedExperts`` weight
    (``...mlp.experts.linear_fc<1|2>.weight`` [E, ...]) becomes E entries ``...mlp.experts.
    local_experts.<j>.linear_fc<1|2>.weight`` with the views ``tensor[j]`` (no copy) and the
    partition of one expert (the stacked one's dim - 1), exactly what ``SequentialMLP``'s
    parameters give; any other name is returned as it is. ``name`` may be local or global (the
    expert indices are local: ``global_name`` shifts them)."""
    names = stacked_expert_names(name, tensor.shape[0]) if tensor.dim() == 3 else None
    if names is None:
        return [(name, tensor, partition)]
    per_expert = None if partition is None else (partition[0] - 1, partition[1])
    return [(expert, tensor[j], per_expert) for j, expert in enumerate(names)]


def tp_slice(full: torch.Tensor, partition: tuple[int, int] | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor that Megatron shards as ``partition`` (see above).

    A stride > 1 (SwiGLU's fc1 stacks [gate; up] rows: stride 2) means each rank owns every
    ``tp_size``-th of ``tp_size * stride`` equal chunks.
    """
    if partition is None or tp_size == 1:
        return full
    dim, stride = partition
    if full.size(dim) % (tp_size * stride):
        raise ValueError(f"dim {dim} of size {full.size(dim)} does not split into {tp_size} x {stride} chunks")
    chunks = torch.split(full, full.size(dim) // (tp_size * stride), dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def resize_vocab(full: torch.Tensor, rows: int, vocab_size: int | None = None) -> torch.Tensor:
    """``full`` with ``rows`` vocabulary rows: padding rows added as zeros or dropped.

    With ``vocab_size`` (the real vocabulary), rows from ``vocab_size`` on are zeroed and dropping
    a real row is an error.
    """
    if vocab_size is not None and (full.size(0) < vocab_size or rows < vocab_size):
        raise ValueError(f"vocabulary rows {full.size(0)} -> {rows} must both cover the vocab_size {vocab_size}")
    if full.size(0) > rows:
        full = full[:rows]
    elif full.size(0) < rows:
        full = torch.cat([full, full.new_zeros(rows - full.size(0), *full.shape[1:])])
    if vocab_size is not None and vocab_size < rows:
        full = full.clone()
        full[vocab_size:] = 0
    return full


def shard_full_state_dict(
    chunk: GPTModel,
    full_state_dict: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    layer_offset: int,
    *,
    vocab_size: int | None = None,
    canonical_name: Callable[[str], str] | None = None,
    expert_offset: int = 0,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> None:
    """Load this rank's TP slice of a full state dict into ``chunk`` (layers shifted by ``layer_offset``).

    Experts: this rank's ``local_experts.<j>`` is the full model's expert ``j + expert_offset``,
    split over the expert tensor-parallel ranks (``etp_rank`` of ``etp_size``) instead of TP; a
    stacked ``GroupedExperts`` weight is filled from its experts' per-expert full tensors
    (``split_experts``).

    The full state dict uses global layer indices; its vocabulary rows may be padded differently
    (or not at all): they are resized to the chunk's padded vocabulary (see ``resize_vocab``). With
    tied embeddings a last pipeline stage's ``output_layer.weight`` comes from the embedding.
    ``canonical_name`` maps the chunk's names to the full state dict's spelling (the Transformer
    Engine spec's fused-norm names to the local spec's: ``weight_sync.mapping.canonical_name``).
    """
    params = dict(chunk.named_parameters())
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    sharded = {}
    for name, local in chunk.state_dict().items():
        experts = split_experts(name, local, tp_partition(params.get(name))) if torch.is_tensor(local) else []
        if len(experts) > 1 or (experts and experts[0][0] != name):
            pieces = []
            for expert, view, partition in experts:
                key = global_name(expert, layer_offset, expert_offset)
                key = canonical_name(key) if canonical_name is not None else key
                full = full_state_dict.get(key)
                if not torch.is_tensor(full):
                    raise KeyError(f"{key} (row of the stacked {name}) is missing from the full state dict")
                pieces.append(_expert_piece(full, partition, etp_rank, etp_size, view, key))
            sharded[name] = torch.stack(pieces).to(dtype=local.dtype, device=local.device)
            continue
        key = global_name(name, layer_offset, expert_offset)
        if canonical_name is not None:
            key = canonical_name(key)
        full = full_state_dict.get(key)
        if full is None and tied and key == "output_layer.weight":
            full = full_state_dict.get("embedding.word_embeddings.weight")
        if not torch.is_tensor(full):
            if torch.is_tensor(local) and not name.endswith("_extra_state") and not is_adapter(name):
                raise KeyError(f"{key} (local {name}) is missing from the full state dict")
            sharded[name] = local  # `_extra_state` entries, adapters a base does not have: the chunk's own
            continue
        partition = tp_partition(params.get(name))
        if name in VOCAB_PARAMETERS:
            full = resize_vocab(full, local.size(0) * (tp_size if partition else 1), vocab_size)
        if is_expert_parameter(name):
            piece = _expert_piece(full, partition, etp_rank, etp_size, local, key)
        else:
            piece = tp_slice(full, partition, tp_rank, tp_size)
            if piece.shape != local.shape:
                raise ValueError(
                    f"{key}: the full tensor gives a {tuple(piece.shape)} slice, the model has {tuple(local.shape)}"
                )
        sharded[name] = piece.to(dtype=local.dtype, device=local.device).clone()
    chunk.load_state_dict(sharded, strict=True)


def _expert_piece(full, partition, etp_rank: int, etp_size: int, local: torch.Tensor, key: str) -> torch.Tensor:
    """This expert-TP rank's slice of an expert's full tensor, checked against its local shape."""
    piece = tp_slice(full, partition, etp_rank, etp_size)
    if piece.shape != local.shape:
        raise ValueError(
            f"{key}: the full tensor gives a {tuple(piece.shape)} slice, the model has {tuple(local.shape)}"
        )
    return piece


def load_full_state_dict(
    chunks: Sequence[GPTModel],
    full_state_dict: Mapping[str, torch.Tensor],
    *,
    vocab_size: int | None = None,
    canonical_name: Callable[[str], str] | None = None,
) -> None:
    """Load this rank's TP/PP(/VPP) slice of a TP1/PP1 state dict into its model chunks (arguments:
    ``shard_full_state_dict``)."""
    cpu_shims.import_megatron()
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp_rank, etp_size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    for chunk in chunks:
        shard_full_state_dict(
            chunk,
            full_state_dict,
            tp_rank,
            tp_size,
            layer_offset(chunk),
            vocab_size=vocab_size,
            canonical_name=canonical_name,
            expert_offset=expert_offset(chunk),
            etp_rank=etp_rank,
            etp_size=etp_size,
        )


def named_weight_shards(
    chunks: Sequence[torch.nn.Module], *, adapters: bool = False
) -> list[tuple[str, torch.Tensor, tuple[int, int] | None]]:
    """This rank's parameters as (global name, local tensor, TP partition) for a weight sync.

    ``chunks`` may be DDP-wrapped. The partition is ``tp_partition``'s (None: replicated over TP;
    an expert's is over the expert tensor-parallel ranks: ``is_expert_parameter``); the tensors are
    the parameters themselves (no copy), a stacked expert weight's rows views of it
    (``split_experts``). Experts carry their global index: each expert-parallel rank names only its own.
    A LoRA policy's adapted linears give their merged weights (new tensors; ``mcore.lora.weights``)
    under the base's names, and the adapters nothing: the engine serves the merged model. With
    ``adapters``, the adapters alone instead (the ``adapter`` weight sync: ``mcore.lora.sync``).
    """
    out = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        offset, experts = layer_offset(module), expert_offset(module)
        merged = {} if adapters else merged_weights(module)
        for name, param in module.named_parameters():
            if is_adapter(name) != adapters:
                continue
            tensor = merged.get(name, param)
            for expert, view, partition in split_experts(name, tensor, tp_partition(param)):
                out.append((global_name(expert, offset, experts), view, partition))
    return out


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits ``[..., V_padded / TP]`` -> ``[..., vocab_size]`` (padding columns dropped)."""
    cpu_shims.import_megatron()
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
