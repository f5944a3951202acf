#!/usr/bin/env python
"""The weight link's throughput on CPU: ``LinkTransport`` -> ``receive_weights`` over the gloo link
against a plain gloo broadcast of the same bytes. Writes JSON; ``benchmarks/async_overlap.py`` runs
it too (its ``link`` key) unless given ``--no-link``.

    OMP_NUM_THREADS=1 python benchmarks/link_throughput.py --out /tmp/link.json

Two spawned processes, ``parallel.link.start_worlds(engine_ranks=1)`` (a training world of rank 0
alone, an engine world of rank 1 alone, and the gloo link between them): rank 0 sends
``--link-mb`` MB of float32 tensors in buckets of ``--bucket-mb`` MB through ``LinkTransport``
(``begin``, ``send`` per bucket: ``pack_bucket``'s copy, a pickled header, the flat bytes;
``finish``), rank 1 receives them with ``receive_weights`` into a transport that only counts the
bytes, then acknowledges on the link; the time is rank 0's from ``begin`` to the acknowledgement.
Against that: two spawned processes of a plain 2-rank gloo world (``init_process_group``)
broadcasting the same buckets' bytes (one uint8 tensor per bucket, rank 1 receiving into buffers
allocated once, ``broadcast_prealloc``, or a fresh ``torch.empty`` per bucket,
``broadcast_fresh``; ``receive_weights`` reuses one buffer per update), then a one-element
acknowledgement; and ``pack_bucket_only``, rank 0 packing every bucket without sending (the
sender's copy alone). One warm-up and ``--link-repeats`` timed transfers each, the two kinds of
processes taking turns ``--link-rounds`` times; best and median over all timed transfers; GB/s =
bytes / seconds (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class CountingTransport:
    """An engine side that takes the buckets and only counts their bytes."""

    def __init__(self) -> None:
        self.bytes = 0

    def begin(self) -> None:
        pass

    def send(self, bucket) -> None:
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    def finish(self, version: str) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buckets(total_mb: float, bucket_mb: float):
    """Buckets of float32 tensors (4 per bucket) of ``total_mb`` MB in all (1 MB = 2**20 bytes)."""
    import torch

    total = int(total_mb * 2**20) // 4
    per_bucket = max(int(bucket_mb * 2**20) // 4, 4)
    buckets, done, index = [], 0, 0
    generator = torch.Generator().manual_seed(0)
    while done < total:
        size = min(per_bucket, total - done)
        parts = [size // 4] * 3 + [size - 3 * (size // 4)]
        bucket = []
        for numel in parts:
            if numel:
                bucket.append((f"layers.{index}.weight", torch.rand(numel, generator=generator)))
                index += 1
        buckets.append(bucket)
        done += size
    return buckets


def _link_worker(rank: int, port: int, total_mb: float, bucket_mb: float, repeats: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from megatron_empg.parallel.link import LEAD, TRAINER, start_worlds
    from megatron_empg.weight_sync.transport import LinkTransport, pack_bucket, receive_weights

    role = start_worlds(1, datetime.timedelta(minutes=5))
    link = role.link
    seconds, received = [], []
    if rank == 0:
        buckets = _buckets(total_mb, bucket_mb)
        transport = LinkTransport(link)
        for i in range(repeats + 1):
            start = time.perf_counter()
            transport.begin()
            for bucket in buckets:
                transport.send(bucket)
            transport.finish(f"v{i}")
            received.append(link.recv_object(src=LEAD))
            seconds.append(time.perf_counter() - start)
        sent = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        packing = []  # pack_bucket alone (the sender's copy into one flat buffer), no communication
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for bucket in buckets:
                pack_bucket(bucket)
            packing.append(time.perf_counter() - start)
        Path(out).write_text(
            json.dumps(
                {
                    "seconds": seconds[1:],
                    "bytes": sent,
                    "received": received[1:],
                    "buckets": len(buckets),
                    "pack_seconds": packing[1:],
                }
            )
        )
    else:
        for _ in range(repeats + 1):
            message = link.broadcast_object(src=TRAINER)
            assert message == ("weights",), message
            counter = CountingTransport()
            _, numel = receive_weights(link, counter)
            assert numel == counter.bytes
            link.send_object(counter.bytes, dst=TRAINER)
    link.shutdown()
    dist.destroy_process_group()


def _broadcast_worker(rank: int, port: int, total_mb: float, bucket_mb: float, repeats: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in _buckets(total_mb, bucket_mb)]
    if rank == 0:
        flats = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    result = {}
    for variant in ("broadcast_prealloc", "broadcast_fresh"):
        if rank == 1 and variant == "broadcast_prealloc":
            flats = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        seconds = []
        for _ in range(repeats + 1):
            ack = torch.zeros(1)
            dist.barrier()
            start = time.perf_counter()
            for i, n in enumerate(sizes):
                tensor = flats[i] if rank == 0 or variant == "broadcast_prealloc" else torch.empty(n, dtype=torch.uint8)
                dist.broadcast(tensor, src=0)
            dist.broadcast(ack, src=1)  # rank 1 has everything
            seconds.append(time.perf_counter() - start)
        result[variant] = seconds[1:]
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": result, "bytes": sum(sizes)}))
    dist.destroy_process_group()


def _spawn(worker, *args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(worker, args=(_free_port(), *args, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def _rate(seconds: list[float], nbytes: int) -> dict:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "seconds_all": seconds,
        "seconds_best": best,
        "seconds_median": median,
        "gbps_best": nbytes / best / 1e9,
        "gbps_median": nbytes / median / 1e9,
    }


def link_benchmark(total_mb: float, bucket_mb: float, repeats: int, rounds: int) -> dict:
    """The link and the plain broadcast, taking turns ``rounds`` times (fresh processes each)."""
    seconds: dict[str, list[float]] = {
        "link_transport": [],
        "pack_bucket_only": [],
        "broadcast_prealloc": [],
        "broadcast_fresh": [],
    }
    per_round = []
    for _ in range(rounds):
        link = _spawn(_link_worker, total_mb, bucket_mb, repeats)
        if any(r != link["bytes"] for r in link["received"]):
            raise RuntimeError(f"the engine side counted {link['received']} bytes, {link['bytes']} sent")
        plain = _spawn(_broadcast_worker, total_mb, bucket_mb, repeats)
        assert plain["bytes"] == link["bytes"]
        got = {"link_transport": link["seconds"], "pack_bucket_only": link["pack_seconds"], **plain["seconds"]}
        for key, values in got.items():
            seconds[key] += values
        per_round.append({key: min(values) for key, values in got.items()})
    nbytes = link["bytes"]
    out = {
        "bytes": nbytes,
        "bucket_mb": bucket_mb,
        "num_buckets": link["buckets"],
        "repeats": repeats,
        "rounds": rounds,
        **{key: _rate(values, nbytes) for key, values in seconds.items()},
        "seconds_best_per_round": per_round,
    }
    for variant in ("broadcast_prealloc", "broadcast_fresh"):
        out[f"link_over_{variant}_gbps_best"] = out["link_transport"]["gbps_best"] / out[variant]["gbps_best"]
        out[f"link_over_{variant}_gbps_median"] = out["link_transport"]["gbps_median"] / out[variant]["gbps_median"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The link's options (also ``benchmarks/async_overlap.py``'s)."""
    parser.add_argument("--link-mb", type=float, default=256.0)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--link-repeats", type=int, default=5, help="timed transfers per round (after one warm-up)")
    parser.add_argument("--link-rounds", type=int, default=3, help="the link and the plain broadcast take turns")


def run(args) -> dict:
    """``link_benchmark`` with ``add_arguments``' options, its headline printed."""
    link = link_benchmark(args.link_mb, args.bucket_mb, args.link_repeats, args.link_rounds)
    print(
        f"link: LinkTransport {link['link_transport']['gbps_best']:.2f} GB/s best, broadcast prealloc "
        f"{link['broadcast_prealloc']['gbps_best']:.2f}, fresh {link['broadcast_fresh']['gbps_best']:.2f}",
        flush=True,
    )
    return link


def main(argv: list[str] | None = None) -> int:
    from benchmarks.timed_runs import machine_info, versions

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "link_throughput_cpu.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    record = {
        "benchmark": "link_throughput",
        "machine": machine_info(),
        "versions": versions(),
        "params": {"command": " ".join(["benchmarks/link_throughput.py", *(argv or sys.argv[1:])])},
        "link": run(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
