"""Processes and host data across them: start-up (`initialize_distributed`, the compilation cache, the mesh of a
config), barriers, and the multi-host helpers of the training loops (one process: plain numpy).

Every process holds its own rows (its rollout workers' blocks, its SFT shard). The loops need three moves:
  `global_array` / `host_local`  this process's rows <-> a global jax.Array split along the batch axis;
  `gather` / `gather_ragged`     every process's values on every process (metrics, whitening, totals);
  `agree_max`                    one integer every process agrees on (micro-batch counts, dynamic-sampling rounds).
Each is a collective: every process calls it at the same point of the loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from arpo_jax import paths


def global_array(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array from this process's rows: [..., B_local, T] -> [..., B_local * processes, T] (the batch
    axis is the second to last: [M, B, T] or [K, M, B, T])."""
    b = local.ndim - 2
    shape = local.shape[:b] + (local.shape[b] * jax.process_count(),) + local.shape[b + 1:]
    return jax.make_array_from_process_local_data(sharding, local, shape)


def host_local(x: jax.Array, mesh: Mesh, sharding: NamedSharding) -> np.ndarray:
    """This process's rows of a global array (the inverse of `global_array`)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, sharding.spec))


def gather(values: np.ndarray) -> np.ndarray:
    """Every process's `values` (the same shape on each) concatenated along axis 0, in process order."""
    if jax.process_count() == 1:
        return values
    return np.asarray(multihost_utils.process_allgather(values)).reshape(-1, *values.shape[1:])


def agree_max(value: int) -> int:
    """The largest of every process's `value`."""
    if jax.process_count() == 1:
        return int(value)
    return int(multihost_utils.process_allgather(np.asarray(value)).max())


def gather_ragged(values: np.ndarray, labels: list[str], names: list[str], *, width: int
                  ) -> tuple[np.ndarray, list[str]]:
    """Every process's float `values` and their `labels` (one of `names` each), when the processes hold different
    counts (at most `width` each): padded to `width`, gathered, the padding dropped."""
    if jax.process_count() == 1:
        return values, labels
    codes = np.asarray([names.index(s) for s in labels], np.int32)
    pad = lambda x, v: np.concatenate([x, np.full(width - len(x), v, x.dtype)])
    all_v = np.asarray(multihost_utils.process_allgather(pad(values, np.nan))).reshape(-1)
    all_c = np.asarray(multihost_utils.process_allgather(pad(codes, -1))).reshape(-1)
    keep = all_c >= 0
    return all_v[keep], [names[c] for c in all_c[keep]]


def replicate_on_local_devices(tree, shardings):
    """Each process gets the whole of a sharded global pytree, placed in `shardings` over its own devices (a
    per-process sampler samples alone)."""
    tree = multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def agree(value):
    """Process 0's `value` (an int or an int array) on every process: decisions taken from files that process 0
    alone reads or writes."""
    if jax.process_count() == 1:
        return value
    out = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))
    return int(out) if np.ndim(value) == 0 else out


# Explicit multi-process start-up (tests, hand-made launches); SLURM and Cloud TPU VMs are auto-detected by JAX.
COORDINATOR_ENV = ("ARPO_COORDINATOR", "ARPO_NUM_PROCESSES", "ARPO_PROCESS_ID")
COMPILATION_CACHE_ENV = "ARPO_COMPILATION_CACHE"


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache, so a resumed or repeated run loads its compiled programs
    instead of compiling them again. The directory: `directory`, else $ARPO_COMPILATION_CACHE, else
    `$ARPO_CACHE/jax-compilation` (default ~/.cache/arpo-jax/jax-compilation); $ARPO_COMPILATION_CACHE=off turns
    it off. A directory already configured for JAX (JAX_COMPILATION_CACHE_DIR) is left as it is. Returns the
    directory in use, or None.
    """
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    choice = str(directory or os.environ.get(COMPILATION_CACHE_ENV) or "")
    if choice.lower() == "off":
        return None
    path = Path(choice).expanduser() if choice else paths.cache_dir() / "jax-compilation"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


def initialize_distributed() -> None:
    """Joins a multi-process run when the environment describes one; a single process does nothing. Also turns
    on the persistent compilation cache (`enable_compilation_cache`).

    `ARPO_COORDINATOR=host:port`, `ARPO_NUM_PROCESSES`, `ARPO_PROCESS_ID` start it explicitly; otherwise a SLURM
    job with several tasks or a multi-host TPU slice is detected by `jax.distributed.initialize()` itself.
    Must run before anything touches a JAX device.
    """
    sigterm = signal.getsignal(signal.SIGTERM)
    if os.environ.get("ARPO_COORDINATOR"):
        missing = [k for k in COORDINATOR_ENV if not os.environ.get(k)]
        if missing:
            raise ValueError(f"ARPO_COORDINATOR is set but {', '.join(missing)} is not")
        jax.distributed.initialize(os.environ["ARPO_COORDINATOR"], int(os.environ["ARPO_NUM_PROCESSES"]),
                                   int(os.environ["ARPO_PROCESS_ID"]), initialization_timeout=300)
    elif int(os.environ.get("SLURM_NTASKS", "1")) > 1 or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        jax.distributed.initialize()
    # JAX's preemption service (on by default) takes SIGTERM over in C++: its notifier logs "SIGTERM caught" and
    # nothing else reaches Python, so the stop protocol (`run_guard.StopSignals`: SLURM's time limit, preemption)
    # never saw the signal on several processes and the run went on to SIGKILL. The handler that was there goes back.
    if sigterm is not None and signal.getsignal(signal.SIGTERM) is sigterm:
        with contextlib.suppress(ValueError):  # not the main thread: nothing was installed from there either
            signal.signal(signal.SIGTERM, sigterm)
    enable_compilation_cache()


def is_main_process() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def trim_host_memory() -> None:
    """Hands the process's freed heap back to the kernel: XLA's CPU runtime takes its buffers from malloc and glibc
    keeps freed memory for reuse, so a finished program's temporaries would stay resident beside whatever runs next
    (on a CPU host: the rollout engine). glibc's `malloc_trim(0)`; elsewhere a no-op."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc and hasattr(lib := ctypes.CDLL(libc), "malloc_trim"):
        lib.malloc_trim(0)
