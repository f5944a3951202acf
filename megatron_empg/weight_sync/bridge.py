"""Streaming the policy's weights from Megatron ranks into a rollout engine, in HF names.

Every rank of the job calls ``sync_weights`` together. Per pipeline stage, the *stage leader*
(TP rank 0 of data-parallel replica 0) gathers each TP-sharded tensor from its TP group (one
``gather`` per tensor: the full tensor exists on one rank, one tensor at a time), converts it to
HF names and layouts (``mapping.to_hf``) and puts it into a bucket of ``bucket_bytes``. Stage 0's
leader holds the engine (and the transport); the other stage leaders send their buckets to it
over the pipeline group (a header object, then one flat byte buffer per bucket), stage by stage.
The other data-parallel replicas only wait, unless the model has an expert grid (a mixture of
experts with expert parallelism EP or expert tensor parallelism ETP > 1): each EP rank holds
other experts, and the EP group crosses the data-parallel replicas. Then every rank takes part in
the expert tensors: each is gathered over its ETP group (to ETP rank 0), then all-gathered over
the EP group (one tensor at a time), so that the stage leader, at ETP rank 0 of its EP group,
holds every expert's tensor once and sends it under its global index. With several engines
(``parallel.placement``) the first replica of each engine group does this for its engine, all of
them at once, each on its own node (the expert exchange serves every leader of an EP group). Afterwards every rank returns the same ``SyncReport`` as its engine's owner.

The ``Transport`` (``weight_sync.transport``) says how a bucket reaches the engine; the engine
drops its prefix cache when the update finishes, and serves ``version`` from then on.

When the consistency gate fails, ``round_trip_errors`` converts every tensor back
(``mapping.to_megatron``) and compares it with the Megatron tensor, and checks by fingerprints that
each bucketed tensor carries its own name: a layout or naming bug (experts exchanged) shows up in
its tensor family, which the gate's error names. (Done on every sync, those checks would cost
about two passes over the bytes: more than the sync itself.)
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.config import ModelConfig
from megatron_empg.parallel.placement import EnginePlacement
from megatron_empg.weight_sync import mapping
from megatron_empg.weight_sync.protocol import Transport
from megatron_empg.weight_sync.transport import pack_bucket, unpack_bucket


class WeightShard(NamedTuple):
    """One of this rank's parameters: its global Megatron name, this rank's TP shard, and
    Megatron's (partition_dim, partition_stride) for TP-sharded ones (None: replicated)."""

    name: str
    tensor: Tensor
    partition: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class SyncGroups:
    """The process groups of the sync: TP and PP groups of this rank, and whether it belongs to
    the data-parallel replica that sends (one per engine: the first it serves; the others wait).
    A mixture of experts adds this rank's expert-parallel and expert tensor-parallel groups
    (``mcore.parallel_state.ParallelGroups.ep_group`` / ``etp_group``; None: size 1)."""

    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    is_sending_replica: bool
    ep_group: dist.ProcessGroup | None = None
    etp_group: dist.ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp_group is not None else 0

    @property
    def tp_size(self) -> int:
        return dist.get_world_size(self.tp_group) if self.tp_group is not None else 1

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group) if self.pp_group is not None else 0

    @property
    def pp_size(self) -> int:
        return dist.get_world_size(self.pp_group) if self.pp_group is not None else 1

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group) if self.ep_group is not None else 0

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep_group) if self.ep_group is not None else 1

    @property
    def etp_rank(self) -> int:
        return dist.get_rank(self.etp_group) if self.etp_group is not None else 0

    @property
    def etp_size(self) -> int:
        return dist.get_world_size(self.etp_group) if self.etp_group is not None else 1

    @property
    def has_expert_grid(self) -> bool:
        """Experts split over several ranks: every rank takes part in their gathers."""
        return self.ep_size > 1 or self.etp_size > 1

    @property
    def is_stage_leader(self) -> bool:
        return self.is_sending_replica and self.tp_rank == 0

    @property
    def is_engine_rank(self) -> bool:
        """Holds the engine: the leader of pipeline stage 0."""
        return self.is_stage_leader and self.pp_rank == 0

    def engine_global_rank(self) -> int:
        """Global rank of the engine holder, as seen from this rank's replica (stage leaders only)."""
        return dist.get_global_rank(self.pp_group, 0) if self.pp_group is not None else dist.get_rank()


