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

import concurrent.futures
import logging
import os
import time
import types

import jax
import numpy as np

from arpo_jax import compile_log
from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.update import value as critic_lib

log = logging.getLogger(__name__)


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


def warm_up(trainer) -> CompileWatch:
    """Compiles every program `trainer`'s run will use (module docstring), on a thread pool (XLA compiles outside
    the GIL; the lowering before it is Python, one program after another), the JAX engine's warm-up beside them.
    Logs what it compiled and how long it took; returns the watch for the steps that follow, which adds `time/warmup`
    and `perf/warmup/*` (the warm-up's compiles, traces and cache hits) to the first step's metrics."""
    t0 = time.perf_counter()
    watch = CompileWatch()
    with compile_log.phase("warmup"):
        lowered = update_programs(trainer)
    tasks = {name: low.compile for name, low in lowered.items()}
    if callable(getattr(trainer.sampler, "warm_up", None)):
        tasks["sampler"] = trainer.sampler.warm_up
    seconds = {}

    def run(item):
        name, task = item
        start = time.perf_counter()
        with compile_log.phase("warmup"):
            task()
        seconds[name] = round(time.perf_counter() - start, 1)

    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(tasks), os.cpu_count() or 1))) as pool:
        list(pool.map(run, tasks.items()))
    with compile_log.phase("warmup"):  # the advantages' eager operations, on arrays of a step's size
        trainer._advantages(stand_in(trainer.cfg, trainer.local_workers, trainer.workers))
    compile_log.arm()  # from now on a compiled program is a late one: named in the log with its shapes
    counts = watch.take()
    total = time.perf_counter() - t0
    log.info("warm-up in %.1f s: %s; %d compiles (%d from the persistent cache)", total,
             ", ".join(f"{k} {v} s" for k, v in seconds.items()), counts["perf/compiles"],
             counts["perf/compile_cache_hits"])
    watch.first = {"time/warmup": total} | {k.replace("perf/", "perf/warmup/", 1): v for k, v in counts.items()
                                            if not k.startswith("perf/compiles/")}
    return watch


def update_programs(trainer) -> dict:
    """The update side's programs, lowered with the run's own arrays ({name: `jax.stages.Lowered`}): the old and
    reference log-prob forwards and the policy update on a mini-batch, with a critic its values forward (over the
    whole [K, M, B, T] step) and its update. The batch is a stand-in rollout (`stand_in`) packed by the run's
    packer: the shapes are the config's, so they are every step's."""
    tr = trainer
    trajs = stand_in(tr.cfg, tr.local_workers, tr.workers)
    arrays = {w: token_arrays(t, critic=tr.critic is not None) for w, t in trajs.items()}
    batch = tr.batches.pack(trajs, arrays)[0][0]
    logp = jax.ShapeDtypeStruct(batch["loss_weight"].shape, np.float32, sharding=batch["loss_weight"].sharding)
    out, full = {}, batch
    if tr.cfg.actor.recompute_old_logprob:  # else the update's own log-probs are the old ones: no forward of its own
        out["logprob_forward"] = tr.logprob_fn.lower(tr.state.params, batch)
        full = batch | {"old_logp": logp}
    if tr.ref_logprobs is not None:
        out["reference_logprobs"] = tr.ref_logprobs.lower(tr.state.params, batch)
        full["ref_logp"] = logp
    out["policy_update"] = tr.policy.step_fn.lower(tr.state, full)
    if tr.critic is not None:
        values_batch = tr.batches.forward_batch(trajs, critic_lib.FORWARD_KEYS)[0]
        out["critic_values"] = tr.critic.value_fn.lower(tr.critic.state.params, values_batch)
        out["critic_update"] = tr.critic.step_fn.lower(tr.critic.state, full)
    return out


def stand_in(cfg, local_workers: range, workers: int) -> dict[int, Trajectories]:
    """Per local worker, a rollout of a step's size (its prompts x rollout.n trajectories) of two tokens each: what
    the packer needs to build a batch of the step's shapes (they depend on the config, not on the rollout), and
    what the advantages read (none failed, one-token responses)."""
    n = cfg.data.train_batch_size // workers * cfg.rollout.n

    def one() -> Trajectories:
        out = types.SimpleNamespace(failed=np.full(n, "", object))  # what the advantages read of a rollout
        return Trajectories(sequences=[np.zeros(2, np.int32)] * n, prompt_lengths=np.ones(n, np.int64),
                            loss_masks=[np.array([0, 1], np.int32)] * n, scores=np.zeros(n, np.float32),
                            group=np.arange(n) // cfg.rollout.n, responses=[""] * n, reward_infos=[{}] * n,
                            out=out, rollout_logps=[np.array([np.nan, 0.0], np.float32)] * n)

    return {w: one() for w in local_workers}


def token_arrays(traj: Trajectories, *, critic: bool) -> dict[str, list[np.ndarray]]:
    """The token-aligned arrays the step packs beside the sequences (`Trainer._advantages`): zeros."""
    zeros = [np.zeros(len(s), np.float32) for s in traj.sequences]
    return {"advantages": zeros} | ({"returns": zeros, "old_values": zeros} if critic else {})
