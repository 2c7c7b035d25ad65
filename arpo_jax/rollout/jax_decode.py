"""The JAX engine's device side: a fixed set of jitted programs over one persistent cache of `slots` rows.

The programs, every shape fixed by `EngineShape` (so by the config alone):
  * `init`: the `DecodeState` (KV cache [slots, cache_len], each row's last hidden state, the decode's row flags);
  * `prefill` at each (rows G, length T) of `EngineShape.prefill`: the next chunk of G rows' contexts, the rows
    picked by an index vector (the cache gathered by row and written back in place); a row's first chunk first cuts
    it to the tokens the host knows it shares with the request (`keep`);
  * `copy`: rows of the cache into other rows in place (an ARPO branch starts from its parent's cache);
  * `decode` at each row count of `EngineShape.decode_rows` and each cache length of `EngineShape.decode_lengths`:
    `decode_steps` sampling steps of every row, or of the live rows picked by an index vector, attending over the
    first `kv_len` slots of each row (the host picks the shortest length that holds every live row's tokens by the
    end of the call). Sampling settings are traced values (greedy, top-k/top-p, the log-prob window), so validation
    and training run the same program; EOS, each row's token limit and the stop strings' token sequences stop a row
    on the device; a chunk in which no row is active does nothing.
`engine_programs` lists them with abstract arguments, so a caller compiles them all ahead (`JaxSampler.warm_up`;
`arpo-jax plan`). Each program also counts its traces in `TRACE_COUNTS`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from types import SimpleNamespace
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax.models.transformer import KVCache, input_major_linears
from arpo_jax.sharding import constrain

PREFILL_LENGTHS = (32, 128)  # prefill chunk lengths below `prefill_chunk` (which is the longest)


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine's fixed sizes; every program's shapes follow from them."""

    slots: int  # rows of the persistent KV cache: the decode batch
    cache_len: int  # slots per row (S): the longest context + new tokens, rounded up
    prefill: tuple[tuple[int, int], ...]  # (rows G, length T) of each prefill program, shortest first
    decode_steps: int  # sampling steps per decode call
    copy_rows: int  # rows one copy call moves
    max_logprobs: int  # top-k log-probs the decode program returns per position
    decode_rows: tuple[int, ...] = ()  # rows of each decode program, fewest first (the last: all `slots`)
    stop_seqs: int = 8  # stop-string token sequences the decode checks (Q)
    stop_len: int = 16  # tokens of the longest one (M)
    decode_lengths: tuple[int, ...] = ()  # cache slots each decode program attends over, shortest first (the last:
    # `cache_len`); () = `cache_len` alone
    kv_dtype: str | None = None  # the cache's dtype; None: the model's compute dtype

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.decode_lengths or (self.cache_len,)


