"""PPO with a critic (`algorithm.adv_estimator = gae`) inside the trainer, on the toy config (2 fake devices).

The packed path (one critic forward over the packed global batch, unpack, GAE per trajectory, whitening over the
step, repack) must equal a direct computation: the value model run on each trajectory alone, GAE as a Python loop
over its response, whitening over every model token of the step. Then the loop itself: critic metrics, the
warm-up (policy frozen, critic moving), critic checkpoints and resume.
"""

from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arpo_jax import testing
from arpo_jax.assemble import components
from arpo_jax.assemble.components import pack_config
from arpo_jax.config import args as args_lib
from arpo_jax.experience import advantages, global_batch, packing
from arpo_jax.experience import trajectories as experience
from arpo_jax.train import metrics
from arpo_jax.train import trainer as trainer_lib
from arpo_jax.update import value as critic_lib
from arpo_jax.weights.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''
GAMMA, LAM = 0.9, 0.8


def _config(tmp_path: Path, *overrides: str):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return args_lib.load_config([
        "--config=builtin:toy_cpu", "--config.algorithm.adv_estimator=gae",
        f"--config.algorithm.gamma={GAMMA}", f"--config.algorithm.lam={LAM}", f"--config.reward.custom_path={reward}",
        "--config.trainer.progress=false", "--config.trainer.loggers=('jsonl',)", "--config.rollout.workers=2",
        "--config.critic.lr=1e-3", *overrides])


