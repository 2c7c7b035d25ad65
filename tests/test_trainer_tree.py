"""Tree training inside the trainer (`actor.tree_training`, issue 34), on the toy config (2 fake devices).

The same seeded run with prefix-tree batches and with flat ones must train to the same parameters: the tree layout
changes which tokens the forward computes (each group's shared prompt and branch prefixes once), never the loss or
its gradients. Two rollout workers, so the workers' tree sizes (micro-batches, heads, entries) are agreed on and the
loss normalisation is split over workers; ARPO branching as the toy config has it (initial_rollouts < n).
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.config import args
from arpo_jax.train import trainer as trainer_lib
from tests.test_trainer_rollouts import HALF_CONSTANT_REWARD, InjectingSampler

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''


def _config(tmp_path: Path, *overrides: str, reward: str = REWARD):
    path = tmp_path / "reward.py"
    path.write_text(reward)
    return args.load_config([
        "--config=builtin:toy_cpu", f"--config.reward.custom_path={path}", "--config.trainer.max_steps=2",
        "--config.trainer.progress=false", "--config.trainer.loggers=('jsonl',)", "--config.rollout.workers=2",
        "--config.trainer.save_freq=0", *overrides])


def _train(tmp_path: Path, name: str, *overrides: str, reward: str = REWARD, wrap=None
           ) -> tuple[list[dict], list[np.ndarray]]:
    """Two steps of a fresh run: (each step's metrics, the final params' leaves)."""
    tr = trainer_lib.Trainer(_config(tmp_path, *overrides, reward=reward), tmp_path / name,
                             testing.trainer_devices())
    try:
        if wrap:
            wrap(tr)
        outs = [tr.train_step() for _ in range(2)]
        return outs, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tr.state.params))]
    finally:
        tr.close()


def _assert_same_training(flat, tree):
    (flat_out, flat_params), (tree_out, tree_params) = flat, tree
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(flat_params, tree_params, strict=True))
    assert diff <= 1e-5, diff
    for f, t in zip(flat_out, tree_out, strict=True):
        assert f["rollout/trajectories"] == t["rollout/trajectories"]
        assert f["reward/mean"] == pytest.approx(t["reward/mean"], abs=1e-6)  # the same rollouts
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
            assert f[key] == pytest.approx(t[key], rel=1e-4, abs=1e-6), key
        assert t["actor/grad_norm"] > 0
        # Every group shares at least its prompt: the tree computes fewer tokens than the flat layout.
        assert 0 < t["perf/tree_tokens_computed"] < t["perf/tree_tokens_flat"]
        assert "perf/tree_tokens_computed" not in f
    return diff


@pytest.mark.slow  # four trainer steps with tool calls
def test_tree_training_equals_flat_with_tool_branches_failures_and_dynamic_sampling(tmp_path):
    """The real sampler, except that one trajectory per rollout calls the (real) Python tool, so branches fork
    after a tool result (masked out of the loss inside a shared prefix), and one request per rollout is rejected
    (a failed, fully masked trajectory in a tree); dynamic sampling draws extra batches for informative groups."""
    def wrap(tr):
        tr.sampler = InjectingSampler(tr.sampler, tr.tokenizer)

    # One extra round draws more batches as well as three (most of this test's time was the toy model's decode
    # steps, ~27 s a round). The one tool-calling trajectory of a rollout branches after its result for sure.
    overrides = ("--config.algorithm.dynamic_sampling=true", "--config.algorithm.max_extra_rounds=1",
                 "--config.rollout.branch_probability=1.0")
    flat = _train(tmp_path, "flat", "--config.actor.tree_training=false", *overrides, reward=HALF_CONSTANT_REWARD,
                  wrap=wrap)
    tree = _train(tmp_path, "tree", "--config.actor.tree_training=true", *overrides, reward=HALF_CONSTANT_REWARD,
                  wrap=wrap)
    _assert_same_training(flat, tree)
    for out in tree[0]:
        assert out["rollout/failed"] > 0 and out["tools/calls_per_trajectory/mean"] > 0
        assert out["rollout/branches_per_prompt"] > 0 and out["dynamic_sampling/extra_rounds"] >= 1


@pytest.mark.slow  # two trainers with a critic
def test_tree_training_with_a_critic_equals_flat(tmp_path):
    """PPO with a critic (GAE): its update on tree batches (a value per loss entry, from the heads) trains the critic
    and the policy to the flat run's parameters."""
    def run(name: str, tree: str):
        cfg = _config(tmp_path, "--config.algorithm.adv_estimator=gae", "--config.critic.lr=1e-3",
                      f"--config.actor.tree_training={tree}")
        tr = trainer_lib.Trainer(cfg, tmp_path / name, testing.trainer_devices())
        try:
            outs = [tr.train_step() for _ in range(2)]
            leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t))]
            return outs, leaves(tr.state.params), leaves(tr.critic.state.params)
        finally:
            tr.close()

    flat, tree = run("flat", "false"), run("tree", "true")
    for a, b in ((flat[1], tree[1]), (flat[2], tree[2])):  # the policy's, then the critic's params
        assert max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) <= 1e-5
    for f, t in zip(flat[0], tree[0], strict=True):
        for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm", "actor/pg_loss"):
            assert f[key] == pytest.approx(t[key], rel=1e-4, abs=1e-6), key
        assert t["critic/grad_norm"] > 0 and 0 < t["perf/tree_tokens_computed"] < t["perf/tree_tokens_flat"]


