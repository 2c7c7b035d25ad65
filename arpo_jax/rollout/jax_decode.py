"""The JAX sampler's device side: its jitted programs (prefill, decode steps, cache regather and init) and the
sampling maths they run (`process_logits`, `sample_categorical`), over a `KVCache` whose rows the host side
(jax_sampler.py) plans. Each program counts its traces in `TRACE_COUNTS`; `jitted` caches them per architecture,
so samplers of one model share them.
"""

from __future__ import annotations

import functools
from collections import Counter
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax.models.transformer import KVCache, input_major_linears
from arpo_jax.sharding import constrain


def _constrain_cache(cache: KVCache, rules: str) -> KVCache:
    kv_axes = (None, "batch", "act_kv_heads", None, None)
    if isinstance(cache.k, tuple):  # per layer
        k, v = (tuple(constrain(x, kv_axes[1:], rules) for x in xs) for xs in (cache.k, cache.v))
    else:
        k, v = constrain(cache.k, kv_axes, rules), constrain(cache.v, kv_axes, rules)
    return KVCache(k, v, constrain(cache.positions, ("batch", None), rules),
                   constrain(cache.lengths, ("batch",), rules))


def process_logits(logits, allowed, temperature, top_k, top_p, *, greedy: bool, truncate: bool):
    """Processed logits [B, V] as vLLM samples from them: tokenizer-id mask, then /T, top-k, top-p (-inf = cut).

    top_k <= 0 is off; top-p keeps the smallest prefix of the sorted distribution whose mass before each kept
    token is < top_p (vLLM's rule); ties at a threshold are kept.
    """
    z = jnp.where(allowed[None], logits, -jnp.inf) if allowed is not None else logits
    if greedy:
        return z
    z = z / temperature
    if truncate:
        v = z.shape[-1]
        desc = -jnp.sort(-z, axis=-1)  # [B, V]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        in_top_k = jnp.arange(v)[None] < k
        desc = jnp.where(in_top_k, desc, -jnp.inf)
        p = jax.nn.softmax(desc, axis=-1)
        # in_top_k again: past the k-th token p is 0, and a float cumsum that ends below 1 would keep them all.
        keep = ((jnp.cumsum(p, axis=-1) - p) < top_p) & in_top_k
        keep = keep.at[:, 0].set(True)
        thresh = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)  # smallest kept logit
        z = jnp.where(z < thresh, -jnp.inf, z)
    return z


def _first_true(hit: jax.Array, fallback: jax.Array) -> jax.Array:
    """Index of the first True along the last axis, or of the last True of `fallback` where `hit` has none."""
    last = fallback.shape[-1] - 1 - jnp.argmax(fallback[..., ::-1], axis=-1)
    return jnp.where(hit.any(-1), jnp.argmax(hit, axis=-1), last)


