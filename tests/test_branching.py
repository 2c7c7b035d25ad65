"""ARPO/AEPO branching maths (spec 4 and 5): entropy measure, branch probabilities, dynamic initial rollouts."""

import math

import numpy as np
import pytest

from arpo_jax.rollout.branching import (
    BranchParams,
    EntropyBaselines,
    branch_probability,
    consecutive_factor,
    decide_branches,
    initial_rollouts_dynamic,
    needs_refill,
    segment_entropy,
    update_consecutive,
)

V = 151_646  # a Qwen-sized vocabulary


# ------------------------------------------------------------------------------------------------ entropy (4.1)
def test_segment_entropy_hand_values():
    half = {1: math.log(0.5), 2: math.log(0.5)}
    assert segment_entropy([half], V) == pytest.approx(math.log(2) / math.log(V))
    # A sum over positions, not a mean (B4), and only the first 20 positions count.
    assert segment_entropy([half] * 5, V) == pytest.approx(5 * math.log(2) / math.log(V))
    assert segment_entropy([half] * 25, V) == pytest.approx(20 * math.log(2) / math.log(V))
    assert segment_entropy([half] * 25, V, window=3) == pytest.approx(3 * math.log(2) / math.log(V))
    assert segment_entropy([half] * 4, V, reduce="mean") == pytest.approx(math.log(2) / math.log(V))
    assert segment_entropy([half] * 4, V, normalize=False) == pytest.approx(4 * math.log(2))
    assert segment_entropy([], V) == 0.0
    assert segment_entropy([{7: 0.0}], V) == 0.0  # certain token
    assert segment_entropy([{7: 0.0, 8: -math.inf}], V) == 0.0


def test_segment_entropy_counts_every_returned_entry():
    # 10 top entries + the sampled token outside them: all 11 count (vLLM's convention, as in the reference).
    probs = [0.09] * 10 + [0.01]
    pos = {i: math.log(q) for i, q in enumerate(probs)}
    expected = -sum(q * math.log(q) for q in probs) / math.log(V)
    assert segment_entropy([pos], V) == pytest.approx(expected)
    truncated = -sum(q * math.log(q) for q in probs[:10]) / math.log(V)
    assert segment_entropy([pos], V, top_k=10) == pytest.approx(truncated)


# --------------------------------------------------------------------------------------- branch probability
def test_branch_probability_hand_values():
    assert branch_probability("arpo", 0.0, p=0.5, w=0.2) == 0.5
    assert branch_probability("arpo", 1.0, p=0.5, w=0.2) == pytest.approx(0.7)
    assert branch_probability("arpo", -1.0, p=0.5, w=0.2) == pytest.approx(0.3)
    assert branch_probability("arpo", 10.0, p=0.5, w=0.2) == 1.0
    assert branch_probability("arpo", -10.0, p=0.5, w=0.2) == 0.0
    assert branch_probability("arpo", 0.0, p=0.8, w=0.2, consecutive=19) == pytest.approx(0.8)  # no penalty
    # AEPO: 1 - p/f + w*dH; equal to ARPO at p = 0.5, f = 1; inverted meaning of p otherwise (B3).
    assert branch_probability("aepo", 1.0, p=0.5, w=0.2) == pytest.approx(0.7)
    assert branch_probability("aepo", 0.0, p=0.8, w=0.2) == pytest.approx(0.2)
    assert branch_probability("aepo", 0.0, p=0.5, w=0.2, consecutive=4) == pytest.approx(1 - 0.5 / 0.8)
    assert branch_probability("aepo", 1.0, p=0.5, w=0.2, consecutive=10) == pytest.approx(0.2)  # f = 0.5
    assert branch_probability("aepo", 1.0, p=0.5, w=0.2, consecutive=4, penalty=0.1) == pytest.approx(
        1 - 0.5 / 0.6 + 0.2)
    assert branch_probability("aepo", 5.0, p=0.5, w=0.2, consecutive=20) == 0.0  # f = 0
    assert branch_probability("aepo", 5.0, p=0.5, w=0.2, consecutive=30) == 0.0
    assert consecutive_factor(3) == pytest.approx(0.85) and consecutive_factor(25) == 0.0
    with pytest.raises(ValueError):
        branch_probability("beam", 0.0, p=0.5, w=0.2)


