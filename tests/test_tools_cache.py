"""The shared search cache: reference format, threads, real concurrent processes, SIGKILL and SIGTERM."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest

from arpo_jax.tools import search_cache as sc
from arpo_jax.tools.search_cache import SearchCache, parse_segment, read_reference_json

REFERENCE_CACHE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "search" / "search_cache.json"
MODULE = pathlib.Path(sc.__file__)

# Subprocesses load search_cache.py by path (stdlib only), so they do not pay for importing the whole package.
_PRELUDE = f"""
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("search_cache", {str(MODULE)!r})
sc = importlib.util.module_from_spec(spec); spec.loader.exec_module(sc)
"""


def run_py(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def entry(writer: int, i: int) -> tuple[str, str]:
    return f"writer {writer} query {i} 北京", f"Page 1: result {writer}.{i} " + "é" * (i % 7)


def test_put_get_persist_and_reference_format(tmp_path):
    path = tmp_path / "search_cache.json"
    cache = SearchCache(str(path))
    cache.put("q1", "Page 1: a")
    cache.put("q2", "Page 1: 北京")
    assert cache.get("q1") == "Page 1: a" and cache.get("missing") is None
    cache.close()
    again = SearchCache(str(path))
    assert again.snapshot() == {"q1": "Page 1: a", "q2": "Page 1: 北京"}
    assert again.compact() == 2
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == {"q1": "Page 1: a", "q2": "Page 1: 北京"}
    assert "北京" in text and text.startswith("{\n  ")  # ensure_ascii=False, indent=2 as the reference writes
    assert list((tmp_path / "search_cache.json.log.d").glob("*.jsonl")) == []  # folded in and removed
    again.close()


def test_reference_cache_loads_and_serves_every_query(tmp_path):
    if not REFERENCE_CACHE.exists():
        pytest.skip(f"reference data not found at {REFERENCE_CACHE}")
    data = json.loads(REFERENCE_CACHE.read_text(encoding="utf-8"))
    cache = SearchCache(str(REFERENCE_CACHE), read_only=True)
    assert len(cache) == len(data) == 1000
    assert all(cache.get(q) == r for q, r in data.items())
    # A writable copy: new entries go to a segment; export gives the reference format with everything.
    copy = tmp_path / "copy.json"
    copy.write_bytes(REFERENCE_CACHE.read_bytes())
    writable = SearchCache(str(copy))
    writable.put("new query", "Page 1: new")
    writable.flush()
    assert writable.export_json(str(tmp_path / "export.json")) == 1001
    exported = read_reference_json(str(tmp_path / "export.json"))
    assert exported == {**data, "new query": "Page 1: new"}
    writable.close()


def test_import_json(tmp_path):
    src = tmp_path / "src.json"
    src.write_text(json.dumps({"a": "A", "b": "B"}), encoding="utf-8")
    cache = SearchCache(str(tmp_path / "c.json"))
    cache.put("a", "mine")
    assert cache.import_json(str(src)) == 1
    assert cache.get("a") == "mine" and cache.get("b") == "B"
    cache.close()


def test_threads_and_bounded_queue(tmp_path):
    path = str(tmp_path / "c.json")
    cache = SearchCache(path, queue_size=4)  # tiny queue: writers block instead of dropping entries

    def work(w):
        for i in range(150):
            cache.put(*entry(w, i))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.flush(timeout=60)
    cache.close()
    expected = dict(entry(w, i) for w in range(8) for i in range(150))
    assert SearchCache(path, read_only=True).snapshot() == expected


def test_refresh_sees_other_writers(tmp_path):
    path = str(tmp_path / "c.json")
    a, b = SearchCache(path), SearchCache(path, refresh_s=0.0)
    a.put("from a", "A")
    a.flush()
    assert b.get("from a") == "A"
    b.put("from b", "B")
    b.compact()  # b folds everything into the snapshot; a sees it through the replaced snapshot
    a.refresh()
    assert a.get("from b") == "B"
    a.close()
    b.close()


def test_damaged_and_torn_lines_are_skipped():
    blob = (json.dumps(["a", "A"]) + "\n{not json\n" + json.dumps(["b", "B"]) + "\n" + '["c", "C').encode()
    entries, used = parse_segment(blob)
    assert entries == [("a", "A"), ("b", "B")]
    assert used == blob.rfind(b"\n") + 1  # the torn tail is left for its writer to finish


def test_concurrent_processes_and_compaction_never_lose_entries(tmp_path):
    path = str(tmp_path / "shared_cache.json")
    n_writers, n_entries = 4, 300
    writer = """
cache = sc.SearchCache(sys.argv[1], queue_size=64)
w = int(sys.argv[2])
for i in range(int(sys.argv[3])):
    cache.put(f"writer {w} query {i} 北京", f"Page 1: result {w}.{i} " + "é" * (i % 7))
    if i % 50 == 0:
        cache.compact()  # compactions race with the other writers' appends
cache.close()
print("done")
"""
    procs = [run_py(writer, path, str(w), str(n_entries)) for w in range(n_writers)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "done", err
    expected = dict(entry(w, i) for w in range(n_writers) for i in range(n_entries))
    assert SearchCache(path, read_only=True).snapshot() == expected
    final = SearchCache(path)
    assert final.compact() == len(expected)
    final.close()
    assert read_reference_json(path) == expected  # the snapshot alone now holds everything


def test_sigkill_mid_write_keeps_every_acknowledged_entry(tmp_path):
    path = str(tmp_path / "c.json")
    writer = """
cache = sc.SearchCache(sys.argv[1], sync=True)
i = 0
while True:
    cache.put(f"k{i}", "v" * 2000 + str(i))   # sync: on disk (fsynced) when put returns
    print(i, flush=True)
    i += 1
"""
    survivor = run_py("""
cache = sc.SearchCache(sys.argv[1])
for i in range(100000):
    cache.put(f"other {i}", "x")
    if i % 1000 == 0:
        cache.flush(); cache.compact()
""", path)
    victim = run_py(writer, path)
    acked = -1
    for line in victim.stdout:
        acked = int(line)
        if acked >= 200:
            break
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    survivor.send_signal(signal.SIGKILL)  # a second writer killed during its writes/compactions
    survivor.wait()
    cache = SearchCache(path, read_only=True)  # parses, despite torn segments
    for i in range(acked + 1):
        assert cache.get(f"k{i}") == "v" * 2000 + str(i)
    if os.path.exists(path):
        read_reference_json(path)  # the snapshot always parses


def test_sigterm_flushes_queued_entries(tmp_path):
    path = str(tmp_path / "c.json")
    proc = run_py("""
cache = sc.SearchCache(sys.argv[1], queue_size=100000, fsync=True)
for i in range(20000):
    cache.put(f"k{i}", f"v{i}")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("not reached")
""", path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and "not reached" not in out, err
    cache = SearchCache(path, read_only=True)
    assert len(cache) == 20000 and cache.get("k19999") == "v19999"


def test_read_only_cache_writes_nothing(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"a": "A"}))
    cache = SearchCache(str(path), read_only=True)
    cache.put("b", "B")  # kept in memory only
    cache.close()
    assert cache.get("b") == "B"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
    with pytest.raises(RuntimeError):
        cache.compact()


def test_cli_export(tmp_path):
    path = tmp_path / "c.json"
    cache = SearchCache(str(path))
    cache.put("q", "r")
    cache.close()
    sc.main(["export", str(path), str(tmp_path / "out.json")])
    assert read_reference_json(str(tmp_path / "out.json")) == {"q": "r"}
