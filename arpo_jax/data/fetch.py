"""`arpo-jax data fetch` / `data pack`: the manifest's files (`data.manifest`) into the layout the configs read, from
their public sources or from a copy made elsewhere.

- The reference repository's raw files with `requests` (`ARPO_DATA_RAW_URL` replaces the URL's base: a mirror), into
  `$ARPO_CACHE/data/` as `<sha256>.part` and resumed there with an HTTP Range request after an interruption (a
  dropped connection is retried from where it stopped, up to `RETRIES` times).
- The hub's files with `huggingface_hub.hf_hub_download` (its cache, its resume, `HF_ENDPOINT`, `HF_TOKEN`).
- `--from DIR_OR_TARBALL`: a folder laid out like `$ARPO_DATA` or a tarball `data pack` wrote.

A file is written into the data folder only whole and checked: copied to a temporary file beside its place, its
sha256 compared with the manifest's (the hub's LFS sha256 where the manifest pins none), then renamed into place;
anything else leaves no file there. A file already present and right is not downloaded again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from arpo_jax import paths
from arpo_jax.data import manifest
from arpo_jax.data.manifest import Entry

RETRIES = 5
CHUNK = 1 << 16


class FetchError(RuntimeError):
    """One file that could not be fetched, in one line naming it and its source."""


def _progress(total: int | None, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, disable=not enabled, leave=False)


# ------------------------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------------------------


def raw_url(source: dict, entry: Entry) -> str:
    base = os.environ.get(source.get("url_env", "")) if source.get("url_env") else None
    if base:
        return f"{base.rstrip('/')}/{entry.remote}"
    return source["url"].format(revision=source["revision"], remote=entry.remote)


def download_raw(source: dict, entry: Entry, cache: Path, progress: bool) -> Path:
    """The file downloaded whole into `cache` (resumed from a previous partial download); its path."""
    import requests

    url = raw_url(source, entry)
    part = cache / f"{entry.sha256 or entry.name}.part"
    part.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(RETRIES + 1):
        have = part.stat().st_size if part.exists() else 0
        if entry.bytes is not None and have == entry.bytes:
            return part
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with requests.get(url, headers=headers, stream=True, timeout=60) as r:
                if r.status_code == 404:
                    raise FetchError(f"{entry.path}: HTTP 404 Not Found at {url} (source {entry.source}: "
                                     f"{source.get('repository', '')} at {source.get('revision', '')[:7]}, file "
                                     f"{entry.remote})")
                r.raise_for_status()
                if have and r.status_code != 206:  # the server ignored the range: start over
                    have = 0
                total = entry.bytes or (have + int(r.headers.get("Content-Length", 0)) or None)
                with open(part, "ab" if have else "wb") as f, _progress(total, have, entry.path, progress) as bar:
                    for block in r.iter_content(CHUNK):
                        f.write(block)
                        bar.update(len(block))
            if entry.bytes is None or part.stat().st_size >= entry.bytes:
                return part
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, requests.Timeout) as e:
            if attempt == RETRIES:
                raise FetchError(f"{entry.path}: the connection to {url} failed {RETRIES + 1} times ({e}); run the "
                                 f"same command again to resume from {part.stat().st_size if part.exists() else 0} "
                                 "bytes") from e
        except requests.HTTPError as e:
            raise FetchError(f"{entry.path}: {e} (source {entry.source}, file {entry.remote})") from e
    raise FetchError(f"{entry.path}: {url} ended after {part.stat().st_size} of {entry.bytes} bytes")


def _cause(e: BaseException) -> str:
    e = e.__cause__ or e.__context__ or e
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"


def download_hub(source: dict, entry: Entry, progress: bool) -> tuple[Path, str | None]:
    """(the file in the hub's cache, the hub's sha256 of it: its LFS etag, or None for a file kept in git)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if progress else disable_progress_bars)()
    where = f"{source['repo_id']} ({source['repo_type']}) at {source['revision']}, file {entry.remote}"
    try:
        path = Path(hf_hub_download(source["repo_id"], entry.remote, repo_type=source["repo_type"],
                                    revision=source["revision"], endpoint=os.environ.get("HF_ENDPOINT") or None))
    except LocalEntryNotFoundError as e:  # offline (HF_HUB_OFFLINE, or no connection) and not in the hub's cache
        offline = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if os.environ.get(v) not in (None, "", "0")]
        why = f"{offline[0]} is set" if offline else \
            f"cannot reach {os.environ.get('HF_ENDPOINT') or 'https://huggingface.co'} ({_cause(e)})"
        raise FetchError(f"{entry.path}: {why} and the hub's cache has no copy of {where}; on a machine without "
                         "the network: arpo-jax data fetch --from DIR_OR_TARBALL (`arpo-jax data pack` elsewhere)") \
            from e
    except (EntryNotFoundError, RepositoryNotFoundError) as e:
        raise FetchError(f"{entry.path}: not found on the hub: {where} ({type(e).__name__})") from e
    except (HfHubHTTPError, OSError) as e:
        raise FetchError(f"{entry.path}: the hub download failed: {where}: {' '.join(str(e).split())[:200]}") from e
    blob = path.resolve().name  # the cache names a blob by its etag: an LFS file's sha256
    return path, blob if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else None


