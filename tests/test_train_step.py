"""The policy-update step: invariances (micro-batch split, packing, sharding), skipped updates, learning, B2, AdamW.

Gradients are compared through a plain SGD(lr=1) optimizer (new params = params - grads), because AdamW's first
step is ~lr * sign(g) and would hide gradient errors. The full AdamW step is compared across meshes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import arpo_jax
from arpo_jax import sharding, testing
from arpo_jax.experience import packing
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts

SGD = optax.sgd(1.0)


def _rollout(n=12, seed=0, vocab=512):
    """n random trajectories: prompt (no loss), response with a tool-result gap (no loss), per-sequence advantage."""
    rng = np.random.RandomState(seed)
    seqs, masks = [], []
    for _ in range(n):
        length = rng.randint(8, 40)
        seqs.append(rng.randint(3, vocab, length))
        m = (np.arange(length) >= rng.randint(2, 6)).astype(np.float32)
        gap = rng.randint(0, length)
        m[gap:gap + 3] = 0  # tool result tokens carry no loss
        masks.append(m)
    return seqs, masks, rng.randn(n).astype(np.float32)


_FORWARDS = {}


def _forward(graphdef, model_cfg):
    """One jitted forward per model for the whole module (each new jit would recompile)."""
    return _FORWARDS.setdefault((graphdef, model_cfg), ts.jit_forward_logprobs(graphdef, model_cfg))


def _batch(graphdef, params, model_cfg, *, seed=0, n=12, kl=False, **pack_kw):
    """Packed [K, M, B, T] batch with old (and ref) log-probs from the current policy, slightly perturbed.

    The perturbations are drawn per sequence, token-aligned, so every layout of the same rollout gets the same values.
    """
    seqs, masks, adv = _rollout(n, seed)
    kw = {"mini_batch_size": n, "row_len": 64, "rows_per_micro": 2} | pack_kw
    batch, layout = packing.pack_batch(seqs, masks, adv, **kw)
    logp = packing.unpack(layout, _forward(graphdef, model_cfg)(params, batch)[0])
    rng = np.random.RandomState(seed + 1)
    # Perturb old log-probs so ratios leave [0.8, 1.2] for some tokens and both clip branches are exercised.
    batch["old_logp"] = packing.place(layout, [lp + 0.3 * rng.randn(len(lp)) for lp in logp])
    if kl:
        batch["ref_logp"] = packing.place(layout, [lp + 0.1 * rng.randn(len(lp)) for lp in logp])
    return batch, layout


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    path, torch_model = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    graphdef, params = jit.split_model(model)
    return path, torch_model, model.config, graphdef, params


def _sgd_grads(tiny, batch, cfg):
    """(grads, metrics) of one mini-batch [M, B, T] through the jitted step with SGD(lr=1)."""
    _, _, model_cfg, graphdef, params = tiny
    state = jit.init_train_state(params, SGD)
    new, metrics = ts.jit_train_step(graphdef, model_cfg, cfg, SGD)(state, batch)
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    return grads, {k: float(v) for k, v in metrics.items()}


def _assert_trees_close(a, b, atol, rtol=1e-4):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                   jax.tree.leaves(b)))


def test_forward_logprobs_of_packed_rows_match_transformers(tiny):
    _, torch_model, model_cfg, graphdef, params = tiny
    seqs, masks, adv = _rollout()
    batch, layout = packing.pack_batch(seqs, masks, adv, mini_batch_size=5, row_len=64, rows_per_micro=2)
    assert layout.shape[0] == 3 and (batch["segment_ids"].max(-1) > 1).any()  # several sequences share a row
    logp, ent = _forward(graphdef, model_cfg)(params, batch)
    for s, lp, h in zip(seqs, packing.unpack(layout, logp), packing.unpack(layout, ent)):
        with torch.no_grad():
            ref = torch.log_softmax(torch_model(torch.tensor(s[None])).logits[0].double(), -1)
        expected_lp = ref[torch.arange(len(s) - 1), torch.tensor(s[1:])].numpy()
        expected_h = -(ref.exp() * ref).sum(-1).numpy()[:-1]
        np.testing.assert_allclose(lp[1:], expected_lp, atol=2e-4)
        np.testing.assert_allclose(h[1:], expected_h, atol=2e-4)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_micro_batch_split_invariance(tiny):
    """Default normalisation: 1 or 4 rows per micro-batch give the same loss and gradients; 'reference' does not."""
    _, _, model_cfg, graphdef, params = tiny
    cfg = ts.UpdateConfig(loss="aepo", kl_coef=0.1, entropy_coef=0.01, entropy_adv=True)
    results = {}
    for rows in (1, 4):
        for norm in ("global_token_mean", "reference"):
            batch, layout = _batch(graphdef, params, model_cfg, kl=True, rows_per_micro=rows, micro_norm=norm)
            assert layout.shape[1] > 1
            results[rows, norm] = _sgd_grads(tiny, {k: v[0] for k, v in batch.items()},
                                             ts.UpdateConfig(**{**cfg.__dict__, "micro_norm": norm}))
    g1, m1 = results[1, "global_token_mean"]
    g4, m4 = results[4, "global_token_mean"]
    _assert_trees_close(g4, g1, atol=1e-6)
    for k in m1.keys() - {"micro_batches"}:  # the count depends on the split
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # verl's per-micro-batch weighting depends on the split: the test above can tell the difference.
    assert _max_diff(results[1, "reference"][0], results[4, "reference"][0]) > 1e-4


@pytest.mark.slow  # > 10 s (compile-bound)
def test_packed_equals_padded(tiny):
    _, _, model_cfg, graphdef, params = tiny
    cfg = ts.UpdateConfig(kl_coef=0.05, entropy_adv=True)
    packed, lp = _batch(graphdef, params, model_cfg, kl=True, pack=True, rows_per_micro=2)
    padded, ld = _batch(graphdef, params, model_cfg, kl=True, pack=False, rows_per_micro=4)
    assert lp.shape[1] * lp.shape[2] < ld.shape[1] * ld.shape[2]  # packing used fewer rows
    g_packed, m_packed = _sgd_grads(tiny, {k: v[0] for k, v in packed.items()}, cfg)
    g_padded, m_padded = _sgd_grads(tiny, {k: v[0] for k, v in padded.items()}, cfg)
    _assert_trees_close(g_packed, g_padded, atol=1e-6)
    for k in m_packed.keys() - {"micro_batches"}:  # the count depends on the layout
        np.testing.assert_allclose(m_packed[k], m_padded[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1)])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_sharded_step_equals_single_device(tiny, mesh_shape):
    path, _, model_cfg, graphdef, params = tiny
    # lr 1e-5: Adam's first step is lr * g / (|g| + eps), ill-conditioned where |g| ~ eps = 1e-8 (a few such
    # elements move by up to ~0.1 lr between summation orders); every other element moves by ~lr, 3x the tolerance.
    cfg = ts.UpdateConfig(loss="aepo", kl_coef=0.1, entropy_coef=0.01, entropy_adv=True, lr=1e-5)
    opt = ts.make_optimizer(cfg, 10)
    batch, _ = _batch(graphdef, params, model_cfg, kl=True, rows_per_micro=8)
    mini = {k: v[0] for k, v in batch.items()}
    ref_state, ref_metrics = ts.jit_train_step(graphdef, model_cfg, cfg, opt)(jit.init_train_state(params, opt), mini)

    mesh = sharding.make_mesh(mesh_shape)
    sharded_model = arpo_jax.from_pretrained(path, mesh=mesh)
    _, sharded_params = jit.split_model(sharded_model)
    p_sh = jit.param_shardings(model_cfg, mesh)
    shardings = jit.state_shardings(opt, p_sh, sharded_params, mesh)
    state = jit.init_train_state(sharded_params, opt, shardings)
    mu = state.opt_state[1][0].mu["model"]["layers"]["mlp"]["up_proj"]["weight"]
    assert mu.sharding == p_sh["model"]["layers"]["mlp"]["up_proj"]["weight"] and not mu.sharding.is_fully_replicated
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt, mesh, shardings)
    new_state, metrics = step(state, mini)
    assert new_state.params["lm_head"]["weight"].sharding == p_sh["lm_head"]["weight"]
    _assert_trees_close(new_state.params, ref_state.params, atol=3e-6, rtol=0)
    _assert_trees_close(new_state.opt_state, ref_state.opt_state, atol=1e-8, rtol=1e-3)  # moments: the gradients
    for k in ref_metrics:
        np.testing.assert_allclose(float(metrics[k]), float(ref_metrics[k]), rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow  # > 10 s (compile-bound)
@pytest.mark.parametrize("micro_norm", ["global_token_mean", "reference"])
def test_hsdp_groups_sum_their_gradients_once_a_step(tiny, micro_norm):
    """On a (data, fsdp) mesh each data group sums its rows' gradients over all micro-batches, and the groups' sums
    meet once after the loop: the gradients and metrics equal one device's, and nothing of the gradients crosses
    `data` (the hosts, 2 devices each here) inside the micro-batch loop. Entropy-aware advantages from a micro-batch's
    own statistics couple its rows ("reference"): that case reduces per micro-batch, as before, and still agrees."""
    from arpo_jax.plan import collectives
    from arpo_jax.update import accumulate

    path, _, model_cfg, graphdef, params = tiny
    cfg = ts.UpdateConfig(loss="aepo", kl_coef=0.1, entropy_coef=0.01, entropy_adv=True, micro_norm=micro_norm)
    batch, layout = _batch(graphdef, params, model_cfg, kl=True, n=24, rows_per_micro=4,
                           micro_norm=micro_norm)
    assert layout.shape[1] >= 3  # micro-batches
    mini = {k: v[0] for k, v in batch.items()}
    ref_grads, ref_metrics = _sgd_grads(tiny, mini, cfg)

    mesh = sharding.make_mesh((2, 2, 1), devices=jax.devices()[:4])
    _, sharded_params = jit.split_model(arpo_jax.from_pretrained(path, mesh=mesh))
    shardings = jit.state_shardings(SGD, jit.param_shardings(model_cfg, mesh), sharded_params, mesh)
    step = ts.jit_train_step(graphdef, model_cfg, cfg, SGD, mesh, shardings)
    new, metrics = step(jit.init_train_state(sharded_params, SGD, shardings), mini)
    grads = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params, new.params)
    _assert_trees_close(grads, ref_grads, atol=1e-6)
    for k in ref_metrics:
        np.testing.assert_allclose(float(metrics[k]), ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)

    _, hlo = collectives.compile_partitioned(step.lower(jit.init_train_state(sharded_params, SGD, shardings), mini))
    items, _ = collectives.collectives(hlo, per_host=2)
    in_loop = [accumulate.MICRO_BATCH_SCOPE in c.op.split("/") for c in items]
    across = lambda inside: sum(c.bytes_per_device for c, i in zip(items, in_loop) if c.crosses_hosts and i == inside)
    in_loop, after = across(True), across(False)
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params)) / 2  # float32, split over fsdp=2
    if micro_norm == "global_token_mean":
        assert in_loop < 64 * layout.shape[1]  # a few flags a micro-batch (is there any loss weight?)
        assert after == pytest.approx(grad_bytes, rel=0.05)  # one all-reduce over 2: 2 * (1/2) * bytes
    else:
        assert in_loop > grad_bytes  # every micro-batch's gradient crosses


def test_nonfinite_update_is_skipped_and_counted(tiny):
    _, _, model_cfg, graphdef, params = tiny
    cfg = ts.UpdateConfig(lr=1e-3)
    opt = ts.make_optimizer(cfg, 10)
    batch, _ = _batch(graphdef, params, model_cfg)
    mini = {k: v[0] for k, v in batch.items()}
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt)
    state = jit.init_train_state(params, opt)
    state, _ = step(state, mini)  # one good step so the optimizer state is not all zeros
    before = jax.tree.map(np.asarray, state)
    bad = dict(mini, advantages=np.where(mini["loss_weight"] > 0, np.nan, mini["advantages"]).astype(np.float32))
    state, metrics = step(state, bad)
    assert float(metrics["skipped"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
    assert int(state.step) == 2 and int(state.skipped) == 1
    _assert_trees_close(state.params, before.params, atol=0, rtol=0)
    _assert_trees_close(state.opt_state, before.opt_state, atol=0, rtol=0)
    state, metrics = step(state, mini)
    assert float(metrics["skipped"]) == 0.0 and int(state.skipped) == 1
    assert _max_diff(state.params, before.params) > 0


@pytest.mark.slow  # > 10 s (compile-bound)
def test_twenty_steps_raise_positive_and_lower_negative_logprobs(tiny):
    """Fixed synthetic advantages (+1 / -1 per sequence), on-policy old log-probs each step, AdamW lr 1e-3."""
    _, _, model_cfg, graphdef, params = tiny
    seqs, masks, _ = _rollout(8, seed=3)
    adv = np.array([1.0, -1.0] * 4, np.float32)
    batch, layout = packing.pack_batch(seqs, masks, adv, mini_batch_size=8, row_len=64, rows_per_micro=2)
    cfg = ts.UpdateConfig(lr=1e-3)
    opt = ts.make_optimizer(cfg, 20)
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt)
    fwd = _forward(graphdef, model_cfg)
    state = jit.init_train_state(params, opt)

    def mean_logp(p):
        per_seq = packing.unpack(layout, fwd(p, batch)[0])
        return np.array([lp[1:][m[1:] > 0].mean() for lp, m in zip(per_seq, masks)])

    start = mean_logp(state.params)
    for _ in range(20):
        batch["old_logp"] = np.asarray(fwd(state.params, batch)[0])
        state, metrics = step(state, {k: v[0] for k, v in batch.items()})
        assert float(metrics["skipped"]) == 0.0
    delta = mean_logp(state.params) - start
    assert (delta[adv > 0] > 0.05).all(), delta
    assert (delta[adv < 0] < -0.05).all(), delta


@pytest.mark.slow  # > 10 s (compile-bound)
def test_reference_compat_reproduces_b2_noop(tiny):
    _, _, model_cfg, graphdef, params = tiny
    batch, _ = _batch(graphdef, params, model_cfg, seed=5)
    mini = {k: v[0] for k, v in batch.items()}
    plain, _ = _sgd_grads(tiny, mini, ts.UpdateConfig(loss="aepo"))
    compat, _ = _sgd_grads(tiny, mini, ts.UpdateConfig(loss="aepo", entropy_adv=True, reference_compat=True))
    fixed, _ = _sgd_grads(tiny, mini, ts.UpdateConfig(loss="aepo", entropy_adv=True))
    assert not ts.UpdateConfig(entropy_adv=True, reference_compat=True).uses_entropy_adv
    assert ts.UpdateConfig(entropy_adv=True, reference_compat=True, entropy_coef=1e-3).uses_entropy_adv
    testing.assert_equal_on_cpu(compat, plain)  # the reference's silent no-op
    assert _max_diff(fixed, plain) > 1e-4  # computing entropy (the default) makes the advantage reshaping act


@pytest.mark.slow  # > 10 s (compile-bound)
def test_reference_micro_norm_uses_micro_batch_entropy_statistics(tiny):
    """With one micro-batch the reference and default modes agree; entropy stats then pool the same tokens."""
    _, _, model_cfg, graphdef, params = tiny
    batch, _ = _batch(graphdef, params, model_cfg, rows_per_micro=8)
    assert batch["input_ids"].shape[1] == 1
    mini = {k: v[0] for k, v in batch.items()}
    ref_batch, _ = _batch(graphdef, params, model_cfg, rows_per_micro=8, micro_norm="reference")
    g_default, _ = _sgd_grads(tiny, mini, ts.UpdateConfig(entropy_adv=True))
    g_ref, _ = _sgd_grads(tiny, {k: v[0] for k, v in ref_batch.items()},
                          ts.UpdateConfig(entropy_adv=True, micro_norm="reference"))
    _assert_trees_close(g_default, g_ref, atol=1e-6)


def _with_rollout_logp(batch, layout, shifts):
    """The batch plus rollout_logp = old_logp - shift (token-aligned shifts per sequence; NaN: no engine log-prob)."""
    old = packing.unpack(layout, batch["old_logp"])
    return batch | {"rollout_logp": packing.place(layout, [o - sh for o, sh in zip(old, shifts)])}


@pytest.mark.slow  # > 10 s (compile-bound)
def test_rollout_correction_truncate_weights_the_token_losses(tiny):
    """TIS in the step: rho = pi_old / pi_rollout per token, loss x min(rho, 2); with no KL/entropy terms that is the
    step on advantages x min(rho, 2). rollout_logp == old_logp (or NaN: none reported) changes nothing."""
    _, _, model_cfg, graphdef, params = tiny
    batch, layout = _batch(graphdef, params, model_cfg, seed=7)
    seqs, masks, adv = _rollout(12, 7)
    rng = np.random.RandomState(3)
    log_rho = [rng.choice([0.0, np.log(1.5), np.log(3.0), np.log(0.3)], size=len(s)) for s in seqs]
    cfg = ts.UpdateConfig(rollout_correction="truncate")
    mini = lambda b: {k: v[0] for k, v in b.items()}
    got, m = _sgd_grads(tiny, mini(_with_rollout_logp(batch, layout, log_rho)), cfg)
    scaled = [a * np.minimum(np.exp(r), 2.0) for a, r in zip(adv, log_rho)]
    expected, _ = _sgd_grads(tiny, mini(batch | {"advantages": packing.place(layout, scaled)}), ts.UpdateConfig())
    _assert_trees_close(got, expected, atol=1e-6)
    loss_rho = np.concatenate([r[1:][mk[1:] > 0] for r, mk in zip(log_rho, masks)])
    np.testing.assert_allclose(m["rollout_corr/truncated_fraction"], np.mean(loss_rho > np.log(2.0)), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/abs_logp_diff_max"], -np.log(0.3), rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/kl"], -loss_rho.mean(), rtol=1e-4, atol=1e-6)

    plain, _ = _sgd_grads(tiny, mini(batch), ts.UpdateConfig())
    same, m0 = _sgd_grads(tiny, mini(_with_rollout_logp(batch, layout, [np.zeros(len(s)) for s in seqs])), cfg)
    _assert_trees_close(same, plain, atol=0, rtol=0)
    assert m0["rollout_corr/abs_logp_diff_max"] == 0 and m0["rollout_corr/tokens"] == sum(m[1:].sum() for m in masks)
    none, m_nan = _sgd_grads(tiny, mini(_with_rollout_logp(batch, layout, [np.full(len(s), np.nan) for s in seqs])),
                             cfg)
    _assert_trees_close(none, plain, atol=0, rtol=0)
    assert m_nan["rollout_corr/tokens"] == 0


@pytest.mark.slow  # > 10 s (compile-bound)
def test_rollout_correction_mask_drops_tokens_from_the_token_mean(tiny):
    """Rejection in the step: tokens with rho outside [1/2, 2] leave the loss and its token-mean normaliser, exactly as
    if their loss mask had been 0."""
    _, _, model_cfg, graphdef, params = tiny
    batch, layout = _batch(graphdef, params, model_cfg, seed=8)
    seqs, masks, adv = _rollout(12, 8)
    rng = np.random.RandomState(4)
    rejected = [rng.rand(len(s)) < 0.2 for s in seqs]
    log_rho = [np.where(r, np.log(4.0), 0.5 * np.log(2.0) * rng.uniform(-1, 1, len(r))) for r in rejected]
    got, m = _sgd_grads(tiny, {k: v[0] for k, v in _with_rollout_logp(batch, layout, log_rho).items()},
                        ts.UpdateConfig(rollout_correction="mask"))
    kept_masks = [mk * ~r for mk, r in zip(masks, rejected)]
    kept_batch, _ = packing.pack_batch(seqs, kept_masks, adv, mini_batch_size=12, row_len=64, rows_per_micro=2)
    expected, _ = _sgd_grads(tiny, {k: v[0] for k, v in (batch | {"loss_weight": kept_batch["loss_weight"]}).items()},
                             ts.UpdateConfig())
    _assert_trees_close(got, expected, atol=1e-6)
    n_loss = sum(mk[1:].sum() for mk in masks)
    n_rejected = sum((mk[1:] > 0)[r[1:]].sum() for mk, r in zip(masks, rejected))
    np.testing.assert_allclose(m["rollout_corr/masked_fraction"], n_rejected / n_loss, rtol=1e-5)
    assert 0 < n_rejected < n_loss


@pytest.mark.parametrize("value", [0.7, 2.3456789, 6.9077554])
def test_pooled_entropy_stats_of_equal_entropies_give_divisor_one(monkeypatch, value):
    """Fidelity 4f for the mini-batch pooled statistics (Chan's combination over micro-batches): equal entropies
    give the mean itself and the divisor 1 (std 0), not float32 noise."""
    rng = np.random.RandomState(0)
    weights = rng.rand(3, 4, 29) * (rng.rand(3, 4, 29) < 0.7)  # [M, B, T] loss weights, some tokens without loss
    monkeypatch.setattr(ts, "token_logprobs", lambda g, p, mb, **kw: (jnp.zeros(mb["loss_weight"].shape),
                                                                       jnp.full(mb["loss_weight"].shape, value)))
    mean, divisor = ts._entropy_stats(None, None, {"loss_weight": jnp.asarray(weights, jnp.float32)},
                                      ts.UpdateConfig(entropy_adv=True))
    assert float(divisor) == 1.0 and abs(float(mean) - value) <= 1e-6 * value


def test_adamw_schedules_and_first_step():
    const = ts.make_schedule(ts.UpdateConfig(lr=1e-3, warmup_steps=4), 100)
    np.testing.assert_allclose([float(const(s)) for s in (0, 1, 2, 4, 50)], [0, 2.5e-4, 5e-4, 1e-3, 1e-3], rtol=1e-6)
    cos = ts.make_schedule(ts.UpdateConfig(lr=1e-3, schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), 110)
    # After warmup: min + (lr - min) * 0.5 * (1 + cos(pi * progress)), progress over the 100 decay steps.
    np.testing.assert_allclose([float(cos(s)) for s in (5, 10, 60, 110)], [5e-4, 1e-3, 5.5e-4, 1e-4], rtol=1e-5)
    assert float(ts.make_schedule(ts.UpdateConfig(lr=2e-6), 10)(7)) == pytest.approx(2e-6)

    # One step by hand: the gradient (3, 4) has norm 5 -> clipped to (0.6, 0.8); Adam's first step is g/|g|;
    # decoupled weight decay adds lr * wd * p.
    cfg = ts.UpdateConfig(lr=0.1, weight_decay=0.01)
    opt = ts.make_optimizer(cfg, 10)
    p = {"w": jnp.array([1.0, -2.0])}
    updates, _ = opt.update({"w": jnp.array([3.0, 4.0])}, opt.init(p), p)
    expected = -0.1 * (np.array([0.6, 0.8]) / (np.array([0.6, 0.8]) + 1e-8) + 0.01 * np.array([1.0, -2.0]))
    # rtol: 1 - 0.999 in float32 (the bias correction of v) is off by 1.3e-5 relative, halved by the sqrt.
    np.testing.assert_allclose(np.asarray(updates["w"]), expected, rtol=2e-5)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_on_policy_the_updates_own_logprobs_are_the_old_ones(tiny):
    """actor.recompute_old_logprob=false: the micro-batch's own log-probs (gradient stopped) as the old ones give the
    step that old log-probs from a forward pass at the same params give (ratio 1), with no old_logp in the batch."""
    _, _, model_cfg, graphdef, params = tiny
    batch, _ = _batch(graphdef, params, model_cfg)
    perturbed = {k: v[0] for k, v in batch.items()}
    exact = perturbed | {"old_logp": _forward(graphdef, model_cfg)(params, batch)[0][0]}
    cfg = ts.UpdateConfig(loss="aepo", entropy_coef=0.01)
    g_exact, m_exact = _sgd_grads(tiny, exact, cfg)
    reuse = dataclasses.replace(cfg, recompute_old_logprob=False)
    g_reuse, m_reuse = _sgd_grads(tiny, {k: v for k, v in exact.items() if k != "old_logp"}, reuse)
    _assert_trees_close(g_reuse, g_exact, atol=1e-6)
    for k in ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl"):
        np.testing.assert_allclose(m_reuse[k], m_exact[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # Old log-probs off the current params (here perturbed) give another step: the comparison above can fail.
    assert _max_diff(_sgd_grads(tiny, perturbed, cfg)[0], g_exact) > 1e-4


def test_update_config_validates():
    with pytest.raises(ValueError, match="loss="):
        ts.UpdateConfig(loss="grpo")
    with pytest.raises(ValueError, match="micro_norm="):
        ts.UpdateConfig(micro_norm="sum")
    with pytest.raises(ValueError, match="clip_c"):
        ts.UpdateConfig(clip_c=1.0)
    assert hash(ts.UpdateConfig()) == hash(ts.UpdateConfig())


@pytest.mark.slow  # > 10 s (compile-bound)
def test_empty_padding_micro_batches_are_skipped(tiny):
    """A micro-batch without loss weight (padding to the largest micro-batch count) is not computed: the update and
    its metrics equal those of the mini-batch without it, and `micro_batches` counts only the computed ones. The
    padding carries NaN advantages and old log-probs as a probe: computing its loss would give 0 * NaN = NaN, and
    the update would be skipped as non-finite."""
    _, _, model_cfg, graphdef, params = tiny
    cfg = ts.UpdateConfig(kl_coef=0.05)
    batch, layout = _batch(graphdef, params, model_cfg, kl=True)
    mini = {k: v[0] for k, v in batch.items()}
    m = layout.shape[1]
    pad = {k: np.concatenate([v, np.zeros_like(v[:1])]) for k, v in mini.items()}
    for key in ("advantages", "old_logp", "ref_logp"):
        pad[key][m] = np.nan
    g_ref, m_ref = _sgd_grads(tiny, mini, cfg)
    g_pad, m_pad = _sgd_grads(tiny, pad, cfg)
    assert m_ref["micro_batches"] == m and m_pad["micro_batches"] == m and m_pad["skipped"] == 0.0
    _assert_trees_close(g_pad, g_ref, atol=0, rtol=0)
    for k in m_ref:
        np.testing.assert_allclose(m_pad[k], m_ref[k], rtol=0, atol=0, err_msg=k)


def test_offloaded_reference_keeps_the_params_shardings_in_pinned_host_memory(tiny):
    """`model.ref_on_host` with a KL loss (`actor.kl_coef` > 0; the 7B/8B configs set ref_on_host): the reference is
    a copy of the starting params in pinned host memory with their shardings, on 8 fake devices here, put back on
    the devices for each log-prob pass. Its log-probs are the starting policy's after the policy has moved on, and
    equal an on-device reference's. (Before, a host numpy tree: uploaded whole and unsharded at every call, and on
    several processes not made at all: tests/test_multihost.py runs that case.)"""
    from arpo_jax.config import args
    from arpo_jax.train import trainer

    path, _, model_cfg, graphdef, _ = tiny
    mesh = sharding.make_mesh((1, 4, 2))
    _, params = jit.split_model(arpo_jax.from_pretrained(path, mesh=mesh))
    fn = ts.jit_forward_logprobs(graphdef, model_cfg, mesh=mesh)
    batch, _ = _batch(graphdef, params, model_cfg, rows_per_micro=4)
    mini = {k: v[0, 0] for k, v in batch.items()}  # one micro-batch [B, T], B over the 4 fsdp devices
    start = np.asarray(fn(params, mini)[0])

    host, on_device = trainer.offload(params)
    for h, p, s in zip(jax.tree.leaves(host), jax.tree.leaves(params), jax.tree.leaves(on_device)):
        assert h.sharding.memory_kind == "pinned_host" and s.memory_kind == "device"
        assert h.sharding.spec == p.sharding.spec and h.sharding.mesh == mesh
    moved = jax.tree.map(lambda x: x * 1.5, params)  # the policy after some updates
    assert not np.allclose(np.asarray(fn(moved, mini)[0]), start)
    for on_host in (True, False):
        cfg = args.load_config(["--config=builtin:toy_cpu", "--config.actor.kl_coef=0.1",
                                f"--config.model.ref_on_host={on_host}"])
        ref = trainer.reference_logprobs(params, cfg, model_cfg, fn, 1.0, mesh)
        # Where the copy lives (the log-probs alone are the same either way).
        assert {x.sharding.memory_kind for x in jax.tree.leaves(ref.ref)} == {"pinned_host" if on_host else "device"}
        np.testing.assert_array_equal(np.asarray(ref(moved, mini)), start)
