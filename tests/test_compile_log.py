"""The compile counter (`arpo_jax.compile_log`): per phase and thread, persistent-cache hits counted as compiles and
apart, late programs named once with their shapes."""

import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from arpo_jax import compile_log


def test_counts_per_phase_and_thread(persistent_cache):
    f = jax.jit(lambda x: x * 3.0 - 1.0)
    x, y = jnp.asarray(np.ones(7, np.float32)), jnp.asarray(np.ones((2, 7), np.float32))  # no eager programs
    before = compile_log.counts()
    with compile_log.phase("warm"):
        f(x)
        f(x)  # in JAX's in-memory cache: nothing new

    def other():
        with compile_log.phase("other_thread"):
            f(y)

    with compile_log.phase("main"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    delta = compile_log.since(before)
    assert delta == {
        "warm": {"traces": 1, "compiles": 1, "cache_hits": 0},
        "other_thread": {"traces": 1, "compiles": 1, "cache_hits": 0},
    }
    assert compile_log.metrics(delta) == {
        "perf/compiles": 2.0,
        "perf/traces": 2.0,
        "perf/compile_cache_hits": 0.0,
        "perf/compiles/warm": 1.0,
        "perf/compiles/other_thread": 1.0,
    }


def test_a_nested_jit_counts_as_one_trace_and_one_compile(persistent_cache):
    """JAX reports the outermost trace only (the module docstring says so): the inner jit is inlined in one program."""
    inner = jax.jit(lambda x: x + 2.5)
    outer = jax.jit(lambda x: inner(x) * 4.0)
    x = jnp.asarray(np.ones(3, np.float32))
    before = compile_log.counts()
    with compile_log.phase("nested"):
        outer(x)
    assert compile_log.since(before) == {"nested": {"traces": 1, "compiles": 1, "cache_hits": 0}}


@pytest.fixture
def persistent_cache(tmp_path):
    """JAX's persistent cache in an empty folder for the test: `make test-fast` keeps one between runs, where these
    programs would be cache hits from the second run on (two tests here failed that way, 2026-11-28)."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_enable_compilation_cache",
    )
    before = {n: getattr(jax.config, n) for n in names}
    compilation_cache.reset_cache()
    for n, v in zip(names, (str(tmp_path), 0.0, 0, True)):
        jax.config.update(n, v)
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


def test_a_persistent_cache_hit_counts_as_a_compile_and_apart(persistent_cache):
    f = jax.jit(lambda x: jnp.sin(x) * 17.25)
    x = jnp.asarray(np.ones(5, np.float32))
    before = compile_log.counts()
    with compile_log.phase("cached"):
        f(x)
        jax.clear_caches()  # the in-memory executables go; the persistent cache keeps the program
        f(x)
    assert compile_log.since(before)["cached"] == {"traces": 2, "compiles": 2, "cache_hits": 1}


def test_a_late_program_is_named_once_with_its_shapes(caplog):
    g = jax.jit(lambda a, b: a @ b)
    a, b = jnp.asarray(np.ones((3, 4), np.float32)), jnp.asarray(np.ones((4, 2), np.int32))
    c = jnp.asarray(np.ones((4, 4), np.float32))
    try:
        compile_log.arm()
        with caplog.at_level(logging.WARNING, "arpo_jax.compile_log"), compile_log.phase("late"):
            g(a, b)
            g(c, c)  # another shape of the same program: counted, not named again
    finally:
        compile_log.arm(False)
    mine = [e for e in compile_log.late() if e[0] == "late"]
    assert [(p, s) for _, p, s in mine] == [("jit(<lambda>)", "float32[3,4], int32[4,2]")]
    assert sum("late compile in phase 'late'" in r.getMessage() for r in caplog.records) == 1
