"""HuggingFace folder <-> model params.

Module attribute names mirror HF, so the key table is the model's own state paths plus a layer index: the layers are
stored stacked, and HF's `model.layers.3.mlp.up_proj.weight` is row 3 of the NNX path ('model', 'layers', 'mlp',
'up_proj', 'weight') [L, F, D] (`hf_tensors`, `transformer.hf_keys`). Each Param declares its (one layer's) HF shape
(`hf_shape` metadata), so the per-tensor transform is a shape check and a reshape (never a transpose, which keeps
both directions at memory-copy speed). The public format stays HF's per-layer keys: layers are split and stacked
here, at the I/O boundary.

Import streams tensor by tensor: each tensor is read from safetensors on the host, cast, and placed straight into its
target sharding (`jax.make_array_from_callback`), so peak host memory is one tensor, not the model; a stacked weight's
L layers are then stacked on the devices (one weight's layers at a time: the transient is one stacked weight).
Export streams the other way into a `.tmp` folder that is renamed into place only when complete
(`write_folder_atomically`: only a previous export is ever replaced, never a run or an unrelated folder).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open

from arpo_jax import models, sharding
from arpo_jax.models import hf_config
from arpo_jax.models.transformer import CausalLM, Config, hf_keys

# Checkpoint keys that carry no parameters and are skipped: RoPE buffers of old checkpoints.
IGNORED_KEYS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
MAX_SHARD_BYTES = 5 * 1024**3
IO_THREADS = min(8, os.cpu_count() or 1)  # tensors read/placed (import) or fetched/written (export) concurrently
HF_CONFIG_LAYOUT_VERSION = "5.0.0"  # config.json's `transformers_version`: the release whose layout it follows
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}


# ----------------------------------------------------------------------------------------------------------------
# Import


def read_config(path: str | os.PathLike, **runtime) -> tuple[Config, dict]:
    """(Config, raw config.json dict) of an HF folder. `runtime` sets dtype, param_dtype, remat, ..."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not a HuggingFace model folder")
    raw = json.loads(cfg_file.read_text())
    return models.config_from_hf(raw, **runtime), raw


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{path}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    return found


def hf_tensors(state: nnx.State, num_layers: int) -> list[tuple[str, tuple, nnx.Variable, int | None]]:
    """[(HF key, state path, Variable, layer index or None)] of every tensor `state` holds in the HF format: a
    stacked layer weight [L, ...] gives L keys (`transformer.hf_keys`), the others their own path."""
    return [(key, tuple(p), var, i) for p, var in nnx.to_flat_state(state) for key, i in hf_keys(p, num_layers)]


def layer_value(var: nnx.Variable, i: int | None) -> jax.Array:
    """The array of one HF tensor: the Variable's value, or layer i of a stacked one."""
    return var[...] if i is None else var[...][i]