@dataclasses.dataclass
class SyncReport:
    """What one sync did (identical on every rank)."""

    version: str
    num_tensors: int = 0  # HF tensors sent
    num_buckets: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # wall time of the whole sync on the engine rank
    transport_seconds: float = 0.0  # of which inside the transport (engine loading included)

    @property
    def gbytes_per_second(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf


# --------------------------------------------------------------------------------------------
# Stage side: gather, convert, bucket.


def _gather_full(shard: WeightShard, group: dist.ProcessGroup | None, rank: int, size: int) -> Tensor | None:
    """The full tensor on rank 0 of ``group`` (TP, or ETP for an expert), None on its other ranks."""
    if shard.partition is None or size == 1:
        return shard.tensor.detach()
    local = shard.tensor.detach().contiguous()
    leader = dist.get_global_rank(group, 0)
    pieces = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
    dist.gather(local, pieces, dst=leader, group=group)
    return mapping.tp_merge(pieces, shard.partition) if pieces is not None else None


_EXPERT_INDEX = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def _gather_experts(
    shard: WeightShard, model: ModelConfig, groups: SyncGroups, own: Fingerprints | None = None
) -> list[tuple[str, Tensor]]:
    """An expert tensor of every EP rank of this rank's EP group: ``[(global name, full tensor)]`` on
    ETP rank 0 (EP rank order; ``[]`` on the other ETP ranks). EP rank r holds experts
    ``r * E/EP ..``, in the same order on every rank, so this rank's ``j``-th local expert tensor
    meets the ``j``-th of the others. With ``own``, this rank's own expert is fingerprinted into it
    under its HF names (before the exchange: the reference of ``round_trip_errors``' name check)."""
    full = _gather_full(shard, groups.etp_group, groups.etp_rank, groups.etp_size)
    if full is None:
        return []
    if own is not None:
        _fingerprint_into(own, shard.name, full, model)
    if groups.ep_size == 1:
        return [(shard.name, full)]
    full = full.contiguous()
    pieces = [torch.empty_like(full) for _ in range(groups.ep_size)]
    dist.all_gather(pieces, full, group=groups.ep_group)
    per_rank = model.num_experts // groups.ep_size
    match = _EXPERT_INDEX.search(shard.name)
    if match is None:
        raise KeyError(f"{shard.name}: an expert tensor without a local_experts.<e> index")
    local = int(match.group(2)) - groups.ep_rank * per_rank
    return [
        (f"{shard.name[: match.start(2)]}{r * per_rank + local}{shard.name[match.end(2) :]}", piece)
        for r, piece in enumerate(pieces)
    ]


def _round_trip_error(
    name: str, full: Tensor, converted: list[tuple[str, Tensor]], rule: mapping.TensorRule, model: ModelConfig
) -> float:
    """Max |Megatron -> HF -> Megatron - Megatron| of one tensor (padded vocabulary rows, which
    carry no meaning, excluded)."""
    if not converted:
        return 0.0
    back = mapping.to_megatron(name, dict(converted), model, full.size(0))
    if back.shape != full.shape:
        return math.inf
    if rule.layout == "vocab":
        back, full = back[: model.vocab_size], full[: model.vocab_size]
    if not full.numel():
        return 0.0
    # The normal case, a bit-exact round trip, costs one comparison pass and no temporaries: a
    # tensor sent as it is ("copy" layout) comes back as the same object; the others are compared
    # bit for bit (as integers: torch.equal on bf16 is ~2x slower) before any float arithmetic.
    if back is full or (back.dtype == full.dtype and torch.equal(_bits(back), _bits(full))):
        return 0.0
    return (back.float() - full.float()).abs().max().item()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """``tensor``'s bits as integers of the same size (a view)."""
    return tensor.view(_SAME_SIZE_INT[tensor.element_size()])


Fingerprints = dict[str, tuple[str, float]]  # HF name -> (tensor family, fingerprint)


def _fingerprint(tensor: Tensor) -> float:
    """A float64 position-weighted sum of ``tensor``'s values: another tensor (or the same values
    in another order) under its name changes it."""
    flat = tensor.detach().reshape(-1).to(torch.float64, copy=True)  # a fresh buffer: the same sum order
    return float(flat @ torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device))


