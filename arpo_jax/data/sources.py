"""The raw readers of RL data files: which files, are they readable, their rows (a leaf: `rl_dataset` parses the
rows, `tfds_builders` serves the same rows through TFDS)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence


def check_files(files: str | Sequence[str]) -> list[str]:
    """The file list with variables and `~` expanded; raises if it is empty or a file is missing."""
    files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not files:
        raise ValueError("no data files given (data.train_files / data.val_files is empty)")
    files = [os.path.expandvars(os.path.expanduser(str(f))) for f in files]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data file not found: {f}")
    return files


def check_parquet(file: str, prompt_key: str) -> str:
    """'' if `file` is a readable parquet file with rows and the columns a row needs, else the problem in words.

    Reads the file's footer only (milliseconds), so a launch can refuse a bad file before building any model."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file)
        columns, rows = meta.schema_arrow.names, meta.metadata.num_rows
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for garbage, empty or truncated files
        return f"{file!r} is not a readable parquet file ({' '.join(str(e).split())[:200]})"
    missing = [c for c in ("data_source", prompt_key) if c not in columns]
    if missing:
        return f"{file!r} has no column(s) {missing} (its columns: {columns})"
    if rows == 0:
        return f"{file!r} has no rows"
    return ""


def parquet_records(files: Sequence[str]) -> Iterator[tuple[str, int, dict]]:
    """(file, row, record) for every row of every file, in order (pyarrow, one file in memory at a time)."""
    import pyarrow.parquet as pq

    for f in files:
        for row, record in enumerate(pq.read_table(f).to_pylist()):
            yield f, row, record
