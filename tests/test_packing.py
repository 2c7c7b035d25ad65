"""Host-side mini-batching, token-budget micro-batching, packing and loss weights (numpy only, no model)."""

import numpy as np
import pytest

from arpo_jax import packing


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

    def w(agg, norm="global_token_mean"):
        return _weights_per_seq(layout, packing.loss_weights(layout, masks, agg_mode=agg, micro_norm=norm))

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
