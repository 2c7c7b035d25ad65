"""Token log-probs and entropy of a model's outputs, chunked along the sequence so the [B, T, V] logits are never
materialised at once (``token_logprobs_and_entropy_from_hidden``: from the final hidden states, with a closed-form
backward per chunk). Float32 whatever the input dtype; pure functions, jittable (chunk sizes are static).

Shape letters: B = sequences, T = response length, V = vocabulary, D = model width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from arpo_jax import sharding

Array = jax.Array


def _shifted_stats(z: Array) -> tuple[Array, Array, Array]:
    """Max-shifted softmax statistics of float32 logits z [..., V].

    Returns ``(zs, lse_s, mean_s)``: ``zs = z - max(z)`` (<= 0), ``lse_s = logsumexp(zs)`` (in [0, log V]) and
    ``mean_s = E_p[zs]`` (<= 0). Then ``log p = zs - lse_s`` and ``H = lse_s - mean_s``: a sum of two non-negative
    terms of the size of H itself. Unshifted, ``H = lse - E_p[z]`` subtracts two numbers of the size of the
    logits, and exp(z - lse) carries lse's rounding (2e-5 nats on LLM-like logits, negative H when peaked).
    """
    zs = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse_s = jax.nn.logsumexp(zs, axis=-1)
    mean_s = jnp.sum(jnp.exp(zs - lse_s[..., None]) * zs, axis=-1)
    return zs, lse_s, mean_s


def _logprob_entropy(z: Array, targets: Array) -> tuple[Array, Array]:
    """float32 logits z [..., V], targets [...] -> (log p(target) [...], entropy [...])."""
    zs, lse_s, mean_s = _shifted_stats(z)
    target_logit = jnp.take_along_axis(zs, targets[..., None], axis=-1)[..., 0]
    return target_logit - lse_s, lse_s - mean_s  # finite logits assumed


def _chunked_over_time(chunk_fn: Callable[[int | Array, int], tuple[Array, Array]], t: int,
                       chunk_size: int | None) -> tuple[Array, Array]:
    """Runs ``chunk_fn(start, size) -> ([B, size], [B, size])`` over T in chunks and concatenates along T.

    Full chunks go through a rematerialised ``lax.scan`` so neither the forward nor the backward pass keeps
    more than one chunk of [B, chunk, V] float32 logits alive; a static tail handles ``T % chunk_size``.
    """
    size = t if chunk_size is None else max(1, min(int(chunk_size), t))
    n_full, tail = divmod(t, size)
    step = jax.checkpoint(lambda start: chunk_fn(start, size))  # recompute the chunk's softmax in backward

    def body(carry, i):
        return carry, step(i * size)

    _, (lp_cbs, ent_cbs) = jax.lax.scan(body, None, jnp.arange(n_full))  # [C, B, size]
    b = lp_cbs.shape[1]
    logp = jnp.moveaxis(lp_cbs, 0, 1).reshape(b, n_full * size)  # [B, C*size]
    ent = jnp.moveaxis(ent_cbs, 0, 1).reshape(b, n_full * size)
    if tail:
        lp_tail, ent_tail = chunk_fn(n_full * size, tail)
        logp, ent = jnp.concatenate([logp, lp_tail], 1), jnp.concatenate([ent, ent_tail], 1)
    return logp, ent


def token_logprobs_and_entropy(logits: Array, targets: Array, *, temperature: float = 1.0,
                               chunk_size: int | None = 256) -> tuple[Array, Array]:
    """Log-prob of each target token and the full-vocabulary entropy, from logits, in float32.

    ``z = logits / temperature`` (spec 9: divide before log-softmax), ``log p = z[target] - logsumexp(z)``,
    ``H = logsumexp(z) - sum softmax(z) z``, both evaluated on ``z - max(z)`` (``_shifted_stats``). The sequence
    axis is processed ``chunk_size`` positions at a time, so float32 temporaries stay at [B, chunk_size, V] even
    when ``logits`` is bf16 [B, T, V].

    Args:
      logits: [B, T, V] logits (any float dtype); ``logits[b, t]`` predicts ``targets[b, t]``.
      targets: [B, T] integer token ids.
      temperature: sampling temperature.
      chunk_size: positions per chunk along T (static); None = one chunk.

    Returns:
      (logp [B, T], entropy [B, T]), float32.
    """
    t = logits.shape[1]

    def chunk_fn(start, size):
        z = jax.lax.dynamic_slice_in_dim(logits, start, size, axis=1).astype(jnp.float32) / temperature
        return _logprob_entropy(z, jax.lax.dynamic_slice_in_dim(targets, start, size, axis=1))

    return _chunked_over_time(chunk_fn, t, chunk_size)


def token_logprobs_and_entropy_from_hidden(hidden: Array, unembed: Array, targets: Array, *,
                                           temperature: float = 1.0,
                                           chunk_size: int | None = 256,
                                           rules: str | None = None) -> tuple[Array, Array]:
    """Like ``token_logprobs_and_entropy`` but from final hidden states and the unembedding matrix.

    Logits are formed ``chunk_size`` positions at a time and never kept: the forward pass saves only two floats
    per position (logsumexp and the mean logit under the softmax, both of the max-shifted logits: see
    ``_shifted_stats``), and the backward pass recomputes each chunk's logits once and applies the closed-form
    gradients (``d logp / dz = onehot - p``, ``dH / dz = -p (z - E_p[z])``, also evaluated on shifted logits)
    instead of differentiating the softmax graph. Memory stays at [B, chunk, V] float32 forward and backward, for
    the same four matmuls as rematerialisation and fewer passes over the chunk (half the time of autodiff through
    a rematerialised scan on CPU, benchmarks/RESULTS.md).

    Args:
      hidden: [B, T, D] final (post-norm) hidden states.
      unembed: [D, V] output projection (for tied embeddings pass ``embedding.T``).
      targets: [B, T] integer token ids.
      temperature: sampling temperature.
      chunk_size: positions per chunk along T (static); None = one chunk.
      rules: the sharding rules preset, under a mesh (`jax.set_mesh`), for an ``unembed`` in its param shards
        (FSDP: D split): the head gathers it over D (else GSPMD contracts over the split D and all-reduces the
        [B, chunk, V] logits of the whole batch), and the backward keeps one float32 gradient partial per batch
        shard through the chunks, summed once at the end straight into the param's shards (a reduce-scatter).
        Without it GSPMD keeps the loop's [V, D] gradient replicated and all-reduces it after every chunk: 2 GiB a
        chunk for a 152k x 3584 vocabulary, ~30 TB a step for the 7B config (`arpo-jax plan`).

    Returns:
      (logp [B, T], entropy [B, T]), float32.
    """
    b, t, d = hidden.shape
    size = t if chunk_size is None else max(1, min(int(chunk_size), t))
    n = -(-t // size)
    pad = n * size - t  # pad T to whole chunks; padded positions get zero cotangents and are cut off
    h_nbcd = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, size, d).swapaxes(0, 1)
    t_nbc = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, size).swapaxes(0, 1)
    logp, ent = _fused_head(h_nbcd, unembed.T, t_nbc, float(temperature), rules)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * size)[:, :t]
    return unchunk(logp), unchunk(ent)


def _chunk_logits(h_bcd: Array, w_vd: Array, temperature: float) -> Array:
    """One chunk's float32 logits z [B, C, V]."""
    return jnp.einsum("bcd,vd->bcv", h_bcd, w_vd, preferred_element_type=jnp.float32) / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_head(h_nbcd, w_vd, targets_nbc, temperature, rules):
    return _fused_head_fwd(h_nbcd, w_vd, targets_nbc, temperature, rules)[0]


