"""The dense backend of the local retriever (``DenseIndex``, ``E5Encoder``, ``serve --backend dense``).

No download: the encoder is a random 2-layer ``BertModel`` (hidden 32) with a WordPiece tokenizer
trained on ``tests/data/search_corpus.jsonl``, saved as a Hugging Face directory. Results are checked
against a brute-force reference computed here with the model itself (e5 prefixes, mean pooling over
the attention mask, L2 normalization, a torch matmul and a sort).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_empg.rollout.retriever.cli import main
from megatron_empg.rollout.retriever.client import RetrieverClient
from megatron_empg.rollout.retriever.index import DenseIndex, E5Encoder, import_faiss, read_corpus
from tests.rollout.retriever_service import CORPUS, serve_retriever

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 32
QUERIES = ["capital of France", "who invented the telephone", "longest river in Asia", "deepest lake", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A random BERT encoder (hidden 32, 2 layers) + a BERT-style WordPiece tokenizer, as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-e5")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    texts = ["query: passage:", *(d["contents"] for d in read_corpus(CORPUS))]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=1000, special_tokens=specials))
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    ).save_pretrained(out)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return read_corpus(CORPUS)


@pytest.fixture(scope="module")
def index(model_dir, documents) -> DenseIndex:
    """Built at construction, 7 texts per forward (so batches pad to different lengths)."""
    return DenseIndex(documents, E5Encoder(model_dir, batch_size=7))


def reference_ranking(model_dir: str, documents: list[dict], queries: list[str]) -> list[list[tuple[str, float]]]:
    """Per query, every document's ``(id, cosine)``, best first, by brute force: one forward per side."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()

    def embed(texts: list[str]) -> torch.Tensor:  # [N, HIDDEN] float32, unit rows
        batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        mean = (hidden * mask).sum(1) / mask.sum(1)
        return mean / mean.norm(dim=-1, keepdim=True)

    passages = embed(["passage: " + d["contents"] for d in documents])
    scores = embed(["query: " + q for q in queries]) @ passages.T  # [Q, N]
    ranked = scores.sort(dim=1, descending=True)
    return [
        [(documents[i]["id"], s) for i, s in zip(row_ids, row_scores)]
        for row_ids, row_scores in zip(ranked.indices.tolist(), ranked.values.tolist())
    ]


def assert_top_hits(got: list[list[tuple[str, float]]], ranking: list[list[tuple[str, float]]], topk: int) -> None:
    """``got`` (per query, ``(id, score)``) is the first ``topk`` of ``ranking`` (scores to 1e-5): the same
    ids in the same order, except that documents whose scores are within 1e-5 may come in either order."""
    assert len(got) == len(ranking)
    for got_row, ranked in zip(got, ranking):
        expected = ranked[:topk]
        assert len(got_row) == len(expected) and len({i for i, _ in got_row}) == len(got_row)
        got_scores = [s for _, s in got_row]
        np.testing.assert_allclose(got_scores, [s for _, s in expected], atol=1e-5)  # the top-k scores, in order
        np.testing.assert_allclose(got_scores, [dict(ranked)[i] for i, _ in got_row], atol=1e-5)  # each id's own


def ids_scores(hits: list[list[tuple[dict, float]]]) -> list[list[tuple[str, float]]]:
    return [[(doc["id"], score) for doc, score in row] for row in hits]


def test_search_equals_the_brute_force_reference(index, model_dir, documents):
    assert index.backend == "dense" and len(index) == 40 and index.documents is documents
    ranking = reference_ranking(model_dir, documents, QUERIES)
    for topk in (1, 3, 40, 100):
        assert_top_hits(ids_scores(index.search(QUERIES, topk)), ranking, topk)
    [many] = index.search(["river"], 100)
    scores = [s for _, s in many]
    assert scores == sorted(scores, reverse=True) and -1.0 <= scores[-1] < scores[0] <= 1.0 + 1e-6


def test_encode_gives_unit_float32_rows_independent_of_batching(model_dir):
    texts = [d["contents"] for d in read_corpus(CORPUS)][:9]
    one_by_one = E5Encoder(model_dir, batch_size=1).encode(texts, "passage: ")
    batched = E5Encoder(model_dir, batch_size=4).encode(texts, "passage: ")
    assert one_by_one.shape == (9, HIDDEN) and one_by_one.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)  # padding does not leak into the mean
    assert not np.allclose(E5Encoder(model_dir).encode(texts, "query: "), batched, atol=1e-3)  # the prefix counts


def test_save_index_then_index_gives_identical_results(index, model_dir, documents, tmp_path):
    path = tmp_path / "e5_Flat.index"
    index.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["e5_Flat.index"]  # the temporary file was renamed
    loaded = DenseIndex(documents, E5Encoder(model_dir), index_path=path)
    assert loaded.search(QUERIES, 5) == index.search(QUERIES, 5)


