"""A persistent ``{query: result}`` search cache shared by threads, processes and nodes.

The reference (spec 6.2) keeps one JSON object and rewrites the whole file after every miss: O(size) per write
(about 150 MB at 10^5 entries, see benchmarks/tools/search_cache.py), and entries of concurrent writers on other nodes
can be lost when the lock file does not work over the shared filesystem. Here the store is log-structured:

  <path>              the snapshot, in the reference format (one JSON object, ``ensure_ascii=False, indent=2``);
                      only replaced atomically (temp file + rename), so it always parses.
  <path>.log.d/*.jsonl  one append-only segment per writer process (``[query, result]`` per line). A segment has
                      a single writer, so no cross-process or cross-node locking is needed for writes; a torn
                      last line (writer killed mid-write) is skipped by readers.

Readers load the snapshot plus every segment and later follow the segments by byte offset. ``compact()`` folds
everything into a new snapshot (the reference file) and deletes the closed segments it fully folded in.
This module uses the standard library only (tests load it by path in subprocesses).
"""

import atexit
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
import weakref

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux
    fcntl = None

log = logging.getLogger(__name__)
_LIVE_CACHES: "weakref.WeakSet[SearchCache]" = weakref.WeakSet()
_SIGTERM_INSTALLED = []


def read_reference_json(path: str) -> dict[str, str]:
    """Loads a cache in the reference format; a missing file is an empty cache."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected one JSON object {{query: result}}, got {type(data).__name__}")
    return data


def write_reference_json(path: str, data: dict[str, str]) -> None:
    """Writes ``data`` in the reference format atomically (a reader sees the old or the new file, never half)."""
    tmp = f"{path}.tmp.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def parse_segment(blob: bytes) -> tuple[list[tuple[str, str]], int]:
    """Parses complete lines of a segment. Returns the entries and the number of bytes consumed.

    A line without its newline is left for later (its writer may still be writing it); a damaged complete line
    is skipped rather than failing the whole cache.
    """
    end = blob.rfind(b"\n") + 1
    entries = []
    for line in blob[:end].splitlines():
        try:
            query, result = json.loads(line)
            entries.append((query, result))
        except (ValueError, TypeError):
            log.warning("search cache: skipping a damaged segment line (%d bytes)", len(line))
    return entries, end


def _on_sigterm(signum, frame):
    for cache in list(_LIVE_CACHES):
        cache.close()
    previous = _SIGTERM_INSTALLED[0]
    if callable(previous):
        previous(signum, frame)
    else:  # default action: die of SIGTERM, as the process would have without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_flush() -> None:
    if _SIGTERM_INSTALLED or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be installed from the main thread; atexit still flushes
    _SIGTERM_INSTALLED.append(signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, _on_sigterm)


class SearchCache:
    """Thread-safe cache with an asynchronous writer. See the module docstring for the on-disk layout.

    Args:
      path: the snapshot file in the reference format (need not exist yet).
      read_only: never create or modify files (e.g. to serve a shared read-only cache).
      refresh_s: at most this often, a miss first reads what other writers added (reference: 15 s).
      queue_size: bound of the write queue; ``put`` blocks when the disk falls that far behind.
      sync: write and fsync inside ``put`` (every returned ``put`` is durable) instead of in the writer thread.
      fsync: fsync each written batch (durability across power loss and visibility on NFS close-to-open).
      segment_max_bytes: start a new segment after this size (closed segments can be compacted away).
    """

    def __init__(self, path: str, *, read_only: bool = False, refresh_s: float = 15.0, queue_size: int = 10000,
                 sync: bool = False, fsync: bool = True, segment_max_bytes: int = 64 << 20):
        self.path = os.path.abspath(path)
        self.log_dir = self.path + ".log.d"
        self.read_only, self.refresh_s, self.sync, self.fsync = read_only, refresh_s, sync, fsync
        self.segment_max_bytes = segment_max_bytes
        self._data: dict[str, str] = {}
        self._lock = threading.RLock()  # guards _data and the reader state
        self._write_lock = threading.RLock()  # guards the own segment (re-entrant: the SIGTERM flush)
        self._offsets: dict[tuple[int, int], int] = {}  # (dev, inode) of a segment -> bytes consumed
        self._snapshot_sig = None
        self._last_refresh = 0.0
        self._writer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._segment_seq, self._segment = 0, None
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = None
        self._closed = False
        self.refresh(force=True)
        if not read_only:
            _LIVE_CACHES.add(self)
            atexit.register(self.close)
            _install_sigterm_flush()

    def __repr__(self) -> str:
        return f"SearchCache({self.path!r}, entries={len(self)}, read_only={self.read_only})"

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __contains__(self, query: str) -> bool:
        return self.get(query) is not None

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return dict(self._data)

    # ----------------------------------------------------------------------------------------------------- reads
    def get(self, query: str) -> str | None:
        """The cached result, or None. A miss first picks up other writers' entries (rate-limited)."""
        with self._lock:
            hit = self._data.get(query)
        if hit is None and time.monotonic() - self._last_refresh >= self.refresh_s:
            self.refresh()
            with self._lock:
                hit = self._data.get(query)
        return hit

    def refresh(self, force: bool = False) -> None:
        """Reads a replaced snapshot and the new bytes of every segment (other processes' and nodes' writes)."""
        with self._lock:
            self._last_refresh = time.monotonic()
            try:
                st = os.stat(self.path)
                sig = (st.st_ino, st.st_size, st.st_mtime_ns)
            except FileNotFoundError:
                sig = None
            if sig is not None and (force or sig != self._snapshot_sig):
                for query, result in read_reference_json(self.path).items():
                    self._data.setdefault(query, result)  # entries we hold are at least as new
            self._snapshot_sig = sig
            for name in self._segment_names():
                self._read_segment(os.path.join(self.log_dir, name), self._data, self._offsets)

    def _segment_names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.log_dir) if n.endswith(".jsonl"))
        except FileNotFoundError:
            return []

    @staticmethod
    def _read_segment(seg_path: str, target: dict, offsets: dict) -> int:
        """Applies the unread complete lines of one segment to ``target``; returns its consumed size."""
        try:
            with open(seg_path, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_dev, st.st_ino)
                offset = offsets.get(key, 0)
                if st.st_size > offset:
                    f.seek(offset)
                    entries, used = parse_segment(f.read(st.st_size - offset))
                    target.update(entries)
                    offset += used
                    offsets[key] = offset
                return offset
        except FileNotFoundError:  # compacted away meanwhile: its entries are in the snapshot
            return 0

    # ---------------------------------------------------------------------------------------------------- writes
    def put(self, query: str, result: str) -> None:
        """Stores an entry: visible to this process at once, on disk after the writer thread (or now if sync)."""
        with self._lock:
            self._data[query] = result
        if self.read_only:
            return
        if self._closed:
            raise RuntimeError("SearchCache is closed")
        if self.sync:
            self._write_batch([(query, result)])
            return
        self._ensure_writer()
        self._queue.put((query, result))  # blocks while the queue is full: back-pressure, never dropped

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every entry put so far is written (and fsynced). Returns False on timeout."""
        if self.read_only or self._thread is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if not self._thread.is_alive():
                self._drain_inline()
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Flushes and closes the own segment (idempotent; also runs at exit and on SIGTERM)."""
        if self._closed:
            return
        if not self.read_only:
            self.flush(timeout=30)
            self._closed = True
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
            with self._write_lock:
                self._close_segment(mark_done=True)
        self._closed = True

    def _ensure_writer(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._write_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._writer_loop, name="search-cache-writer",
                                                    daemon=True)
                    self._thread.start()

    def _writer_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            batch = [item]
            while len(batch) < 4096:  # batch whatever is queued: one write + one fsync per batch
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.task_done()
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                self._write_batch(batch)
            except OSError as e:  # keep serving from memory; the entries stay in this process
                log.error("search cache: writing %d entries to %s failed: %s", len(batch), self.log_dir, e)
            for _ in batch:
                self._queue.task_done()

    def _drain_inline(self) -> None:
        batch = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                batch.append(item)
            self._queue.task_done()
        if batch:
            self._write_batch(batch)

    def _write_batch(self, batch: list[tuple[str, str]]) -> None:
        blob = b"".join(json.dumps([q, r], ensure_ascii=False).encode("utf-8") + b"\n" for q, r in batch)
        with self._write_lock:
            seg = self._open_segment()
            seg.write(blob)  # one write() of whole lines; unbuffered file, so it reaches the kernel now
            if self.fsync:
                os.fsync(seg.fileno())
            st = os.fstat(seg.fileno())
            with self._lock:  # we hold these entries already: mark our own bytes as read
                self._offsets[(st.st_dev, st.st_ino)] = st.st_size
            if st.st_size >= self.segment_max_bytes:
                self._close_segment(mark_done=True)

    def _segment_path(self, done: bool = False) -> str:
        suffix = ".done.jsonl" if done else ".jsonl"
        return os.path.join(self.log_dir, f"{self._writer_id}-{self._segment_seq:05d}{suffix}")

    def _open_segment(self):
        if self._segment is None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._segment = open(self._segment_path(), "ab", buffering=0)
        return self._segment

    def _close_segment(self, mark_done: bool) -> None:
        # Renaming to *.done.jsonl tells compaction that nobody appends to this segment any more.
        if self._segment is None:
            return
        self._segment.close()
        self._segment = None
        if mark_done:
            os.replace(self._segment_path(), self._segment_path(done=True))
        self._segment_seq += 1

    # ------------------------------------------------------------------------------------------------ compaction
    def compact(self, stale_after_s: float | None = None, lock_timeout_s: float = 60.0) -> int:
        """Folds the snapshot and all segments into a new snapshot; deletes closed segments folded in.

        Args:
          stale_after_s: also delete open segments not modified for this long (writers that were killed).
            Only safe when no live writer can stay idle that long.
          lock_timeout_s: how long to wait for another process's compaction.
        Returns:
          The number of entries in the new snapshot.
        """
        if self.read_only:
            raise RuntimeError("compact() on a read-only SearchCache")
        self.flush()
        with self._write_lock:
            self._close_segment(mark_done=True)  # our own entries become deletable too
        with _FileLock(self.path + ".lock", lock_timeout_s), self._lock:
            merged = read_reference_json(self.path)
            removable, offsets, now = [], {}, time.time()
            for name in self._segment_names():  # every segment from its start, into `merged`
                seg_path = os.path.join(self.log_dir, name)
                size = self._read_segment(seg_path, merged, offsets)
                try:
                    st = os.stat(seg_path)
                except FileNotFoundError:
                    continue
                closed = name.endswith(".done.jsonl") or (
                    stale_after_s is not None and now - st.st_mtime > stale_after_s)
                # A stale segment's torn last line was never acknowledged; a closed one must be fully folded in.
                if closed and (st.st_size == size or not name.endswith(".done.jsonl")):
                    removable.append(seg_path)
            write_reference_json(self.path, merged)
            for seg_path in removable:
                os.unlink(seg_path)
            for query, result in merged.items():
                self._data.setdefault(query, result)
            self._snapshot_sig = None
        return len(merged)

    def export_json(self, out_path: str) -> int:
        """Writes every entry this process can see to ``out_path`` in the reference format."""
        self.refresh(force=True)
        data = self.snapshot()
        write_reference_json(out_path, data)
        return len(data)

    def import_json(self, in_path: str) -> int:
        """Adds the entries of a reference-format file (existing entries of this cache win)."""
        added = 0
        for query, result in read_reference_json(in_path).items():
            with self._lock:
                if query in self._data:
                    continue
            self.put(query, result)
            added += 1
        return added


class _FileLock:
    """An exclusive ``flock`` (cross-process; across nodes where the shared filesystem supports it)."""

    def __init__(self, path: str, timeout_s: float):
        self.path, self.timeout_s, self.fd = path, timeout_s, None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"could not lock {self.path} within {self.timeout_s} s") from None
                time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # closing releases the lock


def main(argv: list[str] | None = None) -> None:
    """``python -m arpo_jax.tools.search_cache {compact,export,import,stats} CACHE [FILE]``."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("command", choices=["compact", "export", "import", "stats"])
    p.add_argument("cache")
    p.add_argument("file", nargs="?")
    args = p.parse_args(argv)
    cache = SearchCache(args.cache, read_only=args.command in ("export", "stats"))
    if args.command == "compact":
        print(f"{cache.compact()} entries in {cache.path}")
    elif args.command == "export":
        print(f"{cache.export_json(args.file)} entries written to {args.file}")
    elif args.command == "import":
        print(f"{cache.import_json(args.file)} entries added")
        cache.close()
    else:
        print(f"{len(cache)} entries; segments: {len(cache._segment_names())}")


if __name__ == "__main__":
    main()