def _fused_head_fwd(h_nbcd, w_vd, targets_nbc, temperature, rules):
    if rules:
        w_vd = sharding.constrain(w_vd, ("act_vocab", None), rules)  # gathered over D (see the rules argument)

    def body(_, xs):
        h, tg = xs
        zs, lse_s, mean_s = _shifted_stats(_chunk_logits(h, w_vd, temperature))
        logp = jnp.take_along_axis(zs, tg[..., None], axis=-1)[..., 0] - lse_s
        return None, (logp, lse_s - mean_s, lse_s, mean_s)

    _, (logp, ent, lse_s, mean_s) = jax.lax.scan(body, None, (h_nbcd, targets_nbc))
    return (logp, ent), (h_nbcd, w_vd, targets_nbc, lse_s, mean_s)


def _fused_head_bwd(temperature, rules, residuals, cotangents):
    h_nbcd, w_vd, targets_nbc, lse_s_nbc, mean_s_nbc = residuals
    d_logp_nbc, d_ent_nbc = cotangents
    # d W sums over the batch rows, which the mesh splits S ways: each shard accumulates its own partial [S, V, D]
    # (no communication in the loop) and the S partials are summed once after it.
    shards = sharding.batch_shards(h_nbcd.shape[1], rules)
    per_shard = lambda x: x.reshape(shards, -1, *x.shape[1:])  # [B, ...] -> [S, B / S, ...]
    keep_split = lambda d_w: sharding.constrain(d_w, ("batch", None, None), rules) if rules else d_w

    def body(d_w_svd, xs):
        h, tg, lse_s, mean_s, d_logp, d_ent = xs
        z = _chunk_logits(h, w_vd, temperature)
        # The forward's shifted logits again (same max): p and z - E_p[z] from numbers of the size of H, not of z.
        zs = z - jnp.max(z, axis=-1, keepdims=True)
        p = jnp.exp(zs - lse_s[..., None])
        onehot = jnp.arange(z.shape[-1]) == tg[..., None]
        d_logp, d_ent, mean_s = d_logp[..., None], d_ent[..., None], mean_s[..., None]
        d_z = jnp.where(onehot, d_logp, 0.0) - p * (d_logp + d_ent * (zs - mean_s))
        d_z = (d_z / temperature).astype(w_vd.dtype)
        d_h = jnp.einsum("bcv,vd->bcd", d_z, w_vd, preferred_element_type=jnp.float32).astype(h.dtype)
        d_w_svd = d_w_svd + jnp.einsum("sbcv,sbcd->svd", per_shard(d_z), per_shard(h),
                                       preferred_element_type=jnp.float32)
        return keep_split(d_w_svd), d_h

    xs = (h_nbcd, targets_nbc, lse_s_nbc, mean_s_nbc, d_logp_nbc, d_ent_nbc)
    d_w, d_h = jax.lax.scan(body, keep_split(jnp.zeros((shards, *w_vd.shape), jnp.float32)), xs)
    d_w = d_w.sum(0)
    if rules:  # summed straight into the unembedding's param shards: a reduce-scatter, not an all-reduce
        d_w = sharding.constrain(d_w, ("vocab", "embed"), rules)
    return d_h, d_w.astype(w_vd.dtype), None


_fused_head.defvjp(_fused_head_fwd, _fused_head_bwd)
