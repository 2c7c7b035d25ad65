"""Block skipping in the blockwise attention kernel (`models/attention.py`, `skip_blocks=True`): the skip kernel
computes only the (query block, key block) pairs with a visible (query, key) pair, and equals the unskipped kernel
and XLA's attention, values and gradients, under causal, packed-segment (with padding) and prefix-tree masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax.experience import tree_packing as tp
from arpo_jax.models.attention import _pairs_needed, blockwise_causal_attention
from arpo_jax.models.transformer import TreeMask, attention_mask_4d, blockwise_blocks

B, T, N, K, H, BLOCK = 2, 37, 4, 2, 8, 8  # 5 blocks of 8, the last one ragged (padded inside the kernel)


def _tree_key_end(seed: int) -> np.ndarray:
    """[B, T] key_end of two rows of prefix trees: a shared prompt, branches forked at random points."""
    rng = np.random.RandomState(seed)
    seqs, groups = [], []
    for g in range(4):
        root = list(rng.randint(3, 50, rng.randint(3, 7)))
        group = [root + list(rng.randint(3, 50, rng.randint(2, 6)))]
        for _ in range(3):
            parent = group[rng.randint(len(group))]
            group.append(parent[:rng.randint(len(root), len(parent) + 1)] + list(rng.randint(3, 50, rng.randint(2, 6))))
        seqs += [np.array(s) for s in group]
        groups += [g] * len(group)
    layout = tp.plan_tree_layout(seqs, groups, [np.ones(len(s)) for s in seqs], mini_batch_size=len(seqs),
                                 row_len=T, rows_per_micro=B)
    return layout.rows["tree_end"][0, 0]


def _case(name: str) -> tuple[dict, jnp.ndarray]:
    """The kernel's mask argument and the [B, 1, T, T] dense mask it means."""
    if name == "tree":
        key_end = jnp.asarray(_tree_key_end(0))
        return {"key_end": key_end}, TreeMask(key_end).dense()
    seg = np.zeros((B, T), np.int32)
    if name == "causal":
        seg[:] = 1
    else:  # packed: three sequences then padding; a row that starts with padding (no visible key)
        seg[0, :9], seg[0, 9:20], seg[0, 20:30] = 1, 2, 3
        seg[1, 11:33] = 1
    mask = attention_mask_4d(None, jnp.asarray(seg), (B, T))
    return {"mask": mask}, mask


@pytest.mark.parametrize("case", ["causal", "packed", "tree"])
def test_skip_kernel_equals_unskipped_kernel_and_xla_values_and_gradients(case):
    info, dense = _case(case)
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k, v = (jax.random.normal(x, (B, T, K, H)) for x in ks[1:3])
    seen = dense[:, 0].any(-1)[..., None, None]  # queries with a visible key (the others differ by convention)
    w = jax.random.normal(ks[3], (B, T, N, H)) * seen

    def run(attn):
        @jax.jit  # one compile per kernel (eager dispatch of the loops is slower)
        def f(q, k, v, w):
            out, vjp = jax.vjp(attn, q, k, v)
            return (out * seen, *vjp(w))
        return f(q, k, v, w)

    skip = run(lambda q, k, v: blockwise_causal_attention(q, k, v, scale=0.3, block_size=BLOCK, skip_blocks=True,
                                                          **info))
    unskipped = run(lambda q, k, v: blockwise_causal_attention(q, k, v, scale=0.3, block_size=BLOCK, **info))
    xla = run(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, scale=0.3, implementation="xla"))
    for a, x, y in zip(skip, unskipped, xla, strict=True):
        np.testing.assert_allclose(a, x, atol=2e-6)
        np.testing.assert_allclose(a, y, atol=1e-5)


@pytest.mark.parametrize("case", ["causal", "packed", "tree"])
def test_the_skipped_block_pairs_are_exactly_those_with_no_visible_key(case):
    info, dense = _case(case)
    n = -(-T // BLOCK)
    pad = n * BLOCK - T
    padded = jnp.pad(dense[:, :, None], [(0, 0)] * 3 + [(0, pad)] * 2)  # [B, 1, 1, Tp, Tp]
    expected = np.asarray(padded.reshape(B, n, BLOCK, n, BLOCK).any(axis=(0, 2, 4)))
    if "key_end" in info:
        got = _pairs_needed(jnp.pad(info["key_end"], [(0, 0), (0, pad)], constant_values=-1), n, BLOCK, True)
    else:
        got = _pairs_needed(padded, n, BLOCK, False)
    np.testing.assert_array_equal(np.asarray(got), expected)
    causal = np.tril(np.ones((n, n), bool))
    assert not (expected & ~causal).any()  # never a key block after the query block
    if case != "causal":  # packing, padding and trees leave pairs of the causal triangle out
        assert expected.sum() < causal.sum()


def test_every_backend_skips_blocks():
    assert blockwise_blocks(1024, "cpu") == {"block_size": 128, "skip_blocks": True}
    assert blockwise_blocks(24000, "tpu") == blockwise_blocks(24000, "gpu") == {"block_size": 512,
                                                                                 "skip_blocks": True}