def _sequential(rng):
    """A `draw` for `decide_branches` that takes the generator's next uniform at every attempt."""
    return lambda source, attempt: rng.random()


def _reference_draws(rule, delta, p, w, f, u):
    """The reference's literal comparisons (spec 4.2 / 5.2) on uniform draws u."""
    if rule == "arpo":
        return np.clip(u - w * delta, 0, 1) <= p
    return np.clip((u + w * delta) * f, 0, 1) >= p


CASES = [("arpo", 0.0, 0.5, 0.2, 0), ("arpo", 1.3, 0.5, 0.2, 0), ("arpo", -0.7, 0.3, 0.5, 0),
         ("arpo", 0.4, 0.9, 0.2, 0), ("aepo", 0.0, 0.5, 0.2, 0), ("aepo", 0.9, 0.5, 0.2, 3),
         ("aepo", -0.4, 0.3, 0.2, 6), ("aepo", 2.0, 0.5, 0.2, 10), ("aepo", 0.5, 0.7, 0.2, 1)]


def _close(freq, prob, n):
    # 5 binomial standard deviations (plus a floor for prob in {0, 1}): a deterministic test with a fixed seed.
    return abs(freq - prob) <= 5 * math.sqrt(prob * (1 - prob) / n) + 1e-12


@pytest.mark.parametrize("rule,delta,p,w,c", CASES)
def test_branch_frequency_matches_formula(rule, delta, p, w, c):
    n_draws = 40_000
    prob = branch_probability(rule, delta, p=p, w=w, consecutive=c)
    # The formula is the reference's decision rule in closed form ...
    u = np.random.default_rng(1).random(n_draws)
    assert _close(_reference_draws(rule, delta, p, w, consecutive_factor(c), u).mean(), prob, n_draws)
    # ... and the decision procedure branches with exactly that frequency (one source, one attempt per call).
    rng = np.random.default_rng(2)
    params = BranchParams(n=2, beam_size=2, p=p, w=w, rule=rule)
    hits = sum(decide_branches([0], lambda s: (delta, 0.0), 1, params, _sequential(rng), consecutive=c)[0].branched
               for _ in range(n_draws))
    assert _close(hits / n_draws, prob, n_draws)


# ------------------------------------------------------------------------------------ the decision procedure
def _always(n, beam, count, sources):
    params = BranchParams(n=n, beam_size=beam, p=1.0, w=0.0, rule="arpo")
    return decide_branches(sources, lambda s: (0.0, 0.0), count, params, _sequential(np.random.default_rng(0)))


def test_decide_branches_budget_and_beam():
    # beam 2: one attempt per source; the budget n - count stops it.
    a = _always(n=8, beam=2, count=2, sources=[0, 1])
    assert [x.source for x in a] == [0, 1] and all(x.branched for x in a)
    a = _always(n=3, beam=2, count=2, sources=[0, 1, 2])
    assert [x.source for x in a] == [0]
    assert _always(n=4, beam=2, count=4, sources=[0, 1]) == []
    # beam 3: up to two attempts per source, still bounded by the budget.
    a = _always(n=16, beam=3, count=3, sources=[5, 6])
    assert [x.source for x in a] == [5, 5, 6, 6]
    a = _always(n=6, beam=3, count=3, sources=[5, 6])
    assert [x.source for x in a] == [5, 5, 6]
    assert _always(n=16, beam=1, count=1, sources=[0, 1]) == []  # beam 1: no branching


def test_decide_branches_failed_attempts_do_not_use_budget():
    params = BranchParams(n=3, beam_size=2, p=0.0, w=0.0, rule="arpo")  # never branches
    a = decide_branches([0, 1, 2, 3], lambda s: (0.0, 0.0), 1, params, _sequential(np.random.default_rng(0)))
    assert len(a) == 4 and not any(x.branched for x in a)


