"""The two worlds of a disaggregated job and the link between them.

With ``rollout.placement: disaggregated`` the job's first ranks train and its last
``rollout.engine_ranks`` only run engines. Each side gets its own default process group (the
*training world*, in which Megatron and every trainer collective run unchanged, and the *engine
world*), both rendezvousing on the launcher's store under their own prefixes. The ``Link`` joins
training rank 0 (link rank 0) and the owner of every engine (link rank 1 + engine index; engine e
owns engine ranks ``[e * engine_tp, (e+1) * engine_tp)``): a gloo group for small pickled
messages, and on GPUs an NCCL group for the weight buckets. Its groups are built
straight from the store (as vLLM's and NeMo-RL's stateless groups are), so neither world sees it.

    role = start_worlds(engine_ranks=1, engine_tp=1, timeout=timedelta(minutes=30))   # every rank
    role.is_engine, role.link                                            # link: None off the link
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle

import torch
import torch.distributed as dist
from torch import Tensor

TRAINER = 0  # the link rank of training rank 0
LEAD = 1  # the link rank of engine rank 0, which speaks for the engines


class Link:
    """Messages between training rank 0 and the engine ranks (link ranks 1 ..).

    ``broadcast_object`` / ``broadcast_tensor`` go from one link rank to all others;
    ``send_object`` / ``recv_object`` between two, on a gloo group of their own, so one thread may
    receive while another broadcasts (``rollout.max_staleness`` >= 1). Tensors travel over NCCL
    when the link has it (``device`` cuda), else over gloo."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, *, nccl: bool) -> None:
        self.rank, self.size = rank, size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("link/gloo/", store), rank, size, timeout)
        self._mail = dist.ProcessGroupGloo(dist.PrefixStore("link/mail/", store), rank, size, timeout)
        self._nccl = None
        self.device = torch.device("cpu")
        if nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("link/nccl/", store), rank, size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())

    # ---------------------------------------------------------------- objects (gloo)

    def broadcast_object(self, obj=None, *, src: int):
        """``obj`` of link rank ``src`` on every link rank (a length, then the pickled bytes)."""
        data = _to_bytes(obj) if self.rank == src else None
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._wait(self._gloo.broadcast([length], _root(src)))
        if data is None:
            data = torch.empty(int(length), dtype=torch.uint8)
        self._wait(self._gloo.broadcast([data], _root(src)))
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def send_object(self, obj, *, dst: int) -> None:
        data = _to_bytes(obj)
        self._wait(self._mail.send([torch.tensor([len(data)], dtype=torch.int64)], dst, 0))
        self._wait(self._mail.send([data], dst, 1))

    def recv_object(self, *, src: int):
        length = torch.empty(1, dtype=torch.int64)
        self._wait(self._mail.recv([length], src, 0))
        data = torch.empty(int(length), dtype=torch.uint8)
        self._wait(self._mail.recv([data], src, 1))
        return pickle.loads(data.numpy().tobytes())

    # ---------------------------------------------------------------- tensors

    def broadcast_tensor(self, tensor: Tensor, *, src: int) -> Tensor:
        """``tensor`` (on ``src``; a buffer of its shape and dtype elsewhere) from link rank
        ``src`` into every link rank's buffer, on ``self.device``; returns it."""
        tensor = tensor.to(self.device) if tensor.device != self.device else tensor
        group = self._nccl if self._nccl is not None else self._gloo
        self._wait(group.broadcast([tensor], _root(src)))
        return tensor

    @staticmethod
    def _wait(work) -> None:
        work.wait()

    def shutdown(self) -> None:
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None


def _root(src: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = src, 0
    return options


def _to_bytes(obj) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


@dataclasses.dataclass(frozen=True)
class Role:
    """This process's side of the job: ``is_engine`` (an engine rank), ``rank`` in its own world,
    ``engine_ranks`` of the job, and the ``link`` (training rank 0 and the engine ranks; None
    elsewhere and in a colocated job)."""

    is_engine: bool
    rank: int
    engine_ranks: int
    link: Link | None


def start_worlds(engine_ranks: int, timeout: datetime.timedelta, *, engine_tp: int = 1) -> Role:
    """Initialise ``torch.distributed`` for this process of a job that torchrun or srun started
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): with ``engine_ranks`` 0 one world
    of every rank (NCCL on GPUs, else gloo); otherwise the training world of the first ranks, the
    engine world (gloo: it carries small objects) of the last ``engine_ranks``, and the link of
    training rank 0 and every ``engine_tp``-th engine rank. Every rank of the job calls it."""
    # Imported before the world exists: its functions take ``group=group.WORLD`` as a default
    # argument, bound at import, which would keep the world group (and its threads) alive past
    # ``destroy_process_group`` into interpreter teardown. (Megatron and torch.distributed.checkpoint
    # import it.)
    import torch.distributed.nn  # noqa: F401

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if engine_ranks == 0:
        dist.init_process_group(backend, timeout=timeout)
        return Role(is_engine=False, rank=dist.get_rank(), engine_ranks=0, link=None)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    training = world - engine_ranks
    if training < 1:
        raise ValueError(f"{engine_ranks} engine ranks leave no training rank in a world of {world}")
    # torchrun's agent already serves the store at MASTER_PORT; srun leaves it to rank 0
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=None,
        is_master=host,
        timeout=timeout,
        wait_for_workers=False,
    )
    is_engine = rank >= training
    if is_engine:
        local = rank - training
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("engines/", store), rank=local, world_size=engine_ranks, timeout=timeout
        )
    else:
        local = rank
        dist.init_process_group(
            backend, store=dist.PrefixStore("training/", store), rank=local, world_size=training, timeout=timeout
        )
    link = None
    if (is_engine and local % engine_tp == 0) or rank == 0:
        link_rank = LEAD + local // engine_tp if is_engine else TRAINER
        link = Link(store, link_rank, 1 + engine_ranks // engine_tp, timeout, nccl=backend == "nccl")
    return Role(is_engine=is_engine, rank=local, engine_ranks=engine_ranks, link=link)
