"""The data manifest (`manifest.json`, shipped with the package): every file the shipped configs and `arpo-jax eval`
read, where it lies under `$ARPO_DATA`, where it comes from (source, revision, the file there), its sha256, rows and
columns; and the check of a folder against it (`arpo-jax data check`, `arpo-jax doctor`, the config's file checks).
No network here: `data.fetch` downloads."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

MANIFEST = Path(__file__).with_name("manifest.json")
DATA_ENV = "ARPO_DATA"
PRESENT, MISSING, WRONG_CHECKSUM, WRONG_COLUMNS = "present", "missing", "wrong checksum", "wrong columns"
_JSON_COLUMNS_LIMIT = 64 << 20  # a larger .json file is not parsed for its columns (its checksum still counts)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # what --only takes, besides the group
    path: str  # relative to $ARPO_DATA
    group: str  # rl | eval | search | sft
    source: str  # a key of the manifest's "sources"
    remote: str  # the file's path in its source
    sha256: str | None  # None: the source's own checksum (the hub's LFS sha256) is checked instead
    bytes: int | None
    rows: int | None
    columns: tuple[str, ...]
    convert: str = ""  # how the source's file differs from what the configs read ("" = the same bytes, same name)


@dataclasses.dataclass(frozen=True)
class FileStatus:
    entry: Entry
    file: Path
    status: str  # PRESENT, MISSING, WRONG_CHECKSUM or WRONG_COLUMNS
    found: str  # what was found, in words

    @property
    def ok(self) -> bool:
        return self.status == PRESENT


def load(path: str | os.PathLike = MANIFEST) -> tuple[dict, list[Entry]]:
    """(the sources by key, the entries in manifest order)."""
    m = json.loads(Path(path).read_text())
    return m["sources"], [Entry(**{**f, "columns": tuple(f["columns"])}) for f in m["files"]]


def select(entries: Sequence[Entry], only: Sequence[str] = ()) -> list[Entry]:
    """The entries named by `only` (groups or names, comma-separated or not); all without it."""
    wanted = {w for item in only for w in item.split(",") if w}
    known = {e.group for e in entries} | {e.name for e in entries}
    unknown = sorted(wanted - known)
    if unknown:
        groups, names = ", ".join(sorted({e.group for e in entries})), ", ".join(e.name for e in entries)
        raise ValueError(f"--only {','.join(unknown)}: not a group or file of the data manifest (groups: {groups}; "
                         f"files: {names})")
    return [e for e in entries if not wanted or e.group in wanted or e.name in wanted]


def data_dir(folder: str | os.PathLike | None = None) -> Path:
    """`folder`, else `$ARPO_DATA`; an error saying how to give one without either."""
    folder = folder or os.environ.get(DATA_ENV)
    if not folder:
        raise ValueError(f"no data folder: pass one (--to DIR / DIR) or export {DATA_ENV}=DIR")
    return Path(folder).expanduser().absolute()


def fetch_command(entries: Sequence[Entry], folder: str | os.PathLike | None = None) -> str:
    """The command that fetches `entries` into `folder` (the `$ARPO_DATA` folder when `folder` is it)."""
    to = "" if folder is None or str(folder) == os.environ.get(DATA_ENV) else f" --to {folder}"
    everything, names = load()[1], {e.name for e in entries}
    if names == {e.name for e in everything}:
        return f"arpo-jax data fetch{to}"
    groups = {e.group for e in everything if all(x.name in names for x in everything if x.group == e.group)}
    parts = sorted(groups) + [e.name for e in entries if e.group not in groups]
    return f"arpo-jax data fetch{to} --only {','.join(parts)}"


def fetch_hint(file: str | os.PathLike) -> str:
    """For a missing file whose path ends as a manifest entry's (e.g. `.../rl/train_10k.parquet`): the fetch command
    that writes it; '' for any other file."""
    file = Path(os.path.expandvars(os.fspath(file))).absolute()
    for e in load()[1]:
        if file.as_posix().endswith("/" + e.path):
            return fetch_command([e], Path(file.as_posix()[: -len(e.path) - 1]))
    return ""


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def columns_of(path: Path) -> tuple[list[str] | None, str]:
    """(the file's columns, '') or (None, why it cannot be read): a parquet file's schema, a JSON-lines file's first
    record's keys, a .json file's first record's keys (a list of records) or [] (an object, e.g. the search cache)."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(path).schema_arrow.names), ""
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                first = next((line for line in f if line.strip()), "{}")
            return list(json.loads(first)), ""
        if path.stat().st_size > _JSON_COLUMNS_LIMIT:
            return None, ""
        value = json.loads(path.read_text(encoding="utf-8"))
        return (list(value[0]) if isinstance(value, list) and value and isinstance(value[0], dict) else []), ""
    except Exception as e:  # pyarrow's ArrowInvalid, JSONDecodeError, UnicodeDecodeError: the file is not readable
        return None, f"not a readable {path.suffix} file ({' '.join(str(e).split())[:160]})"


def check_file(entry: Entry, file: str | os.PathLike) -> FileStatus:
    """The file at `file` against its entry: missing; wrong columns (unreadable, or a column the manifest names is
    absent); wrong checksum (sha256, where the manifest pins one); else present."""
    file = Path(file)
    if not file.is_file():
        return FileStatus(entry, file, MISSING, "not found")
    columns, problem = columns_of(file)
    if problem:
        return FileStatus(entry, file, WRONG_COLUMNS, problem)
    absent = [c for c in entry.columns if columns is not None and c not in columns]
    if absent:
        return FileStatus(entry, file, WRONG_COLUMNS, f"no column(s) {absent} (its columns: {columns})")
    if entry.sha256:
        digest = sha256_of(file)
        if digest != entry.sha256:
            return FileStatus(entry, file, WRONG_CHECKSUM, f"sha256 {digest[:12]}..., the manifest's "
                              f"{entry.sha256[:12]}... ({file.stat().st_size} bytes, expected {entry.bytes})")
    rows = f"{entry.rows} rows, " if entry.rows else ""
    return FileStatus(entry, file, PRESENT, f"{rows}{file.stat().st_size} bytes" +
                      ("" if entry.sha256 else ", checksum not pinned"))


def check_dir(folder: str | os.PathLike | None = None, only: Sequence[str] = ()) -> list[FileStatus]:
    """Every selected entry checked under `folder` (default `$ARPO_DATA`)."""
    root = data_dir(folder)
    return [check_file(e, root / e.path) for e in select(load()[1], only)]


def format_status(statuses: Sequence[FileStatus], folder: str | os.PathLike | None = None) -> str:
    """One line a file, and for the files that are not present the one command that fixes them."""
    width = max((len(s.entry.path) for s in statuses), default=4)
    lines = [f"{s.entry.path:{width}}  {s.status:14}  {s.found}" for s in statuses]
    bad = [s.entry for s in statuses if not s.ok]
    lines.append(f"arpo-jax data check: {len(bad)} of {len(statuses)} file(s) to fetch: {fetch_command(bad, folder)}"
                 if bad else f"arpo-jax data check: all {len(statuses)} file(s) present")
    return "\n".join(lines)