def test_decide_branches_records_entropies():
    params = BranchParams(n=4, beam_size=2, p=0.5, w=0.2, rule="aepo")
    ent = {3: (1.5, 0.5)}
    (a,) = decide_branches([3], ent.__getitem__, 1, params, _sequential(np.random.default_rng(0)), round_index=7,
                           consecutive=2)
    assert (a.round, a.source, a.entropy, a.baseline, a.consecutive) == (7, 3, 1.5, 0.5, 2)
    assert a.probability == pytest.approx(branch_probability("aepo", 1.0, p=0.5, w=0.2, consecutive=2))
    assert a.branched == (a.draw < a.probability)


def test_refill_and_consecutive_counters():
    assert needs_refill(False, 3, 4) and not needs_refill(True, 3, 4) and not needs_refill(False, 4, 4)
    assert update_consecutive([2, 5, 0], [1, 0, 2]) == [3, 0, 1]
    assert update_consecutive([2, 5, 0], [0, 0, 0]) == [2, 5, 0]  # no new slot anywhere: unchanged (B6)


def test_entropy_baselines_are_set_once():
    b = EntropyBaselines()
    assert b.get(4) == 0.0
    assert b.observe(4, 1.5) == 1.5
    assert b.observe(4, 9.0) == 1.5
    assert b.get(4) == 1.5


# ------------------------------------------------------------------------------- dynamic initial rollouts (5.1)
def test_initial_rollouts_dynamic_hand_values():
    assert initial_rollouts_dynamic(12, 1.0, 1.0) == 7
    assert initial_rollouts_dynamic(16, 2.5, 2.5) == 9
    assert initial_rollouts_dynamic(8, 0.0, 0.0) == 5
    assert initial_rollouts_dynamic(16, 100.0, 0.0) == 16  # clipped to n
    assert initial_rollouts_dynamic(16, 0.0, 100.0) == 1
    assert initial_rollouts_dynamic(16, -1e6, 1e6) == 1  # no overflow
    assert initial_rollouts_dynamic(1, 3.0, 0.0) == 1
    # floor(16 * sigmoid(0.5 * 2)) + 1 = floor(11.697) + 1 = 12; beta is a parameter.
    assert initial_rollouts_dynamic(16, 2.0, 0.0) == 12
    assert initial_rollouts_dynamic(16, 2.0, 0.0, beta=1.0) == math.floor(16 / (1 + math.exp(-2.0))) + 1


def test_initial_rollouts_dynamic_matches_formula_on_a_grid():
    for n in (1, 2, 5, 12, 16):
        prev = 0
        for d in np.linspace(-20, 20, 81):
            m = initial_rollouts_dynamic(n, float(d), 0.0)
            expected = min(n, max(1, math.floor(n / (1 + math.exp(-0.5 * d))) + 1))
            assert m == expected and 1 <= m <= n and m >= prev  # monotone in H_root - H_tool
            prev = m


def test_attempt_draws_are_uniform_independent_and_named_by_the_attempt():
    """`identity.attempt_draw`: U[0, 1) (Kolmogorov-Smirnov against the uniform), uncorrelated between neighbouring
    names, the same for the same name whenever it is drawn, different when any part of the name changes."""
    from scipy import stats

    from arpo_jax.rollout import identity

    u = np.array([identity.attempt_draw(7, b, identity.fresh_key(b, j), seg, k)
                  for b in range(10) for j in range(10) for seg in range(5) for k in range(4)])
    assert 0.0 <= u.min() and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(len(u))
    name = (7, 1, identity.fresh_key(1, 2), 3, 0)
    assert identity.attempt_draw(*name) == identity.attempt_draw(*name)
    for i in range(5):
        other = list(name)
        other[i] += 1
        assert identity.attempt_draw(*other) != identity.attempt_draw(*name)
    keys = {identity.fresh_key(b, j) for b in range(50) for j in range(50)}
    keys |= {identity.branch_key(k, s, a) for k in list(keys)[:100] for s in range(5) for a in range(3)}
    assert len(keys) == 2500 + 1500  # no two trajectories share a key
