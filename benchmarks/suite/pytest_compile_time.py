"""A pytest plugin: where the tests' JAX time goes, from JAX's own compile events, per test and in all.

JAX reports each phase of a compile to `jax.monitoring` listeners: tracing to a jaxpr, lowering to MLIR, XLA's
backend compile, and persistent-cache hits (the seconds they saved). This plugin sums them by test (setup included)
and prints the totals and the tests with the most compile time at the end of the session. It sees the test
process only (not `arpo-jax` subprocesses), so run it without pytest-xdist:

  PYTHONPATH=benchmarks/suite .venv/bin/python -m pytest -p no:xdist -p pytest_compile_time tests/test_train_step.py
"""

from __future__ import annotations

import collections

from jax import monitoring

TOP = 25
TOTAL: collections.Counter = collections.Counter()
PER_TEST: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current = ["(collection)"]


def _record(event: str, duration: float, **_) -> None:
    TOTAL[event] += duration
    PER_TEST[_current[0]][event] += duration


monitoring.register_event_duration_secs_listener(_record)


def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    short = lambda event: event.rsplit("/", 1)[-1]  # noqa: E731
    events = [e for e, _ in TOTAL.most_common()]
    terminalreporter.section("JAX compile seconds (jax.monitoring)")
    terminalreporter.write_line("all tests: " + ", ".join(f"{short(e)} {TOTAL[e]:.1f}" for e in events))
    ranked = sorted(PER_TEST.items(), key=lambda kv: -sum(kv[1].values()))[:TOP]
    for test, counts in ranked:
        phases = ", ".join(f"{short(e)} {counts[e]:.1f}" for e in events if counts[e] >= 0.05)
        terminalreporter.write_line(f"{test}: {phases}")
