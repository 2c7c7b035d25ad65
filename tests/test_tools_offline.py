"""Offline search backends: serving a cache file, and BM25 over a local corpus (bm25s)."""

import json
import pathlib

import pytest

from arpo_jax.tools import make_tool
from arpo_jax.tools.offline_search import CacheSearchTool, LocalSearchTool, documents_from_cache, load_documents
from arpo_jax.tools.search import NO_RESULTS

REFERENCE_CACHE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "search" / "search_cache.json"

CORPUS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889.",
    "Python is a high-level programming language created by Guido van Rossum.",
    "The Great Wall of China is a series of fortifications across northern China.",
    "Mount Everest is Earth's highest mountain above sea level.",
]


def test_cache_backend_hit_and_configurable_miss(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text(json.dumps({"capital of France": "Page 1: Paris."}, ensure_ascii=False), encoding="utf-8")
    tool = make_tool("search", backend="cache", cache_file=str(path), miss_message="Not in the offline cache.")
    assert tool.tag == "search"
    assert tool.execute('"capital of France"') == "Page 1: Paris."  # same query cleaning as online
    assert tool.execute("capital of Spain") == "Not in the offline cache."
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.json"]  # read-only: nothing written


def test_cache_backend_missing_file_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        CacheSearchTool(str(tmp_path / "nope.json"))


def test_cache_backend_serves_the_reference_cache():
    if not REFERENCE_CACHE.exists():
        pytest.skip(f"reference data not found at {REFERENCE_CACHE}")
    data = json.loads(REFERENCE_CACHE.read_text(encoding="utf-8"))
    tool = CacheSearchTool(str(REFERENCE_CACHE))
    assert all(tool.execute(q) == r for q, r in data.items())


def test_local_bm25_ranks_and_formats():
    tool = LocalSearchTool(CORPUS, max_results=2, result_length=30)
    out = tool.execute("Eiffel Tower Paris")
    lines = out.split("\n")
    assert len(lines) == 2
    assert lines[0] == "Page 1: " + CORPUS[1][:30] and lines[1] == "Page 2: " + CORPUS[0][:30]
    assert tool.search("Guido programming language")[0][0] == 2
    assert tool.execute("zebra quantum") == NO_RESULTS
    assert tool.execute("the of and") == NO_RESULTS  # stopwords only


def test_local_corpus_files(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"title": f"T{i}", "text": t}) for i, t in enumerate(CORPUS)))
    assert load_documents(str(jsonl))[0] == "T0: " + CORPUS[0]
    txt = tmp_path / "docs.txt"
    txt.write_text("\n".join(CORPUS) + "\n\n")
    assert load_documents(str(txt)) == CORPUS
    tool = make_tool("search", backend="local", corpus_file=str(jsonl), max_results=1)
    assert tool.execute("highest mountain") == "Page 1: T4: " + CORPUS[4]


def test_local_corpus_from_the_reference_cache():
    if not REFERENCE_CACHE.exists():
        pytest.skip(f"reference data not found at {REFERENCE_CACHE}")
    docs = documents_from_cache(str(REFERENCE_CACHE))
    assert len(docs) > 1000 and len(set(docs)) == len(docs)
    tool = LocalSearchTool(docs, max_results=3)
    out = tool.execute("Amy Smart film debut Campfire Tales")
    assert out.startswith("Page 1: ") and "Campfire Tales" in out.split("\n")[0]
