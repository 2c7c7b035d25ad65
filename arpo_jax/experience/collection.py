"""Collecting a step's rollouts: dynamic sampling's rounds, the rollout generated one step ahead, the
failure budget (host side, numpy; the multi-host moves come in as callables)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from arpo_jax import knobs
from arpo_jax.data.rl_dataset import DataPosition
from arpo_jax.experience import reward as reward_lib
from arpo_jax.experience.trajectories import Trajectories, select_groups

log = logging.getLogger(__name__)


def collect(batch_at: Callable[[DataPosition], dict[int, list]], roll: Callable[[list, int, int], Trajectories],
            position: DataPosition, *, steps_per_epoch: int, need: int, dynamic: bool = False,
            max_extra_rounds: int = 0, agree_max: Callable[[int], int] = int,
            gather: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> tuple[dict[int, Trajectories],
                                                                               DataPosition, dict]:
    """The rollout and reward phases: this step's shaped rollouts per local worker, the data position after them,
    and dynamic-sampling metrics.

    Args:
      batch_at: position -> the prompts of the batch there, per local worker.
      roll: (prompts, worker, draw) -> the worker's scored, shaped rollout (draw 0: the step's batch).
      position: where this step's batch starts.
      need: prompt groups per worker (`data.train_batch_size` / workers).
      dynamic, max_extra_rounds: `algorithm.dynamic_sampling`: groups whose rewards are all equal are dropped and
        the next batches of the data stream are rolled out (up to `max_extra_rounds` more) until every worker of
        every process has `need` informative groups; a worker still short is topped up with dropped groups
        (`reward_lib.pick_groups`).
      agree_max, gather: the largest int over every process, and every process's rows of an array (for counts).
    """
    draws: dict[int, list[Trajectories]] = {}
    informative: dict[int, list[np.ndarray]] = {}
    have = lambda w: sum(int(i.sum()) for i in informative[w])
    extra = 0
    while True:
        for w, ex in batch_at(position).items():
            if extra and have(w) >= need:
                continue  # this worker is full; others draw on
            t = roll(ex, w, extra)
            draws.setdefault(w, []).append(t)
            informative.setdefault(w, []).append(reward_lib.informative_groups(t.scores, t.group, ~t.failed)[1])
        position = position.advance(steps_per_epoch)
        if not dynamic:
            return {w: d[0] for w, d in draws.items()}, position, {}
        short = agree_max(max(need - have(w) for w in draws))
        if extra >= max_extra_rounds or max(short, 0) == 0:
            break
        extra += 1
    trajs, counts = {}, np.zeros(3)  # informative groups drawn, groups drawn, uninformative groups kept
    for w in draws:
        picks = reward_lib.pick_groups(informative[w], need)
        trajs[w] = select_groups([(t, [k for r, k in picks if r == j]) for j, t in enumerate(draws[w])])
        counts += (have(w), sum(len(i) for i in informative[w]), sum(not informative[w][r][k] for r, k in picks))
    counts = gather(counts[None]).sum(0)
    return trajs, position, {"dynamic_sampling/kept_fraction": float(counts[0] / max(counts[1], 1)),
                             "dynamic_sampling/extra_rounds": float(extra),
                             "dynamic_sampling/filled_groups": float(counts[2])}


@dataclasses.dataclass
class Collected:
    """One step's rollout and reward (`collect`), with what its step logs about it."""

    trajs: dict[int, Trajectories]  # per local rollout worker
    position: DataPosition  # the data position after its batches
    metrics: dict  # dynamic sampling's and the tools' metrics of this rollout
    seconds: dict[str, float]  # its phases' times (rollout, reward), wherever it ran
    weights_version: int  # the policy step whose weights the engine generated it with


STALENESS = knobs.at_least(0, "0 (synchronous) | 1 (one step off-policy) | 2 | ...")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The off-policy schedule's knobs (config/schema.py): how many steps stale the rollout generated ahead
    (`RolloutAhead`) may be; the trainer's `schedule.EngineSchedule` keeps to it."""

    max_staleness: int = knobs.knob("rollout.max_staleness", STALENESS)

    def __post_init__(self):
        knobs.validate(self)


class RolloutAhead:
    """`rollout.max_staleness` > 0: the next step's rollout, started while this step updates and taken by the next.

    `overlap`: in a background thread (an engine in another process: vLLM; the thread waits on it, and JAX releases
    the GIL while the update runs); without it the rollout runs at `start`, before the update (the JAX engine shares
    the devices with the update: the same schedule and results, without the overlap). At most one is in flight."""

    def __init__(self, overlap: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if overlap else None
        self._step, self._future = None, None

    def start(self, step: int, run: Callable[[], Collected]) -> None:
        assert self._future is None, "one rollout in flight at most"
        self._step = step
        if self._pool is not None:
            self._future = self._pool.submit(run)
            return
        self._future = Future()
        try:
            self._future.set_result(run())
        except Exception as e:  # raised by `take`, where the step that needs it runs
            self._future.set_exception(e)

    def wait(self) -> None:
        """Until the rollout in flight (if any) has ended: the engine is idle and its weights may change."""
        if self._future is not None:
            wait([self._future])

    def idle(self) -> bool:
        """Whether no rollout is running now (none started, or the one started has ended)."""
        return self._future is None or self._future.done()

    def take(self, step: int) -> Collected | None:
        """Step `step`'s rollout if it was started ahead (its error, if it failed), else None."""
        future, started = self._future, self._step
        self._step = self._future = None
        return future.result() if future is not None and started == step else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class FailureBudget:
    """`rollout.failures`: a step where more than `max_fraction` of the trajectories failed skips its update;
    `max_skipped_steps` such steps in a row (0: no limit) stop the run."""

    def __init__(self, max_fraction: float, max_skipped_steps: int):
        self.max_fraction, self.max_skipped_steps = max_fraction, max_skipped_steps
        self.skipped_in_a_row = 0

    def skip(self, failed: np.ndarray, step: int) -> bool:
        """True (with a warning) when the step's share of `failed` (bool per trajectory of every process) is over
        the budget; raises at the `max_skipped_steps`-th such step in a row."""
        share = float(failed.mean()) if failed.size else 0.0
        if share <= self.max_fraction:
            self.skipped_in_a_row = 0
            return False
        self.skipped_in_a_row += 1
        log.warning("step %d: %.0f%% of the trajectories failed (> rollout.failures.max_fraction = %g): the update "
                    "is skipped (%d step(s) in a row)", step, 100 * share, self.max_fraction, self.skipped_in_a_row)
        if self.max_skipped_steps and self.skipped_in_a_row >= self.max_skipped_steps:
            raise RuntimeError(f"{self.skipped_in_a_row} steps in a row had more than rollout.failures.max_fraction="
                               f"{self.max_fraction:g} of failed trajectories (see the rollout/failed/* metrics): "
                               "the engine or a tool is broken")
        return True
