"""benchmarks/trace_summary.py (what `rollout.py --profile` and `train_step.py --profile` print): a real trace of a
jitted program on this machine's CPU backend, and the interval union by hand."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

_spec = importlib.util.spec_from_file_location("trace_summary",
                                               Path(__file__).parents[1] / "benchmarks" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def test_union_of_overlapping_intervals():
    # [0, 10] and [5, 12] overlap (12 us), [20, 21] apart, [3, 4] inside the first: 13 us in all
    assert trace_summary._union_ms([(20.0, 21.0), (5.0, 12.0), (0.0, 10.0), (3.0, 4.0)]) == 13 / 1e3
    assert trace_summary._union_ms([]) == 0.0


def test_a_traced_program_is_summed_by_kernel(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((128, 128))
    f(x).block_until_ready()  # compiled outside the trace
    with trace_summary.traced(tmp_path):
        for _ in range(3):
            f(x).block_until_ready()
    s = trace_summary.summarise(tmp_path, top=5)
    assert 0 < s["device_busy_ms"] <= s["span_ms"]
    assert s["device_kernels"] >= 3 and 0 < len(s["kernels"]) <= 5
    assert s["kernels"] == sorted(s["kernels"], key=lambda k: -k["ms"])
    assert any("PjitFunction" in h["name"] for h in s["host"])  # the host side of each call


def test_the_device_busy_time_is_split_by_the_annotated_phases(tmp_path):
    """`phase_busy`: the device's busy time inside each `phase/<name>` span (what the trainer's PhaseTimer and the
    agent loop annotate); a phase that only waits on the host is idle."""
    import time

    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with trace_summary.traced(tmp_path):
        with jax.profiler.TraceAnnotation("phase/compute"):
            for _ in range(20):
                f(x).block_until_ready()
        with jax.profiler.TraceAnnotation("rollout/tools"):
            time.sleep(0.05)
    p = trace_summary.phase_busy(tmp_path)
    assert set(p) == {"phase/compute", "rollout/tools", "span"}
    assert p["phase/compute"]["busy_ms"] > 0 and p["rollout/tools"]["busy_ms"] == 0
    assert p["rollout/tools"]["wall_ms"] >= 50 and p["span"]["wall_ms"] >= p["rollout/tools"]["wall_ms"]
    assert p["span"]["busy_ms"] >= p["phase/compute"]["busy_ms"]