# ------------------------------------------------------------------------------------------------------------------
# Writing a file into the data folder: whole and checked, or not at all
# ------------------------------------------------------------------------------------------------------------------


def install(entry: Entry, source_file, target: Path, expected: str | None, what: str) -> None:
    """Copies `source_file` (a path or an open binary file) to `target` through a temporary file beside it, renamed
    into place only when its sha256 is `expected` (None: any)."""
    import hashlib

    target.parent.mkdir(parents=True, exist_ok=True)
    size = entry.bytes or (os.path.getsize(source_file) if isinstance(source_file, (str, Path)) else 0)
    free = shutil.disk_usage(target.parent).free
    if size and free < size:
        raise FetchError(f"{entry.path}: no space left in {target.parent} ({free} bytes free, the file needs "
                         f"{size}); nothing was written")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    h = hashlib.sha256()
    try:
        with contextlib.ExitStack() as stack:
            src = stack.enter_context(open(source_file, "rb")) if isinstance(source_file, (str, Path)) else source_file
            out = stack.enter_context(os.fdopen(fd, "wb"))
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if expected and h.hexdigest() != expected:
            raise FetchError(f"{entry.path}: {what} has sha256 {h.hexdigest()}, the manifest's is {expected}: "
                             "refused (a corrupted or changed file; nothing was written)")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it (mkstemp's is 0600)
        os.replace(tmp, target)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise FetchError(f"{entry.path}: no space left on the device of {target.parent} while writing; "
                             "nothing was written") from e
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class _Copy:
    """`--from`: a folder laid out like the data folder, or a tarball of one (`pack`)."""

    def __init__(self, origin: str | os.PathLike):
        self.origin = Path(origin)
        if not self.origin.exists():
            raise ValueError(f"--from {origin}: no such folder or tarball")
        self.tar = None if self.origin.is_dir() else tarfile.open(self.origin)

    def open(self, entry: Entry):
        if self.tar is None:
            file = self.origin / entry.path
            if not file.is_file():
                raise FetchError(f"{entry.path}: not in the copy {self.origin}")
            return file
        try:
            return self.tar.extractfile(entry.path) or _missing(entry, self.origin)
        except KeyError:
            return _missing(entry, self.origin)


def _missing(entry: Entry, origin: Path):
    raise FetchError(f"{entry.path}: not in the tarball {origin}")


def fetch(to: str | os.PathLike | None = None, only: Sequence[str] = (), *, origin: str | os.PathLike | None = None,
          progress: bool = True) -> dict:
    """Every selected file of the manifest into `to` (default `$ARPO_DATA`): what was already there, what was
    written, and the failures (one line each; the others are fetched anyway)."""
    root = manifest.data_dir(to)
    sources, entries = manifest.load()
    copy = _Copy(origin) if origin else None
    cache = paths.cache_dir() / "data"
    done, written, failed = [], [], []
    for entry in manifest.select(entries, only):
        target = root / entry.path
        if manifest.check_file(entry, target).ok:
            done.append(entry.path)
            continue
        source = sources[entry.source]
        try:
            if copy is not None:
                install(entry, copy.open(entry), target, entry.sha256, f"the copy in {copy.origin}")
            elif source["kind"] == "raw":
                part = download_raw(source, entry, cache, progress)
                try:
                    install(entry, part, target, entry.sha256, f"the download from {raw_url(source, entry)}")
                except FetchError:
                    if manifest.sha256_of(part) != entry.sha256:
                        part.unlink()  # a corrupted download: the next run starts over
                    raise
                part.unlink()
            else:
                file, hub_sha = download_hub(source, entry, progress)
                install(entry, file, target, entry.sha256 or hub_sha, f"the hub's {source['repo_id']}/{entry.remote}")
            status = manifest.check_file(entry, target)
            if not status.ok:
                target.unlink()
                raise FetchError(f"{entry.path}: {status.status} after the download: {status.found}")
            written.append(entry.path)
        except FetchError as e:
            failed.append(str(e))
        except OSError as e:  # e.g. the cache's disk full while downloading
            failed.append(f"{entry.path}: {e}")
    return {"folder": str(root), "present": done, "written": written, "failed": failed}


def pack(folder: str | os.PathLike | None, out: str | os.PathLike, only: Sequence[str] = ()) -> dict:
    """A tarball of the selected files of `folder` (each checked first: a file that is not present and right is
    refused), for `fetch --from` on a machine without the network; written whole or not at all."""
    statuses = manifest.check_dir(folder, only)
    bad = [s for s in statuses if not s.ok]
    if bad:
        raise ValueError("cannot pack: " + "; ".join(f"{s.entry.path} {s.status} ({s.found})" for s in bad) +
                         f"; first: {manifest.fetch_command([s.entry for s in bad], folder)}")
    out = Path(out).absolute()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz" if out.name.endswith(("gz", "tgz")) else "w") as tar:
            for s in statuses:
                tar.add(s.file, arcname=s.entry.path)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return {"tarball": str(out), "files": [s.entry.path for s in statuses], "bytes": out.stat().st_size}