def _fingerprint_into(out: Fingerprints, megatron_name: str, full: Tensor, model: ModelConfig) -> None:
    family = mapping.tensor_rule(megatron_name, model).family
    for hf_name, tensor in mapping.to_hf(megatron_name, full, model):
        out[hf_name] = (family, _fingerprint(tensor))


def stage_hf_tensors(
    shards: Iterable[WeightShard],
    model: ModelConfig,
    groups: SyncGroups,
    errors: dict[str, float] | None = None,
    own: Fingerprints | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """This stage's tensors in HF names and layouts, yielded on the stage leader only; every rank
    calls it (the other TP ranks of the sending replica take part in the gathers, and with an
    expert grid every rank in the expert gathers, and yield nothing). With ``errors``, the
    round-trip error per tensor family is collected into it on the stage leader (costs about two
    passes over the bytes, so the sync itself skips it; ``round_trip_errors`` runs it when the gate
    fails). With ``own``, each rank fingerprints the tensors it holds under their own global names
    (experts on ETP rank 0, the rest on the stage leader)."""
    if groups.is_stage_leader and groups.etp_rank != 0:
        raise ValueError(
            f"rank {dist.get_rank()}: the weight sync needs each stage leader (TP rank 0) at expert tensor-parallel "
            f"rank 0, it is at {groups.etp_rank}: make expert_tensor_parallel_size divide tensor_model_parallel_size"
        )
    for shard in shards:
        rule = mapping.tensor_rule(shard.name, model)
        if rule.is_expert and (groups.has_expert_grid or groups.is_sending_replica):
            tensors = _gather_experts(shard, model, groups, own)  # split over ETP, not TP
        elif groups.is_sending_replica:
            full = _gather_full(shard, groups.tp_group, groups.tp_rank, groups.tp_size)
            tensors = [(shard.name, full)] if full is not None else []
            if own is not None and full is not None:
                _fingerprint_into(own, shard.name, full, model)
        else:
            continue
        if not groups.is_stage_leader:
            continue
        for name, full in tensors:
            converted = mapping.to_hf(name, full, model)
            if errors is not None:
                error = _round_trip_error(name, full, converted, rule, model)
                errors[rule.family] = max(errors.get(rule.family, 0.0), error)
            yield from converted


def buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive groups of tensors of at most ``bucket_bytes`` (a larger tensor is a bucket alone)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# --------------------------------------------------------------------------------------------
# Pipeline stages -> engine rank.


def _send_stage(bucket_iter: Iterable[list[tuple[str, Tensor]]], groups: SyncGroups) -> None:
    dst = groups.engine_global_rank()
    for bucket in bucket_iter:
        header, flat = pack_bucket(bucket)
        dist.send_object_list([header, flat.numel()], dst=dst, group=groups.pp_group)
        dist.send(flat, dst=dst, group=groups.pp_group)
    dist.send_object_list([None, 0], dst=dst, group=groups.pp_group)


def _receive_stage(stage: int, groups: SyncGroups, device: torch.device) -> Iterator[list[tuple[str, Tensor]]]:
    src = dist.get_global_rank(groups.pp_group, stage)
    while True:
        box: list = [None, 0]
        dist.recv_object_list(box, src=src, group=groups.pp_group)
        header, numel = box
        if header is None:
            return
        flat = torch.empty(numel, dtype=torch.uint8, device=device)
        dist.recv(flat, src=src, group=groups.pp_group)
        yield unpack_bucket(header, flat)


# --------------------------------------------------------------------------------------------
# The sync.


def sync_weights(
    shards: Sequence[WeightShard],
    model: ModelConfig,
    groups: SyncGroups,
    transport: Transport | None,
    version: str,
    *,
    bucket_bytes: int,
    placement: EnginePlacement,
) -> SyncReport:
    """Push this rank's weights into its engine as ``version``; every rank calls it.

    ``transport`` is given on the engine rank (``groups.is_engine_rank``: ``placement.owner``,
    TP 0, PP 0 of the first DP replica its engine serves) and None elsewhere. The replica with
    ``groups.is_sending_replica`` (``placement.feeds_engine``) feeds the engine; with several
    engines they all sync at once, each from its own replica. Each owner shares its report inside
    its engine group (the world for one engine), so every rank returns its engine's report.
    """
    engine_rank = placement.owner
    shards = [WeightShard(*shard) for shard in shards]  # plain (name, tensor, partition) tuples work too
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    if groups.is_engine_rank != (transport is not None) or groups.is_engine_rank != (dist.get_rank() == engine_rank):
        raise ValueError(
            f"rank {dist.get_rank()}: the engine rank {engine_rank} (TP 0, PP 0 of its engine's first DP replica), "
            "and only it, "
            "needs a transport"
        )
    report = SyncReport(version=version)
    start = time.perf_counter()
    if groups.is_sending_replica or groups.has_expert_grid:
        local = stage_hf_tensors(shards, model, groups)
        if not groups.is_stage_leader:
            for _ in local:  # take part in the TP (and expert) gathers
                pass
        elif not groups.is_engine_rank:
            _send_stage(buckets(local, bucket_bytes), groups)
        else:
            device = shards[0].tensor.device if shards else torch.device("cpu")
            transport.begin()
            for stage in range(groups.pp_size):
                stage_buckets = buckets(local, bucket_bytes) if stage == 0 else _receive_stage(stage, groups, device)
                for bucket in stage_buckets:
                    sent = time.perf_counter()
                    transport.send(bucket)
                    report.transport_seconds += time.perf_counter() - sent
                    report.num_buckets += 1
                    report.num_tensors += len(bucket)
                    report.num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            finished = time.perf_counter()
            transport.finish(version)
            report.transport_seconds += time.perf_counter() - finished
            report.seconds = time.perf_counter() - start
    return placement.broadcast_from_owner(report)


def round_trip_errors(
    shards: Sequence[WeightShard], model: ModelConfig, groups: SyncGroups, *, bucket_bytes: int | None = None
) -> dict[str, float]:
    """The gate's diagnosis, per tensor family over the whole model, on every rank; every rank calls
    it (the gathers of a sync, nothing sent to the engine). A family with an error has a bug:

    - the round trip: max |Megatron -> HF -> Megatron - Megatron| (a layout bug);
    - the name check: each stage leader buckets and packs its HF tensors as a sync would (buckets of
      ``bucket_bytes``, None: one tensor each) and fingerprints them by name; every rank
      fingerprints the tensors it holds itself by their own global names (an expert on its EP rank,
      before the exchange). A tensor that arrives under another's name (experts swapped, a wrong
      expert index), twice, or unknown is an error of ``inf`` in its family.

    Not seen: what happens after the bridge hands a bucket over (transport, engine loading).
    """
    shards = [WeightShard(*shard) for shard in shards]
    errors: dict[str, float] = {}
    own: Fingerprints = {}
    sent: dict[str, list[float]] = {}  # what the stage leader would send, by name
    if groups.is_sending_replica or groups.has_expert_grid:
        for bucket in buckets(stage_hf_tensors(shards, model, groups, errors, own), bucket_bytes or 1):
            for name, tensor in unpack_bucket(*pack_bucket(bucket)):
                sent.setdefault(name, []).append(_fingerprint(tensor))
    everyone = [(errors, own, sent)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (errors, own, sent))
    reference: Fingerprints = {}
    for rank_errors, rank_own, _ in everyone:
        reference.update(rank_own)
        for family, error in rank_errors.items():
            errors[family] = max(errors.get(family, 0.0), error)
    for _, _, rank_sent in everyone:
        for name, prints in rank_sent.items():
            family, expected = reference.get(name, ("unknown names", math.nan))
            if len(prints) != 1 or prints[0] != expected:
                errors[family] = math.inf
    return errors
