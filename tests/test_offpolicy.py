"""Off-policy rollouts (`rollout.max_staleness`): the weight-sync schedule and the rollout that runs ahead.

The trainer runs with it here (the JAX engine: the same schedule without the overlap, and a resume with a rollout
generated ahead) and in tests/test_trainer.py (vLLM, overlapped)."""

import threading

import pytest

from arpo_jax import testing
from arpo_jax.config import args
from arpo_jax.experience.collection import RolloutAhead
from arpo_jax.train import trainer as trainer_lib
from arpo_jax.train.schedule import sync_due
from tests.test_trainer_rollouts import TEXT_REWARD


def _versions(max_staleness: int, steps: int) -> list[int]:
    """The weights version each step's rollout is generated with, by the trainer's schedule: with S > 0 the rollout
    of step k+1 is generated during step k (before its sync), so it sees the engine's version at that time."""
    engine, seen = 0, []
    for step in range(steps):
        if max_staleness == 0 or step == 0:
            seen.append(engine)  # generated at the start of the step
        if max_staleness and step + 1 < steps:
            seen.append(engine)  # step + 1's, generated during this step's update
        if sync_due(engine, step, max_staleness):
            engine = step + 1
    return seen


def test_sync_schedule_bounds_the_staleness_and_syncs_only_when_due():
    # 0: every step's rollout uses the weights of that step (the synchronous loop).
    assert _versions(0, 5) == [0, 1, 2, 3, 4]
    # 1: step k's rollout uses the weights of step k-1 (the first step has no earlier weights).
    assert _versions(1, 5) == [0, 0, 1, 2, 3]
    # 2: the engine reloads every other step; staleness alternates 1, 2 and never exceeds 2.
    assert _versions(2, 6) == [0, 0, 0, 2, 2, 4]
    for s in range(4):
        assert all(0 <= k - v <= s for k, v in enumerate(_versions(s, 9)))
        assert max(k - v for k, v in enumerate(_versions(s, 9))) == s  # the bound is reached: syncs are skipped
    assert [sync_due(0, k, 2) for k in range(4)] == [False, True, True, True]  # a stale engine is refreshed


def test_rollout_ahead_overlaps_the_caller_in_a_thread():
    """overlap: the rollout runs while the caller goes on (it waits for an event the caller sets after `start`, so
    run synchronously it would time out), and `take` hands it to the step it was started for."""
    started, go = threading.Event(), threading.Event()

    def rollout():
        started.set()
        return go.wait(timeout=30)  # True only if the caller could set it while this ran

    ahead = RolloutAhead(overlap=True)
    try:
        ahead.start(3, rollout)
        assert started.wait(timeout=30)
        go.set()  # "the update" runs here, in the caller's thread
        ahead.wait()
        assert ahead.take(3) is True
        assert ahead.take(4) is None  # nothing in flight any more
    finally:
        ahead.close()


def test_rollout_ahead_without_overlap_runs_at_start_and_reports_errors_at_take():
    order = []
    ahead = RolloutAhead(overlap=False)
    ahead.start(1, lambda: order.append("rollout") or "r1")
    order.append("update")
    assert order == ["rollout", "update"] and ahead.take(1) == "r1"
    # A failed rollout raises in the step that needs it; a rollout for another step is not handed out.
    for overlap in (False, True):
        ahead = RolloutAhead(overlap=overlap)
        ahead.start(2, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            ahead.take(2)
        ahead.start(5, lambda: "r5")
        assert ahead.take(4) is None
        ahead.close()


@pytest.mark.slow  # two trainers (compiles) on the toy config
def test_jax_engine_schedule_and_a_resume_with_a_rollout_generated_ahead(tmp_path):
    """max_staleness = 1 with the JAX engine (the same schedule as vLLM's, without the thread): step k trains on a
    rollout generated with the weights of step k-1. Its engine log-probs then differ from the trainer's (at
    staleness 0 they are the same model code and weights: equal), and the rollout correction is on.

    A run stopped after step 2 holds step 3's rollout, generated ahead: it is dropped, and the resumed run starts at
    that batch's data position with the resumed weights (the step's seeds are (seed, step, worker)): no batch lost,
    none trained twice. (Only the resumed run's state is checked: its step would compile the update again.)
    """
    reward = tmp_path / "reward.py"
    reward.write_text(TEXT_REWARD)
    cfg = args.load_config([
        "--config=builtin:toy_cpu", f"--config.reward.custom_path={reward}", "--config.trainer.progress=false",
        "--config.trainer.loggers=('jsonl',)", "--config.trainer.max_steps=3", "--config.rollout.max_staleness=1"])
    tr = trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())
    try:
        calls, collect = [], tr._collect
        version = lambda: tr.engine.weights_version
        tr._collect = lambda step, pos: calls.append((step, pos.to_dict(), version())) or collect(step, pos)
        records = [tr.train_step(), tr.train_step()]
        tr.save()  # stopped here: step 3's rollout, generated ahead, is lost with the process
        tr.checkpoints.wait()
    finally:
        tr.close()
    assert [(s, v) for s, _, v in calls] == [(0, 0), (1, 0), (2, 1)]  # step k+1's rollout: step k's weights
    assert [(r["rollout/weights_version"], r["rollout/staleness"]) for r in records] == [(0, 0), (0, 1)]
    # The JAX engine runs the trainer's model code: same weights, same log-probs up to rounding; stale: not.
    assert records[0]["rollout_corr/abs_logp_diff_max"] < 1e-5 and records[1]["rollout_corr/abs_logp_diff_mean"] > 1e-3
    assert all(r["rollout_corr/tokens"] > 0 and r["actor/grad_norm"] > 0 for r in records)

    resumed = trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())
    try:
        assert (resumed.step, resumed.position.to_dict(), resumed.engine.weights_version) == (2, calls[2][1], 2)
        assert resumed.engine.ahead.take(2) is None  # so its first step generates the dropped batch now, with version 2
    finally:
        resumed.close()
