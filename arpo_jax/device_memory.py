"""Free memory where an array will live, and the check that a large allocation fits before it is made.

Why: a JAX engine sized for the wrong workload asks for its whole KV cache at once (`arpo-jax eval` once sized
it from the training batch: 2,048 rows of 5.6k tokens, ~280 GB for a 0.5B model), and on a CPU host the kernel's
OOM killer ends the process with no message. Checked first, the same mistake is one line naming the numbers and the
setting to change.
"""

from __future__ import annotations

import math
from pathlib import Path

GIB = 2**30
# Room left for what the check does not count (the programs' temporaries, the allocator's fragmentation).
DEFAULT_MARGIN = 0.9


class DoesNotFit(ValueError):
    """An allocation larger than the free memory (a ValueError: the CLI prints it as one line, exit 2)."""


def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """What the host can still give this process: MemAvailable, or the cgroup v2 limit's remainder when lower (a
    container or a SLURM job's memory limit). None where neither can be read."""
    free = None
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path(cgroup, "memory.current").read_text())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


def available_bytes(device) -> int | None:
    """Free bytes on a JAX device: the host's for a CPU device, else the allocator's limit less what is in use (None
    where the backend reports no statistics)."""
    if device.platform == "cpu":
        return host_available_bytes()
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def tree_bytes(abstract) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs, whole (not per shard)."""
    import jax

    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))


def require_fits(need: int, free: int | None, what: str, fix: str, margin: float = DEFAULT_MARGIN) -> None:
    """Raises DoesNotFit when `need` bytes exceed `margin` of `free` (None: unknown, nothing is checked); `what`
    names the allocation and its sizes, `fix` the settings that make it smaller."""
    if free is not None and need > margin * free:
        raise DoesNotFit(f"{what} needs {need / GIB:.2f} GiB, more than {margin:.0%} of the {free / GIB:.2f} GiB "
                         f"free: {fix}")