def _gae_loop(rewards: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Unwhitened GAE of one response (values past its end are 0)."""
    adv, last = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(values) else 0.0
        last = rewards[t] + GAMMA * next_v - values[t] + GAMMA * LAM * last
        adv[t] = last
    return adv


@pytest.mark.slow  # a trainer and its rollouts
def test_gae_packed_equals_direct(tmp_path):
    # The flat layout's packing of GAE's arrays (tree batches: test_tree, test_trainer_tree's critic test).
    cfg = _config(tmp_path, "--config.trainer.max_steps=1", "--config.actor.tree_training=false")
    tr = trainer_lib.Trainer(cfg, tmp_path / "run", testing.trainer_devices())
    try:
        # A random value head, so the values (and their alignment) matter.
        head = tr.critic.state.params["value_head"]
        head["weight"] = jax.device_put(0.05 * jax.random.normal(jax.random.key(1), head["weight"].shape),
                                        head["weight"].sharding)
        head["bias"] = jax.device_put(jnp.full(head["bias"].shape, 0.3), head["bias"].sharding)
        trajs = {w: tr._reward(tr._rollout(ex, w), ex) for w, ex in
                 trainer_lib.batch_examples(tr.train_data, cfg.data, tr.position, tr.workers, tr.local_workers).items()}
        arrays = tr._advantages(trajs)
        layouts = tr.batches.layouts(trajs)
        packed = {w: global_batch.worker_batch(trajs[w], arrays[w], layouts[w], pack_config(cfg)) for w in trajs}

        model = critic_lib.ValueModel(tr.model_cfg, rngs=nnx.Rngs(0))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.device_get(tr.critic.state.params))
        nnx.update(model, state)
        expected_adv, expected_ret, expected_val, masks = [], [], [], []
        for t in trajs.values():
            for seq, p, lm, score in zip(t.sequences, t.prompt_lengths, t.loss_masks, t.scores):
                v_slots = np.asarray(model(jnp.asarray(seq)[None], jnp.arange(len(seq))[None],
                                           jnp.ones((1, len(seq)), jnp.int32)))[0]
                v_tok = np.concatenate([[0.0], v_slots[:-1]])  # value of token j is computed from tokens < j
                r = len(seq) - p
                rewards = np.zeros(r)
                rewards[-1] = score
                adv = _gae_loop(rewards, v_tok[p:])
                expected_adv.append(adv)
                expected_ret.append(adv + v_tok[p:])
                expected_val.append(v_tok)
                masks.append(lm[p:])
        flat_adv, flat_mask = np.concatenate(expected_adv), np.concatenate(masks).astype(bool)
        mean, std = flat_adv[flat_mask].mean(), flat_adv[flat_mask].std(ddof=1)

        i = 0
        for w, t in trajs.items():
            got = {k: packing.unpack(layouts[w], packed[w][k]) for k in ("advantages", "returns", "old_values")}
            for j, (p, lm) in enumerate(zip(t.prompt_lengths, t.loss_masks)):
                model_tokens = lm[p:].astype(bool)
                assert model_tokens.any()
                np.testing.assert_allclose(got["old_values"][j][1:], expected_val[i][1:], atol=2e-4)
                np.testing.assert_allclose(got["returns"][j][p:][model_tokens], expected_ret[i][model_tokens],
                                           atol=5e-4)
                np.testing.assert_allclose(got["advantages"][j][p:][model_tokens],
                                           ((expected_adv[i] - mean) / std)[model_tokens], atol=5e-4)
                i += 1
        # Not a degenerate case: the values differ across tokens and the advantages are not all equal.
        assert np.std(np.concatenate(expected_val)) > 1e-3 and np.std(flat_adv[flat_mask]) > 1e-3
    finally:
        tr.close()


@pytest.mark.slow  # three trainer runs, one resumed
def test_gae_loop_warmup_checkpoint_resume(tmp_path):
    workdir = tmp_path / "run"
    args = ("--config.critic.warmup_steps=1", "--config.trainer.save_freq=1", "--config.trainer.keep_checkpoints=3")
    summary = trainer_lib.train(_config(tmp_path, "--config.trainer.max_steps=2", *args), workdir,
                                testing.trainer_devices())
    assert summary["steps"] == 2
    records = [r for r in metrics.read_jsonl(workdir / "metrics.jsonl") if r.get("step")]
    by_step = {r["step"]: r for r in records}
    for step in (1, 2):
        assert np.isfinite(by_step[step]["critic/vf_loss"]) and by_step[step]["critic/skipped"] == 0
    assert "actor/pg_loss" not in by_step[1] and "actor/pg_loss" in by_step[2]  # warm-up: critic only

    with Checkpointer(workdir / "checkpoints", async_save=False) as ck:
        p0 = ck.restore(1)[0]
        p1 = ck.restore(2)[0]
    with Checkpointer(workdir / "critic_checkpoints", async_save=False) as ck:
        assert ck.all_steps() == [1, 2]
        head1 = ck.read_meta(1)["counters"]
    assert head1["updates"] == critic_updates(1)
    # The warm-up step left the policy at its initial weights; step 2 moved it.
    init = trainer_lib.Trainer(_config(tmp_path, "--config.trainer.max_steps=2", "--config.trainer.resume=false",
                                       "--config.trainer.async_save=false"),
                               tmp_path / "fresh", testing.trainer_devices())
    try:
        init_params = jax.device_get(init.state.params)
        # trainer.async_save=false reaches the critic's checkpoints too (orbax's option, read back).
        assert init.critic.ckpt._manager._options.enable_async_checkpointing is False
    finally:
        init.close()
    leaves = lambda t: jax.tree.leaves(t)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(p0), leaves(init_params))) == 0.0
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(p1), leaves(init_params))) > 0.0

    # Resume at step 2: the critic state comes back exactly.
    tr = trainer_lib.Trainer(_config(tmp_path, "--config.trainer.max_steps=3", *args), workdir,
                             testing.trainer_devices())
    try:
        assert tr.step == 2
        with Checkpointer(workdir / "critic_checkpoints", async_save=False) as ck:
            saved = ck.restore(2, params_target=jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tr.critic.state.params))[0]
        for a, b in zip(leaves(saved), leaves(jax.device_get(tr.critic.state.params))):
            np.testing.assert_array_equal(np.asarray(a), b)
        assert int(tr.critic.state.step) == critic_updates(2)
    finally:
        tr.close()


def critic_updates(steps: int) -> int:
    """Critic optimizer steps after `steps` training steps of the toy config (batch 4 / mini-batch 2, 1 epoch)."""
    return steps * 2



def test_seq_mean_token_sum_norm_divides_by_the_configured_response_length(tmp_path):
    """Fidelity 4d: the reference divides by its padded response length (data.max_response_length), a constant; the
    trainer used the longest response of the batch, so the divisor changed from batch to batch."""
    cfg = _config(tmp_path, "--config.algorithm.adv_estimator=grpo", "--config.actor.agg_mode=seq-mean-token-sum-norm",
                  "--config.rollout.n=2", "--config.actor.ppo_mini_batch_size=2")
    seqs = [np.arange(3, 3 + n, dtype=np.int32) for n in (9, 7, 12, 6)]
    masks = [(np.arange(len(s)) >= 4).astype(np.int32) for s in seqs]  # 4 prompt tokens each
    out = SimpleNamespace(failed=np.array([""] * 4, dtype=object))  # what the packing reads of the rollout
    traj = experience.Trajectories(seqs, np.full(4, 4), masks, np.array([0.0, 1.0, 1.0, 0.5], np.float32),
                                   np.array([0, 0, 1, 1]), [], [], out, [np.zeros(len(s)) for s in seqs])
    layout = global_batch.layout(traj, pack_config(cfg), mini_prompts=2, rows=2, row_len=32)
    adv = advantages.outcome_advantages(traj, cfg.algorithm.adv_estimator)
    batch = global_batch.worker_batch(traj, {"advantages": adv}, layout, pack_config(cfg))
    r = cfg.data.max_response_length
    assert r > 8  # longer than every response here: the old divisor (8) differs
    for w, m in zip(packing.unpack(layout, batch["loss_weight"]), masks):
        np.testing.assert_allclose(w[1:], m[1:] / r, rtol=1e-6)


def test_rollout_correction_defaults_by_engine(tmp_path):
    """auto: token TIS with C = 2 for vLLM, off for the JAX engine (the trainer's own model code) and for vLLM at a
    temperature other than 1 (its log-probs are temperature 1's); an explicit mode is kept."""
    def resolved(*overrides):
        return components.update_config(_config(tmp_path, "--config.algorithm.adv_estimator=grpo", *overrides))

    vllm = resolved("--config.rollout.engine=vllm")
    assert (vllm.rollout_correction, vllm.rollout_correction_level, vllm.rollout_correction_threshold) == (
        "truncate", "token", 2.0)
    assert resolved().rollout_correction == "off"
    assert resolved("--config.rollout.engine=vllm", "--config.rollout.temperature=0.7").rollout_correction == "off"
    # Off-policy rollouts (rollout.max_staleness > 0): on for the JAX engine too, still off where vLLM's log-probs
    # are not the sampling distribution's.
    assert resolved("--config.rollout.max_staleness=1").rollout_correction == "truncate"
    assert resolved("--config.rollout.engine=vllm", "--config.rollout.temperature=0.7",
                    "--config.rollout.max_staleness=1").rollout_correction == "off"
    explicit = resolved("--config.actor.rollout_correction.mode=mask",
                        "--config.actor.rollout_correction.level=sequence",
                        "--config.actor.rollout_correction.threshold=3.0")
    assert (explicit.rollout_correction, explicit.rollout_correction_level,
            explicit.rollout_correction_threshold) == ("mask", "sequence", 3.0)
