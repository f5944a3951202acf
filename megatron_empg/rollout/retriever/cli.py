"""The retriever's command line::

    python -m megatron_empg.rollout.retriever serve --corpus corpus.jsonl --port 8000 \\
        [--host 127.0.0.1] [--topk 3] [--pid-file retriever.pid]
    python -m megatron_empg.rollout.retriever serve --corpus corpus.jsonl --port 8000 \\
        --backend dense --model e5-base-v2/ [--index e5_Flat.index | --save-index e5_Flat.index] \\
        [--batch-size 64] [--host, --topk, --pid-file as above]
    python -m megatron_empg.rollout.retriever stop --pid-file retriever.pid

``serve`` runs the server (``server``) over an index of the corpus (``index``: ``bm25`` by
default, ``dense`` with ``--model``) in the foreground until SIGTERM/SIGINT; ``stop`` sends
SIGTERM to the PID in the file and waits for the process to exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from megatron_empg.rollout.retriever.index import (
    DEFAULT_ENCODE_BATCH_SIZE,
    Bm25Index,
    DenseIndex,
    E5Encoder,
    import_faiss,
    read_corpus,
)
from megatron_empg.rollout.retriever.server import DEFAULT_TOPK, RetrieverServer

STOP_TIMEOUT_S = 10.0  # how long `stop` waits for the server process to exit


def _serve(args: argparse.Namespace) -> int:
    try:
        documents = read_corpus(args.corpus)
        if args.backend == "dense":
            index = DenseIndex(documents, E5Encoder(args.model, batch_size=args.batch_size), index_path=args.index)
        else:
            index = Bm25Index(documents)
    except ValueError as e:  # a malformed corpus, an --index that does not match the corpus or the --model
        print(f"retriever: {e}", file=sys.stderr)
        return 2
    if args.save_index:
        index.save(args.save_index)
    server = RetrieverServer(index, host=args.host, port=args.port, default_topk=args.topk)
    if args.pid_file:
        Path(args.pid_file).write_text(f"{os.getpid()}\n")

    def stop(signum, frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"retriever: {len(index)} documents ({index.backend}) at {server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        if args.pid_file:
            Path(args.pid_file).unlink(missing_ok=True)
    return 0


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie awaiting its parent has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # Linux: the state is the field after the parenthesised command name
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _stop(args: argparse.Namespace) -> int:
    path = Path(args.pid_file)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError) as e:
        print(f"retriever stop: cannot read a PID from {path} ({e})", file=sys.stderr)
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        print(f"retriever stop: no process {pid} (from {path}); removing the stale file", file=sys.stderr)
        path.unlink(missing_ok=True)
        return 1
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        if not _running(pid):
            return 0
        time.sleep(0.05)
    print(f"retriever stop: process {pid} still running {STOP_TIMEOUT_S} s after SIGTERM", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_empg.rollout.retriever",
        description="A local passage retriever over HTTP, wire-compatible with the Search-R1 retrieval server.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve /retrieve and /health in the foreground")
    serve.add_argument("--corpus", required=True, help='JSONL, one {"id", "contents"} per line')
    serve.add_argument("--port", type=int, required=True, help="0 picks a free port (printed)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--backend", choices=("bm25", "dense"), default="bm25")
    serve.add_argument("--topk", type=int, default=DEFAULT_TOPK, help="when a request gives no topk")
    serve.add_argument("--pid-file", help="write this process's PID here (removed on exit)")
    serve.add_argument("--model", help="dense: local Hugging Face directory of an e5 encoder (e.g. e5-base-v2)")
    serve.add_argument("--index", help="dense: prebuilt faiss index, row i = corpus line i (else built at start)")
    serve.add_argument("--save-index", help="dense: write the index built at start here, for --index next time")
    serve.add_argument("--batch-size", type=int, default=DEFAULT_ENCODE_BATCH_SIZE, help="dense: texts per forward")
    stop = commands.add_parser("stop", help="SIGTERM the server whose PID is in --pid-file and wait")
    stop.add_argument("--pid-file", required=True)
    args = parser.parse_args(argv)
    if args.command == "stop":
        return _stop(args)
    _check_serve_args(serve, args)
    return _serve(args)


def _check_serve_args(serve: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``serve.error`` (exit 2) for a flag combination of ``serve`` that cannot work."""
    if args.backend == "bm25":
        for flag, value in (("--model", args.model), ("--index", args.index), ("--save-index", args.save_index)):
            if value is not None:
                serve.error(f"{flag} is for --backend dense only (got --backend bm25)")
        return
    if args.model is None:
        serve.error("--backend dense needs --model DIR (a local Hugging Face e5 model directory)")
    if not os.path.isdir(args.model):
        serve.error(f"--model {args.model}: not a directory (expected a local Hugging Face model directory)")
    if args.index is not None and not os.path.isfile(args.index):
        serve.error(f"--index {args.index}: no such file (expected a faiss index, e.g. e5_Flat.index)")
    if args.index is not None and args.save_index is not None:
        serve.error("--save-index writes an index built at start; with --index nothing is built")
    if args.batch_size < 1:
        serve.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        import_faiss()
    except ImportError as e:
        serve.error(str(e))
