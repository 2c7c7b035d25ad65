"""Search cache at scale: the reference's JSON rewrite per miss vs the log-structured SearchCache.

At N entries (default 10^5, values sampled from the real reference cache texts, ~1.5 KB each) measures:
the reference write (lock, read + merge the whole JSON, rewrite it, rename: spec 6.2), SearchCache writes
(sync = fsync per entry; async = batched by the writer thread), lookups, a cold load, and a compaction.
Prints a table and a final JSON line.

    python benchmarks/tools/search_cache.py [--entries 100000] [--dir /tmp]
"""

import argparse
import json
import os
import pathlib
import random
import shutil
import tempfile
import time

from arpo_jax.tools.search_cache import SearchCache, read_reference_json, write_reference_json

REFERENCE_CACHE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "search" / "search_cache.json"


def sample_values() -> list[str]:
    if REFERENCE_CACHE.exists():
        return list(json.loads(REFERENCE_CACHE.read_text(encoding="utf-8")).values())
    return ["\n".join(f"Page {k}: " + "lorem ipsum " * 12 for k in range(1, 11))]


def reference_write(path: str, memory: dict, query: str, result: str) -> None:
    """The reference's sync save for one miss: merge what is on disk, rewrite everything, rename."""
    memory[query] = result
    disk = read_reference_json(path)
    disk.update(memory)
    write_reference_json(path, disk)


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--writes", type=int, default=2000, help="timed writes into the full store")
    p.add_argument("--reference-writes", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    rng = random.Random(0)
    values = sample_values()
    data = {f"query {i} {rng.random():.6f}": rng.choice(values) for i in range(args.entries)}
    work = tempfile.mkdtemp(prefix="cache_bench_", dir=args.dir)
    res: dict[str, float] = {"entries": args.entries}
    try:
        ref_path = os.path.join(work, "reference.json")
        t0 = time.perf_counter()
        write_reference_json(ref_path, data)
        res["json_size_mb"] = round(os.path.getsize(ref_path) / 2**20, 1)
        res["json_full_write_s"] = round(time.perf_counter() - t0, 3)
        memory = dict(data)
        t0 = time.perf_counter()
        for i in range(args.reference_writes):
            reference_write(ref_path, memory, f"new reference query {i}", values[i % len(values)])
        res["reference_write_s"] = round((time.perf_counter() - t0) / args.reference_writes, 3)

        # SearchCache: the same N entries as the snapshot, then timed writes into it.
        store = os.path.join(work, "store.json")
        shutil.copy(ref_path, store)
        t0 = time.perf_counter()
        cache = SearchCache(store, sync=True)
        res["load_snapshot_s"] = round(time.perf_counter() - t0, 3)
        new = [(f"new query {i}", values[i % len(values)]) for i in range(args.writes)]
        t0 = time.perf_counter()
        for q, r in new[: args.writes // 4]:
            cache.put(q, r)
        res["sync_write_per_s"] = round(rate(args.writes // 4, time.perf_counter() - t0))
        cache.close()
        cache = SearchCache(store)
        t0 = time.perf_counter()
        for q, r in new:
            cache.put(q, r)
        cache.flush()
        res["async_write_per_s"] = round(rate(len(new), time.perf_counter() - t0))
        keys = rng.sample(list(data), 20000)
        t0 = time.perf_counter()
        hits = sum(cache.get(k) is not None for k in keys)
        res["lookup_per_s"] = round(rate(len(keys), time.perf_counter() - t0))
        assert hits == len(keys)
        cache.close()
        # The worst cold start: every entry in segments, none in the snapshot.
        seg_store = os.path.join(work, "segments.json")
        seg_cache = SearchCache(seg_store)
        for q, r in data.items():
            seg_cache.put(q, r)
        seg_cache.close()
        t0 = time.perf_counter()
        loaded = SearchCache(seg_store, read_only=True)
        res["load_segments_s"] = round(time.perf_counter() - t0, 3)
        assert len(loaded) == len(data)
        t0 = time.perf_counter()
        n = SearchCache(seg_store).compact()
        res["compact_s"] = round(time.perf_counter() - t0, 3)
        assert n == len(data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["speedup_write_sync_vs_reference"] = round(res["sync_write_per_s"] * res["reference_write_s"], 1)
    res["speedup_write_async_vs_reference"] = round(res["async_write_per_s"] * res["reference_write_s"], 1)
    print(f"{'measure at ' + str(args.entries) + ' entries':40} {'value':>12}")
    for k, v in res.items():
        print(f"{k:40} {v:>12}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
