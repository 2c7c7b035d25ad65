"""Validation as `rollout.val_kwargs` says: greedy n = 1 (the reference default) or n sampled trajectories a prompt."""

from pathlib import Path

import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.config import args
from arpo_jax.rollout import agent_loop
from arpo_jax.train import trainer as trainer_lib

REPO = Path(__file__).resolve().parents[1]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0 - 0.5}
'''


def _trainer(tmp_path: Path, *overrides: str) -> trainer_lib.Trainer:
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = args.load_config([
        "--config=builtin:toy_cpu", f"--config.reward.custom_path={reward}",
        "--config.trainer.progress=false", "--config.trainer.loggers=('jsonl',)", "--config.data.val_max_samples=6",
        "--config.data.max_response_length=24", "--config.trainer.max_steps=1", *overrides])
    return trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())


@pytest.mark.slow  # trainer rollouts and steps
def test_sampled_validation_draws_n_different_trajectories_per_prompt(tmp_path):
    tr = _trainer(tmp_path, "--config.rollout.val_kwargs.do_sample=true", "--config.rollout.val_kwargs.n=3")
    examples = [tr.val_data[i] for i in range(len(tr.val_data))]
    t = tr._reward(tr._rollout(examples, 0, validation=True), examples, shape=False)
    assert sorted(t.group.tolist()) == sorted(list(range(len(examples))) * 3)
    assert (t.out.parent_id < 0).all()  # no branching in validation
    distinct = [len({t.responses[i] for i in np.flatnonzero(t.group == p)}) for p in range(len(examples))]
    assert max(distinct) > 1  # T = 1 on a random model: the samples of a prompt differ

    out = tr.validate()
    assert out["val/samples"] == 3 * len(examples)
    sources = sorted({e.data_source for e in examples})
    assert sorted(k for k in out if k.endswith("@3")) == [f"val/{s}/reward/mean@3" for s in sources]
    assert -0.5 <= out["val/reward/mean"] <= 0.5


def test_greedy_validation_is_one_deterministic_trajectory_per_prompt(tmp_path):
    tr = _trainer(tmp_path)
    first, second = tr.validate(), tr.validate()
    assert first["val/samples"] == len(tr.val_data)
    for key in first:
        if key.startswith("val/"):
            assert first[key] == second[key], key
    assert any(k.endswith("/reward/mean@1") for k in first)


@pytest.mark.slow  # trainer rollouts and steps
def test_each_worker_keeps_its_rollout_state_across_steps_and_validation(tmp_path, monkeypatch):
    """B1 compat (spec 14): the reference's entropy dict lives in its per-GPU rollout object, never cleared, shared
    by training and validation. The trainer passes one RolloutState per worker to every rollout of that worker."""
    tr = _trainer(tmp_path, "--config.rollout.reference_compat=true", "--config.rollout.workers=2",
                  "--config.trainer.max_steps=2")
    passed = []
    real = agent_loop.rollout
    monkeypatch.setattr(trainer_lib, "rollout", lambda *a, state=None, **kw: passed.append(state) or real(
        *a, state=state, **kw))
    try:
        tr.train_step()
        first = {w: dict(s.baselines.values) for w, s in tr.rollout_states.items()}
        tr.train_step()
        tr.validate()
        states = [tr.rollout_states[w] for w in (0, 1)]
        assert passed[:4] == states * 2 and all(any(s is x for x in states) for s in passed[4:])
        for w, values in first.items():
            assert values  # step 1 recorded first-segment entropies ...
            now = tr.rollout_states[w].baselines.values
            assert {k: now[k] for k in values} == values  # ... which later steps read, stale (B1)
    finally:
        tr.close()
