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

The mask is either a [B, 1, T, T] bool array or, for prefix trees (`arpo_jax.tree_packing`), a rule on one int per
key: `key_end[b, s]`, the last slot whose query may see key s. Rows laid out in pre-order make "a token sees its
ancestors and itself" the interval test `s <= t <= key_end[s]` (the slot is the pre-order index; key_end is the
end of the key's subtree), evaluated per block inside the kernel: no [T, T] array exists. Flat packed sequences are
the special case of chains (key_end = the last slot of the key's sequence; -1 for padding).
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


def blockwise_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None, *,
                               scale: float, key_end: jax.Array | None = None, block_size: int = 128,
                               max_blocks: int = 8) -> jax.Array:
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
        to keep the compile time bounded.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
    block = max(int(block_size), -(-t // max_blocks))
    if (mask is None) == (key_end is None):
        raise ValueError("blockwise_causal_attention: pass exactly one of mask and key_end")
    info = mask[:, :, None] if key_end is None else key_end.astype(jnp.int32)
    out = _attention(qg, kt, vt, info, float(scale), block, key_end is not None)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