def engine_shape(*, max_len: int, slots: int, prefill_chunk: int, decode_chunk: int, max_logprobs: int = 20,
                 batch_multiple: int = 1, max_tokens_per_call: int = 0, decode_rows: str = "auto",
                 decode_lengths: str = "auto", kv_dtype: str = "auto") -> EngineShape:
    """The sizes for contexts up to `max_len` tokens: `slots` rows (a multiple of `batch_multiple`, the mesh's
    batch devices; with `max_tokens_per_call`, at most that many cache slots in all), prefill programs of
    `prefill_chunk` tokens each (G x T: T in 32, 128 and `prefill_chunk`, at most the cache length), decode
    programs of `DECODE_ROWS[decode_rows]` rows (`decode_row_counts`) over `decode_lengths` cache lengths
    (`decode_length_buckets`), and the cache in `kv_dtype` (`kv_cache_dtype`)."""
    cache_len = -(-max_len // 32) * 32
    slots = -(-max(slots, 1) // batch_multiple) * batch_multiple
    if max_tokens_per_call:
        fit = max_tokens_per_call // cache_len // batch_multiple * batch_multiple
        if fit < 1:
            raise ValueError(f"max_tokens_per_call={max_tokens_per_call} holds no {batch_multiple} row(s) of "
                             f"{cache_len} slots (a multiple of the mesh's batch devices); allowed: 0 (no limit) or "
                             f">= {batch_multiple * cache_len}")
        slots = min(slots, fit)
    longest = max(1, min(prefill_chunk, cache_len))
    lengths = sorted({min(t, longest) for t in PREFILL_LENGTHS} | {longest})
    prefill = tuple((max(1, min(slots, prefill_chunk // t)), t) for t in lengths)
    rows = decode_row_counts(decode_rows, slots, batch_multiple)
    return EngineShape(slots, cache_len, prefill, decode_chunk, min(slots, 8), max_logprobs, rows,
                       decode_lengths=decode_length_buckets(decode_lengths, cache_len),
                       kv_dtype=kv_cache_dtype(kv_dtype))


DECODE_ROWS = ("auto", "all", "quarters")  # rollout.jax.decode_rows
DECODE_LENGTHS = ("auto", "all", "halves")  # rollout.jax.decode_lengths
KV_DTYPES = ("auto", "bfloat16", "float32", "compute")  # rollout.jax.kv_dtype


def decode_length_buckets(mode: str, cache_len: int) -> tuple[int, ...]:
    """Cache lengths of the decode programs: "all" = one, the whole cache; "halves" = also 1/2 and 1/4 of it (multiples
    of 32), so a call whose rows hold few tokens reads (and attends over) only the slots they fill: the decode
    step's KV reads follow the live lengths, not the buffer (what a paged engine's ragged attention does with page
    tables, vLLM / tpu-inference; here a few fixed programs, as tpu-inference and JetStream pad to a few compiled
    lengths); "auto" = halves on accelerators, where a decode step is bound by the bytes it reads, all on CPU (its
    decode is bound by the matmuls, and each program is one more compile)."""
    if mode not in DECODE_LENGTHS:
        raise ValueError(f"decode_lengths={mode!r}; allowed: {', '.join(DECODE_LENGTHS)}")
    if mode == "all" or (mode == "auto" and jax.default_backend() == "cpu"):
        return (cache_len,)
    return tuple(sorted({max(32, -(-cache_len // d // 32) * 32) for d in (4, 2)} | {cache_len}))


def kv_cache_dtype(mode: str) -> str | None:
    """The KV cache's dtype: "bfloat16", "float32", "compute" (None: the model's compute dtype), or "auto" = bfloat16
    on accelerators (a decode step's KV reads are most of its bytes at long contexts: a float32 model's cache read
    ~22x its weights at 1k tokens and 256 rows; vLLM and JetStream keep bf16 or narrower caches whatever the
    weights) and the compute dtype on CPU (XLA's CPU dots upcast bf16, so a bf16 cache only costs conversions)."""
    if mode not in KV_DTYPES:
        raise ValueError(f"kv_dtype={mode!r}; allowed: {', '.join(KV_DTYPES)}")
    if mode == "compute" or (mode == "auto" and jax.default_backend() == "cpu"):
        return None
    return "bfloat16" if mode == "auto" else mode


def decode_row_counts(mode: str, slots: int, multiple: int = 1) -> tuple[int, ...]:
    """Rows of the decode programs: "all" = one program over every row; "quarters" = also 1/4 and 1/16 of them (the
    live rows gathered, so a round's tail of a few rows costs a few rows' matmuls: what a CPU's compute-bound decode
    wants); "auto" = quarters on CPU, all elsewhere (an accelerator's decode reads the weights whatever the rows,
    and each program is one more compile)."""
    if mode not in DECODE_ROWS:
        raise ValueError(f"decode_rows={mode!r}; allowed: {', '.join(DECODE_ROWS)}")
    if mode == "all" or (mode == "auto" and jax.default_backend() != "cpu"):
        return (slots,)
    fewer = {-(-slots // d // multiple) * multiple for d in (4, 16)}
    return tuple(sorted(r for r in fewer | {slots} if r <= slots))


class DecodeState(NamedTuple):
    """What the device keeps between calls (donated through every program)."""

    cache: KVCache  # [slots, S] rows
    h: jax.Array  # [slots, D] hidden state of each row's last token (its next logits)
    active: jax.Array  # [slots] bool: the row samples
    ngen: jax.Array  # [slots] int32: tokens the row has sampled since it was admitted
    recent: jax.Array  # [slots, M] int32: its last M sampled tokens (-1: none), for the stop sequences


class Knobs(NamedTuple):
    """A decode call's sampling settings, as traced scalars (one program for every setting)."""

    seed: jax.Array  # uint32
    temperature: jax.Array  # float32, > 0
    top_k: jax.Array  # int32, <= 0: off
    top_p: jax.Array  # float32
    greedy: jax.Array  # bool
    truncate: jax.Array  # bool: top-k or top-p applies
    window: jax.Array  # int32: positions that need top-k log-probs
    want_top: jax.Array  # bool: top-k log-probs requested
    want_token_lp: jax.Array  # bool: the sampled token's log-prob at every position


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


def _processed(logits, allowed, k: Knobs):
    """`process_logits` with greedy and truncation as traced switches (only the branch taken runs)."""

    def z(greedy: bool, truncate: bool):
        return lambda x: process_logits(x, allowed, k.temperature, k.top_k, k.top_p, greedy=greedy, truncate=truncate)

    sampled = lambda x: jax.lax.cond(k.truncate, z(False, True), z(False, False), x)  # noqa: E731
    return jax.lax.cond(k.greedy, z(True, False), sampled, logits)


def _stop_hit(recent, seqs, on):
    """[B] bool: a row's last tokens recent [B, M] end with one of the enabled (`on` [Q]) sequences seqs [Q, M]
    (right-aligned, -1 = no token there)."""
    same = (seqs[None] < 0) | (recent[:, None] == seqs[None])  # [B, Q, M]
    return (same.all(-1) & on[None]).any(-1)


def _logprobs(logits, z, allowed, tok, *, n_logprobs: int, raw: bool) -> dict:
    """Top-`n_logprobs` log-probs [B, K] and the sampled token's [B]: of the distribution sampled from (z), or
    with `raw` of the model's over the tokenizer ids."""
    if raw:
        lp = jax.nn.log_softmax(logits if allowed is None else jnp.where(allowed[None], logits, -jnp.inf), axis=-1)
    else:
        lp = jax.nn.log_softmax(z, axis=-1)
    vals, ids = jax.lax.top_k(lp, n_logprobs)
    return {"top_vals": vals, "top_ids": ids, "tok_lp": jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]}


def _decode(graphdef, params, ds: DecodeState, rows, admit, stop_host, limits, ctx_lens, seeds, eos_ids, stop_seqs,
            stop_on, allowed, knobs: Knobs, *, n_steps, n_logprobs, raw_logprobs, rules, kv_len=None):
    """Up to `n_steps` sampling steps of the rows `rows` [G] (None: every row; an index past the end: padding),
    returning after the step in which a row finishes (`steps`: how many ran). Each: logits from the row's hidden
    state -> sample -> feed the token. The per-row inputs are the G rows'.

    `kv_len` (static; None: the whole cache): the steps run over a copy of the cache's first `kv_len` slots, taken
    at the call's start and written back at its end, so each step reads (and attends over) `kv_len` slots, not the
    buffer's S: the caller's bound on what the live rows hold by the end of the call (a row past it would see a cut
    context; slots past it are untouched). A slice feeding the attention's matmuls in every step would be copied
    by XLA at every step (3x its bytes, measured on CPU); once per call it costs 4 x kv_len / `n_steps` a step.

    Rows in `admit` start (their prefill is done), rows in `stop_host` stop (the host found a stop string). A row
    samples while active; a sampled token is written to the cache unless it ends the row (EOS, the row's limit, a
    stop sequence), so a row holds context + its generated tokens but the last. Per-row PRNG key of generated
    position t: fold_in(fold_in(fold_in(key(seed), the request's seed), context length), t), independent of the
    row, the number of rows and the order of admission.
    """
    model = nnx.merge(graphdef, params)
    layers = None
    if not isinstance(ds.cache.k, tuple) and model.config.scan_layers:
        layers = model.stacked_layers()  # the stored stacked params (no copy), split once per call
    base = jax.random.key(knobs.seed)
    row_keys = jax.vmap(lambda i, c: jax.random.fold_in(jax.random.fold_in(base, i), c))(seeds, ctx_lens)
    lp_fn = functools.partial(_logprobs, allowed=allowed, n_logprobs=n_logprobs, raw=raw_logprobs)
    pick = (lambda x, fill=0: x) if rows is None else (  # noqa: E731
        lambda x, fill=0: jnp.take(x, rows, axis=0, mode="fill", fill_value=fill))

    def step(carry, _):
        cache, h, active, ngen, recent = carry
        logits = model.logits(h[:, None])[:, 0]  # [G, V] float32
        z = _processed(logits, allowed, knobs)
        keys = jax.vmap(jax.random.fold_in)(row_keys, ngen)
        tok = jax.lax.cond(knobs.greedy, lambda x: jnp.argmax(x, axis=-1), lambda x: sample_categorical(keys, x), z)
        tok = tok.astype(jnp.int32)
        in_window = active & (ngen < knobs.window)
        ngen = ngen + active.astype(jnp.int32)
        recent = jnp.where(active[:, None], jnp.concatenate([recent[:, 1:], tok[:, None]], axis=1), recent)
        done = jnp.isin(tok, eos_ids) | (ngen >= limits) | _stop_hit(recent, stop_seqs, stop_on)
        written = active & ~done
        hidden, cache = model.extend_hidden(tok[:, None], (ctx_lens + ngen - 1)[:, None], cache, written[:, None],
                                            layers, rows=rows)
        h = jnp.where(written[:, None], hidden[:, 0], h)
        need = (knobs.want_top & in_window.any()) | knobs.want_token_lp
        shapes = jax.eval_shape(lp_fn, logits, z, tok=tok)
        lps = jax.lax.cond(need, lambda: lp_fn(logits, z, tok=tok),
                           lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        out = {"tok": tok, "sampled": active, "written": written, **lps}
        return (cache, h, active & ~done, ngen, recent), out

    def go_on(state):
        i, carry, _, finished = state
        return (i < n_steps) & ~finished & carry[2].any()

    def body(state):
        i, carry, outs, _ = state
        was_active = carry[2]
        carry, out = step(carry, None)
        outs = jax.tree.map(lambda buf, x: buf.at[i].set(x), outs, out)
        return i + 1, carry, outs, (was_active & ~carry[2]).any()

    carry = (_window(ds.cache, kv_len), pick(ds.h), admit | (pick(ds.active) & ~stop_host),
             jnp.where(admit, 0, pick(ds.ngen)), jnp.where(admit[:, None], -1, pick(ds.recent, -1)))
    shapes = jax.eval_shape(step, carry, None)[1]
    outs = jax.tree.map(lambda s: jnp.zeros((n_steps, *s.shape), s.dtype), shapes)  # a step not run samples nothing
    # The call returns at the step a row finishes (or when no row is active: a call the host dispatched ahead of
    # what it read may find none), so that the host sees the finish at once and the row's next request, or another
    # waiting one, can enter at the next call instead of a whole chunk later.
    start = (jnp.int32(0), carry, outs, jnp.bool_(False))
    steps, (cache, h, active, ngen, recent), outs, _ = jax.lax.while_loop(go_on, body, start)
    outs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)  # [n, G, ...] -> [G, n, ...]
    put = (lambda full, x: x) if rows is None else (lambda full, x: full.at[rows].set(x, mode="drop"))  # noqa: E731
    ds = DecodeState(_unwindow(ds.cache, cache), put(ds.h, h), put(ds.active, active), put(ds.ngen, ngen),
                     put(ds.recent, recent))
    return _constrain_state(ds, rules), outs | {"active": active, "steps": steps}


def _window(cache: KVCache, n: int | None) -> KVCache:
    """The cache's first n slots of every row (a copy; n None: the cache itself)."""
    if n is None:
        return cache
    cut = lambda x, axis: jax.lax.slice_in_dim(x, 0, n, axis=axis)  # noqa: E731
    kv = (lambda xs: tuple(cut(x, 2) for x in xs)) if isinstance(cache.k, tuple) else (lambda x: cut(x, 3))
    return KVCache(kv(cache.k), kv(cache.v), cut(cache.positions, 1), cache.lengths)


def _unwindow(cache: KVCache, window: KVCache) -> KVCache:
    """`cache` with its first slots replaced by `window` (`_window`'s), in place."""
    if window.positions.shape == cache.positions.shape:
        return window
    put = lambda x, w, axis: jax.lax.dynamic_update_slice_in_dim(x, w, 0, axis=axis)  # noqa: E731
    if isinstance(cache.k, tuple):
        k, v = (tuple(put(x, w, 2) for x, w in zip(xs, ws)) for xs, ws in ((cache.k, window.k), (cache.v, window.v)))
    else:
        k, v = put(cache.k, window.k, 3), put(cache.v, window.v, 3)
    return KVCache(k, v, put(cache.positions, window.positions, 1), window.lengths)


def _prefill(graphdef, params, ds: DecodeState, rows, ids, positions, valid, last, keep, *, rules):
    """Appends one right-padded chunk ids [G, T] to rows `rows` [G] of the cache, in place (a row past the end is
    padding); keeps the hidden state of a row's last context token when the chunk holds it (`last` >= 0: its index).
    A row with keep >= 0 (its first chunk) is first cut to its first `keep` slots: what the host knows it shares with
    the request."""
    model = nnx.merge(graphdef, params)
    cache = ds.cache
    s = cache.positions.shape[1]
    pos = jnp.take(cache.positions, rows, axis=0, mode="fill", fill_value=-1)
    lengths = jnp.take(cache.lengths, rows, axis=0, mode="fill", fill_value=0)
    cut = keep >= 0
    pos = jnp.where(cut[:, None] & (jnp.arange(s)[None] >= keep[:, None]), -1, pos)
    cache = cache._replace(positions=cache.positions.at[rows].set(pos, mode="drop"),
                           lengths=cache.lengths.at[rows].set(jnp.where(cut, keep, lengths), mode="drop"))
    hidden, cache = model.extend_hidden(ids, positions, cache, valid, rows=rows)
    sel = jnp.take_along_axis(hidden, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]  # [G, D]
    old = jnp.take(ds.h, rows, axis=0, mode="fill", fill_value=0)
    h = ds.h.at[rows].set(jnp.where((last >= 0)[:, None], sel.astype(ds.h.dtype), old), mode="drop")
    return _constrain_state(ds._replace(cache=cache, h=h), rules)


def _copy(ds: DecodeState, src, dst, *, rules):
    """Cache rows dst [W] <- rows src [W], in place, one layer at a time (a dst past the end is dropped): a branch
    starts from its parent's row."""
    move = lambda x: x.at[dst].set(x[src], mode="drop")  # noqa: E731  [B, ...] -> [B, ...]
    cache = ds.cache
    if isinstance(cache.k, tuple):  # per layer [B, K, S, H]
        k, v = tuple(map(move, cache.k)), tuple(map(move, cache.v))
    else:  # stacked [L, B, K, S, H]: a loop over the layers, so that one layer's rows are in flight at a time
        def layer(i, kv):
            return tuple(jax.lax.dynamic_update_index_in_dim(x, move(x[i]), i, 0) for x in kv)

        k, v = jax.lax.fori_loop(0, cache.k.shape[0], layer, (cache.k, cache.v))
    cache = KVCache(k, v, move(cache.positions), move(cache.lengths))
    return _constrain_state(ds._replace(cache=cache), rules)


def _init(cfg, shape: EngineShape, per_layer: bool) -> DecodeState:
    b = shape.slots
    h = jnp.zeros((b, cfg.hidden_size), cfg.compute_dtype)
    return DecodeState(new_cache(cfg, b, shape.cache_len, per_layer, shape.kv_dtype), h, jnp.zeros((b,), bool),
                       jnp.zeros((b,), jnp.int32), jnp.full((b, shape.stop_len), -1, jnp.int32))


# Traces (= compiles) of the jitted engine functions, process-wide: samplers of the same model share them.
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
def jitted(graphdef, cfg, shape: EngineShape, per_layer_cache: bool = False, raw_logprobs: bool = False
           ) -> SimpleNamespace:
    """The jitted init / prefill / copy / decode functions of one model architecture and engine shape (the
    `DecodeState` donated through each; `decode` one per cache length of `shape.lengths`)."""
    rules = cfg.sharding_rules
    decode = functools.partial(_decode, graphdef, rules=rules, n_steps=shape.decode_steps,
                               n_logprobs=shape.max_logprobs, raw_logprobs=raw_logprobs)
    return SimpleNamespace(
        init=jax.jit(_counted("init", lambda: _constrain_state(_init(cfg, shape, per_layer_cache), rules))),
        prefill=jax.jit(_counted("prefill", functools.partial(_prefill, graphdef, rules=rules)), donate_argnums=(1,)),
        copy=jax.jit(_counted("copy", functools.partial(_copy, rules=rules)), donate_argnums=(0,)),
        # {cache length: the decode attending over that many slots}
        decode={n: jax.jit(_counted("decode", functools.partial(decode, kv_len=None if n >= shape.cache_len else n)),
                           donate_argnums=(1,)) for n in shape.lengths},
    )


def _constrain_state(ds: DecodeState, rules: str) -> DecodeState:
    """Every leaf of the state in one fixed layout, its rows split like the cache's: `init` and every program
    return it so, so each call gets the state in the shardings the programs were compiled for. (Left to GSPMD, a
    prefill on an fsdp mesh returned `h` split over its hidden axis instead of replicated, as `init` made it: the
    next decode compiled again, twice, after the warm-up.)"""
    return DecodeState(_constrain_cache(ds.cache, rules), constrain(ds.h, ("batch", "act_embed"), rules),
                       constrain(ds.active, ("batch",), rules), constrain(ds.ngen, ("batch",), rules),
                       constrain(ds.recent, ("batch", None), rules))


def _abstract(x):
    """`x`'s ShapeDtypeStruct as a call sees it: an uncommitted array (one never placed on purpose, e.g. a model
    built outside a mesh) has no sharding, as the call's lowering gives it none; giving it its device's sharding
    lowers another program (the same HLO under another cache key: the call would compile it again)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    committed = getattr(x, "committed", False)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)


def engine_programs(fns: SimpleNamespace, shape: EngineShape, params, ds, *, n_eos: int, vocab: int | None
                    ) -> dict[str, tuple]:
    """Every program the engine runs, as {name: (jitted function, abstract arguments)}: `fn.lower(*args)` compiles
    it without running it. `params` / `ds`: the weights and the `DecodeState` (arrays or ShapeDtypeStructs; e.g.
    `jax.eval_shape(fns.init)`); `n_eos`: the EOS ids; `vocab`: the allowed-ids mask's length (None: no mask)."""
    params, ds = jax.tree.map(_abstract, params), jax.tree.map(_abstract, ds)
    sds = jax.ShapeDtypeStruct
    b, i32, u32, f32, bool_ = shape.slots, jnp.int32, jnp.uint32, jnp.float32, jnp.bool_
    out = {"init": (fns.init, ())}
    for g, t in shape.prefill:
        out[f"prefill_{g}x{t}"] = (fns.prefill, (params, ds, sds((g,), i32), sds((g, t), i32), sds((g, t), i32),
                                                 sds((g, t), bool_), sds((g,), i32), sds((g,), i32)))
    w = shape.copy_rows
    out["copy"] = (fns.copy, (ds, sds((w,), i32), sds((w,), i32)))
    knobs = Knobs(*(sds((), dt) for dt in (u32, f32, i32, f32, bool_, bool_, i32, bool_, bool_)))
    q, m = shape.stop_seqs, shape.stop_len
    for g in shape.decode_rows:  # the all-rows program takes no index vector (no gathers)
        rows = None if g == b else sds((g,), i32)
        args = (params, ds, rows, sds((g,), bool_), sds((g,), bool_), sds((g,), i32), sds((g,), i32), sds((g,), u32),
                sds((n_eos,), i32), sds((q, m), i32), sds((q,), bool_), None if vocab is None else sds((vocab,), bool_),
                knobs)
        for n in shape.lengths:  # named by rows alone with one length (the whole cache)
            name = f"decode_{g}" if len(shape.lengths) == 1 else f"decode_{g}x{n}"
            out[name] = (fns.decode[n], args)
    return out


def new_cache(cfg, b: int, s: int, per_layer: bool, dtype: str | None = None) -> KVCache:
    cache = KVCache.init(cfg, b, s, dtype and jnp.dtype(dtype))
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
