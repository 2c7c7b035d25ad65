"""Host-side mini-batching, token-budget micro-batching, packing and loss weights (numpy only, no model)."""

import numpy as np
import pytest

from arpo_jax.experience import packing


def _seqs(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 100, n) for n in lengths]


def test_packing_fills_rows_within_budget_and_keeps_segments_apart():
    lengths = [30, 20, 12, 40, 8, 25, 33, 5]
    seqs = _seqs(lengths)
    masks = [np.ones(n) for n in lengths]
    batch, layout = packing.pack_batch(seqs, masks, np.arange(8.0), mini_batch_size=8, row_len=48,
                                       rows_per_micro=2)
    k, m, b, t = layout.shape
    assert (k, b, t) == (1, 2, 48)
    assert m * b < len(lengths)  # fewer rows than sequences
    assert sum(lengths) <= m * b * t
    for i, s in enumerate(seqs):
        kk, mm, bb, sl = layout.slots(i)
        np.testing.assert_array_equal(batch["input_ids"][kk, mm, bb, sl], s)
        np.testing.assert_array_equal(batch["positions"][kk, mm, bb, sl], np.arange(len(s)))
        seg = batch["segment_ids"][kk, mm, bb, sl]
        assert (seg == seg[0]).all() and seg[0] > 0
        # targets are the next token inside the sequence; the last slot of a sequence predicts nothing
        np.testing.assert_array_equal(batch["targets"][kk, mm, bb, sl][:-1], s[1:])
        assert batch["loss_weight"][kk, mm, bb, sl.stop - 1] == 0
        assert (batch["advantages"][kk, mm, bb, sl][:-1] == i).all()
    # one segment id per sequence within each row
    for kk, mm, bb in {(layout.mini[i], layout.micro[i], layout.row[i]) for i in range(8)}:
        members = [i for i in range(8) if (layout.mini[i], layout.micro[i], layout.row[i]) == (kk, mm, bb)]
        ids = {batch["segment_ids"][layout.slots(i)[:3]][layout.slots(i)[3]][0] for i in members}
        assert len(ids) == len(members)
    assert (batch["segment_ids"] == 0).sum() == m * b * t - sum(lengths)


def test_mini_batches_are_consecutive_and_share_one_shape():
    lengths = [10, 50, 10, 10, 60, 5, 5]
    layout = packing.plan_layout(lengths, mini_batch_size=3, row_len=64, rows_per_micro=1)
    np.testing.assert_array_equal(layout.mini, [0, 0, 0, 1, 1, 1, 2])
    # mini 0: 50 + 10 | 10 -> 2 rows; mini 1: 60 | 10 + 5 -> 2 rows; mini 2: 1 row. M = max = 2.
    assert layout.shape == (3, 2, 1, 64)
    padded = packing.plan_layout(lengths, mini_batch_size=3, row_len=64, rows_per_micro=1, pack=False)
    assert padded.shape == (3, 3, 1, 64) and (padded.start == 0).all()


def test_place_unpack_roundtrip():
    lengths = [7, 3, 9, 4]
    layout = packing.plan_layout(lengths, mini_batch_size=2, row_len=12, rows_per_micro=2)
    values = [np.arange(n, dtype=np.float32) + 10 * i for i, n in enumerate(lengths)]
    back = packing.unpack(layout, packing.place(layout, values))
    for v, b in zip(values, back):
        np.testing.assert_array_equal(b[1:], v[1:])
        assert b[0] == 0


def test_too_long_sequence_raises():
    with pytest.raises(ValueError, match="does not fit a row of row_len=8"):
        packing.plan_layout([5, 9], mini_batch_size=2, row_len=8, rows_per_micro=1)


def _weights_per_seq(layout, w):
    return [x[1:] for x in packing.unpack(layout, w)]


def test_loss_weights_by_hand():
    # 3 sequences in one mini-batch, one per micro-batch (rows_per_micro=1, pack=False); loss tokens 3, 1, 2.
    masks = [np.array([0, 1, 1, 1]), np.array([0, 0, 1]), np.array([0, 1, 0, 1, 0])]
    layout = packing.plan_layout([4, 3, 5], mini_batch_size=3, row_len=5, rows_per_micro=1, pack=False)

    def w(agg, norm="global_token_mean", **kw):
        return _weights_per_seq(layout, packing.loss_weights(layout, masks, agg_mode=agg, micro_norm=norm, **kw))

    for got, m in zip(w("token-mean"), masks):
        np.testing.assert_allclose(got, m[1:] / 6)
    for got, m in zip(w("seq-mean-token-sum"), masks):
        np.testing.assert_allclose(got, m[1:] / 3)
    for got, m, n in zip(w("seq-mean-token-mean"), masks, (3, 1, 2)):
        np.testing.assert_allclose(got, m[1:] / (3 * n))
    # norm_len: longest span from a first loss token to the end = 3 (first) or 4 (third sequence).
    for got, m in zip(w("seq-mean-token-sum-norm"), masks):
        np.testing.assert_allclose(got, m[1:] / 4)
    # reference: token-mean per micro-batch (one sequence each) times 1/3 sequences.
    for got, m, n in zip(w("token-mean", "reference"), masks, (3, 1, 2)):
        np.testing.assert_allclose(got, m[1:] / n / 3)
    # One of 2 workers: reference averages the workers (verl's ranks), its counts stay its own; global_token_mean
    # takes the counts of the whole mini-batch (here 12 loss tokens over both workers), not 1 / workers.
    for got, m, n in zip(w("token-mean", "reference", workers=2), masks, (3, 1, 2)):
        np.testing.assert_allclose(got, m[1:] / n / 3 / 2)
    for got, m in zip(w("token-mean", totals=np.array([[12.0, 6.0]]), workers=2), masks):
        np.testing.assert_allclose(got, m[1:] / 12)
    assert np.isclose(sum(x.sum() for x in w("token-mean")), 1.0)


