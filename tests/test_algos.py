"""Tests for arpo_jax.update.algos: hand-computed values, invariances, reference re-implementations, AEPO gradients.

Reference formulas are re-implemented independently here (numpy loops written like verl's, and PyTorch for the
losses, since the reference is PyTorch) rather than imported from the module under test.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax.experience import advantages
from arpo_jax.update import algos, logprobs

EPS_L = EPS_H = 0.2
CLIP_C = 3.0


def _np(x):
    return np.asarray(x, dtype=np.float64)


# ------------------------------------------------------------------------------------------------
# Independent reference implementations (written like verl 0.3.1, loops and dicts)
# ------------------------------------------------------------------------------------------------


def _ref_groups(scores, ids):
    groups = {}
    for s, i in zip(scores, ids):
        groups.setdefault(int(i), []).append(float(s))
    return groups


def ref_grpo(scores, ids, norm_by_std=True, eps=1e-6):
    groups = _ref_groups(scores, ids)
    out = []
    for s, i in zip(scores, ids):
        g = groups[int(i)]
        mean, std = (0.0, 1.0) if len(g) == 1 else (np.mean(g), np.std(g, ddof=1))
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return np.array(out)


def ref_rloo(scores, ids):
    groups = _ref_groups(scores, ids)
    out = []
    for s, i in zip(scores, ids):
        g = groups[int(i)]
        n = len(g)
        out.append(s if n == 1 else s * n / (n - 1) - np.mean(g) * n / (n - 1))
    return np.array(out)


def ref_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros((b, t))
    last = np.zeros(b)
    for k in reversed(range(t)):
        nxt = values[:, k + 1] if k < t - 1 else 0.0
        delta = rewards[:, k] + gamma * nxt - values[:, k]
        last = delta + gamma * lam * last
        adv[:, k] = last
    returns = adv + values
    sel = adv[mask > 0]
    mean = sel.mean()
    var = np.var(sel, ddof=1)
    return (adv - mean) / np.sqrt(var + 1e-8), returns


def torch_policy_loss(logp, old_logp, adv, mask, balanced, cl=EPS_L, ch=EPS_H, c=CLIP_C):
    """verl compute_policy_loss / AEPO compute_policy_loss_entropy_balanced_clipping, token-mean."""
    import torch

    def masked_mean(v, m):
        return (v * m).sum() / (m.sum() + 1e-8)

    neg_kl = logp - old_logp
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    l1 = -adv * ratio
    if balanced:
        lower = torch.full_like(ratio, 1 - cl)
        upper = (1 + ch) * ratio / ratio.detach()
        l2 = -adv * torch.clamp(ratio, lower, upper)
    else:
        l2 = -adv * torch.clamp(ratio, 1 - cl, 1 + ch)
    lclip = torch.maximum(l1, l2)
    clipfrac = masked_mean(torch.gt(l2, l1).float(), mask)
    l3 = -adv * c
    lclip2 = torch.min(l3, lclip)
    clipfrac_lower = masked_mean(torch.gt(lclip, l3).float() * (adv < 0).float(), mask)
    per_tok = torch.where(adv < 0, lclip2, lclip)
    loss = (per_tok * mask).sum() / (mask.sum() + 1e-8)
    return loss, clipfrac, clipfrac_lower, ppo_kl


# ------------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO / RLOO
# ------------------------------------------------------------------------------------------------


def test_grpo_hand_values():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 0.5])
    ids = jnp.array([7, 7, 3, 3, 9])
    # group 7: mean .5, unbiased std sqrt(.5) -> +-.5/.70711; group 3: std 0 -> 0; group 9 (size 1): .5/(1+1e-6)
    expected = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 0.0, 0.0, 0.5 / (1 + 1e-6)]
    np.testing.assert_allclose(advantages.grpo_advantages(rewards, ids), expected, rtol=1e-6)


def test_dr_grpo_hand_values():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 0.5])
    ids = jnp.array([7, 7, 3, 3, 9])
    np.testing.assert_allclose(advantages.grpo_advantages(rewards, ids, norm_by_std=False), [0.5, -0.5, 0, 0, 0.5])
    np.testing.assert_allclose(advantages.compute_advantages("dr_grpo", rewards, ids), [0.5, -0.5, 0, 0, 0.5])


def test_rloo_is_leave_one_out_baseline():
    rewards = jnp.array([1.0, 2.0, 6.0, 3.0])
    ids = jnp.array([5, 5, 5, 1])
    # s_i minus the mean of the others: 1-4, 2-3.5, 6-1.5; a singleton keeps its score.
    np.testing.assert_allclose(advantages.rloo_advantages(rewards, ids), [-3.0, -1.5, 4.5, 3.0], rtol=1e-6)


def test_grpo_token_level_rewards_are_summed():
    tok = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 0.0]])
    ids = jnp.array([0, 0, 1, 1])
    np.testing.assert_allclose(advantages.grpo_advantages(tok, ids), advantages.grpo_advantages(tok.sum(-1), ids))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_advantages_match_reference_loops(name):
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.full(4, 11), np.full(3, -2), [40], np.full(5, 3), [7]])  # includes size-1 groups
    rng.shuffle(ids)
    scores = rng.normal(size=ids.shape[0]).astype(np.float32)
    scores[ids == 3] = 1.0  # an all-equal group: zero advantage
    got = advantages.compute_advantages(name, jnp.asarray(scores), jnp.asarray(ids))
    expected = {"grpo": lambda: ref_grpo(scores, ids), "dr_grpo": lambda: ref_grpo(scores, ids, False),
                "rloo": lambda: ref_rloo(scores, ids)}[name]()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[ids == 3] == 0.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_advantages_permutation_and_relabel_invariant(name):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5, size=16)
    scores = rng.normal(size=16).astype(np.float32)
    base = np.asarray(advantages.compute_advantages(name, jnp.asarray(scores), jnp.asarray(ids)))
    perm = rng.permutation(16)
    permuted = advantages.compute_advantages(name, jnp.asarray(scores[perm]), jnp.asarray(ids[perm]))
    np.testing.assert_allclose(permuted, base[perm], rtol=1e-6, atol=1e-6)
    relabel = np.array([1000, -7, 3, 2**30, 0])[ids]  # arbitrary, non-contiguous, negative
    np.testing.assert_allclose(advantages.compute_advantages(name, jnp.asarray(scores), jnp.asarray(relabel)), base,
                               rtol=1e-6, atol=1e-6)


def test_grpo_singletons_and_jit():
    f = jax.jit(advantages.grpo_advantages, static_argnames=("norm_by_std",))
    out = f(jnp.array([2.0, -1.0, 0.0]), jnp.array([1, 2, 3]))
    np.testing.assert_allclose(out, np.array([2.0, -1.0, 0.0]) / (1 + 1e-6), rtol=1e-6)
    assert np.all(np.isfinite(out))


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        advantages.compute_advantages("ppo", jnp.zeros(2), jnp.zeros(2, jnp.int32))


# ------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------


def test_gae_hand_values():
    # delta_1 = 1 + 0 - 2 = -1, delta_0 = 0 + .5*2 - 1 = 0; A_1 = -1, A_0 = 0 + .25*(-1) = -.25; returns = A + V.
    adv, ret = advantages.gae_advantages(jnp.array([[0.0, 1.0]]), jnp.array([[1.0, 2.0]]), jnp.ones((1, 2)),
                                    gamma=0.5, lam=0.5)
    np.testing.assert_allclose(ret, [[0.75, 1.0]], rtol=1e-6)
    # whitening: mean -.625, unbiased std sqrt(2 * .375^2) -> +-1/sqrt(2)
    np.testing.assert_allclose(adv, [[1 / math.sqrt(2), -1 / math.sqrt(2)]], rtol=1e-5)


def test_gae_gamma_lam_one_returns_are_reward_to_go():
    rng = np.random.default_rng(2)
    r, v = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    _, ret = advantages.gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.ones((3, 6)), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, np.cumsum(r[:, ::-1], axis=1)[:, ::-1], rtol=1e-5, atol=1e-5)


def test_gae_matches_reference_loop_and_whitening_stats():
    rng = np.random.default_rng(3)
    r, v = rng.normal(size=(4, 7)), rng.normal(size=(4, 7))
    mask = (rng.random((4, 7)) < 0.7).astype(np.float32)
    adv, ret = jax.jit(functools.partial(advantages.gae_advantages, gamma=0.9, lam=0.8))(
        jnp.asarray(r), jnp.asarray(v), jnp.asarray(mask))
    ref_adv, ref_ret = ref_gae(r, v, mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
    sel = np.asarray(adv)[mask > 0]
    assert abs(sel.mean()) < 1e-5 and abs(sel.std(ddof=1) - 1) < 1e-4


def test_gae_single_valid_token_is_finite():
    adv, ret = advantages.gae_advantages(jnp.ones((2, 3)), jnp.zeros((2, 3)), jnp.array([[1, 0, 0], [0, 0, 0]]),
                                    gamma=1.0, lam=1.0)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(ret))


def _token_mean(per_token, mask):
    """verl's token-mean of a per-token loss (the packer's token-mean weights are mask / tokens)."""
    return jnp.sum(per_token * mask) / (jnp.sum(mask) + 1e-8)


def test_ppo_gradient_invariant_to_micro_batch_split():
    rng = np.random.default_rng(5)
    logp = jnp.asarray(rng.normal(size=(6, 5)) * 0.3 - 1, jnp.float32)
    old = logp + jnp.asarray(rng.normal(size=(6, 5)) * 0.3, jnp.float32)
    adv = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    mask = jnp.asarray((rng.random((6, 5)) < 0.7).astype(np.float32))
    n_tok = jnp.sum(mask)

    def loss_fn(lp, sl):  # sum(w * loss) with the mini-batch's token-mean weights w = mask / n_tok
        return jnp.sum(mask[sl] / n_tok * algos.ppo_policy_loss(lp, old[sl], adv[sl], mask[sl])[0])

    full = jax.grad(lambda lp: _token_mean(algos.ppo_policy_loss(lp, old, adv, mask)[0], mask))(logp)
    g1 = jax.grad(loss_fn)(logp[:2], slice(0, 2))
    g2 = jax.grad(loss_fn)(logp[2:], slice(2, 6))
    np.testing.assert_allclose(jnp.concatenate([g1, g2]), full, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# PPO / AEPO policy loss
# ------------------------------------------------------------------------------------------------


def _hand_batch():
    # (A, r) per valid token: (1, 1.5), (1, .5), (-1, .5) | (-1, 4), (2, 1), padding with garbage log-probs.
    ratios = np.array([[1.5, 0.5, 0.5], [4.0, 1.0, 1.0]])
    old = np.full((2, 3), -1.0)
    logp = old + np.log(ratios)
    logp[1, 2] = np.nan  # padding garbage must not leak
    adv = np.array([[1.0, 1.0, -1.0], [-1.0, 2.0, np.inf]])
    mask = np.array([[1.0, 1, 1], [1, 1, 0]])
    return [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]


@pytest.mark.parametrize("loss_fn", [algos.ppo_policy_loss, algos.entropy_balanced_policy_loss])
def test_policy_loss_hand_values(loss_fn):
    # per-token losses: -1.2, -0.5, 0.8, min(4, 3)=3, -2  -> token-mean 0.1/5
    per_token, m = loss_fn(*_hand_batch())
    np.testing.assert_allclose(per_token, [[-1.2, -0.5, 0.8], [3.0, -2.0, 0.0]], rtol=1e-5)  # 0 at padding
    np.testing.assert_allclose(_token_mean(per_token, _hand_batch()[3]), 0.02, rtol=1e-5)
    np.testing.assert_allclose(m["pg_clipfrac"], 2 / 5, rtol=1e-6)  # tokens 1 and 3 are clipped
    np.testing.assert_allclose(m["pg_clipfrac_lower"], 1 / 5, rtol=1e-6)  # token 4: dual clip
    np.testing.assert_allclose(m["ppo_kl"], -math.log(1.5) / 5, rtol=1e-5)  # mean of -log r
    grads = jax.grad(lambda lp: jnp.sum(loss_fn(lp, *_hand_batch()[1:])[0]))(_hand_batch()[0])
    assert np.all(np.isfinite(grads)) and float(grads[1, 2]) == 0.0


def test_policy_loss_rejects_bad_dual_clip():
    with pytest.raises(ValueError, match="clip_c"):
        algos.ppo_policy_loss(*_hand_batch(), clip_c=1.0)


def test_policy_loss_all_masked_is_finite():
    logp, old, adv, _ = _hand_batch()
    loss, m = algos.entropy_balanced_policy_loss(logp, old, adv, jnp.zeros((2, 3)))
    assert not np.any(np.asarray(loss)) and all(np.isfinite(float(v)) for v in m.values())


def _token_grad(loss_fn, adv, ratio):
    """d loss / d logp for one valid token (token-mean over one token = the per-token loss)."""
    old = jnp.full((1, 1), -1.0)
    logp = old + jnp.log(ratio)

    def f(lp):
        return loss_fn(lp, old, jnp.full((1, 1), adv), jnp.ones((1, 1)), clip_low=EPS_L, clip_high=EPS_H,
                       clip_c=CLIP_C)[0][0, 0]

    return float(jax.grad(f)(logp)[0, 0]), float(f(logp))


def _check_case(adv, ratio, ppo_expected, aepo_expected):
    g_ppo, l_ppo = _token_grad(algos.ppo_policy_loss, adv, ratio)
    g_aepo, l_aepo = _token_grad(algos.entropy_balanced_policy_loss, adv, ratio)
    np.testing.assert_allclose(g_ppo, ppo_expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_aepo, aepo_expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(l_aepo, l_ppo, rtol=1e-6)  # AEPO changes the backward pass only


# Spec 10.1 table, one test per row (A = +-2, eps = 0.2, c = 3).
@pytest.mark.parametrize("ratio", [1.5, math.exp(30.0)])  # e^30: beyond the overflow clamp of log r
def test_aepo_grad_positive_adv_above_upper_clip(ratio):
    _check_case(2.0, ratio, ppo_expected=0.0, aepo_expected=-2.0 * 1.2)  # -A(1+eps_h): gradient kept


def test_aepo_grad_positive_adv_below_lower_clip():
    _check_case(2.0, 0.5, ppo_expected=-2.0 * 0.5, aepo_expected=-2.0 * 0.5)  # -A r, unchanged


def test_aepo_grad_negative_adv_below_lower_clip():
    _check_case(-2.0, 0.5, ppo_expected=0.0, aepo_expected=0.0)  # lower clip untouched


def test_aepo_grad_negative_adv_above_upper_clip():
    _check_case(-2.0, 1.5, ppo_expected=2.0 * 1.5, aepo_expected=2.0 * 1.5)  # -A r, unclipped


def test_aepo_grad_negative_adv_beyond_dual_clip():
    _check_case(-2.0, 4.0, ppo_expected=0.0, aepo_expected=0.0)  # r > c: dual clip, no gradient


@pytest.mark.parametrize("adv,ratio", [(2.0, 1.1), (-2.0, 0.9)])
def test_aepo_grad_inside_clip_range(adv, ratio):
    _check_case(adv, ratio, ppo_expected=-adv * ratio, aepo_expected=-adv * ratio)


@pytest.mark.parametrize("balanced", [False, True])
def test_policy_loss_matches_torch_reference(balanced):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6 + balanced)
    shape = (6, 9)
    old = rng.normal(size=shape).astype(np.float32) - 2
    logp = (old + rng.normal(size=shape) * 0.6).astype(np.float32)  # ratios spread over ~[0.15, 6]
    adv = rng.normal(size=shape).astype(np.float32)
    mask = (rng.random(shape) < 0.8).astype(np.float32)
    mask[2] = 0.0

    t_logp = torch.tensor(logp, requires_grad=True)
    t_out = torch_policy_loss(t_logp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), balanced)
    t_out[0].backward()

    fn = algos.entropy_balanced_policy_loss if balanced else algos.ppo_policy_loss
    def token_mean_loss(lp):
        per_token, metrics = fn(lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask))
        return _token_mean(per_token, jnp.asarray(mask)), metrics

    jfn = jax.jit(token_mean_loss)
    (loss, m), grad = jfn(jnp.asarray(logp)), jax.grad(lambda lp: jfn(lp)[0])(jnp.asarray(logp))
    np.testing.assert_allclose(loss, t_out[0].item(), rtol=1e-5, atol=1e-6)
    for key, t_val in zip(("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"), t_out[1:]):
        np.testing.assert_allclose(m[key], t_val.item(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, t_logp.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert float(m["pg_clipfrac"]) > 0  # the random batch really exercises the clipped cases


def test_policy_loss_registry():
    assert algos.POLICY_LOSSES["ppo"] is algos.ppo_policy_loss
    assert algos.POLICY_LOSSES["aepo"] is algos.entropy_balanced_policy_loss


# ------------------------------------------------------------------------------------------------
# Entropy-aware advantages
# ------------------------------------------------------------------------------------------------


def test_entropy_aware_hand_values():
    adv = jnp.array([[1.0, 1.0], [1.0, 5.0]])
    ent = jnp.array([[1.0, 2.0], [3.0, 99.0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    # mean 2, unbiased std 1 -> H_hat = -1, 0, 1 -> factors .8, 1, 1.2; padding unchanged
    np.testing.assert_allclose(algos.entropy_aware_advantages(adv, ent, mask), [[0.8, 1.0], [1.2, 5.0]],
                               rtol=1e-6)


def test_entropy_aware_matches_reference_formula():
    rng = np.random.default_rng(8)
    adv, ent = rng.normal(size=(4, 6)), rng.random((4, 6)) * 3
    mask = (rng.random((4, 6)) < 0.7).astype(np.float32)
    h = ent[mask > 0]
    std = np.std(h, ddof=1)
    expected = adv * (1 + 0.5 * (ent - h.mean()) / (std if std != 0 else 1.0))
    got = algos.entropy_aware_advantages(jnp.asarray(adv), jnp.asarray(ent), jnp.asarray(mask), alpha=0.5)
    np.testing.assert_allclose(np.asarray(got)[mask > 0], expected[mask > 0], rtol=1e-5)


def test_entropy_aware_zero_std_and_single_token():
    adv = jnp.array([[1.0, -2.0, 3.0]])
    same = algos.entropy_aware_advantages(adv, jnp.full((1, 3), 0.7), jnp.ones((1, 3)))
    np.testing.assert_allclose(same, adv)  # std 0 -> 1, H_hat = 0
    single = algos.entropy_aware_advantages(adv, jnp.array([[5.0, 1.0, 2.0]]), jnp.array([[1.0, 0.0, 0.0]]))
    np.testing.assert_allclose(single, adv)  # reference: NaN; intended: finite, unchanged
    empty = algos.entropy_aware_advantages(adv, jnp.array([[5.0, 1.0, 2.0]]), jnp.zeros((1, 3)))
    np.testing.assert_allclose(empty, adv)


@pytest.mark.parametrize("value", [0.7, 2.3456789, 5.123457, 6.9077554])
def test_entropy_aware_equal_entropies_give_factor_exactly_one(value):
    """Fidelity 4f: equal entropies over many tokens. A one-pass float32 mean is not exactly the value, so the
    std was ~1e-7 instead of 0 and H_hat = +-O(1) (factors 0.8-1.2); now every factor is exactly 1."""
    rng = np.random.default_rng(22)
    adv = jnp.asarray(rng.normal(size=(6, 53)), jnp.float32)
    mask = jnp.asarray(rng.random((6, 53)) < 0.8, jnp.float32)
    ent = jnp.where(mask > 0, jnp.float32(value), 3.0)  # padding holds other values: they must not count
    got = algos.entropy_aware_advantages(adv, ent, mask)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(adv))
    mean, divisor = algos.entropy_moments(ent, mask > 0)
    assert float(mean) == np.float32(value) and float(divisor) == 1.0


def test_entropy_aware_stops_gradient_into_entropy():
    adv, mask = jnp.array([[1.0, -1.0, 2.0]]), jnp.ones((1, 3))
    g = jax.grad(lambda e: jnp.sum(algos.entropy_aware_advantages(adv, e, mask)))(jnp.array([[0.1, 0.5, 2.0]]))
    np.testing.assert_array_equal(g, 0.0)


# ------------------------------------------------------------------------------------------------
# KL estimators
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,expected", [
    ("k1", math.log(2)), ("kl", math.log(2)), ("abs", math.log(2)), ("k2", 0.5 * math.log(2) ** 2),
    ("mse", 0.5 * math.log(2) ** 2), ("k3", 0.5 + math.log(2) - 1), ("low_var_kl", 0.5 + math.log(2) - 1),
])
def test_kl_hand_values(kind, expected):
    # logp = log .5, ref = log .25: logp - ref = ln 2; kappa = -ln 2, e^kappa = .5
    out = jax.jit(algos.kl_penalty, static_argnames="kind")(jnp.log(0.5), jnp.log(0.25), kind)
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_kl_abs_is_symmetric_k1_is_not():
    assert float(algos.kl_penalty(-3.0, -1.0, "abs")) == pytest.approx(2.0)
    assert float(algos.kl_penalty(-3.0, -1.0, "k1")) == pytest.approx(-2.0)


def test_k3_clamped_and_finite_gradient():
    logp = jnp.array([0.0, -100.0, -30.0, 0.0])
    ref = jnp.array([5.0, 0.0, 0.0, -30.0])  # kappa = 5, 100, 30, -30: all beyond the clamp
    np.testing.assert_allclose(algos.kl_penalty(logp, ref, "low_var_kl"), 10.0)
    g = jax.grad(lambda lp: jnp.sum(algos.kl_penalty(lp, ref, "k3")))(logp)
    np.testing.assert_array_equal(g, 0.0)


def test_low_var_kl_matches_torch_reference():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    logp = (rng.normal(size=50) * 1.5 - 2).astype(np.float32)
    ref = (logp + rng.normal(size=50) * 1.5).astype(np.float32)
    t_logp = torch.tensor(logp, requires_grad=True)
    kl = torch.tensor(ref) - t_logp
    t_out = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    t_out.sum().backward()
    np.testing.assert_allclose(algos.kl_penalty(logp, ref, "low_var_kl"), t_out.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    g = jax.grad(lambda lp: jnp.sum(algos.kl_penalty(lp, jnp.asarray(ref), "low_var_kl")))(jnp.asarray(logp))
    np.testing.assert_allclose(g, t_logp.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_kl_unknown_and_full():
    with pytest.raises(NotImplementedError):
        algos.kl_penalty(0.0, 0.0, "full")
    with pytest.raises(ValueError, match="unknown KL kind"):
        algos.kl_penalty(0.0, 0.0, "k4")


# ------------------------------------------------------------------------------------------------
# Token log-probs and entropy
# ------------------------------------------------------------------------------------------------


def _ref_logprob_entropy(logits, targets, temperature):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    return np.take_along_axis(logp_all, targets[..., None], -1)[..., 0], -(p * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 100])
def test_logprobs_entropy_chunked_matches_reference(chunk_size):
    rng = np.random.default_rng(10)
    logits = rng.normal(size=(2, 7, 11)) * 3
    targets = rng.integers(0, 11, size=(2, 7))
    lp, ent = logprobs.token_logprobs_and_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                                               temperature=0.7, chunk_size=chunk_size)
    ref_lp, ref_ent = _ref_logprob_entropy(logits, targets, 0.7)
    assert lp.dtype == jnp.float32 and lp.shape == (2, 7) and ent.shape == (2, 7)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_logprobs_bf16_input_computed_in_float32():
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.normal(size=(1, 5, 300)) * 4, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 300, size=(1, 5)))
    lp, ent = logprobs.token_logprobs_and_entropy(logits, targets, chunk_size=2)
    ref_lp, ref_ent = _ref_logprob_entropy(np.asarray(logits.astype(jnp.float32)), np.asarray(targets), 1.0)
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 4), (1.0, 9), (1.0, None)])
def test_logprobs_from_hidden_matches_logits_values_and_gradients(temperature, chunk):
    """The fused head (closed-form backward, chunks padded to whole blocks) against autodiff of full logits."""
    rng = np.random.default_rng(12)
    hidden = jnp.asarray(rng.normal(size=(2, 9, 8)), jnp.float32)
    unembed = jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 13, size=(2, 9)))

    def via_logits(h, w):
        return logprobs.token_logprobs_and_entropy(jnp.einsum("btd,dv->btv", h, w), targets, chunk_size=None,
                                                temperature=temperature)

    def via_hidden(h, w):
        return logprobs.token_logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=chunk, temperature=temperature)

    for a, b in zip(via_logits(hidden, unembed), jax.jit(via_hidden)(hidden, unembed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    def objective(fn):  # a loss touching both outputs, like policy loss - entropy bonus
        return lambda h, w: jnp.sum(fn(h, w)[0] * 0.7) - 0.1 * jnp.sum(fn(h, w)[1])

    g_ref = jax.grad(objective(via_logits), argnums=(0, 1))(hidden, unembed)
    g_chk = jax.grad(objective(via_hidden), argnums=(0, 1))(hidden, unembed)
    for a, b in zip(g_ref, g_chk):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _llm_like_logits(rng, rows, v=32768):
    """float32 logits as an LLM emits them: a large common offset, a spread of a few nats, a head of likely tokens."""
    logits = 18.0 + rng.normal(size=(rows, v)) * 2.5
    logits[:, :50] += 8.0 + rng.normal(size=(rows, 50)) * 3.0
    return logits.astype(np.float32)


def test_entropy_from_shifted_logits_is_accurate_on_llm_like_logits():
    """Fidelity 4e: H = lse - E[z] on unshifted float32 logits was off by 6e-5 here (and 0 instead of 7e-6 when
    peaked); from max-shifted logits the error is that of float32 at the size of H."""
    rng = np.random.default_rng(20)
    logits = _llm_like_logits(rng, 8)
    lp, ent = logprobs.token_logprobs_and_entropy(jnp.asarray(logits)[None], jnp.zeros((1, 8), jnp.int32),
                                               chunk_size=None)
    ref_lp, ref_ent = _ref_logprob_entropy(logits, np.zeros(8, np.int64), 1.0)
    assert np.abs(np.asarray(ent[0]) - ref_ent).max() < 2e-6
    np.testing.assert_allclose(lp[0], ref_lp, rtol=1e-6)
    # Peaked: one token at +26 nats over a vocabulary of N(10, 1) logits. H ~ 7e-6 must come out positive and close.
    peaked = (10.0 + rng.normal(size=(6, 32768))).astype(np.float32)
    peaked[:, 3] = 36.0
    _, ent = logprobs.token_logprobs_and_entropy(jnp.asarray(peaked)[None], jnp.zeros((1, 6), jnp.int32),
                                              chunk_size=None)
    ref_ent = _ref_logprob_entropy(peaked, np.zeros(6, np.int64), 1.0)[1]
    assert np.all(np.asarray(ent) > 0)
    assert np.abs(np.asarray(ent[0]) - ref_ent).max() < 1e-6


def test_fused_head_entropy_and_gradient_from_shifted_logits():
    """The fused head's forward and closed-form backward on LLM-like logits: entropy against float64 (the unshifted
    head was off by 4e-5), gradients against jax.grad of a plain log_softmax implementation in float64."""
    rng = np.random.default_rng(21)
    d, v = 8, 32768
    hidden = rng.normal(size=(1, 8, d)).astype(np.float32)
    hidden[..., 0] = 1.0  # with unembed row 0 at +18: a large common offset of every logit
    unembed = rng.normal(size=(d, v)).astype(np.float32)
    unembed[0] += 18.0
    targets = jnp.asarray(rng.integers(0, v, size=(1, 8)))
    lp, ent = jax.jit(lambda h, w: logprobs.token_logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=4))(
        hidden, unembed)
    logits64 = np.einsum("btd,dv->btv", hidden.astype(np.float64), unembed.astype(np.float64))
    ref_lp, ref_ent = _ref_logprob_entropy(logits64[0], np.asarray(targets[0]), 1.0)
    assert np.abs(np.asarray(ent[0]) - ref_ent).max() < 5e-6
    np.testing.assert_allclose(lp[0], ref_lp, rtol=1e-5)

    def plain(h, w):
        logp_all = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w), axis=-1)
        lp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
        return lp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    def fused(h, w):
        return logprobs.token_logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=4)

    def objective(fn):
        return lambda h, w: jnp.sum(fn(h, w)[0] * 0.7) - 0.3 * jnp.sum(fn(h, w)[1])

    # The reference in float64: against the plain head in float32 (itself 6e-5 off here, 1e-4 on another CPU) a
    # 1e-4 tolerance was a coin toss between machines. Both float32 heads are within 1e-4 of the gradient's scale.
    with jax.enable_x64(True):
        g_ref = jax.grad(objective(plain), argnums=(0, 1))(jnp.asarray(hidden, jnp.float64),
                                                           jnp.asarray(unembed, jnp.float64))
        g_ref = [np.asarray(g) for g in g_ref]
    g_fused = jax.grad(objective(fused), argnums=(0, 1))(jnp.asarray(hidden), jnp.asarray(unembed))
    for ref, got in zip(g_ref, g_fused):
        np.testing.assert_allclose(got, ref, rtol=0, atol=5e-4 * np.abs(ref).max())


def test_logprobs_from_hidden_never_materialises_full_logits():
    b, d, v = 2, 16, 4096

    def temp_bytes(t):
        targets = jnp.zeros((b, t), jnp.int32)

        def loss(h, w):
            lp, ent = logprobs.token_logprobs_and_entropy_from_hidden(h, w, targets, chunk_size=32)
            return jnp.sum(lp) + jnp.sum(ent)

        args = jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32)
        analysis = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
        if analysis is None:
            pytest.skip("backend gives no memory analysis")
        return analysis.temp_size_in_bytes

    short, long = temp_bytes(256), temp_bytes(1024)
    assert long < b * 1024 * v * 4 / 4  # far below the [B, T, V] float32 logits of the forward + backward
    assert long < 1.25 * short + 65536  # temporaries do not grow with the sequence length


# ------------------------------------------------------------------------------------------------
# Composition under one jit (how train_step uses the module)
# ------------------------------------------------------------------------------------------------


def test_full_loss_pipeline_jits_and_is_finite():
    rng = np.random.default_rng(13)
    b, t, d, v = 6, 5, 8, 17
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    unembed = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, size=(b, t)))
    mask = jnp.asarray((rng.random((b, t)) < 0.8).astype(np.float32)).at[4].set(0.0)
    rewards, ids = jnp.asarray(rng.random(b), jnp.float32), jnp.array([3, 3, 3, 8, 8, 1])
    old = jnp.asarray(rng.normal(size=(b, t)) - 3, jnp.float32)
    old = old.at[0, 0].set(-250.0)  # extreme ratio: exp(log r) overflows / underflows somewhere

    @jax.jit
    def total_loss(w):
        logp, ent = logprobs.token_logprobs_and_entropy_from_hidden(hidden, w, targets, chunk_size=2)
        adv = advantages.compute_advantages("grpo", rewards, ids)[:, None] * mask
        adv = algos.entropy_aware_advantages(adv, ent, mask)
        # seq-mean-token-mean weights (as packing.loss_weights gives them): 1 / (sequences * tokens of the sequence)
        n_seq = jnp.sum(jnp.any(mask > 0, -1))
        w = mask / (n_seq * jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0))
        pg, metrics = algos.entropy_balanced_policy_loss(logp, old, adv, mask)
        kl = algos.kl_penalty(logp, old, "low_var_kl")
        return jnp.sum(w * pg) + 0.01 * _token_mean(kl, mask) - 0.001 * _token_mean(ent, mask), metrics

    (loss, metrics), grad = jax.value_and_grad(total_loss, has_aux=True)(unembed)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
    assert all(np.isfinite(float(x)) for x in metrics.values())


# ------------------------------------------------------------------------------------------------
# Rollout correction (verl's rollout correction, decoupled mode)
# ------------------------------------------------------------------------------------------------

# Two sequences of 4 slots. log rho = old - rollout per token: row 0: ln 3, ln 1.5, -ln 4, (padding);
# row 1: ln 1.2, ln 1.2, 0, 0 (the last two: masked, e.g. a tool result with a garbage rollout log-prob).
_LOG_RHO = np.log(np.array([[3.0, 1.5, 0.25, 1.0], [1.2, 1.2, 1.0, 1.0]]))
_RC_MASK = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def _rc(level, mode, threshold=2.0, **kw):
    old = jnp.asarray(np.full((2, 4), -1.0) + _LOG_RHO, jnp.float32)
    rollout = jnp.asarray(np.where(_RC_MASK > 0, -1.0, np.nan), jnp.float32)  # garbage outside the mask
    return algos.rollout_correction(old, rollout, jnp.asarray(_RC_MASK), level=level, mode=mode, threshold=threshold,
                                    **kw)


def test_rollout_correction_token_truncate_by_hand():
    w, keep, m = _rc("token", "truncate")
    np.testing.assert_allclose(w, [[2.0, 1.5, 0.25, 1.0], [1.2, 1.2, 1.0, 1.0]], rtol=1e-6)  # min(rho, 2)
    assert bool(jnp.all(keep))
    diffs = np.abs(_LOG_RHO[_RC_MASK > 0])  # |ln 3|, |ln 1.5|, |ln 4|, |ln 1.2|, |ln 1.2|
    np.testing.assert_allclose(m["abs_logp_diff_mean"], diffs.mean(), rtol=1e-6)
    np.testing.assert_allclose(m["abs_logp_diff_max"], np.log(4.0), rtol=1e-6)
    np.testing.assert_allclose(m["kl"], -_LOG_RHO[_RC_MASK > 0].mean(), rtol=1e-5)  # mean(rollout - old)
    rho = np.exp(_LOG_RHO[_RC_MASK > 0])
    np.testing.assert_allclose(m["k3_kl"], np.mean(rho - np.log(rho) - 1), rtol=1e-5)
    assert float(m["tokens"]) == 5
    np.testing.assert_allclose(m["ratio_fraction_high"], 1 / 5)  # rho 3
    np.testing.assert_allclose(m["ratio_fraction_low"], 1 / 5)  # rho 1/4
    np.testing.assert_allclose(m["truncated_fraction"], 1 / 5)  # only the high side is truncated
    np.testing.assert_allclose(m["seq_truncated_fraction"], 1 / 2)
    assert float(m["masked_fraction"]) == 0 and float(m["seq_masked_fraction"]) == 0


def test_rollout_correction_token_mask_by_hand():
    w, keep, m = _rc("token", "mask")
    np.testing.assert_array_equal(w, 1.0)
    # rho 3 > 2 and 1/4 < 1/2 are dropped; padding / masked slots are kept (they are not the correction's business).
    np.testing.assert_array_equal(keep, [[False, True, False, True], [True, True, True, True]])
    np.testing.assert_allclose(m["masked_fraction"], 2 / 5)
    np.testing.assert_allclose(m["seq_masked_fraction"], 1 / 2)
    assert float(m["truncated_fraction"]) == 0


def test_rollout_correction_sequence_level_by_hand():
    # Sequence ratios: row 0: 3 * 1.5 * 0.25 = 1.125; row 1: 1.44.
    w, keep, m = _rc("sequence", "truncate", threshold=1.3)
    np.testing.assert_allclose(w, [[1.125, 1.125, 1.125, 1.0], [1.3, 1.3, 1.0, 1.0]], rtol=1e-5)
    np.testing.assert_allclose(m["truncated_fraction"], 2 / 5)  # the two tokens of row 1
    np.testing.assert_allclose(m["seq_truncated_fraction"], 1 / 2)
    _, keep, m = _rc("sequence", "mask", threshold=1.3)
    np.testing.assert_array_equal(keep, [[True] * 4, [False, False, True, True]])
    np.testing.assert_allclose(m["seq_masked_fraction"], 1 / 2)
    # Packed: the same two sequences as two segments of one row give the same weights.
    old = np.full((1, 8), -1.0)
    old[0, :4], old[0, 4:] = -1.0 + _LOG_RHO[0], -1.0 + _LOG_RHO[1]
    mask = np.concatenate([_RC_MASK[0], _RC_MASK[1]])[None]
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2]])
    w_packed, _, _ = algos.rollout_correction(jnp.asarray(old), jnp.full((1, 8), -1.0), jnp.asarray(mask),
                                              level="sequence", mode="truncate", threshold=1.3,
                                              segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(w_packed[0], [1.125, 1.125, 1.125, 1.0, 1.3, 1.3, 1.0, 1.0], rtol=1e-5)


def test_rollout_correction_off_measures_only_and_rejects_bad_arguments():
    w, keep, m = _rc("token", "off")
    np.testing.assert_array_equal(w, 1.0)
    assert bool(jnp.all(keep)) and float(m["truncated_fraction"]) == 0 and float(m["masked_fraction"]) == 0
    np.testing.assert_allclose(m["abs_logp_diff_max"], np.log(4.0), rtol=1e-6)
    for kw, match in (({"level": "tok"}, "level='tok'"), ({"mode": "clip"}, "mode='clip'"),
                      ({"threshold": 1.0}, "threshold=1.0")):
        with pytest.raises(ValueError, match=match):
            algos.rollout_correction(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                     **({"level": "token", "mode": "truncate"} | kw))


def test_policy_loss_applies_is_weights_per_token():
    """verl multiplies each token's (clipped) policy loss by its rollout-correction weight before aggregation."""
    logp = jnp.log(jnp.array([[1.1, 0.5, 1.0]]))
    adv, mask = jnp.array([[1.0, -2.0, 0.5]]), jnp.ones((1, 3))
    wts = jnp.array([[2.0, 0.5, 1.0]])
    seq_sum = lambda per_token: jnp.sum(per_token)  # seq-mean-token-sum of one sequence
    base = seq_sum(algos.ppo_policy_loss(logp, jnp.zeros((1, 3)), adv, mask)[0])
    got = seq_sum(algos.ppo_policy_loss(logp, jnp.zeros((1, 3)), adv, mask, is_weights=wts)[0])
    # Per token: -1 * 1.1 (inside the clip), -(-2) * 0.8 (clipped at 1 - 0.2), -0.5 * 1.
    np.testing.assert_allclose(base, -1.1 + 1.6 - 0.5, rtol=1e-6)
    np.testing.assert_allclose(got, 2 * -1.1 + 0.5 * 1.6 - 0.5, rtol=1e-6)
    g = jax.grad(lambda lp: _token_mean(algos.ppo_policy_loss(lp, jnp.zeros((1, 3)), adv, mask, is_weights=wts)[0],
                                        mask))(logp)
    np.testing.assert_allclose(g, [[-2 * 1.1 / 3, 0.0, -0.5 / 3]], rtol=1e-5)  # the weight scales the gradient
