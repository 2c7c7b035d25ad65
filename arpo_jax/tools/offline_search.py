"""Offline ``<search>`` backends: for users without an API key, for tests and for the demo.

``cache``: serve a cache in the reference format (e.g. ../shared/data/search/search_cache.json); a miss returns a
configurable message. ``local``: BM25 (the ``bm25s`` library) over a document collection, formatted like the
online tool (``Page k: text``), so the model sees the same kind of result.
"""

import json
import logging
import os
import threading

from arpo_jax.tools.base import Tool
from arpo_jax.tools.search import NO_RESULTS, clean_query
from arpo_jax.tools.search_cache import SearchCache

DEFAULT_MISS_MESSAGE = "No search results found."


class CacheSearchTool(Tool):
    """Answers from a search cache only (read-only: it never writes to the cache)."""

    tag = "search"

    def __init__(self, cache_file: str, miss_message: str = DEFAULT_MISS_MESSAGE, refresh_s: float = 15.0):
        if not os.path.exists(cache_file) and not os.path.isdir(cache_file + ".log.d"):
            raise FileNotFoundError(f"search cache not found: {cache_file}")
        self.cache = SearchCache(cache_file, read_only=True, refresh_s=refresh_s)
        self.miss_message = miss_message

    def __repr__(self) -> str:
        return f"CacheSearchTool({self.cache.path!r}, entries={len(self.cache)})"

    def execute(self, content: str) -> str:
        hit = self.cache.get(clean_query(content))
        return self.miss_message if hit is None else hit


def load_documents(path: str, text_field: str = "text", title_field: str | None = "title") -> list[str]:
    """Documents from a .jsonl file (one object a line), a .json list, or a plain text file (one a line)."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            rows = [json.loads(line) for line in f if line.strip()]
        elif path.endswith(".json"):
            rows = json.load(f)
        else:
            return [line.strip() for line in f if line.strip()]
    docs = []
    for row in rows:
        if isinstance(row, str):
            docs.append(row)
            continue
        title = row.get(title_field) if title_field else None
        docs.append(f"{title}: {row[text_field]}" if title else str(row[text_field]))
    return docs


def documents_from_cache(cache_file: str) -> list[str]:
    """Every snippet of a reference-format cache, one document each (a ready-made corpus for the demo)."""
    docs: list[str] = []
    for result in SearchCache(cache_file, read_only=True).snapshot().values():
        for line in result.split("\n"):
            text = line.split(": ", 1)[1] if line.startswith("Page ") and ": " in line else line
            if text.strip() and text != NO_RESULTS:
                docs.append(text.strip())
    return list(dict.fromkeys(docs))  # de-duplicate, keep order


class LocalSearchTool(Tool):
    """BM25 over a local corpus with ``bm25s`` (sparse, fast; the index is built once at construction)."""

    tag = "search"

    def __init__(self, documents: list[str] | None = None, corpus_file: str | None = None, max_results: int = 10,
                 result_length: int = 1000, stopwords: str | None = "en", text_field: str = "text"):
        import bm25s  # imported here: only this backend needs it

        # bm25s sets its own logger to DEBUG at import: its lines would reach the console of any handler (the demo's)
        logging.getLogger("bm25s").setLevel(logging.WARNING)

        if documents is None:
            if corpus_file is None:
                raise ValueError("LocalSearchTool needs documents or corpus_file")
            documents = load_documents(corpus_file, text_field=text_field)
        if not documents:
            raise ValueError("LocalSearchTool: empty corpus")
        self.documents = list(documents)
        self.max_results, self.result_length, self.stopwords = max_results, result_length, stopwords
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(self.documents, stopwords=stopwords, show_progress=False),
                          show_progress=False)
        self._lock = threading.Lock()  # retrieval shares scratch state inside bm25s

    def __repr__(self) -> str:
        return f"LocalSearchTool(documents={len(self.documents)}, max_results={self.max_results})"

    def search(self, query: str, k: int | None = None) -> list[tuple[int, float]]:
        """Top documents as (index, score), best first; documents with a zero score are dropped."""
        k = min(k or self.max_results, len(self.documents))
        tokens = self._bm25s.tokenize([query], stopwords=self.stopwords, show_progress=False)
        if not tokens.vocab:  # nothing but stopwords / punctuation
            return []
        with self._lock:
            ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def execute(self, content: str) -> str:
        hits = self.search(clean_query(content))
        lines = [f"Page {k}: {self.documents[i][:self.result_length]}" for k, (i, _) in enumerate(hits, start=1)]
        return "\n".join(lines) if lines else NO_RESULTS