def checkpoint_index(path: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """{key: (file, shape)} of every tensor in the folder; unreadable files and duplicate keys raise."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="np") as f:
                for key in f.keys():
                    if key in index:
                        raise ValueError(f"tensor {key!r} appears twice: in {index[key][0].name} and {file.name}")
                    index[key] = (file, tuple(f.get_slice(key).get_shape()))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    return index


class TensorSource(NamedTuple):
    """One tensor of a checkpoint: its shape in HF layout, where it lives (for messages), and a reader that returns
    it as a host array (called on a worker thread, once)."""

    shape: tuple[int, ...]
    origin: str
    read: Callable[[], np.ndarray]


def _read_safetensor(file: Path, key: str) -> np.ndarray:
    try:
        with safe_open(str(file), framework="np") as f:  # one handle per thread: cheap (an mmap)
            return f.get_tensor(key)
    except (SafetensorError, ValueError, OSError) as e:
        raise ValueError(f"{file.name}: cannot read tensor {key!r} ({e})") from e


def folder_tensors(path: Path) -> dict[str, TensorSource]:
    """The tensors of an HF folder's safetensors files."""
    return {key: TensorSource(shape, file.name, functools.partial(_read_safetensor, file, key))
            for key, (file, shape) in checkpoint_index(path).items()}


def load_state(path: str | os.PathLike, cfg: Config, mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """Reads an HF folder's safetensors into (graphdef, params nnx.State) in `cfg.param_dtype`, sharded on `mesh`."""
    return place_tensors(folder_tensors(Path(path)), cfg, mesh, where=str(path))


def place_tensors(tensors: dict[str, TensorSource], cfg: Config, mesh: Mesh | None = None, *,
                  where: str) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params nnx.State) from HF-named tensors, in `cfg.param_dtype`, sharded on `mesh`.

    Every key and shape is checked against the model before any tensor is read; tensors are then read and placed
    concurrently (reads and host-to-device copies release the GIL), each straight into its target sharding.
    """
    graphdef, abstract = nnx.split(models.abstract_model(cfg))
    expected = {key: (p, var, i) for key, p, var, i in hf_tensors(abstract, cfg.num_layers)}
    plan = []
    for key, src in tensors.items():
        if any(p.fullmatch(key) for p in IGNORED_KEYS):
            continue
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints store the (identical) head anyway; transformers ignores it too
        if key not in expected:
            raise ValueError(f"{src.origin}: unexpected tensor {key!r} for model_type={cfg.model_type!r} "
                             f"(tie_word_embeddings={cfg.tie_word_embeddings}, layers={cfg.num_layers})")
        hf_shape = tuple(expected[key][1].get_metadata()["hf_shape"])
        if tuple(src.shape) != hf_shape:
            raise ValueError(f"{src.origin}: tensor {key!r} has shape {tuple(src.shape)}, expected {hf_shape}")
        plan.append(key)
    missing = sorted(set(expected) - set(plan))
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"({len(missing)} of {len(expected)})")

    rules = sharding.get_rules(cfg.sharding_rules)
    target_dtype = _NP_DTYPES[cfg.param_dtype]

    def target_of(axes, shape):
        if mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return sharding.param_sharding(axes, shape, mesh, rules)

    def load_one(key: str) -> jax.Array:
        _, var, i = expected[key]
        axes, shape = tuple(var.get_metadata()["axes"]), var.shape
        if i is not None:  # one layer of a stacked weight: its own slice of the stacked sharding
            axes, shape = axes[1:], shape[1:]
        host = tensors[key].read().reshape(shape).astype(target_dtype, copy=False)
        # Each device gets only its slice of the host tensor; the host copy is dropped when this returns.
        return jax.make_array_from_callback(shape, target_of(axes, shape), lambda idx: host[idx])

    by_path: dict[tuple, list[str]] = {}
    for key, (p, _, _) in expected.items():
        by_path.setdefault(p, []).append(key)
    loaded = {}
    with ThreadPoolExecutor(IO_THREADS) as pool:
        for p, keys in by_path.items():  # one stacked weight at a time: its L layers, then their stack
            arrays = list(pool.map(load_one, keys))
            var = expected[keys[0]][1]
            if expected[keys[0]][2] is None:
                loaded[p] = arrays[0]
            else:
                target = target_of(var.get_metadata()["axes"], var.shape)
                loaded[p] = sharding.stack_onto(arrays, target)
                del arrays
    state = nnx.from_flat_state([(p, v.replace(loaded[tuple(p)])) for p, v in nnx.to_flat_state(abstract)])
    return graphdef, state


# ----------------------------------------------------------------------------------------------------------------
# Export


def to_host(x: jax.Array, *, local: bool = False) -> np.ndarray:
    """`x` as a numpy array. Multi-host: gathered from every process (a collective: every process must call this),
    or with `local` put together from this process's own shards, which must hold all of it (`held_here`)."""
    if local and not x.is_fully_addressable:
        if not held_here(x):
            raise RuntimeError(f"a node-local export needs every part of each array on this process's devices; an "
                               f"array {x.shape} sharded {x.sharding} is spread over several processes")
        out = np.empty(x.shape, x.dtype)
        for shard in x.addressable_shards:  # replicas write the same block again
            out[shard.index] = np.asarray(shard.data)
        return out
    if not x.is_fully_addressable:  # multi-host: gather the global value (every process must call this)
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def local_layer(x: jax.Array, i: int | None) -> np.ndarray:
    """`x`, or layer i of a stacked `x`, put together on the host from this process's own shards, which must hold all
    of it (`held_here`). Each shard's part of the layer is sliced on its own device: no program runs over other
    processes' devices, so processes need not call this in the same order and threads may (a node-local export)."""
    out, done = np.empty(x.shape if i is None else x.shape[1:], x.dtype), set()
    for shard in x.addressable_shards:
        index = shard.index
        if i is not None:
            start, stop, _ = index[0].indices(x.shape[0])
            if not start <= i < stop:
                continue
            index = index[1:]
        block = tuple(s.indices(n)[:2] for s, n in zip(index, out.shape))
        if block not in done:  # a replica holds the same block again
            done.add(block)
            out[index] = np.asarray(shard.data if i is None else shard.data[i - start])
    return out


def held_here(x: jax.Array) -> bool:
    """Whether this process's devices hold every block of `x`: with HSDP (data over the hosts, fsdp within one) each
    host holds a whole replica of the params, so it can export them without the other hosts."""
    if x.is_fully_addressable:
        return True
    where = x.sharding.devices_indices_map(x.shape)
    block = lambda index: tuple(s.indices(n)[:2] for s, n in zip(index, x.shape))  # noqa: E731
    mine = {block(i) for d, i in where.items() if d.process_index == jax.process_index()}
    return mine == {block(i) for i in where.values()}


def write_safetensors(file: Path, tensors: list[tuple[str, tuple, np.dtype, callable]], *, threads: int) -> None:
    """Streams tensors into one safetensors file: the header first, then each tensor fetched and written at its
    offset.

    The format is an 8-byte little-endian header size, a JSON header of dtype/shape/offsets, then raw bytes.
    safetensors' own `save_file` needs every tensor of the shard in host memory at once and copies each to bytes;
    this writer holds at most `threads` tensors at a time and overlaps device-to-host copies with file writes
    (both release the GIL). Files are verified with safetensors' own reader in the tests.
    """
    header, offsets, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, shape, dtype, _ in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets.append(offset)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    data_start = 8 + len(blob)

    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, data_start + offset)
        os.pwrite(fd, struct.pack("<Q", len(blob)) + blob, 0)

        def write_one(i):
            name, shape, dtype, fetch = tensors[i]
            arr = np.ascontiguousarray(fetch())
            if arr.shape != tuple(shape) or arr.dtype != dtype:
                raise AssertionError(f"{name}: got {arr.shape} {arr.dtype}, header says {shape} {dtype}")
            view = memoryview(arr.reshape(-1).view(np.uint8))  # zero-copy; bf16 has no buffer format code
            done = 0
            while done < len(view):  # pwrite may write less than asked
                done += os.pwrite(fd, view[done:], data_start + offsets[i] + done)

        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(write_one, range(len(tensors))))
        else:
            for i in range(len(tensors)):
                write_one(i)
    finally:
        os.close(fd)


