"""The retriever's HTTP server, in the wire format of Search-R1's ``search_r1/search/retrieval_server.py``
(so a client of this package can point at a Search-R1 server and a Search-R1 trainer at this one):

- ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int | null, "return_scores": bool}``
  (``topk`` absent or null: the server's default; ``return_scores`` absent: false) answers
  ``{"result": [[{"document": {"id": str, "contents": str}, "score": float}, ...], ...]}``: one
  list per query, at most ``topk`` entries, best first. Without ``return_scores`` each inner entry
  is the document itself, ``{"id", "contents"}``.
- ``GET /health`` answers ``{"status": "ok", "backend": str, "num_documents": int}``.
- A malformed request gets 400 and ``{"error": str}`` naming the field; an unknown path 404.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_empg.rollout.retriever.index import Bm25Index, DenseIndex

DEFAULT_TOPK = 3  # Search-R1's default retrieval_topk


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
