"""`trainer.time_limit_minutes`: the run ends after the first step past the limit as it would at max_steps (its end
checkpoint, a summary that says so), and a resumed run without a limit goes on to max_steps."""

import pytest

from arpo_jax import testing
from arpo_jax.config import args as args_lib
from arpo_jax.train import metrics
from arpo_jax.train import trainer as trainer_lib
from arpo_jax.weights.checkpoint import Checkpointer


def _config(*overrides: str):
    return args_lib.load_config(["--config=builtin:toy_cpu", "--config.trainer.progress=false",
                                 "--config.trainer.loggers=('jsonl',)", "--config.trainer.max_steps=3",
                                 "--config.trainer.test_freq=0", "--config.trainer.save_freq=0",
                                 "--config.trainer.async_save=false", *overrides])


@pytest.mark.slow  # two toy trainer runs (~25 s)
def test_time_limit_ends_the_run_after_the_step_that_passes_it_then_resume_continues(tmp_path):
    workdir = tmp_path / "run"
    # A limit every step passes: the run ends after its first step (not before it, not at max_steps).
    summary = trainer_lib.train(_config("--config.trainer.time_limit_minutes=1e-9"), workdir,
                                testing.trainer_devices())
    assert summary["steps"] == 1 and summary["total_steps"] == 3 and summary["time_limit_reached"] is True
    with Checkpointer(workdir / "checkpoints", async_save=False) as ck:
        assert ck.all_steps() == [1]  # save_freq=0 saves only at the end: the time limit is an end
    # Without a limit the resumed run goes on to max_steps.
    summary = trainer_lib.train(_config(), workdir, testing.trainer_devices())
    assert summary["steps"] == 3 and summary["time_limit_reached"] is False
    steps = [r["step"] for r in metrics.read_jsonl(workdir / "metrics.jsonl") if r.get("step")]
    assert steps == [1, 2, 3]
