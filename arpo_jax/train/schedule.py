"""The rollout engine's off-policy schedule (`rollout.max_staleness` = S): which policy step's weights it holds,
the rollout it generates one step ahead, and when it gets new weights.

S = 0 is the synchronous loop: each step's rollout uses the weights of the step before, and the engine syncs after
every update. With S > 0, as soon as a step has its batch, the next step's rollout (and reward) starts with the
weights the engine holds (`collection.RolloutAhead`: a background thread for vLLM, before the update for the JAX
engine, which shares the devices with the update); the weight sync waits for it (`time/rollout_wait`), so an
engine never reloads in the middle of a rollout, and it is skipped while the engine's weights are at most S steps
stale (`sync_due`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from arpo_jax.data.rl_dataset import DataPosition
from arpo_jax.experience.collection import Collected, RolloutAhead, ScheduleConfig

log = logging.getLogger(__name__)

def sync_due(weights_version: int, step: int, max_staleness: int) -> bool:
    """Whether the engine, holding the weights of step `weights_version`, needs those of step + 1 after step `step`'s
    update: the next rollout it generates (step + 2's with one generated ahead, else step + 1's) may be at most
    `max_staleness` steps stale. Every step for 0 and 1; every other step for 2 (k syncs out of k for k+1 ...)."""
    next_rollout = step + 1 + (1 if max_staleness else 0)
    return weights_version < next_rollout - max_staleness


class EngineSchedule:
    """When the engine generates and when it is synced, for `Trainer.train_step`: `take_rollout` at the start of a
    step, `before_update` once the batch is packed, `after_update` at the end.

    `sleep()` frees the engine's memory until its next use; `sync()` gives it the current weights and returns False
    when it could not (a stopping run). `weights_version` is the policy step whose weights the engine holds.
    """

    def __init__(self, cfg: ScheduleConfig, *, overlap: bool, weights_version: int, sleep: Callable[[], None],
                 sync: Callable[[], bool]):
        self.max_staleness = cfg.max_staleness
        self.weights_version = weights_version
        self.ahead = RolloutAhead(overlap)
        self._sleep, self._sync = sleep, sync

    def take_rollout(self, step: int, position: DataPosition, collect: Callable[[int, DataPosition], Collected],
                     more: Callable[[int, DataPosition], bool], timers) -> Collected:
        """Step `step`'s rollout: the one generated ahead, or `collect`ed now from `position`. With S > 0 the next
        step's rollout starts here, when `more(step + 1, position after this one)` says there is a next step."""
        with timers("rollout_wait"):  # 0 when it was generated ahead and is already done
            got = self.ahead.take(step) or collect(step, position)
        if self.max_staleness and more(step + 1, got.position):
            with timers("rollout_ahead"):  # ~0 s; the JAX engine's whole rollout (it runs here, without overlap)
                self.ahead.start(step + 1, functools.partial(collect, step + 1, got.position))
        return got

    def before_update(self, step: int) -> None:
        """The engine gets new weights after this update: it frees its copy and cache meanwhile (the JAX engine's
        rollout ahead has already run; vLLM's may still be generating: then it keeps them)."""
        if self.due(step) and self.ahead.idle():
            self._sleep()

    def after_update(self, step: int, updated: bool, timers) -> None:
        """The rollout in flight ends before the engine's weights change; then the sync, when it is due."""
        with timers("rollout_wait"):
            self.ahead.wait()
        with timers("weight_sync"):
            if not updated and self.weights_version == step:
                self.weights_version += 1  # no update: the engine's weights are the next step's too
            elif self.due(step):
                self.sync_to(step + 1)

    def due(self, step: int) -> bool:
        return sync_due(self.weights_version, step, self.max_staleness)

    def sync_to(self, version: int) -> None:
        """The (idle) engine gets the current weights, those of step `version`."""
        if self._sync():
            self.weights_version = version

    def close(self) -> None:
        self.ahead.close()  # a rollout still in flight (the step failed) ends before its engine closes


def describe(cfg: ScheduleConfig, engine: str, correction: str) -> None:
    """Says once where the rollout generated ahead runs."""
    s = cfg.max_staleness
    if not s:
        return
    where = ("generated before the update of step k-1 (the JAX engine shares the devices with the update: the same "
             "schedule without the overlap)" if engine == "jax" else "generated during the update of step k-1")
    log.info("rollout.max_staleness=%d: step k trains on a rollout generated with the weights of step k-1 (at most "
             "k-%d), %s; rollout correction: %s", s, s, where, correction)
