"""The client of a Search-R1-compatible retriever (``server``'s wire format): passages per query,
with timeouts and retries; an outage is a ``RetrieverUnavailable``, never an empty result."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


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