def test_an_index_of_the_wrong_size_or_dimension_is_a_clear_error(index, model_dir, documents, tmp_path, capsys):
    faiss = import_faiss()
    rng = np.random.default_rng(0)
    for name, dim, rows, message in [
        ("short.index", HIDDEN, 39, r"--index .*short.index: 39 vectors, but the corpus has 40 documents"),
        (
            "narrow.index",
            16,
            40,
            r"--index .*narrow.index: vectors of dimension 16, but the --model's hidden size is 32",
        ),
    ]:
        flat = faiss.IndexFlatIP(dim)
        flat.add(rng.standard_normal((rows, dim)).astype(np.float32))
        faiss.write_index(flat, str(tmp_path / name))
        with pytest.raises(ValueError, match=message):
            DenseIndex(documents, index.encoder, index_path=tmp_path / name)
    # The command line: the same message, exit 2, no server.
    argv = ["serve", "--corpus", str(CORPUS), "--port", "0", "--backend", "dense", "--model", model_dir]
    assert main([*argv, "--index", str(tmp_path / "short.index")]) == 2
    assert "39 vectors, but the corpus has 40 documents" in capsys.readouterr().err


def test_serve_dense_answers_in_search_r1s_format_with_the_in_process_hits(index, model_dir, documents, tmp_path):
    ranking = ids_scores(index.search(QUERIES, 40))  # in-process, every document
    saved = tmp_path / "e5_Flat.index"
    argv = ["--backend", "dense", "--model", model_dir, "--batch-size", "16", "--save-index", str(saved)]
    with serve_retriever(tmp_path, *argv) as url:
        client = RetrieverClient(url)
        assert client.health() == {"status": "ok", "backend": "dense", "num_documents": 40}
        passages = client.search(QUERIES, topk=4)
        assert_top_hits([[(p.id, p.score) for p in row] for row in passages], ranking, 4)
        by_id = {d["id"]: d["contents"] for d in documents}
        assert all(p.contents == by_id[p.id] for row in passages for p in row)
        top3 = client.search(QUERIES[:2], topk=3)
        request = urllib.request.Request(
            url + "/retrieve",
            data=json.dumps({"queries": QUERIES[:2]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
    # No topk: the default 3; no return_scores: each entry is the document {"id", "contents"} itself.
    assert answer == {"result": [[{"id": p.id, "contents": p.contents} for p in row] for row in top3]}
    # --save-index wrote the index the server built: loaded, it answers like the in-process one.
    assert_top_hits(ids_scores(DenseIndex(documents, index.encoder, index_path=saved).search(QUERIES, 5)), ranking, 5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--backend", "dense"], "--backend dense needs --model"),
        (["--backend", "dense", "--model", str(CORPUS)], "--model " + str(CORPUS) + ": not a directory"),
        (["--model", str(REPO)], "--model is for --backend dense only"),
        (["--index", str(CORPUS)], "--index is for --backend dense only"),
        (
            ["--backend", "dense", "--model", str(REPO), "--index", "missing.index"],
            "--index missing.index: no such file",
        ),
        (["--backend", "dense", "--model", str(REPO), "--index", str(CORPUS), "--save-index", "x"], "--save-index"),
        (["--backend", "dense", "--model", str(REPO), "--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_serve_flag_errors_exit_2_naming_the_flag(extra, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--corpus", str(CORPUS), "--port", "0", *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_faiss_the_dense_backend_says_pip_install_faiss_cpu(monkeypatch, model_dir, documents, capsys):
    monkeypatch.setitem(sys.modules, "faiss", None)  # `import faiss` raises ImportError
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        import_faiss()
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        DenseIndex(documents, E5Encoder(model_dir))
    with pytest.raises(SystemExit) as info:
        main(["serve", "--corpus", str(CORPUS), "--port", "0", "--backend", "dense", "--model", model_dir])
    assert info.value.code == 2 and "pip install faiss-cpu" in capsys.readouterr().err


def test_building_a_dense_index_leaves_llvmlite_and_numba_unimported(model_dir):
    # vllm 0.32 cannot start an engine in a process where llvmlite is imported (see _import_bm25s)
    script = (
        "import sys\n"
        "from megatron_empg.rollout.retriever.index import DenseIndex, E5Encoder\n"
        f"index = DenseIndex([{{'id': 'a', 'contents': 'Paris'}}, {{'id': 'b', 'contents': 'Berlin'}}], E5Encoder({model_dir!r}))\n"
        "[[(best, _)]] = index.search(['Paris'], 1)\n"
        "print(len(index), 'faiss' in sys.modules, 'llvmlite' in sys.modules, 'numba' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2 True False False"
