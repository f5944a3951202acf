"""The local retriever (``megatron_empg.rollout.retriever``): the server started by its command
line on a loopback port over ``tests/data/search_corpus.jsonl``, queried by the client and by raw
HTTP in Search-R1's wire format; the client's timeouts and retries against dead endpoints."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_empg.rollout.retriever.client import Passage, RetrieverClient, RetrieverError, RetrieverUnavailable
from megatron_empg.rollout.retriever.index import Bm25Index
from megatron_empg.rollout.retriever.server import RetrieverServer
from tests.dist import free_port
from tests.rollout.retriever_service import CORPUS, serve_retriever

PARIS_ID = "0"  # '"Paris"\nParis is the capital and largest city of France, ...'
LYON_ID = "10"  # a France passage without "capital": the runner-up


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> str:
    """The URL of ``retriever serve`` (a subprocess) on a free loopback port; stopped by ``stop``."""
    with serve_retriever(tmp_path_factory.mktemp("retriever")) as url:
        yield url


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/retrieve", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health(server):
    assert RetrieverClient(server).health() == {"status": "ok", "backend": "bm25", "num_documents": 40}


def test_capital_of_france_ranks_paris_first(server):
    [hits] = RetrieverClient(server).search(["capital of France"], topk=3)
    assert [h.id for h in hits[:2]] == [PARIS_ID, LYON_ID]
    assert hits[0].contents.startswith('"Paris"\nParis is the capital')
    assert all(isinstance(h, Passage) for h in hits)


def test_batch_topk_and_descending_scores(server):
    queries = ["who invented the telephone", "longest river in Asia", "capital of Japan"]
    results = RetrieverClient(server).search(queries, topk=2)
    assert len(results) == 3 and all(len(hits) == 2 for hits in results)
    assert [hits[0].contents.split("\n")[0] for hits in results] == ['"Telephone"', '"Yangtze"', '"Tokyo"']
    for hits in results:
        assert hits[0].score > 0 and hits[0].score >= hits[1].score
    [many] = RetrieverClient(server).search(["river"], topk=100)  # more than the corpus holds
    assert len(many) == 40
    assert [h.score for h in many] == sorted((h.score for h in many), reverse=True)


def test_wire_format_is_search_r1s(server):
    status, answer = _post(
        server, json.dumps({"queries": ["capital of France", "Nile"], "topk": 2, "return_scores": True}).encode()
    )
    assert status == 200 and list(answer) == ["result"]
    assert len(answer["result"]) == 2
    for row in answer["result"]:
        assert len(row) == 2
        for hit in row:
            assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float)
    # Without return_scores each entry is the document itself; without topk the server's default (3).
    status, answer = _post(server, json.dumps({"queries": ["capital of France"]}).encode())
    assert status == 200
    [row] = answer["result"]
    assert len(row) == 3 and row[0]["id"] == PARIS_ID and set(row[0]) == {"id", "contents"}
    status, answer = _post(server, json.dumps({"queries": []}).encode())
    assert (status, answer) == (200, {"result": []})


@pytest.mark.parametrize(
    "body, field",
    [
        (b'{"topk": 3}', '"queries"'),
        (b'{"queries": "capital of France"}', '"queries"'),
        (b'{"queries": ["a"], "topk": 0}', '"topk"'),
        (b'{"queries": ["a"], "return_scores": "yes"}', '"return_scores"'),
        (b"not json", "not JSON"),
    ],
)
def test_bad_request_is_400_naming_the_field(server, body, field):
    status, answer = _post(server, body)
    assert status == 400 and field in answer["error"]


def test_client_raises_on_4xx_without_retrying(server):
    with pytest.raises(RetrieverError, match="400") as info:
        RetrieverClient(server, retries=3).search(["a"], topk=0)
    assert not isinstance(info.value, RetrieverUnavailable)


def test_unknown_path_is_404(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server + "/nope", timeout=10)
    assert info.value.code == 404


def test_nothing_listening_raises_unavailable_after_the_retries():
    url = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    client = RetrieverClient(url, timeout_s=1.0, retries=2, backoff_s=0.0)
    with pytest.raises(RetrieverUnavailable) as info:
        client.search(["capital of France"], topk=3)
    assert info.value.attempts == 3
    message = str(info.value)
    assert url + "/retrieve" in message and "3 attempt" in message and "retriever serve" in message


def test_silent_server_times_out_and_raises_unavailable():
    """A socket that accepts connections but never answers: each attempt ends at timeout_s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(RetrieverUnavailable, match="timed out") as info:
            RetrieverClient(url, timeout_s=0.2, retries=1, backoff_s=0.0).health()
    assert info.value.attempts == 2 and url in str(info.value)


class _RetrieveOnly(BaseHTTPRequestHandler):
    """Search-R1's retrieval server as far as the client sees it: POST /retrieve, no /health (404)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_error(404)  # FastAPI's answer to an unknown path

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        hit = {"document": {"id": "0", "contents": '"A"\ntext'}, "score": 1.0}
        payload = json.dumps({"result": [[hit] for _ in body["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


def test_health_of_a_server_without_health_endpoint_is_checked_by_a_query():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RetrieveOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert RetrieverClient(url, retries=0).health() == {"status": "ok", "backend": "unknown (no /health)"}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_bm25_index_rejects_a_row_without_contents(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"A\\"\\nok"}\n{"id": "1", "text": "no contents"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'contents'"):
        Bm25Index.from_jsonl(corpus)


def test_in_process_server():
    """``RetrieverServer`` in a thread with ``port=0``: the address it bound is ``url``."""
    server = RetrieverServer(Bm25Index.from_jsonl(CORPUS), port=0, default_topk=1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        [[hit]] = RetrieverClient(server.url).search(["deepest lake"], topk=1)
        assert hit.contents.startswith('"Lake Baikal"')
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_building_an_index_leaves_llvmlite_unimported_and_numba_importable():
    # vllm 0.32 cannot start an engine in a process where llvmlite.binding is imported (its kernel-override
    # scan of sys.modules fails on llvmlite's objects), and bm25s imports numba -> llvmlite when it can
    script = (
        "import sys\n"
        "from megatron_empg.rollout.retriever.index import Bm25Index\n"
        "index = Bm25Index([{'id': 'a', 'contents': 'Paris is the capital of France'},\n"
        "                   {'id': 'b', 'contents': 'Berlin is the capital of Germany'}])\n"
        "[[(best, _)]] = index.search(['capital of France'], 1)\n"
        "print(best['id'], 'llvmlite.binding' in sys.modules, 'numba' in sys.modules)\n"
        "import numba\n"
        "print('numba', bool(numba.njit))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["a False False", "numba True"]