def sample_categorical(keys: jax.Array, z: jax.Array, block: int = 256) -> jax.Array:
    """One token per row from logits z [B, V] (-inf: never), with one uniform number per row: inverse CDF.

    The distribution of `jax.random.categorical`, whose Gumbel-max trick draws V random numbers per row: on CPU at
    B = 32, V = 49152 that cost more than the LM head (43 vs 27 CPU-ms a step). The cumulative sums go in two
    levels (block masses, then within the chosen block) so their float32 rounding stays relative to one block's
    mass; a token of zero mass is never chosen, even where rounding makes the sums flat.
    """
    b, v = z.shape
    n_blocks = -(-v // block)
    p = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))  # unnormalised; exp(-inf) = 0
    p = jnp.pad(p, ((0, 0), (0, n_blocks * block - v))).reshape(b, n_blocks, block)
    mass = p.sum(-1)  # [B, n_blocks]
    cum = jnp.cumsum(mass, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    target = u * cum[:, -1]  # in [0, total)
    blk = _first_true((cum > target[:, None]) & (mass > 0), mass > 0)
    rows = jnp.arange(b)
    rest = target - (cum[rows, blk] - mass[rows, blk])  # the target's offset inside the chosen block
    inner = p[rows, blk]  # [B, block]
    j = _first_true((jnp.cumsum(inner, axis=-1) > rest[:, None]) & (inner > 0), inner > 0)
    return blk * block + j


def _decode_chunk(graphdef, state, cache, h, active, ngen, row_ids, ctx_lens, limits, eos_ids, allowed, seed,
                  temperature, top_k, top_p, *, n_steps, greedy, truncate, n_logprobs, raw_logprobs, rules,
                  tok_logprobs=False):
    """`n_steps` sampling steps. Each: logits from the carried hidden state -> sample -> feed the token.

    A row samples while `active`; a sampled token is written to the cache unless it ends the row (EOS or the
    row's limit), so a row holds context + its generated tokens but the last. Per-row PRNG key of generated
    position t: fold_in(fold_in(fold_in(key(seed), row_ids = the request's seed), context length), t), independent
    of batching.
    A per-layer cache (`KVCache.per_layer`, `unrolled_layout`) runs the layers unrolled over it, each step reading and
    writing every layer's buffer in place; a stacked one runs them as the model's config says.
    """
    model = nnx.merge(graphdef, state)
    layers = None
    if not isinstance(cache.k, tuple) and model.config.scan_layers:
        layers = model.stacked_layers()  # the stored stacked params (no copy), split once per call
    base = jax.random.key(seed)
    row_keys = jax.vmap(lambda i, c: jax.random.fold_in(jax.random.fold_in(base, i), c))(row_ids, ctx_lens)

    def step(carry, _):
        cache, h, active, ngen = carry
        logits = model.logits(h[:, None])[:, 0]  # [B, V] float32
        z = process_logits(logits, allowed, temperature, top_k, top_p, greedy=greedy, truncate=truncate)
        if greedy:
            tok = jnp.argmax(z, axis=-1)
        else:
            keys = jax.vmap(jax.random.fold_in)(row_keys, ngen)
            tok = sample_categorical(keys, z)
        tok = tok.astype(jnp.int32)
        sampled = active
        ngen = ngen + active.astype(jnp.int32)
        done = jnp.isin(tok, eos_ids) | (ngen >= limits)
        written = active & ~done
        hidden, cache = model.extend_hidden(tok[:, None], (ctx_lens + ngen - 1)[:, None], cache, written[:, None],
                                            layers)
        h = jnp.where(written[:, None], hidden[:, 0], h)
        out = {"tok": tok, "sampled": sampled, "written": written}
        if n_logprobs or tok_logprobs:  # tok_logprobs: the sampled token's log-prob at every step
            if raw_logprobs:  # the model's distribution over tokenizer ids
                lp = jax.nn.log_softmax(logits if allowed is None else jnp.where(allowed[None], logits, -jnp.inf))
            else:  # the distribution sampled from
                lp = jax.nn.log_softmax(z, axis=-1)
            if n_logprobs:
                out["top_vals"], out["top_ids"] = jax.lax.top_k(lp, n_logprobs)
            out["tok_lp"] = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        return (cache, h, active & ~done, ngen), out

    (cache, h, active, ngen), outs = jax.lax.scan(step, (cache, h, active, ngen), None, length=n_steps)
    outs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)  # [n, B, ...] -> [B, n, ...]
    return _constrain_cache(cache, rules), h, active, ngen, outs


def _prefill_chunk(graphdef, state, cache, h, ids, positions, valid, last_idx, *, rules, fresh):
    """Appends one right-padded chunk [B, T]; keeps the hidden state of each row's last prompt token. `fresh`: no
    row holds anything yet, so the chunk attends to itself only (`CausalLM.extend_hidden`)."""
    model = nnx.merge(graphdef, state)
    hidden, cache = model.extend_hidden(ids, positions, cache, valid, fresh=fresh)
    sel = jnp.take_along_axis(hidden, jnp.maximum(last_idx, 0)[:, None, None], axis=1)[:, 0]  # [B, D]
    h = jnp.where((last_idx >= 0)[:, None], sel.astype(h.dtype), h)
    return _constrain_cache(cache, rules), h


def _regather(cache, rows, keep, *, s_new, rules):
    """New cache [B', s_new] from rows `rows` of the old one, row b truncated to its first keep[b] tokens."""
    s_old = cache.positions.shape[1]

    def fit(x, fill=0):  # k / v [(L,) B, K, S, H] or positions [B, S]: rows `rows`, S cut or padded to s_new
        b_axis, s_axis = (0, 1) if x.ndim == 2 else (x.ndim - 4, x.ndim - 2)
        x = jnp.take(x, rows, axis=b_axis)
        if s_new <= s_old:
            return jax.lax.slice_in_dim(x, 0, s_new, axis=s_axis)
        pad = [(0, 0)] * x.ndim
        pad[s_axis] = (0, s_new - s_old)
        return jnp.pad(x, pad, constant_values=fill)

    k, v = jax.tree.map(fit, (cache.k, cache.v))  # stacked [L, B, K, S, H] or tuples of [B, K, S, H]
    pos = fit(cache.positions, -1)
    pos = jnp.where(jnp.arange(s_new)[None] < keep[:, None], pos, -1)
    return _constrain_cache(KVCache(k, v, pos, keep.astype(jnp.int32)), rules)


