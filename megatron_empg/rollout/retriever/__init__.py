"""A local passage retriever over HTTP, wire-compatible with the Search-R1 retrieval server, and its client.

``index``: the corpus (JSONL, one ``{"id": str, "contents": str}`` per line; ``contents`` is
``'"Title"\\ntext'`` as in Search-R1's wiki-18 corpus) and its search backends, BM25 and dense e5;
``server``: ``POST /retrieve`` and ``GET /health`` over an index (the wire format);
``client``: what the search agent (``rollout.search_agent``) asks it through, with timeouts and retries;
``cli``: ``python -m megatron_empg.rollout.retriever serve|stop`` (``__main__``). Importing the
package imports none of them.
"""
