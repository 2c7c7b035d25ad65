"""arpo_jax.hugepages: when the entry points re-execute with glibc's huge-page tunable, and that it takes effect."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arpo_jax import hugepages

ON_HERE = hugepages.wanted_tunables(environ={}) is not None  # Linux, glibc >= 2.35, THP in madvise mode
needs_thp = pytest.mark.skipif(not ON_HERE, reason="needs Linux, glibc >= 2.35 and transparent huge pages = madvise")


def _thp(tmp_path, mode: str):
    f = tmp_path / "enabled"
    f.write_text(" ".join(f"[{m}]" if m == mode else m for m in ("always", "madvise", "never")) + "\n")
    return f


@needs_thp
def test_wanted_tunables(tmp_path):
    madvise = _thp(tmp_path, "madvise")
    assert hugepages.wanted_tunables({}, madvise) == "glibc.malloc.hugetlb=1"
    assert hugepages.wanted_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, madvise) == (
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")  # the user's other tunables are kept
    assert hugepages.wanted_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise) is None  # their choice
    assert hugepages.wanted_tunables({}, _thp(tmp_path, "always")) is None  # huge pages already
    assert hugepages.wanted_tunables({}, _thp(tmp_path, "never")) is None  # none to be had
    assert hugepages.wanted_tunables({}, tmp_path / "missing") is None


_CHILD = """
import json, os, resource, sys
from arpo_jax import hugepages
if sys.argv[1] == "reexec":
    hugepages.reexec_with_hugepages()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):  # large malloc'ed (so mmap'ed) buffers, zero-filled, freed: as XLA's are (numpy would advise
    bytearray(256 << 20)  # huge pages itself)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps([os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), hugepages.active(), faults]))
"""


def _child(mode: str) -> tuple[int, list]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return proc.pid, json.loads(out)


@needs_thp
def test_reexec_keeps_the_pid_and_cuts_page_faults():
    pid, (child_pid, tunables, active, faults) = _child("reexec")
    assert child_pid == pid  # exec, not a new process: launchers and signals see the same one
    assert "glibc.malloc.hugetlb=1" in tunables and active
    _, (_, plain_tunables, plain_active, plain_faults) = _child("plain")
    assert "hugetlb" not in plain_tunables and not plain_active
    # 4 x 256 MB written: ~262k faults on 4 KB pages; on 2 MB pages a few hundred.
    assert plain_faults > 200_000
    assert faults < plain_faults / 4, (faults, plain_faults)
