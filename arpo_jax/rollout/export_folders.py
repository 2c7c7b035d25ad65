"""The weight sync's export folders: where a version goes, whether it fits, and what is left to clean up.

`VllmSampler.update_weights` writes each version of the policy to `export_dir/sync-<k>` (`SYNC_PREFIX`,
`write_version`) and the engines reload it from there. With no `export_dir` given, the sampler's own folder
`arpo_jax_vllm_<pid>` goes under /dev/shm (RAM: the fastest hand-off) or the temporary folder
(`default_export_dir`); the room for one export is checked before anything is written (`check_export_room`, agreed
by every process: `agree_on_room`), and what a killed run left behind is removed (`remove_previous_syncs`,
`remove_stale_exports`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

_EXPORT_PREFIX = "arpo_jax_vllm_"
SYNC_PREFIX = "sync-"  # export_dir/sync-<k>: the k-th weight export of a sampler


def remove_previous_syncs(export_dir: Path) -> list[Path]:
    """Removes `sync-<k>` exports under `export_dir` (only folders marked as exports of this project)."""
    from arpo_jax.weights.hf import EXPORT_MARKER

    removed = []
    for d in export_dir.glob(f"{SYNC_PREFIX}*"):
        if d.name[len(SYNC_PREFIX):].isdigit() and (d / EXPORT_MARKER).is_file():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def version_nbytes(model, kind: str, dtype: str) -> int:
    """The tensors' bytes of one version of `model` in `dtype`: its LoRA adapters ("adapters") or its full weights
    ("full": a LoRA model's base, which the export merges the adapters into)."""
    from flax import nnx

    from arpo_jax.models import lora, transformer
    from arpo_jax.weights import hf

    if kind == "adapters":
        return hf.export_nbytes(nnx.state(model, transformer.LoRAParam), dtype)
    return hf.export_nbytes(lora.base_state(model) if model.config.lora_rank else nnx.state(model, nnx.Param), dtype)


def write_version(model, path: Path, kind: str, dtype: str, *, local: bool) -> dict:
    """Writes one version of `model` into `path`: a PEFT folder of its adapters ("adapters", float32) or an HF folder
    of its (merged) weights in `dtype` ("full"); `local`: from this process's own shards (each holds the whole
    model), else process 0 gathers and writes while the others take part in the gathers. Returns its stats (the
    bytes the folder takes, where this process can see them)."""
    from arpo_jax import distributed
    from arpo_jax.weights import hf, lora_io

    if kind == "adapters":
        lora_io.save_peft(model, path, local=local)
    else:
        hf.save_pretrained(model, path, dtype=dtype, local=local)
    stats = {"export_dtype": dtype, "weights": kind, "node_local": local}
    if local or distributed.is_main_process():  # what the folder takes: tensors, headers, config, tokenizer files
        stats["written_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return stats


# Room kept beyond the tensors' bytes: config, tokenizer files, safetensors headers, and what others write meanwhile.
EXPORT_SLACK_BYTES = 64 * 1024**2


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds `folder` (or the nearest existing folder above it)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_export_room(folder: Path, nbytes: int, dtype: str) -> None:
    """Raises OSError when the file system of `folder` cannot hold one export of `nbytes` (before writing any)."""
    free = _free_bytes(folder)
    if free < nbytes + EXPORT_SLACK_BYTES:
        raise OSError(
            f"weight sync: one export of the policy needs {_gib(nbytes + EXPORT_SLACK_BYTES)} ({_gib(nbytes)} of "
            f"{dtype} weights) in {folder}, which has {_gib(free)} free. Set rollout.vllm.export_dir to a folder with "
            "room (multi-host: on a file system every host shares), or give /dev/shm more room (a container's is "
            "64 MiB unless started with e.g. `docker run --shm-size=32g`).")


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def agree_on_room(export_dir: Path, nbytes: int, dtype: str, *, first_sync: bool, node_local_version: int = 0
                  ) -> None:
    """Process 0 (the writer) clears what a killed run left (`first_sync`) and checks the room for one export; every
    process raises if it lacks room (not only the writer: the others would wait for it at the barrier). Node-local
    exports (`node_local_version`: the version about to be written, each process its own): each checks its own
    `export_dir`, and that every process is about to write the same version."""
    from arpo_jax import distributed  # the trainer's side: jax is already there

    every_process = node_local_version > 0
    if every_process and distributed.agree_max(node_local_version) != node_local_version:
        raise RuntimeError(f"weight sync: this process is at version {node_local_version}, another one ahead of it")
    no_room = ""
    if every_process or distributed.is_main_process():
        if first_sync:
            remove_previous_syncs(export_dir)  # left by a run that was killed mid-sync
        try:
            check_export_room(export_dir, nbytes, dtype)
        except OSError as e:
            no_room = str(e)
    if distributed.agree(int(bool(no_room))):
        writer = "another process" if every_process else "process 0"
        raise OSError(no_room or f"weight sync: {writer} found too little room for one export in {export_dir} (its "
                                 "log says how much)")


def held_by_every_process(state) -> bool:
    """Whether several processes each hold every block of `state`'s arrays on their own devices (HSDP: params
    sharded within a host, replicated across hosts), agreed by all of them: then each can export its own copy for
    its own engines, with no gathers across hosts and no shared folder."""
    import jax

    from arpo_jax import distributed
    from arpo_jax.weights import hf

    if jax.process_count() == 1:
        return False
    held = all(hf.held_here(x) for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    return not distributed.agree_max(int(not held))


def one_process_dir(nbytes: int) -> Path:
    """`default_export_dir` where only one process exports and reads; several processes whose params are spread
    over the hosts need a folder they share."""
    import jax

    if jax.process_count() > 1:  # /dev/shm/arpo_jax_vllm_<pid> is one host's: the others never see it
        raise ValueError("a multi-process weight sync of a model spread over the hosts needs export_dir on a file "
                         "system every host shares (the trainer uses <workdir>/weight_sync; config: "
                         "rollout.vllm.export_dir)")
    return default_export_dir(nbytes)


def default_export_dir(nbytes: int = 0) -> Path:
    """/dev/shm (RAM: the fastest hand-off) when it can hold one export of `nbytes`, else the temporary folder
    (with a warning naming both sizes); the caller's `check_export_room` reports a folder that still lacks room."""
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    root = tmp
    if shm.is_dir() and os.access(shm, os.W_OK):
        remove_stale_exports(shm)
        if _free_bytes(shm) >= nbytes + EXPORT_SLACK_BYTES:
            root = shm
        else:
            logging.getLogger(__name__).warning(
                "weight sync: /dev/shm has %s free, one export needs %s: exporting to %s instead (slower; set "
                "rollout.vllm.export_dir to choose)", _gib(_free_bytes(shm)), _gib(nbytes + EXPORT_SLACK_BYTES), tmp)
    if root != shm:
        remove_stale_exports(root)
    return root / f"{_EXPORT_PREFIX}{os.getpid()}"


def remove_stale_exports(root: Path) -> list[Path]:
    """Removes the export folders `arpo_jax_vllm_<pid>` under `root` whose process is gone (killed before `close`,
    e.g. by the OOM killer: in /dev/shm each one holds a model's weights in RAM until reboot). Returns them."""
    removed = []
    for d in root.glob(f"{_EXPORT_PREFIX}*"):
        pid = d.name[len(_EXPORT_PREFIX):]
        if not (pid.isdigit() and d.is_dir()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's process: not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
