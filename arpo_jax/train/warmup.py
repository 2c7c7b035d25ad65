"""The RL run's programs compiled before its first step (`warm_up`), and the compiles of each step (`CompileWatch`).

A run's programs are fixed by its config (issue 54): the update side's batches have the micro-batch count, heads and
loss entries `global_batch.GlobalBatch` fixes, the JAX engine its slots and prefill lengths. `warm_up` lowers every
one of them with the run's own arrays (a stand-in rollout packed by the run's own packer, so keys, dtypes and
shardings are the step's) and compiles them on a thread pool, with the JAX engine's own warm-up beside them. After
it, `compile_log` names any program compiled later (a shape outside the set) once, with its shapes, and every
step's metrics count what it compiled (`perf/compiles`, per phase `perf/compiles/<phase>`): 0 from the second step
on (the first may still compile a few eager operations, e.g. the learning-rate schedule's).
"""

from __future__ import annotations

from arpo_jax import compile_log


class CompileWatch:
    """The programs traced and compiled since the last `take` (all threads), as a step's metrics."""

    def __init__(self):
        self.mark = compile_log.counts()
        self.first: dict[str, float] = {}  # added to the next `take` only (the warm-up's metrics)

    def take(self) -> dict[str, float]:
        delta = compile_log.since(self.mark)
        self.mark = compile_log.counts()
        out, self.first = compile_log.metrics(delta) | self.first, {}
        return out