# Traces (= compiles) of the jitted sampler functions, process-wide: samplers of the same model share them.
TRACE_COUNTS: Counter[str] = Counter()


def _counted(name, fn):
    def traced(*args, **kw):
        TRACE_COUNTS[name] += 1  # runs at trace time only
        return fn(*args, **kw)
    return traced


LAYOUTS = ("auto", "unrolled", "scanned")  # JaxSampler(layout=...), rollout.jax.layout


def unrolled_by_default() -> bool:
    """Whether `layout="auto"` unrolls: on CPU and GPU, not on TPU. The unrolled layout lays Linear weights out
    inputs first and per layer (`input_major_linears`, which also unstacks the stored stacked layers; once per
    weights) and runs the layers unrolled over per-layer cache buffers (`KVCache.per_layer`, the cache's layout from
    allocation on). The scan instead copies a slice of every stacked weight and of every layer's cache at every
    step: on CPU about a third of a decode step at batch 32 on SmolLM2 (XLA's CPU matmuls also copy weights not laid
    out inputs first); on an H100 43% of the decode's GPU time (memcpy + dynamic-slice kernels), and unrolled the
    sampler ran 1.76x faster at Qwen2.5-1.5B's shape (benchmarks/RESULTS.md, "Decode layouts on an H100"). The price
    is compiles that grow with depth (21 s instead of 12 s at 28 layers on the H100). TPUs keep the scan
    (unmeasured there; `rollout.jax.layout=unrolled` tries it)."""
    return jax.default_backend() in ("cpu", "gpu", "cuda", "rocm")


def unrolled_layout(layout: str) -> bool:
    """Whether a sampler with `layout` runs the unrolled layout: "unrolled" (per-layer weights laid out inputs first
    and per-layer cache buffers), "scanned" (one `lax.scan` over the stored stacked layers and a stacked cache), or
    "auto" (`unrolled_by_default`: unrolled on CPU and GPU, scanned on TPU)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; allowed: {', '.join(LAYOUTS)}")
    return layout == "unrolled" or (layout == "auto" and unrolled_by_default())


@functools.lru_cache(maxsize=8)
def jitted(graphdef, cfg, per_layer_cache: bool = False) -> SimpleNamespace:
    """The jitted prefill / decode / regather / init functions of one model architecture (cache donated)."""
    rules = cfg.sharding_rules
    return SimpleNamespace(
        prefill=jax.jit(_counted("prefill", functools.partial(_prefill_chunk, graphdef, rules=rules)),
                        static_argnames=("fresh",), donate_argnums=(1, 2)),
        decode=jax.jit(_counted("decode", functools.partial(_decode_chunk, graphdef, rules=rules)),
                       static_argnames=("n_steps", "greedy", "truncate", "n_logprobs", "raw_logprobs",
                                        "tok_logprobs"),
                       donate_argnums=(1, 2, 4)),
        # Not donated: the new cache has another shape, so XLA could not reuse the old buffers anyway.
        regather=jax.jit(_counted("regather", functools.partial(_regather, rules=rules)), static_argnames=("s_new",)),
        init_cache=jax.jit(_counted("init_cache", lambda b, s: _constrain_cache(new_cache(cfg, b, s, per_layer_cache),
                                                                                rules)),
                           static_argnums=(0, 1)),
    )


def new_cache(cfg, b: int, s: int, per_layer: bool) -> KVCache:
    cache = KVCache.init(cfg, b, s)
    return cache.per_layer() if per_layer else cache


def decode_weights(state, dtype):
    """The sampler's copy of the weights: floating leaves in `dtype` (the model's compute dtype), other leaves
    copied. Every weight is cast to the compute dtype before it is used (embedding rows, Linear weights and biases,
    norm scales, the unembedding, LoRA adapters), so this copy holds the values the model computes with, at half
    the bytes of float32 masters and without a cast per call. (Not always bitwise: XLA's CPU backend upcasts bf16
    dots to float32 and, allowed excess precision, may then read a float32 weight unrounded.) Always new buffers:
    the caller's may be donated (the train step donates its params)."""
    dt = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dt else jnp.copy(x)

    return jax.tree.map(cast, state)


@functools.lru_cache(maxsize=8)
def to_input_major(graphdef):
    """jitted: the model's state -> the state of its `input_major_linears` copy (see `unrolled_by_default`)."""
    return jax.jit(lambda state: nnx.state(input_major_linears(nnx.merge(graphdef, state))))


def input_major_graphdef(graphdef, state):
    """The graphdef of `to_input_major(graphdef)`'s model (state: arrays or ShapeDtypeStructs)."""
    return nnx.split(nnx.eval_shape(lambda s: input_major_linears(nnx.merge(graphdef, s)), state))[0]
