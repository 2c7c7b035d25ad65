"""The critic: clipped value loss by hand, next-token alignment of values, learning, sharding, GAE with its values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arpo_jax import models, sharding
from arpo_jax.experience import advantages, packing
from arpo_jax.update import jit
from arpo_jax.update import value as critic

TINY = models.Config(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, sharding_rules="fsdp_tp")
SGD = optax.sgd(1.0)


@pytest.fixture(scope="module")
def tiny():
    """(graphdef, critic params from a random policy, with a random head so every param gets a gradient)."""
    _, policy_params = jit.split_model(models.init_model(TINY, seed=0))
    params = critic.value_params_from_policy(policy_params)
    head = params["value_head"]
    params["value_head"] = {"weight": 0.3 * jax.random.normal(jax.random.key(1), head["weight"].shape),
                            "bias": jnp.full((1,), 0.1)}
    return critic.value_graphdef(TINY), params


def _rollout(n=8, seed=0):
    """n random sequences with loss masks (prompt and a tool-result gap excluded), token-aligned returns."""
    rng = np.random.RandomState(seed)
    seqs, masks, returns = [], [], []
    for i in range(n):
        length = rng.randint(6, 24)
        seqs.append(rng.randint(3, TINY.vocab_size, length))
        m = (np.arange(length) >= rng.randint(2, 4)).astype(np.float32)
        m[length // 2:length // 2 + 2] = 0
        masks.append(m)
        returns.append(np.full(length, 1.0 if i % 2 else -1.0, np.float32))
    return seqs, masks, returns


def _batch(old_values=None, **pack_kw):
    seqs, masks, returns = _rollout()
    old_values = old_values or [np.zeros(len(s), np.float32) for s in seqs]
    kw = {"mini_batch_size": len(seqs), "row_len": 32, "rows_per_micro": 4} | pack_kw
    return packing.pack_batch(seqs, masks, np.zeros(len(seqs)), extra={"old_values": old_values, "returns": returns},
                              **kw)


def test_value_loss_hand_computed():
    # c = 0.5. Token 0 moved past the clip towards R: the clipped loss (0.5 - 1)^2 = 0.25 wins, gradient 0.
    # Token 1 inside the clip: (2 - 1)^2 = 1. Token 2: (0 - 3)^2 = 9. Token 3 moved away from R past the clip:
    # the unclipped (3 - 0)^2 = 9 wins (max is pessimistic). Token 4 is padding with garbage.
    v = jnp.array([[1.0, 2.0, 0.0, 3.0, jnp.nan]])
    old = jnp.array([[0.0, 1.8, 0.0, 0.0, jnp.nan]])
    ret = jnp.array([[1.0, 1.0, 3.0, 0.0, jnp.inf]])
    mask = jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]])
    token_mean = mask / mask.sum()  # the loss weights of token-mean over these four tokens
    loss, m = critic.value_loss(v, old, ret, token_mean, 0.5)
    np.testing.assert_allclose(float(loss), 0.5 * (0.25 + 1 + 9 + 9) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(m["vf_clipfrac"]), 0.25, rtol=1e-6)
    np.testing.assert_allclose(float(m["vpred_mean"]), 1.5, rtol=1e-6)
    grad = jax.grad(lambda x: critic.value_loss(x, old, ret, token_mean, 0.5)[0])(v)
    # d/dv 0.5 * (v - R)^2 / 4 = (v - R) / 4 where unclipped wins; 0 where the clipped (constant) term wins.
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.25, -0.75, 0.75, 0.0]], atol=1e-6)

    # Other weights: sum(w * max(L1, L2)) * 0.5 (the packed batch's normalised loss weights).
    w = jnp.array([[0.5, 0.25, 0.25, 0.0, 0.0]])
    loss_w, m_w = critic.value_loss(v, old, ret, w, 0.5)
    np.testing.assert_allclose(float(loss_w), 0.5 * (0.5 * 0.25 + 0.25 * 1 + 0.25 * 9), rtol=1e-6)
    np.testing.assert_allclose(float(m_w["vf_clipfrac"]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(m_w["vpred_mean"]), 0.5 * 1 + 0.25 * 2, rtol=1e-6)

    # Unclipped case (c large): plain 0.5 * mean squared error.
    loss_u, m_u = critic.value_loss(v, old, ret, token_mean, 100.0)
    np.testing.assert_allclose(float(loss_u), 0.5 * (0 + 1 + 9 + 9) / 4, rtol=1e-6)
    assert float(m_u["vf_clipfrac"]) == 0.0


def test_value_loss_reference_compat_drops_the_half(monkeypatch):
    """Fidelity 4c: the reference's verl has no 0.5 factor: loss and gradient exactly twice current verl's."""
    v = jnp.array([[1.0, 2.0, 0.0, 3.0]])
    old = jnp.array([[0.0, 1.8, 0.0, 0.0]])
    ret = jnp.array([[1.0, 1.0, 3.0, 0.0]])
    mask = jnp.ones((1, 4))
    loss_fn = lambda compat: lambda x: critic.value_loss(x, old, ret, mask / 4, 0.5, reference_compat=compat)[0]
    np.testing.assert_allclose(float(loss_fn(True)(v)), (0.25 + 1 + 9 + 9) / 4, rtol=1e-6)
    np.testing.assert_allclose(float(loss_fn(True)(v)), 2 * float(loss_fn(False)(v)), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss_fn(True))(v), 2 * jax.grad(loss_fn(False))(v), rtol=1e-6)
    # The step's micro-batch loss reads the flag from CriticConfig.
    monkeypatch.setattr(critic, "values_of", lambda graphdef, params, mb: v)  # the loss, not the model, is tested
    mb = {"loss_weight": mask * 0.25, "old_values": old, "returns": ret}
    micro = lambda compat: critic._micro_value_loss(None, None, mb, critic.CriticConfig(reference_compat=compat))[0]
    np.testing.assert_allclose(float(micro(True)), 2 * float(micro(False)), rtol=1e-6)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_values_are_next_token_aligned_and_layout_independent(tiny):
    """Token-aligned value j (after unpack) is V(tokens < j): the model's last-slot value on the prefix."""
    graphdef, params = tiny
    forward = critic.jit_value_forward(graphdef, TINY)
    packed, layout = _batch()
    padded, layout_p = _batch(pack=False)
    assert packed["input_ids"].shape[1] < padded["input_ids"].shape[1]  # fewer micro-batches: rows hold several
    vals = packing.unpack(layout, np.asarray(forward(params, packed)))
    vals_p = packing.unpack(layout_p, np.asarray(forward(params, padded)))
    seqs, _, _ = _rollout()
    for i in (0, 3):
        s = seqs[i]
        for j in (1, 4, len(s) - 1):
            prefix = jnp.asarray(s[None, :j])
            mb = {"input_ids": prefix, "positions": jnp.arange(j)[None], "segment_ids": jnp.ones((1, j), jnp.int32)}
            expected = float(critic.values_of(graphdef, params, mb)[0, -1])
            np.testing.assert_allclose(vals[i][j], expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(vals, vals_p):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # Padding slots are 0, so a packed [K, M, B, T] array of values is clean.
    v = np.asarray(forward(params, packed))
    assert np.all(v[packed["segment_ids"] == 0] == 0.0)


def test_value_model_backbone_is_the_policy(tiny):
    """Value = head(policy hidden states): the critic starts from the policy's weights, without lm_head."""
    graphdef, params = tiny
    _, policy_params = jit.split_model(models.init_model(TINY, seed=0))
    assert "lm_head" not in params and "lm_head" in policy_params
    policy = models.init_model(TINY, seed=0)
    ids = jnp.asarray(np.arange(12)[None] % TINY.vocab_size)
    pos, seg = jnp.arange(12)[None], jnp.ones((1, 12), jnp.int32)
    hidden = policy.hidden_states(ids, pos, segment_ids=seg)
    head = params["value_head"]
    expected = hidden @ head["weight"][0] + head["bias"][0]
    got = critic.values_of(graphdef, params, {"input_ids": ids, "positions": pos, "segment_ids": seg})
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    zero = critic.value_params_from_policy(policy_params)
    assert not np.any(np.asarray(critic.values_of(graphdef, zero, {"input_ids": ids, "positions": pos,
                                                                    "segment_ids": seg})))


def test_critic_regresses_toward_returns(tiny):
    graphdef, params = tiny
    cfg = critic.CriticConfig(lr=3e-3, cliprange_value=0.5)
    opt = critic.make_optimizer(cfg, 100)
    step = critic.jit_value_step(graphdef, TINY, cfg, opt)
    forward = critic.jit_value_forward(graphdef, TINY)
    state = jit.init_train_state(params, opt)
    batch, layout = _batch()
    losses = []
    for _ in range(25):
        # As PPO does every training step: the old values are the current critic's (the clip is relative to them).
        batch["old_values"] = np.asarray(forward(state.params, batch))
        mini = {k: v[0] for k, v in batch.items()}
        state, m = step(state, mini)
        losses.append(float(m["vf_loss"]))
        assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["grad_norm"]))
    assert losses[-1] < 0.1 * losses[0], losses
    vals = packing.unpack(layout, np.asarray(forward(state.params, batch)))
    _, masks, returns = _rollout()
    err = [np.abs(v - r)[1:][m[1:] > 0].mean() for v, r, m in zip(vals, returns, masks)]
    assert np.mean(err) < 0.3, err  # from |0 - (+-1)| = 1 at the start


