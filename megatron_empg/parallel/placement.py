"""Where the rollout engines live: one ``EnginePlacement`` that the rollout stage, the weight sync
and the consistency gate share.

E engines serve the D data-parallel replicas of a TP x PP x DP world: engine ``e`` serves the
replicas ``[e * D/E, (e+1) * D/E)`` and samples their prompts. Its *owner*, which starts the
engine process and holds it, is TP rank 0 / PP rank 0 of the first of those replicas; its *group*
is every rank of those replicas (the samples and the gate's probe travel inside it, never over
the whole world). The first replica of each engine feeds it the weights, so the E syncs run in
parallel, each from its own replica.

E = D (``rollout.engines: per_replica``) at TP 1 gives every rank its own engine and a group of
one; E = 1 (``single``) is one engine on global rank 0 whose group is the whole world.

Disaggregated engines (``rollout.placement``) live in the engine ranks' own world
(``engine_world_placement``: the same object, over engine ranks); the training ranks see them as
one engine behind their rank 0, the end of the link (``build_placement(1, ...)``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_empg.parallel.collectives import collective_device


@dataclasses.dataclass(frozen=True)
class EnginePlacement:
    """This rank's view of the engines (identical on every rank but for the per-rank fields).

    ``owners[e]``: global rank of engine e's owner; ``members[e]``: the global ranks of its group,
    ascending. ``engine``: the engine serving this rank's replica. ``group``: the process group of
    ``members[engine]`` (the world for E = 1; None when it is this rank alone). ``feeds_engine``:
    this rank's replica is the one that syncs the engine's weights. ``node_slot`` / ``node_slots``:
    this engine's position among the engines owned on this rank's node, and their number (for
    splitting a node's CPU cores between engine processes). ``local_rank``: this rank's index on
    its node (``LOCAL_RANK``; for the GPUs of its engine).
    """

    num_engines: int
    engine: int
    owners: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    group: dist.ProcessGroup | None
    feeds_engine: bool
    rank: int
    node_slot: int
    node_slots: int
    local_rank: int

    @property
    def owner(self) -> int:
        """Global rank of the owner of this rank's engine."""
        return self.owners[self.engine]

    @property
    def is_owner(self) -> bool:
        return self.rank == self.owner

    @property
    def group_size(self) -> int:
        return len(self.members[self.engine])

    def prompts(self, num_prompts: int, engine: int | None = None) -> range:
        """The indices of a global batch of ``num_prompts`` prompts that ``engine`` (default: this
        rank's) samples: the ``num_prompts / E`` consecutive ones of its replicas."""
        if num_prompts % self.num_engines:
            raise ValueError(f"{num_prompts} prompts do not split over {self.num_engines} engines")
        e = self.engine if engine is None else engine
        per_engine = num_prompts // self.num_engines
        return range(e * per_engine, (e + 1) * per_engine)

    def split(self, num_items: int, engine: int | None = None) -> range:
        """``engine``'s consecutive share of ``num_items`` items that need not divide evenly (a
        validation set): the first ``num_items % E`` engines take one more."""
        e = self.engine if engine is None else engine
        base, extra = divmod(num_items, self.num_engines)
        start = e * base + min(e, extra)
        return range(start, start + base + (e < extra))

    def engine_table(self, row: Sequence[float] | None, width: int, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        """[E, width] float64 on the CPU, row e being engine e's owner's ``row`` (None elsewhere):
        one all-reduce over the world of a table that only owners fill (``op`` SUM, or MAX for
        values >= 0; without a process group, this rank's table)."""
        distributed = dist.is_initialized()
        device = collective_device() if distributed else torch.device("cpu")
        table = torch.zeros(self.num_engines, width, dtype=torch.float64, device=device)
        if row is not None:
            table[self.engine] = torch.tensor(row, dtype=torch.float64)
        if distributed and dist.get_world_size() > 1:
            dist.all_reduce(table, op=op)
        return table.cpu()

    def broadcast_from_owner(self, value):
        """The owner's ``value`` on every rank of its group (a pickled object broadcast inside the
        group; none for a group of one)."""
        if self.group is None:
            return value
        box = [value if self.is_owner else None]
        dist.broadcast_object_list(box, src=self.owner, group=self.group)
        return box[0]


def build_placement(
    num_engines: int, *, tp_rank: int, pp_rank: int, dp_rank: int, dp_size: int, cp_rank: int = 0
) -> EnginePlacement:
    """The placement of ``num_engines`` engines over the current world; every rank calls it
    together (one object all-gather of each rank's grid coordinates and node, then one
    ``new_group`` per engine group of more than one rank and less than the world). A replica's
    context-parallel ranks are all in its group; its CP rank 0 owns and feeds (they hold the same
    weights)."""
    if num_engines < 1 or dp_size % num_engines:
        raise ValueError(f"{num_engines} engines do not divide the {dp_size} data-parallel replicas")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tp_rank, pp_rank, cp_rank, dp_rank, socket.gethostname()))
    replicas_per_engine = dp_size // num_engines
    members = tuple(
        tuple(r for r, (_, _, _, dp, _) in enumerate(everyone) if dp // replicas_per_engine == e)
        for e in range(num_engines)
    )
    owners = tuple(
        next(
            r
            for r, (tp, pp, cp, dp, _) in enumerate(everyone)
            if (tp, pp, cp, dp) == (0, 0, 0, e * replicas_per_engine)
        )
        for e in range(num_engines)
    )
    engine = dp_rank // replicas_per_engine
    group = None
    for e, ranks in enumerate(members):  # every rank creates every group, in the same order
        if len(ranks) == len(everyone):
            created = dist.group.WORLD
        elif len(ranks) > 1:
            created = dist.new_group(list(ranks))
        else:
            created = None
        if e == engine:
            group = created
    host = everyone[rank][4]
    on_node = [e for e, owner in enumerate(owners) if everyone[owner][4] == host]
    return EnginePlacement(
        num_engines=num_engines,
        engine=engine,
        owners=owners,
        members=members,
        group=group,
        feeds_engine=dp_rank % replicas_per_engine == 0 and cp_rank == 0,
        rank=rank,
        node_slot=on_node.index(engine) if engine in on_node else 0,
        node_slots=max(len(on_node), 1),
        local_rank=local_rank,
    )


def engine_world_placement(num_engines: int, engine_tp: int, dp_size: int) -> EnginePlacement:
    """The placement of ``num_engines`` disaggregated engines over the engine ranks' own world
    (``parallel.link``): engine e runs on engine ranks ``[e * engine_tp, (e+1) * engine_tp)``, its
    owner the first of them, and samples the prompts of training replicas
    ``[e * dp_size/E, (e+1) * dp_size/E)``. Every engine rank calls it together."""
    rank = dist.get_rank()
    engine = rank // engine_tp
    return build_placement(
        num_engines, tp_rank=rank % engine_tp, pp_rank=0, dp_rank=engine * (dp_size // num_engines), dp_size=dp_size
    )
