"""Large host allocations on transparent huge pages: glibc's `glibc.malloc.hugetlb=1` tunable, set by re-executing.

XLA's CPU runtime takes each program run's buffers from malloc. Above glibc's mmap threshold every allocation is a
fresh mapping, and the kernel faults it in 4 KB at a time: one SmolLM2-135M policy update (2 x 4 x 256 tokens)
took ~930k page faults and ~1.4 s of kernel time per step, 6.1 s in all; with the tunable, 2.6k faults, 0.25 s
and 5.4 s (benchmarks/RESULTS.md, issue 20). With transparent huge pages in `madvise` mode (the common default)
the tunable makes malloc advise huge pages for those mappings. glibc reads tunables only when a process starts,
so the entry points that run models (`arpo-jax demo/train/sft/eval/chat/quickstart`, the speed benchmarks) call
`reexec_with_hugepages()` first; a library import never does. `GLIBC_TUNABLES` with any `glibc.malloc.hugetlb`
value (e.g. `=0`) is the user's choice and is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wanted_tunables(environ=os.environ, thp_mode_file: Path = _THP_MODE) -> str | None:
    """The GLIBC_TUNABLES value to re-execute with, or None where it would change nothing: not Linux with glibc
    >= 2.35 (the first with the tunable), huge pages not in `madvise` mode (`always` already uses them, `never`
    forbids them), or the user has set the tunable."""
    libc, version = platform.libc_ver()
    if sys.platform != "linux" or libc != "glibc":
        return None
    try:
        if tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
        if "[madvise]" not in thp_mode_file.read_text():
            return None
    except (OSError, ValueError):
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in current:
        return None
    return ":".join(filter(None, (current, f"{TUNABLE}=1")))


def reexec_with_hugepages() -> None:
    """Replaces this process by the same command line with `wanted_tunables()` in its environment (same pid, so
    launchers and signals are unaffected); returns without doing anything where that would change nothing."""
    tunables = wanted_tunables()
    if tunables is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": tunables})


def active() -> bool:
    """Whether this process started with the tunable on (for benchmark reports)."""
    return f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", "")
