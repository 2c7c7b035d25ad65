"""The run skeleton shared by the RL loop (`trainer.Trainer`) and the SFT loop (`sft.run_sft`).

Both build the same things in the same order:
  1. the policy's update (`update.machinery.build_policy`): optimizer and schedule -> abstract params -> state
     shardings -> the jitted step;
  2. the run's checkpoint folders and resume-or-init (`RunCheckpoints.resume_or_init`): the newest step that every
     folder holds intact, else a fresh state;
  3. the metrics logger (`open_logger`), continuing the run's metrics from the resumed step;
  4. the stop protocol, at every step boundary: a background save that failed stops the run
     (`RunCheckpoints.raise_if_failed`); a stop signal saves the current step and ends it
     (`RunCheckpoints.save_for_stop`, then `run_guard.StopSignals.stopped`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from arpo_jax.config import redaction
from arpo_jax.train import metrics as metrics_lib
from arpo_jax.weights.checkpoint import Checkpointer


def policy_checkpointer(cfg, workdir: Path) -> Checkpointer:
    """`workdir/checkpoints`: the newest `trainer.keep_checkpoints` steps, saved in the background unless
    `trainer.async_save` is off (RL and SFT alike)."""
    return Checkpointer(Path(workdir) / "checkpoints", max_to_keep=cfg.trainer.keep_checkpoints,
                        async_save=cfg.trainer.async_save)


class RunCheckpoints:
    """The run's checkpoint folders (the policy's first, e.g. the critic's beside it), saved at the same steps."""

    def __init__(self, checkpointers: Sequence[Checkpointer]):
        self.all = tuple(checkpointers)
        self.main = self.all[0]

    def steps(self) -> list[int]:
        """The steps every folder holds (a kill may land between the saves of two folders)."""
        steps = set(self.main.all_steps())
        for ckpt in self.all[1:]:
            steps &= set(ckpt.all_steps())
        return sorted(steps)

    def resume_or_init(self, resuming: bool, restore: Callable[[int], Any],
                       init: Callable[[], Any]) -> tuple[int | None, Any]:
        """(step, restore(step)) for the newest step whose files and params are intact in every folder (a damaged
        newer one is moved aside, logged); (None, init()) for a new run or one without checkpoints."""
        steps = self.steps() if resuming else []
        if not steps:
            return None, init()
        return self.main.restore_newest_intact(restore, steps=steps, also=self.all[1:])

    def raise_if_failed(self) -> None:
        """Raises if a background save failed (a full disk): called at each step boundary."""
        for ckpt in self.all:
            ckpt.raise_if_failed()

    def wait(self) -> None:
        for ckpt in self.all:
            ckpt.wait()

    def close(self) -> None:
        for ckpt in self.all:
            ckpt.wait()
            ckpt.close()

    def save_for_stop(self, step: int, save: Callable[[], None]) -> str:
        """The stop protocol's save: `save()` the current `step` unless it is saved already, wait for the saves.
        Returns what happened, for `run_guard.StopSignals.stopped`."""
        if step > 0 and step not in self.steps():
            save()
        self.wait()
        if step == 0:
            return "no step was trained, nothing to save"
        return f"step {step} is saved in {self.main.directory}; the same command resumes it"


def open_logger(cfg, workdir: Path, *, resume_step: int | None, enabled: bool) -> metrics_lib.MetricsLogger:
    """The run's metrics logger (`trainer.loggers`; only `enabled` on the main process), with the redacted config;
    a resumed run's metrics continue after `resume_step`."""
    return metrics_lib.MetricsLogger(workdir, loggers=tuple(cfg.trainer.loggers), config=redaction.redact(cfg),
                                     project=cfg.trainer.project, experiment=cfg.trainer.experiment or workdir.name,
                                     resume_step=resume_step, enabled=enabled)
