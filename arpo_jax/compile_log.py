"""Counts the programs this process traces and compiles, per phase, through `jax.monitoring` listeners.

A run is meant to compile a fixed set of programs before its first step (issue 54); a program compiled later is a
new shape that stalls the device while the host compiles it. This module counts, per phase of the thread that
triggered it (`phase("rollout")`, thread-local: the rollout may run beside the update):

* `traces`: jaxpr traces (`/jax/core/compile/jaxpr_trace_duration`, one per jit cache miss of an outermost call: a jit
  called inside another's trace is not reported by JAX, jax/_src/pjit.py fires the event only on a clean trace state);
* `compiles`: backend compiles (`/jax/core/compile/backend_compile_duration`), eager ops on new shapes included;
* `cache_hits`: the compiles the persistent compilation cache served (`/jax/compilation_cache/cache_hits`).

A persistent-cache hit counts as a compile too, and is also counted apart: it is still a program this process did
not have (a shape outside the planned set), and whether it hits depends on the cache directory's state, which a
test or a metric must not. After `arm()` (the warm-up is done) each late program is logged once per name with its
argument shapes, and kept in `late()`.

Leaf module: imports nothing from arpo_jax.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections import Counter

from jax import monitoring

log = logging.getLogger(__name__)

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
KINDS = ("traces", "compiles", "cache_hits")

_lock = threading.Lock()
_local = threading.local()
_counts: Counter[tuple[str, str]] = Counter()  # (phase, kind) -> events
_state = {"installed": False, "armed": False}
_late: list[tuple[str, str, str]] = []  # (phase, program, shapes), one per program name after arm()


def install() -> None:
    """Registers the listeners (once per process; later calls do nothing)."""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def current_phase() -> str:
    return getattr(_local, "phase", "other")


@contextlib.contextmanager
def phase(name: str):
    """Counts what this thread compiles inside the block under `name` (blocks nest; the innermost wins)."""
    install()
    before = current_phase()
    _local.phase = name
    try:
        yield
    finally:
        _local.phase = before


def counts() -> dict[str, dict[str, int]]:
    """{phase: {kind: events}} since the process started counting (the first call starts it)."""
    install()
    with _lock:
        items = list(_counts.items())
    out: dict[str, dict[str, int]] = {}
    for (ph, kind), n in items:
        out.setdefault(ph, dict.fromkeys(KINDS, 0))[kind] = n
    return out


def since(before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The counts added since the snapshot `before` (a `counts()` result); phases with nothing new left out."""
    out = {}
    for ph, kinds in counts().items():
        diff = {k: n - before.get(ph, {}).get(k, 0) for k, n in kinds.items()}
        if any(diff.values()):
            out[ph] = diff
    return out


def total(delta: dict[str, dict[str, int]], kind: str = "compiles") -> int:
    return sum(kinds.get(kind, 0) for kinds in delta.values())


def metrics(delta: dict[str, dict[str, int]]) -> dict[str, float]:
    """A step's `since(...)` as metrics: `perf/compiles`, `perf/traces`, `perf/compile_cache_hits` and
    `perf/compiles/<phase>` per phase that compiled."""
    out = {
        "perf/compiles": float(total(delta)),
        "perf/traces": float(total(delta, "traces")),
        "perf/compile_cache_hits": float(total(delta, "cache_hits")),
    }
    out |= {f"perf/compiles/{ph}": float(k["compiles"]) for ph, k in delta.items() if k["compiles"]}
    return out


def arm(on: bool = True) -> None:
    """From now on, name each newly compiled program (once per name) in the log with its shapes: the warm-up is
    over, so any compile is late."""
    install()
    _state["armed"] = on


def late() -> list[tuple[str, str, str]]:
    """(phase, program, argument shapes) of the programs compiled after `arm()`, one per program name."""
    with _lock:
        return list(_late)


def _bump(kind: str) -> None:
    with _lock:
        _counts[(current_phase(), kind)] += 1


def _on_event(event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
        _bump("cache_hits")


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == TRACE_EVENT:
        _bump("traces")
    elif event == COMPILE_EVENT:
        _bump("compiles")
        if _state["armed"]:
            _name_late(str(kwargs.get("fun_name", "?")))


def _name_late(name: str) -> None:
    with _lock:
        if any(p == name for _, p, _ in _late):
            return
        entry = (current_phase(), name, _shapes_on_stack())
        _late.append(entry)
    log.warning("late compile in phase %r: %s with arguments %s (a shape outside the warmed-up set)", *entry)


def _shapes_on_stack(depth: int = 40) -> str:
    """The argument shapes of the program being compiled: the avals JAX's lowering holds in a caller's frame
    (`global_in_avals` / `in_avals`; read only for a late compile, so a JAX without them costs the shapes only)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        for name in ("global_in_avals", "in_avals"):
            avals = frame.f_locals.get(name)
            if isinstance(avals, (list, tuple)) and avals and all(hasattr(a, "shape") for a in avals):
                return ", ".join(a.str_short() if hasattr(a, "str_short") else str(a) for a in avals)
        frame = frame.f_back
    return "(shapes unknown)"
