"""The JAX KV-cache sampler: the embedded rollout engine (and the TPU path) behind `rollout.sampler.Sampler`.

One `generate` call runs, for a batch of trajectories:
  1. regather: the new call's cache rows are gathered from the previous call's cache (a continuing slot keeps its
     row, a branch copies its parent's row, a new trajectory gets an empty row), each truncated to the longest
     prefix that provably equals the request's token ids (host bookkeeping of what every row holds);
  2. prefill: only the uncached suffix of each request (a tool result, or the whole prompt), in right-padded
     chunks;
  3. decode: `decode_chunk` steps per jitted call (a `lax.scan` over the donated cache); EOS and max_tokens are
     detected on device, stop strings on the host between chunks, on incrementally decoded text (as vLLM does).

Shapes are bucketed so compiles stay bounded: batch B to powers of two (a multiple of the mesh's batch axes), the
cache length S (the longest context + new tokens; padding is never stored past it) and prefill chunks T (up to
`prefill_chunk`) in 1.5x / 2x steps. Each jitted function (jax_decode.py: the device side) counts its traces in
`TRACE_COUNTS` (a trace = a compile); samplers of one model share the compiled functions. On CPU and GPU the
model's layers run unrolled over per-layer weights and cache buffers (`jax_decode.unrolled_by_default`: a scan
copies every layer's weights and cache at every step), compiled in a few seconds at 30 layers on CPU, 21 s on an
H100; on TPU they run as one `lax.scan` (`Config.scan_layers`), whose compile costs about one layer's at any depth.

Memory: the weights are kept in the compute dtype (`decode_weights`, once per `update_weights`: every weight is
cast to it before use anyway; half the bytes of float32 masters), and with
`max_tokens_per_call` the requests of a call run in chunks, one after another, each chunk's cache at most that many
slots (rows bucket x cache length): the peak is set by the budget, not by the call's size. Outputs do not depend on
the chunking (per-request seeds, per-row computation). Only the last chunk's cache is kept for the next call (the
memory bound holds between calls too); requests that continue its rows run first, the others prefill their whole
context again (compute, where the alternative is memory that is not there). Finished rows are dropped between
chunks and between calls: a cache holds only its chunk's rows, and the next call gathers only the rows it continues.
`sleep` frees the weights and the cache until the next `update_weights` (the trainer's update runs meanwhile).

Cache invariant: every row is contiguous from slot 0 and slot index == RoPE position. Slots >= the row's
`lengths` are free (position -1). The host records, per saved slot, the token ids its row holds.

Log-probs (`settings.logprobs` > 0): top-k of the *processed* distribution, as vLLM V0 (the reference, spec 3.5)
returns them: log_softmax over the logits restricted to tokenizer ids, divided by the temperature and with
top-k/top-p truncation applied (truncated tokens have -inf and are not reported). At greedy (temperature 0) the
temperature is taken as 1 and no truncation applies (vLLM forces top_p=1, top_k=-1 then). With the training
settings (T=1, top_p=1, top_k=-1) this is the plain model log_softmax. `logprobs_mode="raw"` reports the model's
log_softmax (restricted to tokenizer ids) regardless of temperature/top-k/top-p (vLLM V1's default).
`settings.token_logprobs` adds the sampled token's log-prob (same distribution) at every position.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import Counter
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax.models.transformer import KVCache
from arpo_jax.rollout.jax_decode import (
    TRACE_COUNTS,
    decode_weights,
    input_major_graphdef,
    jitted,
    to_input_major,
    unrolled_layout,
)
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings, find_stop, request_seed
from arpo_jax.sharding import get_rules

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)
_SUMMED_STATS = ("batch", "reused_tokens", "prefill_tokens")  # `last_stats` that add up over a call's chunks
_DETOK_PRIME = 5  # prompt tokens that prime the incremental detokenizer (vLLM's initial offset)


def pow2_buckets(lo: int, hi: int, *, half_steps: bool = False, quarter_steps: bool = False) -> tuple[int, ...]:
    """Powers of two from `lo` up to the first one >= `hi` (with `half_steps`, also 1.5x each: 64, 96, 128, ...;
    with `quarter_steps`, also 1.25x, 1.5x and 1.75x: 64, 80, 96, 112, 128, ...)."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    steps = (5, 6, 7) if quarter_steps else (6,) if half_steps else ()
    return tuple(sorted(set(out) | {b * m // 4 for b in out[:-1] for m in steps}))


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


# ----------------------------------------------------------------------------------------------------------------
# Host side


class _Row:
    """Host state of one request during a call: generated ids, incremental text, stop detection, log-probs."""

    def __init__(self, tokenizer, context: np.ndarray, limit: int, stop: tuple[str, ...]):
        from tokenizers.decoders import DecodeStream

        self.tok = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.limit, self.stop = limit, stop
        self.gen: list[int] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.token_logprobs: list[float] = []  # the sampled tokens' (settings.token_logprobs)
        self.text = ""
        self.finish: str | None = None
        self.stop_string: str | None = None
        # Prime with the context's tail (as vLLM does) so the first generated token decodes in context; a tail that
        # starts inside a multi-byte character is shortened until it decodes cleanly.
        prime = [int(t) for t in context[-_DETOK_PRIME:]]
        while prime and "\ufffd" in self.tok.decode(prime, skip_special_tokens=True):
            prime = prime[1:]
        for t in prime:
            self.stream.step(self.tok, t)

    def add(self, token: int, eos: frozenset[int], logprobs: dict[int, float] | None) -> None:
        self.gen.append(token)
        if logprobs is not None:
            self.top_logprobs.append(logprobs)
        piece = self.stream.step(self.tok, token) or ""
        self.text += piece
        # Only where a match can end inside the new characters (vLLM's check_stop_strings).
        hit = find_stop(self.text, self.stop, new_chars=len(piece)) if piece else None
        if hit is not None:
            self.text, self.finish, self.stop_string = self.text[:hit[0]], "stop", hit[1]
            return
        if token in eos:
            self.finish = "eos"
        elif len(self.gen) >= self.limit:
            self.finish = "length"


@dataclasses.dataclass
class _Slot:
    row: int  # row of the cache kept from the last call
    tokens: np.ndarray  # the token ids that row holds, slot by slot


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class JaxSampler(Sampler):
    """Batched KV-cache sampler over a CausalLM (see the module docstring).

    Args:
      model: a CausalLM or its `(graphdef, state)` split (params may be sharded, as `from_pretrained(mesh=...)`).
      tokenizer: a HF fast tokenizer (decoding for stop strings, EOS ids, the ids sampling is restricted to).
      max_len: longest sequence (context + new tokens) a row may reach; generation stops there ("length").
      mesh: run sharded over this mesh: the batch over the `batch` mesh axes, KV heads over `tensor`.
      eos_ids: token ids that end generation; default: the tokenizer's EOS plus the model config's.
      decode_chunk: sampling steps per jitted decode call (the host checks stop strings in between).
      prefill_chunk: longest prefill chunk; longer suffixes are prefilled in several.
      batch_buckets / length_buckets: allowed B and S (cache length); default powers of two.
      logprobs_mode: "processed" (vLLM V0, the reference) or "raw" (see the module docstring).
      restrict_to_tokenizer: sample only ids the tokenizer knows (the reference's allowed_token_ids).
      max_tokens_per_call: KV-cache slots (rows bucket x cache length, the whole process) one program may hold;
        a call with more runs in chunks (module docstring). 0 = no limit.
      layout: "unrolled", "scanned" or "auto" (`jax_decode.unrolled_layout`); the same samples either way.
    """

    def __init__(self, model, tokenizer, *, max_len: int, mesh: Mesh | None = None,
                 eos_ids: Sequence[int] | None = None, decode_chunk: int = 16, prefill_chunk: int = 512,
                 batch_buckets: Sequence[int] | None = None, length_buckets: Sequence[int] | None = None,
                 logprobs_mode: str = "processed", restrict_to_tokenizer: bool = True, max_tokens_per_call: int = 0,
                 layout: str = "auto"):
        graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
        self.config = cfg = nnx.merge(graphdef, state).config
        self._model_graphdef, self._unrolled = graphdef, unrolled_layout(layout)
        self._model_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)  # update_weights
        if self._unrolled:  # the sampler keeps its own copy of the weights, laid out for the CPU's matmuls
            graphdef = input_major_graphdef(graphdef, state)
        self._graphdef = graphdef
        self._set_state(state)
        self.tokenizer, self.max_len, self.mesh = tokenizer, max_len, mesh
        if logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r}; allowed: 'processed', 'raw'")
        self.logprobs_mode = logprobs_mode
        self.decode_chunk, self.prefill_chunk = decode_chunk, prefill_chunk
        if max_tokens_per_call < 0:
            raise ValueError(f"max_tokens_per_call={max_tokens_per_call}; allowed: 0 (no limit) or > 0")
        self.max_tokens_per_call = max_tokens_per_call
        self._batch_multiple = 1
        if mesh is not None:
            self._batch_multiple = math.prod(mesh.shape[a] for a in get_rules(cfg.sharding_rules)["batch"])
        self.batch_buckets = tuple(batch_buckets or pow2_buckets(self._batch_multiple, 1 << 16))
        if any(b % self._batch_multiple for b in self.batch_buckets):
            raise ValueError(f"batch buckets {self.batch_buckets} must be multiples of {self._batch_multiple} "
                             "(the mesh's batch axes)")
        # Cache lengths step by 1.5x / 2x: attention cost per decode step is linear in S.
        self.length_buckets = tuple(length_buckets or pow2_buckets(64, max_len, half_steps=True))
        if eos_ids is None:
            eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            cfg_eos = cfg.eos_token_id
            eos |= set(cfg_eos if isinstance(cfg_eos, tuple) else () if cfg_eos is None else (cfg_eos,))
            eos_ids = sorted(eos)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._eos_arr = np.asarray(sorted(self.eos_ids) or [-1], np.int32)
        allowed = np.zeros(cfg.vocab_size, bool)
        ids = [i for i in tokenizer.get_vocab().values() if i < cfg.vocab_size]
        allowed[ids] = True
        self._allowed = jnp.asarray(allowed) if restrict_to_tokenizer and not allowed.all() else None
        self.trace_counts = TRACE_COUNTS
        self._fns = jitted(graphdef, cfg, self._unrolled)
        self._cache: KVCache | None = None
        self._slots: dict[int, _Slot] = {}
        self.last_stats: dict[str, int] = {}

    def _set_state(self, state) -> None:
        """The weights to sample with: the model's state (HF layout) in the compute dtype and the decode's layout."""
        self._state = None  # the old weights go before the new copy is made
        state = decode_weights(state, self.config.compute_dtype)
        if self._unrolled:
            state = to_input_major(self._model_graphdef)(state)
        self._state = jax.block_until_ready(state)

    def _mesh_ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else _NullCtx()

    # -- the Sampler interface ----------------------------------------------------------------------------------

    def update_weights(self, params_or_path) -> float:
        """New policy weights: a CausalLM, its nnx.State, a pure dict of it (`nnx.to_pure_dict`), or an HF folder.

        Returns the seconds taken. The arrays are used as given (no copy, no resharding): pass them in the
        sampler's dtype; another sharding than the last call's only costs a recompile.
        """
        t0 = time.perf_counter()
        if isinstance(params_or_path, nnx.Module):
            state = nnx.state(params_or_path)
        elif isinstance(params_or_path, (str, os.PathLike)):
            from arpo_jax.weights import hf
            _, state = hf.load_state(params_or_path, self.config, self.mesh)
        elif isinstance(params_or_path, dict) and not isinstance(params_or_path, nnx.State):
            state = jax.tree.map(lambda x: x, self._model_shapes)  # a new State tree (its leaves are all replaced)
            nnx.replace_by_pure_dict(state, params_or_path)
        else:
            state = params_or_path
        if jax.tree.structure(state) != jax.tree.structure(self._model_shapes):
            raise ValueError("update_weights: the new params do not have the structure of the sampler's model")
        self._set_state(state)
        # The cached keys/values were computed by the old weights: no cached row may be reused.
        self._slots.clear()
        return time.perf_counter() - t0

    def reset_cache(self) -> None:
        """Forgets every cached slot, so that a call does not depend on what earlier calls left in the cache."""
        self._slots.clear()
        self._cache = None  # a cache no slot points into is never read again: free it now

    def sleep(self) -> None:
        """Frees the weights and cache until the next `update_weights` (the trainer's update gives new ones)."""
        self._state = self._cache = None
        self._slots.clear()

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        if not requests:
            self._slots.clear()
            return []
        _check_settings(settings)
        if self._state is None:
            raise RuntimeError("JaxSampler.generate after sleep(): update_weights first")
        rows: list[_Row | None] = [None] * len(requests)
        stats: Counter[str] = Counter()
        try:
            with self._mesh_ctx():
                chunks = self._chunks(requests)
                for idx in chunks:
                    sub = [requests[i] for i in idx]
                    plan = self._plan(sub, idx)
                    h = self._prefill_all(plan)
                    for i, row in zip(idx, self._decode_all(plan, h, settings)):
                        rows[i] = row
                    self._save_slots(sub, plan)
                    for k, v in self.last_stats.items():  # counts add up, sizes are the largest chunk's
                        stats[k] = stats[k] + v if k in _SUMMED_STATS else max(stats[k], v)
        except BaseException:
            # `_plan` has already taken the cache: slots kept now would point into a cache that is gone, and the
            # next call would prefill only their suffixes onto empty rows.
            self._slots.clear()
            self._cache = None
            raise
        self.last_stats = dict(stats) | {"chunks": len(chunks)}
        return [SampleResult(r.gen, r.text, r.finish, r.stop_string, r.top_logprobs,
                             r.token_logprobs if settings.token_logprobs else None) for r in rows]

    def _chunks(self, requests: Sequence[SampleRequest]) -> list[list[int]]:
        """The requests' indices in the order they run, one list per chunk: all at once without a budget; with
        `max_tokens_per_call` as many rows as the largest batch bucket whose cache (rows x the call's longest cache
        length) fits it, the requests that continue a row of the cache kept from the last call first."""
        n = len(requests)
        if not self.max_tokens_per_call:
            return [list(range(n))]
        s = bucket(max(min(len(r.token_ids) + max(r.max_tokens, 1), self.max_len) for r in requests),
                    self.length_buckets, "cache length")
        fits = [b for b in self.batch_buckets if b * s <= self.max_tokens_per_call]
        if not fits:
            raise ValueError(f"max_tokens_per_call={self.max_tokens_per_call} holds no batch bucket of {s}-slot rows "
                             f"(the smallest is {self.batch_buckets[0]} rows, a multiple of the mesh's batch "
                             f"devices); allowed: 0 (no limit) or >= {self.batch_buckets[0] * s}")
        size = fits[-1]
        cached = [i for i, r in enumerate(requests)
                  if any(k is not None and k in self._slots for k in (r.slot_id, r.parent_id))]
        first = set(cached)
        order = cached + [i for i in range(n) if i not in first]
        return [order[k:k + size] for k in range(0, n, size)]

    # -- the three phases ---------------------------------------------------------------------------------------

    def _plan(self, requests: Sequence[SampleRequest], index: Sequence[int]) -> dict:
        """Decides rows, reusable prefixes and bucket sizes; builds this chunk's cache from the last one's.
        `index`: the requests' positions in the call (their seeds)."""
        n = len(requests)
        contexts = [np.asarray(r.token_ids, np.int32) for r in requests]
        src, keep = np.zeros(n, np.int32), np.zeros(n, np.int32)
        limits = np.zeros(n, np.int32)
        for i, (r, ctx) in enumerate(zip(requests, contexts)):
            if len(ctx) == 0 or len(ctx) >= self.max_len:
                raise ValueError(f"request {index[i]}: {len(ctx)} context tokens; need 1 .. max_len - 1 = "
                                 f"{self.max_len - 1}")
            if r.max_tokens < 1:
                raise ValueError(f"request {index[i]}: max_tokens={r.max_tokens} (must be >= 1)")
            limits[i] = min(r.max_tokens, self.max_len - len(ctx))
            slot = self._slots.get(r.slot_id) if r.slot_id is not None else None
            if slot is None and r.parent_id is not None:
                slot = self._slots.get(r.parent_id)
            if slot is not None:
                # At least one token must be fed to get next-token logits.
                src[i], keep[i] = slot.row, min(_common_prefix(slot.tokens, ctx), len(ctx) - 1)
        ctx_lens = np.asarray([len(c) for c in contexts], np.int32)
        suffix_max = int((ctx_lens - keep).max())
        # Prefill is compute bound (every padding token costs a real one's FLOPs): 1.25x steps, at the price of up
        # to twice as many (cheap: the layers are scanned) prefill compiles as 1.5x steps. A 150-token prompt takes
        # 160 instead of 192.
        t_buckets = pow2_buckets(16, self.prefill_chunk, quarter_steps=True)
        t = min(bucket(min(suffix_max, self.prefill_chunk), t_buckets, "prefill length"), self.prefill_chunk)
        # A prefill chunk's padding past the end of the cache is dropped (`_write_rows`), so S covers the real tokens
        # only: attention per decode step is linear in S.
        s = bucket(int((ctx_lens + limits).max()), self.length_buckets, "cache length")
        b = bucket(n, self.batch_buckets, "batch size")
        pad = b - n
        src_b, keep_b = np.pad(src, (0, pad)), np.pad(keep, (0, pad))
        if self._cache is None or not keep.any():
            self._cache = None  # nothing reusable: free the old cache before allocating
            cache = self._fns.init_cache(b, s)
        else:
            cache = self._fns.regather(self._cache, jnp.asarray(src_b), jnp.asarray(keep_b), s_new=s)
        self._cache = None
        self.last_stats = {"batch": n, "batch_bucket": b, "cache_len": s, "prefill_chunk": t,
                           "reused_tokens": int(keep.sum()), "prefill_tokens": int((ctx_lens - keep).sum())}
        return {"n": n, "b": b, "t": t, "s": s, "contexts": contexts, "keep": keep, "ctx_lens": ctx_lens,
                "limits": limits, "cache": cache, "index": list(index)}

    def _prefill_all(self, plan: dict) -> jax.Array:
        """Prefills every row's uncached suffix; returns the hidden state [B, D] of each row's last token."""
        b, t, keep, ctx_lens = plan["b"], plan["t"], plan["keep"], plan["ctx_lens"]
        lens = ctx_lens - keep
        n_chunks = -(-int(lens.max()) // t)
        width = n_chunks * t
        ids = np.zeros((b, width), np.int32)
        valid = np.zeros((b, width), bool)
        for i, ctx in enumerate(plan["contexts"]):
            ids[i, :lens[i]] = ctx[keep[i]:]
            valid[i, :lens[i]] = True
        positions = np.pad(keep, (0, b - plan["n"]))[:, None] + np.arange(width)[None]
        last = np.pad(lens - 1, (0, b - plan["n"]), constant_values=-1)  # index of each row's last token
        cache = plan.pop("cache")
        h = jnp.zeros((b, self.config.hidden_size), self.config.compute_dtype)
        for c in range(n_chunks):
            sl = slice(c * t, (c + 1) * t)
            last_c = np.where((last >= c * t) & (last < (c + 1) * t), last - c * t, -1).astype(np.int32)
            cache, h = self._fns.prefill(self._state, cache, h, jnp.asarray(ids[:, sl]),
                                         jnp.asarray(positions[:, sl].astype(np.int32)), jnp.asarray(valid[:, sl]),
                                         jnp.asarray(last_c), fresh=c == 0 and not keep.any())
        plan["cache"] = cache
        return h

    def _decode_all(self, plan: dict, h: jax.Array, settings: SamplingSettings) -> list[_Row]:
        n, b = plan["n"], plan["b"]
        rows = [_Row(self.tokenizer, ctx, int(lim), tuple(settings.stop))
                for ctx, lim in zip(plan["contexts"], plan["limits"])]
        written: list[list[int]] = [[] for _ in range(n)]
        greedy = settings.temperature < _SAMPLING_EPS
        truncate = not greedy and (settings.top_k > 0 or settings.top_p < 1.0)
        pad = (0, b - n)
        fixed = {
            "row_ids": jnp.asarray(self._row_seeds(plan["contexts"], plan["index"], settings.seed, b)),
            "ctx_lens": jnp.asarray(np.pad(plan["ctx_lens"], pad)),
            "limits": jnp.asarray(np.pad(plan["limits"], pad)), "eos_ids": jnp.asarray(self._eos_arr),
            "allowed": self._allowed, "seed": jnp.uint32(settings.seed & 0xFFFFFFFF),
            "temperature": jnp.float32(max(settings.temperature, _SAMPLING_EPS)), "top_k": jnp.int32(settings.top_k),
            "top_p": jnp.float32(settings.top_p)}
        cache, ngen = plan.pop("cache"), jnp.zeros((b,), jnp.int32)
        active = np.zeros(b, bool)
        active[:n] = True
        step0, max_limit = 0, int(plan["limits"].max())
        while active.any():
            lp_k = settings.logprobs if step0 < settings.logprob_positions else 0
            remaining = min(max_limit - step0, self.decode_chunk)
            n_steps = min(self.decode_chunk, bucket(remaining, pow2_buckets(1, self.decode_chunk), "steps"))
            cache, h, dev_active, ngen, out = self._fns.decode(
                self._state, cache, h, jnp.asarray(active), ngen, **fixed, n_steps=n_steps, greedy=greedy,
                truncate=truncate, n_logprobs=lp_k, raw_logprobs=self.logprobs_mode == "raw",
                tok_logprobs=settings.token_logprobs)
            out = jax.device_get(out)
            for i in np.flatnonzero(active):
                row = rows[i]
                written[i].extend(out["tok"][i][out["written"][i]].tolist())
                for j in np.flatnonzero(out["sampled"][i]):
                    lps = None
                    if lp_k and len(row.gen) < settings.logprob_positions:
                        lps = _logprob_dict(out["top_vals"][i, j], out["top_ids"][i, j], out["tok"][i, j],
                                            out["tok_lp"][i, j])
                    if settings.token_logprobs:
                        row.token_logprobs.append(float(out["tok_lp"][i, j]))
                    row.add(int(out["tok"][i, j]), self.eos_ids, lps)
                    if row.finish is not None:
                        active[i] = False
                        break
            active &= np.asarray(dev_active)
            step0 += n_steps
        self._cache = cache
        plan["written"] = written
        return rows

    @staticmethod
    def _row_seeds(contexts, index, seed: int, b: int) -> np.ndarray:
        """Each row's `sampler.request_seed` (of its position `index` in the call; the padding rows' are 0): what
        its PRNG keys fold in, so a request samples the same in any chunk."""
        seeds = np.zeros(b, np.uint32)
        seeds[:len(contexts)] = [request_seed(seed, i, ctx) for i, ctx in zip(index, contexts)]
        return seeds

    def _save_slots(self, requests: Sequence[SampleRequest], plan: dict) -> None:
        """Remembers what each slot's row holds; slots absent from this chunk are dropped (their rows freed)."""
        self._slots = {}
        for i, r in enumerate(requests):
            if r.slot_id is not None:
                held = np.concatenate([plan["contexts"][i], np.asarray(plan["written"][i], np.int32)])
                self._slots[r.slot_id] = _Slot(i, held)
        if not self._slots:
            self._cache = None


def _logprob_dict(vals, ids, tok, tok_lp) -> dict[int, float]:
    """{id: logprob} of the top-k plus the sampled token (vLLM's k or k+1 entries); -inf (truncated) dropped."""
    d = {int(i): float(v) for i, v in zip(ids, vals) if np.isfinite(v)}
    if int(tok) not in d and np.isfinite(tok_lp):
        d[int(tok)] = float(tok_lp)
    return d


def _check_settings(s: SamplingSettings) -> None:
    if s.temperature < 0:
        raise ValueError(f"temperature={s.temperature} must be >= 0")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p={s.top_p} must be in (0, 1]")
    if s.top_k == 0 or s.top_k < -1:
        raise ValueError(f"top_k={s.top_k} must be -1 (off) or >= 1")
    if s.logprobs < 0 or s.logprob_positions < 0:
        raise ValueError(f"logprobs={s.logprobs}, logprob_positions={s.logprob_positions} must be >= 0")


class _NullCtx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
