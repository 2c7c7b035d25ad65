"""The update side's batch shapes come from the config alone (issue 54): the micro-batch count holds the worst case
(`packing.max_rows`, `tree_packing.max_tree_rows`), a tree row's heads and entries are capped, every step's batch has
the same shapes, and the forward passes skip the empty micro-batches that room costs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax import sharding
from arpo_jax.experience import global_batch, packing
from arpo_jax.experience import tree_packing as tp
from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.update import jit
from tests.test_tree import _model_cfg, _random_group


@pytest.mark.parametrize("k_rows", [1, 1.5, 2, 3, 4])
def test_first_fit_needs_at_most_max_rows(k_rows):
    rng = np.random.default_rng(0)
    max_len = 50
    row_len = int(k_rows * max_len)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(1, max_len + 1, n)
        assert len(packing.fill_rows(lengths, row_len, pack=True)) <= packing.max_rows(n, row_len, max_len)
    # The bound is reached: sequences of max_len tokens, row_len // max_len to a row.
    n = 13
    assert len(packing.fill_rows(np.full(n, max_len), row_len, pack=True)) == packing.max_rows(n, row_len, max_len)


def _groups(rng, groups: int, n: int, scale: int):
    """Random ARPO-like groups (shared prompts, branches, duplicates), each token repeated `scale` times."""
    seqs, masks, group = [], [], []
    for g in range(groups):
        for s, m in _random_group(rng, n):
            seqs.append(np.repeat(s, scale))
            masks.append(np.repeat(m, scale))
            group.append(g)
    return seqs, masks, np.array(group)


@pytest.mark.parametrize("k_rows", [1, 2, 3, 4])
@pytest.mark.parametrize("cap_factor", [2, tp.ENTRIES_PER_TOKEN])  # 2: the smallest cap the bound holds with
def test_tree_rows_heads_and_entries_within_the_fixed_sizes(k_rows, cap_factor):
    rng = np.random.RandomState(1)
    for trial in range(30):
        seqs, masks, group = _groups(rng, groups=int(rng.randint(1, 5)), n=int(rng.randint(2, 12)), scale=3)
        max_len = max(map(len, seqs))
        row_len = k_rows * max_len
        cap = cap_factor * row_len
        lay = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=len(seqs), row_len=row_len, rows_per_micro=1,
                                  max_entries=cap)
        assert lay.shape[1] <= tp.max_tree_rows(len(seqs), row_len, max_len), trial
        assert lay.heads <= tp.max_heads_per_row(row_len) and lay.entries <= cap
        lay.with_sizes(tp.max_tree_rows(len(seqs), row_len, max_len), tp.max_heads_per_row(row_len), cap)


def test_tree_rows_can_exceed_the_flat_bound():
    """Why trees have their own bound: at three trajectories' length a row, groups of two unrelated trajectories of
    0.77 of that length make parts of 1.54 that do not share a row, so a row holds two trajectories, not three."""
    max_len, groups = 100, 6
    seqs = [np.full(77, 3 + i) for i in range(2 * groups)]  # no shared prefix
    masks = [np.ones(77, np.float32)] * len(seqs)
    lay = tp.plan_tree_layout(seqs, np.arange(len(seqs)) // 2, masks, mini_batch_size=len(seqs), row_len=3 * max_len,
                              rows_per_micro=1, max_entries=tp.max_entries_per_row(3 * max_len))
    assert lay.shape[1] == groups > packing.max_rows(len(seqs), 3 * max_len, max_len)
    assert lay.shape[1] <= tp.max_tree_rows(len(seqs), 3 * max_len, max_len)


def test_entries_cap_splits_a_tree_of_duplicates():
    """Identical trajectories cost no tree tokens but each brings its loss entries: the cap splits the group."""
    seq, mask = np.arange(3, 43), np.r_[np.zeros(10), np.ones(30)].astype(np.float32)
    lay = tp.plan_tree_layout([seq] * 12, np.zeros(12, int), [mask] * 12, mini_batch_size=12, row_len=80,
                              rows_per_micro=1, max_entries=160)
    per_row = np.bincount(lay.entry_at[:, 1], minlength=lay.shape[1])  # one row a micro-batch
    assert len(lay.entry_traj) == 12 * 30 and per_row.tolist() == [150, 150, 60]  # 5 + 5 + 2 trajectories


def _trajs(seqs, masks, group) -> Trajectories:
    n = len(seqs)
    return Trajectories(sequences=seqs, prompt_lengths=np.ones(n, np.int64), loss_masks=masks,
                        scores=np.zeros(n, np.float32), group=group, responses=[""] * n, reward_infos=[{}] * n,
                        out=None, rollout_logps=[np.zeros(len(s), np.float32) for s in seqs])


@pytest.mark.parametrize("tree", [False, True])
def test_every_step_has_the_configs_shapes(tree):
    """Two rollouts of different lengths and sharing pack to the same shapes, the config's (`micro_batches`)."""
    from arpo_jax.experience.packing import PackConfig

    pack = PackConfig(group_size=6, mini_batch_prompts=2, pack=True, tree=tree, agg_mode="token-mean",
                      micro_norm="global_token_mean", norm_len=100, row_len=240, max_len=120)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    batches = global_batch.GlobalBatch(pack, mesh, _model_cfg(), workers=1, local=range(1))
    shapes = []
    for seed, scale in ((0, 1), (1, 3)):
        seqs, masks, group = _groups(np.random.RandomState(seed), groups=4, n=6, scale=scale)
        seqs = [s[:120] for s in seqs]
        masks = [m[:120] for m in masks]
        trajs = {0: _trajs(seqs, masks, group)}
        minis, _ = batches.pack(trajs, {0: {"advantages": [np.zeros(len(s), np.float32) for s in seqs]}})
        shapes.append({k: v.shape for mini in minis for k, v in mini.items()})
    assert shapes[0] == shapes[1]
    m = global_batch.micro_batches(pack, 1, 1, tree=tree)
    assert shapes[0]["input_ids"] == (m, 1, 240) and m == 6  # 12 trajectories of <= 120 tokens, 2 a row


def test_forward_skips_empty_micro_batches():
    """`map_micro_batches` computes only the micro-batches with tokens: zeros for the others."""
    calls = []

    def fn(mb):
        jax.debug.callback(lambda: calls.append(1))
        return (mb["input_ids"] * 2.0,)

    seg = np.zeros((4, 2, 3), np.int32)
    seg[0, 0, :2] = seg[2, 1, 0] = 1
    batch = {"input_ids": jnp.arange(24, dtype=jnp.float32).reshape(4, 2, 3) + 1, "segment_ids": jnp.asarray(seg)}
    out = jax.jit(lambda b: jit.map_micro_batches(fn, b, ("input_ids", "segment_ids")))(batch)[0]
    jax.effects_barrier()
    assert len(calls) == 2
    np.testing.assert_array_equal(np.asarray(out)[[0, 2]], np.asarray(batch["input_ids"])[[0, 2]] * 2)
    assert not np.asarray(out)[[1, 3]].any()
