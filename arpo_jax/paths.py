"""Where runs write: POSIX folders only (a leaf module: the run guard, checkpoints and the metrics logger use it),
and the cache folder (`$ARPO_CACHE`, default ~/.cache/arpo-jax: named models, the compilation cache)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(path: str | os.PathLike, what: str = "workdir") -> Path:
    """`path` made absolute; a URL (gs://, s3://, ...) is refused with what to use instead.

    `Path("gs://b/x").absolute()` is `$PWD/gs:/b/x`: each host of a pod would write its own local copy, lost with
    the VM. The run's files (the run lock, metrics.jsonl, the checkpoints' integrity records, the weight-sync
    exports) are written with POSIX calls, so an object store is refused rather than half supported.
    """
    text = os.fspath(path)
    if _URL.match(text):
        raise ValueError(
            f"{what} {text!r} is a URL; arpo-jax writes runs to POSIX paths only. Use a folder that every host "
            "mounts at the same path: a shared file system (NFS, Filestore, Lustre), or the bucket mounted with "
            f"gcsfuse (e.g. `gcsfuse --implicit-dirs BUCKET /gcs/BUCKET`, then {what} /gcs/BUCKET/...); on a single "
            "host, a local folder.")
    return Path(text).absolute()


CACHE_ENV = "ARPO_CACHE"


def cache_dir() -> Path:
    """The folder the named models are converted into and the compilation cache lives in."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "arpo-jax").expanduser()
