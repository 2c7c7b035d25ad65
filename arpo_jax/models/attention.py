"""Causal self-attention computed in query blocks, with a hand-written backward pass (for CPU training).

XLA's CPU backend runs `jax.nn.dot_product_attention` as full [B, N, T, T] score tensors through several
memory-bound passes, and autodiff of the softmax adds more: on 2 cores at T = 1024 it is ~3x slower than PyTorch's
fused SDPA kernel, and attention dominated the train step (benchmarks/RESULTS.md). This version

  * splits the queries into blocks of `block_size` and lets block [a, e) see keys [0, e) only: under a causal mask
    later keys are never visible, so about half of the score FLOPs and exps are skipped;
  * works in the [B, K, G, T, H] layout (K kv heads x G query heads per kv head: grouped-query attention without
    repeating k/v), where every contraction is a plain batched matmul;
  * saves only the output and the per-row log-sum-exp, and recomputes the probabilities in the backward pass
    (the FlashAttention recipe: dS = P * (dP - rowsum(dO * O))), instead of autodiff's stored softmax graph.

Numerically it is exact attention (float32 scores and softmax), equal to `jax.nn.dot_product_attention` within
float32 rounding, except on rows with no visible key at all (padding queries), where it returns 0 instead of a
uniform average; their gradient is 0 either way.

The mask is either a [B, 1, T, T] bool array or, for prefix trees (`experience/tree_packing.py`), a rule on one int per
key: `key_end[b, s]`, the last slot whose query may see key s. Rows laid out in pre-order make "a token sees its
ancestors and itself" the interval test `s <= t <= key_end[s]` (the slot is the pre-order index; key_end is the
end of the key's subtree), evaluated per block inside the kernel: no [T, T] array exists. Flat packed sequences are
the special case of chains (key_end = the last slot of the key's sequence; -1 for padding).

Block skipping (`skip_blocks=True`, the default of every backend through `transformer.blockwise_blocks`): the keys
are split into blocks too, and only the (query block, key block) pairs in which some query sees some key are
computed, so packed rows, padding and trees cost their visible blocks, not the whole causal triangle.

  * Which pairs: `_pairs_needed`, before the loops. For a dense mask, any over the block; for the tree rule, key s
    is seen by the queries [s, key_end[s]], which meet query block [a, a + n) iff max(s, a) <= min(key_end[s],
    a + n - 1), so O(T x blocks) integer work, no [T, T] array. A pair is skipped only if no row of the batch needs
    it (`lax` control flow takes one decision per program; under GSPMD the decision is over the global batch, so
    rows that are packed differently on different devices skip only their common blocks: per-device decisions
    would need the kernel under `shard_map`).
  * How: a `fori_loop` over query blocks, and inside it a `fori_loop` over that block's needed key blocks only
    (a dynamic trip count: a while loop), with an online softmax (running max and sum, the FlashAttention
    forward). The loops are compiled once whatever T. The backward (`custom_vjp`) runs the same loops over the
    same pairs, recomputing the probabilities from the saved log-sum-exp; no autodiff goes through the loops.
  * Memory: one pair's float32 scores [B, K, G, n, n] at a time, whatever T (the unskipped kernel holds
    [B, K, G, n, T]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # a large finite negative: exp underflows to 0 without inf - inf = nan


def _blocks(t: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(t, a + block)) for a in range(0, t, block)]


def _scores(q, k, a, e, scale):
    """float32 scores of query block [a, e) against keys [0, e): [B, K, G, e - a, e]."""
    return jnp.einsum("bkgth,bksh->bkgts", q[:, :, :, a:e], k[:, :, :e], preferred_element_type=jnp.float32) * scale


def _block_mask(mask, a: int, e: int, tree: bool):
    """Visibility of keys [0, e) to queries [a, e): [B, 1, 1, e - a, e] bool.

    mask: [B, 1, 1, T, T] bool (causal), or with `tree` the per-key ints key_end [B, T] (module docstring)."""
    if not tree:
        return mask[..., a:e, :e]
    t_q = jnp.arange(a, e, dtype=jnp.int32)[:, None]  # [e - a, 1]
    s_k = jnp.arange(e, dtype=jnp.int32)[None, :]  # [1, e]
    return (s_k <= t_q) & (t_q <= mask[:, None, None, None, :e])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, mask, scale: float, block: int, tree: bool):
    return _forward(q, k, v, mask, scale, block, tree)[0]


def _forward(q, k, v, mask, scale, block, tree):
    # q: [B, K, G, T, H]; k, v: [B, K, T, H]; mask: [B, 1, 1, T, T] bool (causal: no key after its query) or, with
    # `tree`, key_end [B, T] int32.
    outs, lses = [], []
    for a, e in _blocks(q.shape[3], block):
        m = _block_mask(mask, a, e, tree)
        s = jnp.where(m, _scores(q, k, a, e, scale), _NEG)
        row_max = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.where(m, jnp.exp(s - row_max), 0.0)
        total = jnp.sum(p, axis=-1, keepdims=True)
        total = jnp.where(total == 0, 1.0, total)  # a row with no visible key: output 0, gradient 0
        o = jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), v[:, :, :e], preferred_element_type=jnp.float32)
        outs.append((o / total).astype(q.dtype))
        lses.append(row_max + jnp.log(total))
    out = jnp.concatenate(outs, axis=3)
    return out, (q, k, v, mask, out, lses)


def _backward(scale, block, tree, residuals, d_out):
    q, k, v, mask, out, lses = residuals
    # rowsum(dO * O): the softmax Jacobian's correction term, one scalar per query row.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dq_blocks = []
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for (a, e), lse in zip(_blocks(q.shape[3], block), lses, strict=True):
        p = jnp.where(_block_mask(mask, a, e, tree), jnp.exp(_scores(q, k, a, e, scale) - lse), 0.0)
        do = d_out[:, :, :, a:e]
        dv = dv.at[:, :, :e].add(jnp.einsum("bkgts,bkgth->bksh", p.astype(do.dtype), do,
                                            preferred_element_type=jnp.float32))
        dp = jnp.einsum("bkgth,bksh->bkgts", do, v[:, :, :e], preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[:, :, :, a:e]) * scale).astype(q.dtype)
        dq_blocks.append(jnp.einsum("bkgts,bksh->bkgth", ds, k[:, :, :e], preferred_element_type=jnp.float32))
        dk = dk.at[:, :, :e].add(jnp.einsum("bkgts,bkgth->bksh", ds, q[:, :, :, a:e],
                                            preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq_blocks, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_forward, _backward)


# Block skipping: query blocks x key blocks, only the pairs in which some query sees some key.


def _pad_seq(x, axis: int, t_pad: int, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, t_pad - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _pairs_needed(mask, n_blocks: int, block: int, tree: bool):
    """[n, n] bool: (query block i, key block j) has a visible (query, key) pair in some row of the batch.

    Dense mask [B, 1, 1, Tp, Tp]: any over the block. Tree (key_end [B, Tp]): key s is seen by the queries
    [s, key_end[s]], which meet block i = [a, a + block) iff max(s, a) <= min(key_end[s], a + block - 1)."""
    if not tree:
        # The barrier keeps XLA from constant-folding the reduction of a constant mask (a mask built from shapes
        # only, e.g. plain causal): folding [T, T] on the compiler's slow path took ~12 s at T = 2048.
        mask = jax.lax.optimization_barrier(mask)
        return mask.reshape(mask.shape[0], n_blocks, block, n_blocks, block).any(axis=(0, 2, 4))
    s = jnp.arange(n_blocks * block, dtype=jnp.int32)
    a = (jnp.arange(n_blocks, dtype=jnp.int32) * block)[:, None]  # [n, 1]
    seen = jnp.maximum(s, a)[None] <= jnp.minimum(mask[:, None, :], a + block - 1)  # [B, n, Tp]
    return seen.reshape(mask.shape[0], n_blocks, n_blocks, block).any(axis=(0, 3))


def _pair_mask(mask, a, c, block: int, tree: bool):
    """Visibility of keys [c, c + block) to queries [a, a + block): [B, 1, 1, block, block] bool."""
    if not tree:
        return jax.lax.dynamic_slice(mask, (0, 0, 0, a, c), (mask.shape[0], 1, 1, block, block))
    t_q = a + jnp.arange(block, dtype=jnp.int32)[:, None]
    s_k = c + jnp.arange(block, dtype=jnp.int32)[None, :]
    key_end = jax.lax.dynamic_slice_in_dim(mask, c, block, axis=1)[:, None, None, None, :]
    return (s_k <= t_q) & (t_q <= key_end)


def _key_lists(needed):
    """Per query block, the needed key blocks first (in order) and their count: [n, n] int32, [n] int32."""
    order = jnp.argsort(~needed, axis=1, stable=True).astype(jnp.int32)
    return order, needed.sum(axis=1).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _skip_attention(q, k, v, mask, scale: float, block: int, tree: bool):
    return _skip_forward(q, k, v, mask, scale, block, tree)[0]


def _skip_forward(q, k, v, mask, scale, block, tree):
    # q: [B, K, G, Tp, H]; k, v: [B, K, Tp, H], Tp a multiple of `block`; mask as `_pairs_needed`'s.
    n = q.shape[3] // block
    order, count = _key_lists(_pairs_needed(mask, n, block, tree))
    row = q.shape[:3] + (block, 1)

    def query_block(i, carry):
        out, lse = carry
        a = i * block
        qi = jax.lax.dynamic_slice_in_dim(q, a, block, axis=3)

        def key_block(n_j, state):  # online softmax over the needed key blocks
            m, total, acc = state
            c = order[i, n_j] * block
            visible = _pair_mask(mask, a, c, block, tree)
            kj = jax.lax.dynamic_slice_in_dim(k, c, block, axis=2)
            vj = jax.lax.dynamic_slice_in_dim(v, c, block, axis=2)
            s = jnp.einsum("bkgth,bksh->bkgts", qi, kj, preferred_element_type=jnp.float32) * scale
            s = jnp.where(visible, s, _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
            rescale = jnp.exp(m - m_new)
            acc = acc * rescale + jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype), vj,
                                             preferred_element_type=jnp.float32)
            return m_new, total * rescale + jnp.sum(p, axis=-1, keepdims=True), acc

        init = (jnp.full(row, _NEG, jnp.float32), jnp.zeros(row, jnp.float32),
                jnp.zeros(qi.shape, jnp.float32))
        m, total, acc = jax.lax.fori_loop(0, count[i], key_block, init)
        total = jnp.where(total == 0, 1.0, total)  # a row with no visible key: output 0, gradient 0
        out = jax.lax.dynamic_update_slice_in_dim(out, (acc / total).astype(q.dtype), a, axis=3)
        return out, jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(total), a, axis=3)

    out, lse = jax.lax.fori_loop(0, n, query_block, (jnp.zeros_like(q), jnp.zeros(q.shape[:4] + (1,), jnp.float32)))
    return out, (q, k, v, mask, out, lse, order, count)


def _skip_backward(scale, block, tree, residuals, d_out):
    q, k, v, mask, out, lse, order, count = residuals
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)

    def query_block(i, carry):
        dq, dk, dv = carry
        a = i * block
        qi, do = (jax.lax.dynamic_slice_in_dim(x, a, block, axis=3) for x in (q, d_out))
        lse_i, delta_i = (jax.lax.dynamic_slice_in_dim(x, a, block, axis=3) for x in (lse, delta))

        def key_block(n_j, state):
            dq_i, dk, dv = state
            c = order[i, n_j] * block
            kj = jax.lax.dynamic_slice_in_dim(k, c, block, axis=2)
            vj = jax.lax.dynamic_slice_in_dim(v, c, block, axis=2)
            s = jnp.einsum("bkgth,bksh->bkgts", qi, kj, preferred_element_type=jnp.float32) * scale
            p = jnp.where(_pair_mask(mask, a, c, block, tree), jnp.exp(s - lse_i), 0.0)
            dv_j = jnp.einsum("bkgts,bkgth->bksh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgth,bksh->bkgts", do, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i) * scale).astype(q.dtype)
            dq_i = dq_i + jnp.einsum("bkgts,bksh->bkgth", ds, kj, preferred_element_type=jnp.float32)
            dk_j = jnp.einsum("bkgts,bkgth->bksh", ds, qi, preferred_element_type=jnp.float32)
            add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                acc, jax.lax.dynamic_slice_in_dim(acc, c, block, axis=2) + x, c, axis=2)
            return dq_i, add(dk, dk_j), add(dv, dv_j)

        dq_i, dk, dv = jax.lax.fori_loop(0, count[i], key_block, (jnp.zeros(qi.shape, jnp.float32), dk, dv))
        return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, a, axis=3), dk, dv

    zeros = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, q.shape[3] // block, query_block, zeros)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_skip_attention.defvjp(_skip_forward, _skip_backward)


def blockwise_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
                               scale: float, key_end: jax.Array | None = None, block_size: int = 128,
                               max_blocks: int = 8, skip_blocks: bool = False) -> jax.Array:
    """Self-attention under a causal mask (module docstring).

    Args:
      q: [B, T, N, H] queries; k, v: [B, T, K, H] keys and values, N a multiple of K (grouped-query attention).
      mask: [B, 1, T, T] bool, True where query t may see key s. It must be causal (False for every s > t): the
        blocks never look at later keys. Packing (segment ids) and padding are any further False entries.
      scale: the score scale (head_dim ** -0.5).
      key_end: instead of `mask`, [B, T] int: query t sees key s iff s <= t <= key_end[b, s] (prefix trees laid out
        in pre-order; -1: a key nobody sees).
      block_size: queries per block; 128 was fastest on 2 CPU cores at T = 1024 (benchmarks/RESULTS.md).
      max_blocks: the blocks are unrolled in the program, so longer sequences get larger blocks (T / max_blocks)
        to keep the compile time bounded. Not used with `skip_blocks` (its loops are compiled once, whatever T).
      skip_blocks: split the keys into blocks of `block_size` too and compute only the (query block, key block)
        pairs in which some query sees some key (`_skip_attention`): causal, packing, padding and tree masks then
        cost the visible blocks only. Same numbers up to float32 rounding (online softmax).
    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
    if (mask is None) == (key_end is None):
        raise ValueError("blockwise_causal_attention: pass exactly one of mask and key_end")
    info = mask[:, :, None] if key_end is None else key_end.astype(jnp.int32)
    tree = key_end is not None
    if skip_blocks:
        block = min(int(block_size), t)
        t_pad = -(-t // block) * block  # whole blocks; the padded keys are seen by nobody, padded queries dropped
        if t_pad > t:
            qg, kt, vt = _pad_seq(qg, 3, t_pad), _pad_seq(kt, 2, t_pad), _pad_seq(vt, 2, t_pad)
            info = _pad_seq(info, 1, t_pad, -1) if tree else _pad_seq(_pad_seq(info, 3, t_pad, False), 4, t_pad, False)
        out = _skip_attention(qg, kt, vt, info, float(scale), block, tree)[:, :, :, :t]
    else:
        out = _attention(qg, kt, vt, info, float(scale), max(int(block_size), -(-t // max_blocks)), tree)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
