"""The retriever's corpus and its search backends.

The corpus is JSONL with one ``{"id": str, "contents": str}`` per line. Backends (``--backend``
of ``serve``):

- ``bm25`` (default, ``Bm25Index``): ``bm25s``, imported when an index is built.
- ``dense`` (``DenseIndex``): e5-style embeddings from a local Hugging Face model directory (e.g. a
  downloaded ``intfloat/e5-base-v2``) and an exact inner-product ``faiss`` index (``faiss-cpu``),
  with Search-R1's conventions: ``"query: "`` / ``"passage: "`` prefixes, at most 256 tokens, mean
  pooling over the attention mask, L2-normalized embeddings (so the score is the cosine). The
  index is built by encoding every passage, or read from a prebuilt faiss file whose row i embeds
  corpus line i (Search-R1's ``e5_Flat.index`` for wiki-18), and can be saved for the next start.
  faiss, torch and transformers are imported only by this backend.

Both answer ``search(queries, topk)``: per query, ``(document, score)`` pairs, best first.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

E5_MAX_LENGTH = 256  # tokens per text: Search-R1's query max_length and its index builder's for passages
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "
DEFAULT_ENCODE_BATCH_SIZE = 64  # texts per encoder forward pass


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


def import_faiss():
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

    def __init__(
        self, model_dir: str | os.PathLike, batch_size: int = DEFAULT_ENCODE_BATCH_SIZE, max_length: int = E5_MAX_LENGTH
    ) -> None:
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
                    max_length=self.max_length,
                    padding=True,
                    truncation=True,
                    return_tensors="pt",
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
        faiss = import_faiss()
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
            import_faiss().write_index(self._faiss_index, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Per query, up to ``min(topk, len(self))`` ``(document, cosine)`` pairs, score descending."""
        k = min(topk, len(self.documents))
        with self._lock:
            scores, ids = self._faiss_index.search(self.encoder.encode(queries, E5_QUERY_PREFIX), k)  # [Q, k] each
        return _hits(self.documents, ids, scores)
