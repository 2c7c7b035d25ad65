"""Host-side data across processes: the multi-host helpers of the training loops (one process: plain numpy).

Every process holds its own rows (its rollout workers' blocks, its SFT shard). The loops need three moves:
  `global_array` / `host_local`  this process's rows <-> a global jax.Array split along the batch axis;
  `gather` / `gather_ragged`     every process's values on every process (metrics, whitening, totals);
  `agree_max`                    one integer every process agrees on (micro-batch counts, dynamic-sampling rounds).
Each is a collective: every process calls it at the same point of the loop.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding


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