def _grads(graphdef, params, batch, cfg, mesh=None):
    """(grads, metrics, old values) of one SGD(lr=1) step, unsharded or on ``mesh``."""
    shardings = None
    if mesh is not None:
        p_sh = critic.value_param_shardings(TINY, mesh)
        params = jax.device_put(params, p_sh)
        shardings = jit.state_shardings(SGD, p_sh, params, mesh)
    values = critic.jit_value_forward(graphdef, TINY, mesh)(params, batch)
    state = jit.init_train_state(params, SGD, shardings)
    new, metrics = critic.jit_value_step(graphdef, TINY, cfg, SGD, mesh, shardings)(state, {k: v[0] for k, v in
                                                                                          batch.items()})
    if mesh is not None:
        leaf = new.params["backbone"]["model"]["layers"]["mlp"]["up_proj"]["weight"]
        assert leaf.sharding == p_sh["backbone"]["model"]["layers"]["mlp"]["up_proj"]["weight"]
        assert not leaf.sharding.is_fully_replicated
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    return grads, {k: float(v) for k, v in metrics.items()}, np.asarray(values)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_sharded_value_step_equals_single_device(tiny, mesh_shape):
    graphdef, params = tiny
    cfg = critic.CriticConfig(cliprange_value=0.2)
    seqs, _, _ = _rollout()
    rng = np.random.RandomState(3)
    batch, _ = _batch(old_values=[0.3 * rng.randn(len(s)).astype(np.float32) for s in seqs], rows_per_micro=8)
    ref = _grads(graphdef, params, batch, cfg)
    got = _grads(graphdef, params, batch, cfg, sharding.make_mesh(mesh_shape))
    np.testing.assert_allclose(got[2], ref[2], atol=1e-5)  # old values of the whole rollout
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(ref[0])):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert 0 < ref[1]["vf_clipfrac"] < 1  # both loss branches are exercised
    for k in ref[1]:
        np.testing.assert_allclose(got[1][k], ref[1][k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_micro_batch_split_does_not_change_the_step(tiny):
    graphdef, params = tiny
    cfg = critic.CriticConfig()
    one, _ = _batch(rows_per_micro=8)
    many, _ = _batch(rows_per_micro=2)
    assert one["input_ids"].shape[1] == 1 and many["input_ids"].shape[1] > 1
    g1, m1, _ = _grads(graphdef, params, one, cfg)
    g2, m2, _ = _grads(graphdef, params, many, cfg)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 summation order
    for k in m1.keys() - {"micro_batches"}:  # the count depends on the split
        np.testing.assert_allclose(m1[k], m2[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_nonfinite_value_update_is_skipped(tiny):
    graphdef, params = tiny
    cfg = critic.CriticConfig(lr=1e-3)
    opt = critic.make_optimizer(cfg, 10)
    step = critic.jit_value_step(graphdef, TINY, cfg, opt)
    batch, _ = _batch()
    mini = {k: v[0] for k, v in batch.items()}
    state, _ = step(jit.init_train_state(params, opt), mini)
    before = jax.tree.map(np.asarray, state)
    bad = dict(mini, returns=np.where(mini["loss_weight"] > 0, np.nan, mini["returns"]).astype(np.float32))
    state, m = step(state, bad)
    assert float(m["skipped"]) == 1.0 and int(state.skipped) == 1 and int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state),
                    jax.tree.leaves(before.params) + jax.tree.leaves(before.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_gae_with_critic_values():
    # Hand example, gamma 0.9, lambda 0.8, reward 1 on the last response token, values [0.2, 0.5, 0.9]:
    # deltas: 0 + 0.9 * 0.5 - 0.2 = 0.25; 0 + 0.9 * 0.9 - 0.5 = 0.31; 1 + 0 - 0.9 = 0.1 (V past the end = 0).
    # A_2 = 0.1; A_1 = 0.31 + 0.72 * 0.1 = 0.382; A_0 = 0.25 + 0.72 * 0.382 = 0.52504; returns = A + V.
    values = jnp.array([[0.2, 0.5, 0.9]])
    rewards = jnp.array([[0.0, 0.0, 1.0]])
    mask = jnp.ones((1, 3))
    adv, ret = advantages.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    raw = np.array([0.52504, 0.382, 0.1])
    np.testing.assert_allclose(np.asarray(ret)[0], raw + [0.2, 0.5, 0.9], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adv)[0], (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8), rtol=1e-5)


def test_gae_flow_from_packed_critic_values(tiny):
    """Trainer flow: old values of the packed rollout -> unpack -> per-trajectory response -> GAE -> pack returns.

    Checked against a plain loop of verl's recursion on the same values.
    """
    graphdef, params = tiny
    seqs, masks, _ = _rollout()
    batch, layout = _batch()
    values = packing.unpack(layout, np.asarray(critic.jit_value_forward(graphdef, TINY)(params, batch)))
    starts = [int(np.argmax(m)) for m in masks]  # first response token
    r_len = max(len(s) - st for s, st in zip(seqs, starts))
    v_nr, r_nr, m_nr = (np.zeros((len(seqs), r_len), np.float32) for _ in range(3))
    for i, (s, st) in enumerate(zip(seqs, starts)):
        n = len(s) - st
        v_nr[i, :n], m_nr[i, :n] = values[i][st:], masks[i][st:]
        r_nr[i, n - 1] = float(i % 3 == 0)  # outcome reward on the last token
    gamma, lam = 0.95, 0.9
    adv, ret = advantages.gae_advantages(jnp.asarray(r_nr), jnp.asarray(v_nr), jnp.asarray(m_nr), gamma=gamma, lam=lam)
    expected = np.zeros_like(v_nr)
    for i in range(len(seqs)):
        last = 0.0
        for t in reversed(range(r_len)):
            nxt = v_nr[i, t + 1] if t + 1 < r_len else 0.0
            last = r_nr[i, t] + gamma * nxt - v_nr[i, t] + gamma * lam * last
            expected[i, t] = last
    np.testing.assert_allclose(np.asarray(ret), expected + v_nr, rtol=1e-5, atol=1e-6)
    # Returns back into the packed layout: the slot of token j-1 holds token j's return, next to its old value.
    tok_ret = [np.concatenate([np.zeros(st, np.float32), np.asarray(ret)[i, :len(s) - st]])
               for i, (s, st) in enumerate(zip(seqs, starts))]
    packed_ret = packing.place(layout, tok_ret)
    k, m, b, sl = layout.slots(0)
    np.testing.assert_allclose(packed_ret[k, m, b, sl.start + starts[0] - 1], np.asarray(ret)[0, 0], rtol=1e-6)
    assert np.isfinite(np.asarray(adv)).all()