def _shard_plan(entries, max_shard_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for e in entries:
        nbytes = math.prod(e[1]) * e[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def export_nbytes(state: nnx.State, dtype: str) -> int:
    """Bytes of the safetensors data `save_state(state, ..., dtype=dtype)` writes (headers and config files aside)."""
    itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
    # A tensor's HF shape is a reshape of its (layer's) array: the bytes are the elements', stacked or not.
    return sum(math.prod(var.shape) * itemsize for _, var in nnx.to_flat_state(state))


def save_state(state: nnx.State, cfg: Config, path: str | os.PathLike, *, tokenizer=None, dtype: str | None = None,
               max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
               transform: Callable[[str, jax.Array], jax.Array] | None = None, local: bool = False) -> Path:
    """Writes params as an HF folder (config.json, generation_config.json, safetensors, tokenizer files).

    Written with `write_folder`: `path` is always either the previous complete export or the new complete one, and
    an existing `path` that is not a previous export is refused unless `overwrite` (see `check_export_destination`).
    In a multi-host run every process must call this (the params are gathered collectively); only process 0 writes,
    unless `local`: then every process writes its own folder from its own shards (each must hold the whole model:
    `held_here`). `transform(key, array)`, when given, computes each tensor as it is written (one at a time: e.g.
    LoRA's merge).
    """
    path = Path(path)
    dtype = dtype or cfg.param_dtype
    np_dtype = np.dtype(_NP_DTYPES[dtype])
    # Node-local (HSDP: this process holds every block): each tensor from this process's own shards, no program over
    # the other processes' devices. Only a `transform` (LoRA's merge) computes over the whole, global arrays.
    own_shards = local and transform is None
    if own_shards and not all(held_here(var[...]) for _, var in nnx.to_flat_state(state)):
        raise RuntimeError("a node-local export needs every part of each array on this process's devices; some are "
                           "spread over several processes (FSDP across hosts: export through a shared folder)")

    def fetch(key, var, i, hf_shape) -> Callable[[], np.ndarray]:
        def get():
            if own_shards:
                x = local_layer(var[...], i)
            else:
                x = layer_value(var, i)
                x = to_host(x if transform is None else transform(key, x), local=local)
            return x.reshape(hf_shape).astype(np_dtype, copy=False)
        return get

    entries = []
    for key, _, var, i in hf_tensors(state, cfg.num_layers):
        hf_shape = tuple(var.get_metadata()["hf_shape"])
        entries.append((key, hf_shape, np_dtype, fetch(key, var, i, hf_shape)))
    if jax.process_index() != 0 and not local:
        for e in entries:  # take part in the collective gathers, write nothing
            e[3]()
        return path
    # Programs over several hosts' devices (gathers, slices and merges of global arrays) must run in the same order
    # on every process: no threads then. Single-host arrays and node-local shards: threads overlap the D2H copies,
    # casts and writes.
    threads = IO_THREADS if own_shards or all(var[...].is_fully_addressable for _, var in nnx.to_flat_state(state)) \
        else 1
    return write_folder(path, entries, models.config_to_hf(cfg), dtype=dtype, tokenizer=tokenizer,
                        max_shard_bytes=max_shard_bytes, threads=threads, overwrite=overwrite)


def write_folder(path: Path, entries: list[tuple[str, tuple, np.dtype, Callable]], hf_config: dict, *, dtype: str,
                 tokenizer=None, max_shard_bytes: int = MAX_SHARD_BYTES, threads: int = IO_THREADS,
                 overwrite: bool = False) -> Path:
    """Writes an HF folder from (key, shape, dtype, fetch) entries: safetensors shards (+ index), config.json,
    generation_config.json and the tokenizer files, with `write_folder_atomically` (the destination rules, the
    temporary sibling renamed into place)."""

    def fill(tmp: Path) -> None:
        shards = _shard_plan(entries, max_shard_bytes)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        for name, shard in zip(names, shards):
            write_safetensors(tmp / name, shard, threads=threads)
        if len(shards) > 1:
            total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
            index = {"metadata": {"total_size": total},
                     "weight_map": {e[0]: n for n, shard in zip(names, shards) for e in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        # The layout written (`rope_parameters`, `dtype`) is transformers 5's. Without a version, transformers 5 takes
        # a local folder's tokenizer for a possibly broken Mistral one and warns at every load (Qwen's regex).
        hf = hf_config | {"dtype": dtype, "torch_dtype": dtype, "transformers_version": HF_CONFIG_LAYOUT_VERSION}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer is not None:
            _save_tokenizer(tokenizer, tmp)

    return write_folder_atomically(path, fill, overwrite=overwrite)


def _save_tokenizer(tokenizer, out: Path) -> None:
    if isinstance(tokenizer, (str, os.PathLike)):  # a folder holding tokenizer files
        src = Path(tokenizer)
        copied = [shutil.copy2(src / f, out / f) for f in TOKENIZER_FILES if (src / f).is_file()]
        if not copied:
            raise FileNotFoundError(f"{src}: no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...)")
    else:
        tokenizer.save_pretrained(str(out))


# ----------------------------------------------------------------------------------------------------------------
# Writing a folder atomically, without ever destroying something that is not ours

EXPORT_MARKER = ".arpo_jax_export"  # written into every exported folder: "a previous export, safe to replace"
# Entries that make a folder a training run (or part of one): never removed, not even with overwrite.
RUN_ENTRIES = ("checkpoints", "critic_checkpoints", "metrics.jsonl", "tensorboard", "run.lock", "summary.json",
               "_CHECKPOINT_METADATA")


def _run_evidence(folder: Path, *, deep: bool) -> Path | None:
    """The first entry inside `folder` that belongs to a training run or an orbax checkpoint (None if there is none).

    Looks at the top level and orbax step folders (`<digits>/_CHECKPOINT_METADATA`); `deep` searches every
    subfolder. A run's config.json (it has a `trainer` section) counts too.
    """
    if deep:
        walk = os.walk(folder)
    else:
        entries = list(folder.iterdir())
        walk = [(str(folder), [p.name for p in entries if p.is_dir()], [p.name for p in entries if not p.is_dir()])]
    for root, dirs, files in walk:
        for name in (*dirs, *files):
            if name in RUN_ENTRIES:
                return Path(root) / name
            if name.isdigit() and (Path(root) / name / "_CHECKPOINT_METADATA").exists():
                return Path(root) / name
        if "config.json" in files:
            try:
                if "trainer" in json.loads((Path(root) / "config.json").read_text()):
                    return Path(root) / "config.json"
            except (OSError, ValueError, TypeError):
                pass
    return None


def check_export_destination(dest: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Checks that writing a folder at `dest` destroys nothing that is not a previous export; returns it absolute.

    Allowed: a path that does not exist, an empty folder, or a folder holding `EXPORT_MARKER` (a previous export
    of this project). Any other folder only with `overwrite`. Never, not even with `overwrite`: a regular file, the
    current directory or one of its parents, or a folder holding a training run (checkpoints, metrics.jsonl, a
    run's config.json, ...). Raises ValueError naming the path and what to do.
    """
    dest = Path(dest).absolute()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest} exists and is not a folder: pick a folder path for the export")
    cwd = Path.cwd().resolve()
    resolved = dest.resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"{dest} is the current directory or contains it: pick a new folder for the export, "
                         "e.g. --out ./hf")
    if not dest.exists() or not any(dest.iterdir()):
        return dest
    found = _run_evidence(dest, deep=False)
    marked = (dest / EXPORT_MARKER).is_file()
    if found is None and overwrite and not marked:
        found = _run_evidence(dest, deep=True)  # an unrelated folder is replaced only if no run hides in it
    if found is not None:
        raise ValueError(f"{dest} holds a training run or checkpoint ({found.relative_to(dest)}): an export never "
                         f"replaces it; pick another folder, e.g. {dest / 'hf'}")
    if not marked and not overwrite:
        raise ValueError(f"{dest} exists and is not an arpo-jax export (no {EXPORT_MARKER} file): pick another "
                         "folder, or pass --overwrite (API: overwrite=True) to replace it")
    return dest


def write_folder_atomically(dest: str | os.PathLike, fill, *, overwrite: bool = False) -> Path:
    """Creates the folder `dest` by calling `fill(tmp)` on a fresh temporary sibling, then moves it into place.

    `dest` is checked first with `check_export_destination` (nothing but a previous export is ever replaced,
    unless `overwrite`; never a run). The folder gets `EXPORT_MARKER` and normal permissions (0777 minus the umask,
    as `mkdir` would make it). If `fill` raises, the temporary folder is removed and `dest` is untouched; a replaced
    `dest` is moved aside first and deleted in the background. Returns `dest` (absolute).
    """
    dest = check_export_destination(dest, overwrite=overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700 folders: an export is meant to be shared
        fill(tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"written_by": "arpo-jax"}) + "\n")
        _replace_dir(tmp, dest)
    except OSError as e:  # e.g. a full disk: say where (os.ftruncate / pwrite errors carry no file name)
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename is not None:
            raise
        if e.errno is None:
            raise OSError(f"{e} while writing the export {dest}") from e
        raise OSError(e.errno, f"{e.strerror} while writing the export {dest}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _replace_dir(new: Path, dest: Path) -> None:
    """Puts `new` at `dest`. An old `dest` is moved aside first, never left half-replaced, and deleted in the
    background (freeing a large folder takes a while; the interpreter waits for non-daemon threads at exit)."""
    if not dest.exists():
        os.rename(new, dest)
        return
    if not any(dest.iterdir()):
        os.rmdir(dest)
        os.rename(new, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, old / dest.name)
    os.rename(new, dest)
    threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True}, daemon=False).start()


def save_pretrained(model: CausalLM, path: str | os.PathLike, tokenizer=None, *, dtype: str | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False, local: bool = False) -> Path:
    """Exports a CausalLM as an HF folder that transformers and vLLM load. See `save_state`. A model with LoRA
    adapters is written merged (`lora.merged_state`): the folder is a plain model of the base's architecture."""
    state, cfg, transform = nnx.state(model, nnx.Param), model.config, None
    if cfg.lora_rank:
        from arpo_jax.models import lora

        state, cfg, transform = lora.merged_export(model)
    return save_state(state, cfg, path, tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes,
                      overwrite=overwrite, transform=transform, local=local)


def checkpoint_dtype(path: str | os.PathLike) -> str:
    return hf_config.checkpoint_dtype(json.loads((Path(path) / "config.json").read_text()))