def test_global_weights_do_not_depend_on_the_split():
    lengths = [30, 20, 12, 40, 8, 25, 33, 5]
    rng = np.random.RandomState(1)
    masks = [(rng.rand(n) > 0.3).astype(float) for n in lengths]
    per_split = []
    for rows, pack in ((1, False), (2, True), (4, True)):
        layout = packing.plan_layout(lengths, mini_batch_size=4, row_len=48, rows_per_micro=rows, pack=pack)
        per_split.append(_weights_per_seq(layout, packing.loss_weights(layout, masks)))
    for other in per_split[1:]:
        for a, b in zip(per_split[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# The aggregation modes through the loss weights (verl's agg_loss on [B, T] rows; moved from test_algos)
# ------------------------------------------------------------------------------------------------


def _row_agg(loss, mask, mode, *, rows=None, totals=None, workers=1):
    """sum(w * loss) for [B, T] per-token losses whose rows are sequences of T + 1 tokens (token 0: the prompt).

    The train step computes exactly this (per-token losses are 0 outside the loss tokens: `where`)."""
    loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
    b, t = mask.shape
    masks = [np.concatenate([[0.0], m]) for m in mask]
    layout = packing.plan_layout([t + 1] * b, mini_batch_size=b, row_len=t + 1, rows_per_micro=rows or b, pack=False)
    w = _weights_per_seq(layout, packing.loss_weights(layout, masks, agg_mode=mode, norm_len=t, totals=totals,
                                                      workers=workers))
    return float(sum(np.where(wi > 0, wi * li, 0.0).sum() for wi, li in zip(w, loss)))


_L = np.array([[1.0, 2, 3, 9], [4, 5, 6, 9], [7, 7, 7, 7]])
_M = np.array([[1.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the third row is an all-masked padding row


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty rows
    ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
    ("seq-mean-token-sum-norm", 1.75),  # 7 / T=4
])
def test_agg_modes_hand_values(mode, expected):
    np.testing.assert_allclose(_row_agg(_L, _M, mode), expected, rtol=1e-6)
    np.testing.assert_allclose(_row_agg(np.where(_M > 0, _L, np.nan), _M, mode), expected, rtol=1e-6)


def test_agg_all_masked_is_zero_not_nan():
    for mode in packing.AGG_MODES:
        assert _row_agg(_L, np.zeros_like(_M), mode) == 0.0


def test_agg_unknown_mode_raises():
    with pytest.raises(ValueError, match="unknown agg_mode 'sum'"):
        _row_agg(_L, _M, "sum")


@pytest.mark.parametrize("split", [(3, 5), (2, 2, 4), (1, 7)])
@pytest.mark.parametrize("mode", packing.AGG_MODES)
def test_agg_invariant_to_micro_batch_split(split, mode):
    """One worker: micro-batches of any size give the mini-batch's aggregate (the normaliser is the mini-batch's)."""
    rng = np.random.default_rng(4)
    loss = rng.normal(size=(8, 6))
    mask = (rng.random((8, 6)) < 0.6).astype(np.float64)
    mask[5] = 0.0
    full = _row_agg(loss, mask, mode)
    for rows in split:
        np.testing.assert_allclose(_row_agg(loss, mask, mode, rows=rows), full, rtol=1e-6)


@pytest.mark.parametrize("split", [(3, 5), (2, 2, 4), (1, 7)])
@pytest.mark.parametrize("mode", packing.AGG_MODES)
def test_workers_with_global_totals_sum_to_the_global_aggregate(split, mode):
    """Rollout workers each pack their share of the mini-batch; with the totals of all (`loss_totals` summed) their
    weighted sums add up to the aggregate of the whole mini-batch. seq-mean-token-sum-norm's normaliser is a
    constant, not a count: the workers' losses are averaged as verl's ranks' are (1 / workers)."""
    rng = np.random.default_rng(4)
    loss = rng.normal(size=(8, 6))
    mask = (rng.random((8, 6)) < 0.6).astype(np.float64)
    mask[5] = 0.0
    bounds = np.cumsum((0,) + split)
    parts = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    totals = 0
    for sl in parts:
        t = mask.shape[1]
        layout = packing.plan_layout([t + 1] * (sl.stop - sl.start), mini_batch_size=8, row_len=t + 1,
                                     rows_per_micro=8, pack=False)
        totals = totals + packing.loss_totals(layout, [np.concatenate([[0.0], m]) for m in mask[sl]])
    np.testing.assert_array_equal(totals, [[mask.sum(), (mask.sum(1) > 0).sum()]])
    got = sum(_row_agg(loss[sl], mask[sl], mode, totals=totals, workers=len(split)) for sl in parts)
    full = _row_agg(loss, mask, mode) / (len(split) if mode == "seq-mean-token-sum-norm" else 1)
    np.testing.assert_allclose(got, full, rtol=1e-6)
    if mode != "seq-mean-token-sum-norm":  # without the global totals each worker normalises by its own share
        alone = sum(_row_agg(loss[sl], mask[sl], mode) for sl in parts)
        assert not np.isclose(alone, full)
