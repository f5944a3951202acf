"""A local passage retriever over HTTP, wire-compatible with the Search-R1 retrieval server.

Wire format (the one of Search-R1's ``search_r1/search/retrieval_server.py``, so a client of this
module can point at a Search-R1 server and a Search-R1 trainer at this one):

- ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int | null, "return_scores": bool}``
  (``topk`` absent or null: the server's default; ``return_scores`` absent: false) answers
  ``{"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}``: one
  list per query, at most ``topk`` entries, best first. Without ``return_scores`` each inner entry
  is the document itself, ``{"id", "contents"}``.
- ``GET /health`` answers ``{"status": "ok", "backend": str, "num_documents": int}``.
- A malformed request gets 400 and ``{"error": str}`` naming the field; an unknown path 404.

The corpus is JSONL with one ``{"id": str, "contents": str}`` per line; ``contents`` is
``'"Title"\\ntext'`` as in Search-R1's wiki-18 corpus.

Backends (``--backend``):

- ``bm25`` (default): ``bm25s``, imported when an index is built.
- ``dense``: e5-style embeddings from a local Hugging Face model directory (e.g. a downloaded
  ``intfloat/e5-base-v2``) and an exact inner-product ``faiss`` index (``faiss-cpu``), with
  Search-R1's conventions: ``"query: "`` / ``"passage: "`` prefixes, at most 256 tokens, mean
  pooling over the attention mask, L2-normalized embeddings (so the score is the cosine). The index
  is built at start-up by encoding every passage, or read with ``--index`` from a prebuilt faiss
  file whose row i embeds corpus line i (Search-R1's ``e5_Flat.index`` for wiki-18);
  ``--save-index`` writes a built one for the next start. faiss, torch and transformers are
  imported only by this backend.

Command line::

    python -m megatron_empg.rollout.retriever serve --corpus corpus.jsonl --port 8000 \\
        [--host 127.0.0.1] [--topk 3] [--pid-file retriever.pid]
    python -m megatron_empg.rollout.retriever serve --corpus corpus.jsonl --port 8000 \\
        --backend dense --model e5-base-v2/ [--index e5_Flat.index | --save-index e5_Flat.index] \\
        [--batch-size 64] [--host, --topk, --pid-file as above]
    python -m megatron_empg.rollout.retriever stop --pid-file retriever.pid

``serve`` runs in the foreground until SIGTERM/SIGINT (``stop`` sends SIGTERM to the PID in the
file and waits for the process to exit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

DEFAULT_TOPK = 3  # Search-R1's default retrieval_topk
STOP_TIMEOUT_S = 10.0  # how long `stop` waits for the server process to exit
E5_MAX_LENGTH = 256  # tokens per text: Search-R1's query max_length and its index builder's for passages
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "
DEFAULT_ENCODE_BATCH_SIZE = 64  # texts per encoder forward pass


# --------------------------------------------------------------------------------------------
# Index.


def read_corpus(path: str | os.PathLike) -> list[dict]:
    """A JSONL corpus (one ``{"id": str, "contents": str}`` per line; blank lines skipped), in file order."""
    documents = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from e
            for field in ("id", "contents"):
                if not isinstance(row.get(field), str):
                    raise ValueError(f"{path}:{line_no}: field {field!r} missing or not a string")
            documents.append({"id": row["id"], "contents": row["contents"]})
    if not documents:
        raise ValueError(f"{path}: no documents")
    return documents


def _hits(documents: list[dict], ids, scores) -> list[list[tuple[dict, float]]]:
    """``ids`` / ``scores``: ``[Q, k]`` arrays of a search (document indices, scores) -> per query
    the ``(document, score)`` pairs."""
    return [
        [(documents[int(i)], float(s)) for i, s in zip(row_ids, row_scores)]
        for row_ids, row_scores in zip(ids.tolist(), scores.tolist())
    ]


def _import_bm25s():
    """``bm25s`` on its numpy backend, without importing numba.

    bm25s imports numba (and with it llvmlite) when it is installed, and vllm 0.32's kernel-override
    scan of ``sys.modules`` (``vllm/triton_utils/dispatcher.py``) then fails on llvmlite's objects
    (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'): a process that had built an
    index could no longer start a vLLM engine. So numba is hidden while bm25s is first imported
    (its ``from numba import njit`` fails and it keeps its numpy backend), then made importable again.
    """
    if "bm25s" in sys.modules or "numba" in sys.modules:
        import bm25s

        return bm25s
    sys.modules["numba"] = None  # type: ignore[assignment]  # `import numba` raises ImportError
    try:
        import bm25s
    finally:
        del sys.modules["numba"]
    return bm25s


class Bm25Index:
    """BM25 (``bm25s``, English stopwords removed) over a list of ``{"id", "contents"}`` documents."""

    backend = "bm25"

    def __init__(self, documents: list[dict]) -> None:
        """``documents``: non-empty list of dicts, each with str ``id`` and str ``contents``."""
        bm25s = _import_bm25s()
        if not documents:
            raise ValueError("Bm25Index: documents is empty")
        self.documents = documents
        self._bm25s = bm25s
        self._model = bm25s.BM25()
        tokens = bm25s.tokenize([d["contents"] for d in documents], stopwords="en", show_progress=False)
        self._model.index(tokens, show_progress=False)
        self._lock = threading.Lock()  # bm25s retrieval is not documented as thread-safe

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike) -> Bm25Index:
        """The index of the JSONL corpus at ``path`` (see ``read_corpus``)."""
        return cls(read_corpus(path))

    def __len__(self) -> int:
        return len(self.documents)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Per query, up to ``min(topk, len(self))`` ``(document, score)`` pairs, score descending."""
        k = min(topk, len(self.documents))
        tokens = self._bm25s.tokenize(queries, stopwords="en", show_progress=False)
        with self._lock:
            ids, scores = self._model.retrieve(tokens, k=k, show_progress=False, n_threads=0)
        return _hits(self.documents, ids, scores)


def _import_faiss():
    """``faiss``, or an ImportError saying how to install it."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(f"the dense retriever backend needs faiss: pip install faiss-cpu ({e})") from e
    return faiss


class E5Encoder:
    """Texts -> e5 embeddings with the model of a local Hugging Face directory (``AutoModel``, float32).

    Each text is ``prefix + text`` (``E5_QUERY_PREFIX`` or ``E5_PASSAGE_PREFIX``), truncated to
    ``max_length`` tokens; its embedding is the mean of the last hidden states over the attention
    mask, L2-normalized. Runs on CUDA when available, else CPU, ``batch_size`` texts per forward.
    """

    def __init__(self, model_dir: str | os.PathLike, batch_size: int = DEFAULT_ENCODE_BATCH_SIZE,
                 max_length: int = E5_MAX_LENGTH) -> None:  # fmt: skip
        import torch
        from transformers import AutoModel, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"E5Encoder: batch_size must be >= 1, got {batch_size}")
        self._torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
        self.hidden_size: int = self.model.config.hidden_size
        self.batch_size = batch_size
        self.max_length = max_length

    def encode(self, texts: list[str], prefix: str) -> np.ndarray:
        """``[len(texts), hidden_size]`` float32, C-contiguous, each row of unit L2 norm."""
        import numpy as np

        torch = self._torch
        embeddings = np.empty((len(texts), self.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    [prefix + text for text in texts[start : start + self.batch_size]],
                    max_length=self.max_length, padding=True, truncation=True, return_tensors="pt",
                ).to(self.device)
                hidden = self.model(**batch).last_hidden_state  # [B, T, hidden_size]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
                embeddings[start : start + len(mean)] = torch.nn.functional.normalize(mean, dim=-1).cpu().numpy()
        return embeddings


class DenseIndex:
    """Exact inner-product search (``faiss.IndexFlatIP``) of e5 query embeddings over passage embeddings.

    ``index_path``: a faiss index file whose row i embeds ``documents[i]`` (Search-R1's
    ``e5_Flat.index``, row i = corpus line i); None: built by encoding every passage's ``contents``.
    A file with another number of rows or another dimension than ``encoder.hidden_size`` is a ValueError.
    """

    backend = "dense"

    def __init__(self, documents: list[dict], encoder: E5Encoder, index_path: str | os.PathLike | None = None) -> None:
        """``documents``: non-empty list of dicts, each with str ``id`` and str ``contents``."""
        faiss = _import_faiss()
        if not documents:
            raise ValueError("DenseIndex: documents is empty")
        self.documents = documents
        self.encoder = encoder
        if index_path is None:
            self._faiss_index = faiss.IndexFlatIP(encoder.hidden_size)
            self._faiss_index.add(encoder.encode([d["contents"] for d in documents], E5_PASSAGE_PREFIX))
        else:
            self._faiss_index = faiss.read_index(str(index_path))
            if self._faiss_index.ntotal != len(documents):
                raise ValueError(
                    f"--index {index_path}: {self._faiss_index.ntotal} vectors, but the corpus has "
                    f"{len(documents)} documents (row i of the index must embed corpus line i)"
                )
            if self._faiss_index.d != encoder.hidden_size:
                raise ValueError(
                    f"--index {index_path}: vectors of dimension {self._faiss_index.d}, but the --model's "
                    f"hidden size is {encoder.hidden_size} (an index built with another model?)"
                )
        self._lock = threading.Lock()  # a fast tokenizer raises "Already borrowed" when used by two threads

    def __len__(self) -> int:
        return len(self.documents)

    def save(self, path: str | os.PathLike) -> None:
        """Write the faiss index to ``path`` (a temporary file in the same directory, then renamed)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            _import_faiss().write_index(self._faiss_index, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Per query, up to ``min(topk, len(self))`` ``(document, cosine)`` pairs, score descending."""
        k = min(topk, len(self.documents))
        with self._lock:
            scores, ids = self._faiss_index.search(self.encoder.encode(queries, E5_QUERY_PREFIX), k)  # [Q, k] each
        return _hits(self.documents, ids, scores)


# --------------------------------------------------------------------------------------------
# Server.


class _BadRequest(ValueError):
    pass


def _parse_retrieve_request(body: bytes, default_topk: int) -> tuple[list[str], int, bool]:
    """The ``(queries, topk, return_scores)`` of a /retrieve body; ``_BadRequest`` naming the field."""
    try:
        request = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(f"body is not JSON ({e})") from e
    if not isinstance(request, dict):
        raise _BadRequest('body must be a JSON object {"queries": [...], "topk": k, "return_scores": bool}')
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise _BadRequest('field "queries" missing or not a list of strings')
    topk = request.get("topk")
    if topk is None:
        topk = default_topk
    elif isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise _BadRequest(f'field "topk" must be a positive integer, got {topk!r}')
    return_scores = request.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise _BadRequest(f'field "return_scores" must be a boolean, got {return_scores!r}')
    return queries, topk, return_scores


class _Handler(BaseHTTPRequestHandler):
    server: RetrieverServer

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != "/health":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; GET /health"})
            return
        index = self.server.index
        self._reply(HTTPStatus.OK, {"status": "ok", "backend": index.backend, "num_documents": len(index)})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/retrieve":
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; POST /retrieve"})
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            queries, topk, return_scores = _parse_retrieve_request(body, self.server.default_topk)
        except _BadRequest as e:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            return
        hits = self.server.index.search(queries, topk) if queries else []
        if return_scores:
            result = [[{"document": doc, "score": score} for doc, score in row] for row in hits]
        else:
            result = [[doc for doc, _ in row] for row in hits]
        self._reply(HTTPStatus.OK, {"result": result})

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        """Silent per request: a rollout step sends many."""


class RetrieverServer(ThreadingHTTPServer):
    """``POST /retrieve`` and ``GET /health`` over ``index`` (``Bm25Index``/``DenseIndex``) on ``(host, port)``.

    ``port=0`` picks a free port; ``url`` is the address actually bound. ``serve_forever()`` runs
    it (in a thread or the foreground), ``shutdown()`` + ``server_close()`` stops it.
    """

    daemon_threads = True

    def __init__(
        self, index: Bm25Index | DenseIndex, host: str = "127.0.0.1", port: int = 0, default_topk: int = DEFAULT_TOPK
    ) -> None:
        self.index = index
        self.default_topk = default_topk
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


# --------------------------------------------------------------------------------------------
# Client.


@dataclass(frozen=True)
class Passage:
    """One retrieved passage: ``contents`` is ``'"Title"\\ntext'``; ``id`` None if the server sent none."""

    id: str | None
    contents: str
    score: float


class RetrieverError(RuntimeError):
    """The retriever answered, but not with a usable result (4xx, malformed response).

    ``status``: the HTTP status of a 4xx answer, else None."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RetrieverUnavailable(RetrieverError):
    """No answer from the retriever after all attempts; ``attempts`` is how many were made."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class RetrieverClient:
    """Client of a Search-R1-compatible retriever at ``url`` (e.g. ``http://127.0.0.1:8000``).

    Each request is tried ``1 + retries`` times, each attempt bounded by ``timeout_s``, with
    ``backoff_s * 2**i`` seconds between attempts; connection errors, timeouts and 5xx answers are
    retried, a 4xx is not. When no attempt succeeds it raises ``RetrieverUnavailable`` (never an
    empty result).
    """

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5) -> None:
        if timeout_s <= 0:
            raise ValueError(f"RetrieverClient: timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"RetrieverClient: retries must be >= 0, got {retries}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def _request(self, path: str, payload: dict | None) -> dict:
        url = self.url + path
        data = None if payload is None else json.dumps(payload).encode()
        headers = {} if payload is None else {"Content-Type": "application/json"}
        attempts = 1 + self.retries
        last_error: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise RetrieverError(
                        f"retriever at {url} answered {e.code}: {e.read().decode(errors='replace')}", status=e.code
                    ) from e
                last_error = e
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
                last_error = e
            except json.JSONDecodeError as e:
                raise RetrieverError(f"retriever at {url} answered non-JSON ({e})") from e
        raise RetrieverUnavailable(
            f"retriever at {url} unavailable after {attempts} attempt(s) (timeout {self.timeout_s} s each): "
            f"{last_error}. Start one with `python -m megatron_empg.rollout.retriever serve --corpus "
            f"CORPUS.jsonl --port PORT` or point the retriever URL at a running Search-R1-compatible server.",
            attempts=attempts,
        )

    def health(self) -> dict:
        """The server's ``GET /health`` answer, e.g. ``{"status": "ok", "backend": "bm25", "num_documents": 40}``.

        A server without ``/health`` (404: Search-R1's own ``retrieval_server.py`` has only
        ``/retrieve``) is checked with a one-query ``/retrieve`` instead: ``{"status": "ok",
        "backend": "unknown (no /health)"}``.
        """
        try:
            return self._request("/health", None)
        except RetrieverError as e:
            if e.status != 404:  # RetrieverUnavailable has no status
                raise
        self.search(["health check"], 1)
        return {"status": "ok", "backend": "unknown (no /health)"}

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Per query (in order), up to ``topk`` passages, best first."""
        answer = self._request("/retrieve", {"queries": list(queries), "topk": topk, "return_scores": True})
        result = answer.get("result") if isinstance(answer, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverError(
                f'retriever at {self.url}: field "result" must be a list of {len(queries)} lists, got {answer!r:.200}'
            )
        try:
            return [
                [Passage(hit["document"].get("id"), hit["document"]["contents"], float(hit["score"])) for hit in row]
                for row in result
            ]
        except (KeyError, TypeError, AttributeError) as e:
            raise RetrieverError(
                f'retriever at {self.url}: each hit must be {{"document": {{"contents": ...}}, "score": ...}} ({e!r})'
            ) from e


# --------------------------------------------------------------------------------------------
# Command line.


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
    parser = argparse.ArgumentParser(prog="python -m megatron_empg.rollout.retriever", description=__doc__.split("\n")[0])
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
        _import_faiss()
    except ImportError as e:
        serve.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
