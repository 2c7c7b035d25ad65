"""The JAX KV-cache engine: the embedded rollout engine (and the TPU path) behind `rollout.sampler.Sampler`.

A fixed set of programs, known from the engine's sizes alone (`jax_decode.EngineShape`: `slots` rows x a cache
length from `max_len`, a few prefill lengths, one to three decode row counts), compiled once (`warm_up`, or the
first call), so no call compiles anything whatever its batch, prompt lengths, tool results or sampling settings:

* one persistent KV cache of `slots` rows: a request runs in a row; a trajectory's next request continues in its
  row (only the new suffix, e.g. a tool result, is prefilled), an ARPO branch copies its parent's row into a free
  one in place; each row is cut to the longest prefix that provably equals the request's token ids (host
  bookkeeping, `jax_slots.SlotTable`);
* continuous batching: a call may hold more requests than rows; a row whose request finishes takes the next
  waiting one (copy, prefill) while the other rows keep decoding;
* prefill in chunks of a few fixed (rows, length) shapes, every chunk picking the rows it advances;
* decode in calls of `decode_chunk` steps over every row (on CPU, over the live rows when 1/4 or 1/16 of the rows
  hold them: `decode_rows`); EOS, each row's token limit and the stop strings' usual token sequences stop a row on
  the device. The host dispatches decode call k + 1 before it reads call k, then reads k's tokens and checks the
  stop strings on their incrementally decoded text (as vLLM does; authoritative: a stop string the device did not
  see ends its row at most one call later, the extra tokens dropped).

Outputs depend on neither the number of rows nor the order of admission: each request's PRNG keys fold in its own
seed (`sampler.request_seed`), context length and position; rows never mix.

On CPU and GPU the model's layers run unrolled over per-layer weights and cache buffers
(`jax_decode.unrolled_by_default`: a scan copies every layer's weights and cache at every step); on TPU as one
`lax.scan` (`Config.scan_layers`), whose compile costs about one layer's at any depth.

Memory: the weights are kept in the compute dtype (`decode_weights`, once per `update_weights`), and the cache is
`slots` x cache length (with `max_tokens_per_call`, `slots` is cut to fit that many cache slots). `sleep` frees the
weights and the cache until the next `update_weights` (the trainer's update runs meanwhile).

Cache invariant: every row is contiguous from slot 0 and slot index == RoPE position. Slots >= the row's `lengths`
are free (position -1).

Log-probs (`settings.logprobs` > 0): top-k of the *processed* distribution, as vLLM V0 (the reference, spec 3.5)
returns them: log_softmax over the logits restricted to tokenizer ids, divided by the temperature and with
top-k/top-p truncation applied (truncated tokens have -inf and are not reported). At greedy (temperature 0) the
temperature is taken as 1 and no truncation applies (vLLM forces top_p=1, top_k=-1 then). With the training
settings (T=1, top_p=1, top_k=-1) this is the plain model log_softmax. `logprobs_mode="raw"` reports the model's
log_softmax (restricted to tokenizer ids) regardless of temperature/top-k/top-p (vLLM V1's default).
`settings.token_logprobs` adds the sampled token's log-prob (same distribution) at every position.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax.rollout.jax_decode import (
    TRACE_COUNTS,
    Knobs,
    decode_weights,
    engine_programs,
    engine_shape,
    input_major_graphdef,
    jitted,
    to_input_major,
    unrolled_layout,
)
from arpo_jax.rollout.jax_slots import SlotTable, common_prefix
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings, find_stop, request_seed
from arpo_jax.sharding import get_rules

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)
_DETOK_PRIME = 5  # prompt tokens that prime the incremental detokenizer (vLLM's initial offset)
_STOP_PREFIXES = ("", " ", "\n")  # a stop string's token sequences checked on the device: alone and after these


def pow2_buckets(lo: int, hi: int, *, half_steps: bool = False, quarter_steps: bool = False) -> tuple[int, ...]:
    """Powers of two from `lo` up to the first one >= `hi` (with `half_steps`, also 1.5x each: 64, 96, 128, ...;
    with `quarter_steps`, also 1.25x, 1.5x and 1.75x: 64, 80, 96, 112, 128, ...)."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    steps = (5, 6, 7) if quarter_steps else (6,) if half_steps else ()
    return tuple(sorted(set(out) | {b * m // 4 for b in out[:-1] for m in steps}))


def engine_kwargs(cfg, processes: int) -> dict:
    """`JaxSampler`'s settings from an experiment config (`rollout.jax`, `rollout.entropy_top_k`), `processes` the
    run's process count: `slots` = 0 means one rollout worker's trajectories (its prompts x rollout.n)."""
    j = cfg.rollout.jax
    workers = cfg.rollout.workers or processes
    slots = j.slots or max(1, cfg.data.train_batch_size // workers) * cfg.rollout.n
    return dict(slots=slots, decode_chunk=j.decode_chunk, prefill_chunk=j.prefill_chunk,
                max_tokens_per_call=j.max_tokens_per_call, layout=j.layout,
                max_logprobs=max(20, cfg.rollout.entropy_top_k), decode_rows=j.decode_rows,
                decode_lengths=j.decode_lengths, kv_dtype=j.kv_dtype)


def config_programs(cfg, graphdef, abstract_state, *, processes: int = 1, batch_multiple: int = 1, n_eos: int = 1,
                    vocab_mask: bool = True) -> dict[str, tuple]:
    """The programs a run's JAX engine compiles, from the config and the model's abstract state alone (nothing is
    allocated): {name: (jitted function, abstract arguments)} as `JaxSampler.programs`, for `arpo-jax plan`.
    `n_eos` / `vocab_mask`: what the tokenizer gives (its EOS ids; a mask when it covers less than the vocab)."""
    kw = engine_kwargs(cfg, processes)
    shape = engine_shape(max_len=cfg.data.max_prompt_length + cfg.data.max_response_length, slots=kw["slots"],
                         prefill_chunk=kw["prefill_chunk"], decode_chunk=kw["decode_chunk"],
                         max_logprobs=kw["max_logprobs"], batch_multiple=batch_multiple,
                         max_tokens_per_call=kw["max_tokens_per_call"], decode_rows=kw["decode_rows"],
                         decode_lengths=kw["decode_lengths"], kv_dtype=kw["kv_dtype"])
    model_cfg = nnx.merge(graphdef, abstract_state).config
    unrolled = unrolled_layout(kw["layout"])
    state = jax.eval_shape(lambda s: decode_weights(s, model_cfg.compute_dtype), abstract_state)  # as `_set_state`
    if unrolled:
        graphdef, state = input_major_graphdef(graphdef, state), jax.eval_shape(to_input_major(graphdef), state)
    fns = jitted(graphdef, model_cfg, shape, unrolled)
    return engine_programs(fns, shape, state, jax.eval_shape(fns.init), n_eos=n_eos,
                           vocab=model_cfg.vocab_size if vocab_mask else None)


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


class JaxSampler(Sampler):
    """KV-cache engine over a CausalLM with fixed decode slots (see the module docstring).

    Args:
      model: a CausalLM or its `(graphdef, state)` split (params may be sharded, as `from_pretrained(mesh=...)`).
      tokenizer: a HF fast tokenizer (decoding for stop strings, EOS ids, the ids sampling is restricted to).
      max_len: longest sequence (context + new tokens) a row may reach; generation stops there ("length").
      mesh: run sharded over this mesh: the rows over the `batch` mesh axes, KV heads over `tensor`.
      eos_ids: token ids that end generation; default: the tokenizer's EOS plus the model config's.
      slots: rows of the KV cache (the decode batch), rounded up to a multiple of the mesh's batch devices; a call
        with more requests runs them as rows free up.
      decode_chunk: sampling steps per decode call.
      prefill_chunk: tokens (rows x length) per prefill call, and the longest prefill length.
      logprobs_mode: "processed" (vLLM V0, the reference) or "raw" (see the module docstring).
      restrict_to_tokenizer: sample only ids the tokenizer knows (the reference's allowed_token_ids).
      max_tokens_per_call: KV-cache slots (rows x cache length) the engine may hold; `slots` is cut to fit it.
        0 = no limit.
      layout: "unrolled", "scanned" or "auto" (`jax_decode.unrolled_layout`); the same samples either way.
      max_logprobs: the most top log-probs per position a call may ask for (vLLM's max_logprobs).
      decode_rows: "all" (one decode program over every row), "quarters" (also over 1/4 and 1/16 of the rows, for
        a round's tail) or "auto" (quarters on CPU; `jax_decode.decode_row_counts`).
      decode_lengths: "all", "halves" (also decode programs over the cache's first 1/2 and 1/4, picked by the live
        rows' lengths; the same samples) or "auto" (halves on accelerators; `jax_decode.decode_length_buckets`).
      kv_dtype: "bfloat16", "float32", "compute" or "auto" (bfloat16 on accelerators; `jax_decode.kv_cache_dtype`).
    """

    def __init__(self, model, tokenizer, *, max_len: int, mesh: Mesh | None = None,
                 eos_ids: Sequence[int] | None = None, slots: int = 32, decode_chunk: int = 16,
                 prefill_chunk: int = 512, logprobs_mode: str = "processed", restrict_to_tokenizer: bool = True,
                 max_tokens_per_call: int = 0, layout: str = "auto", max_logprobs: int = 20,
                 decode_rows: str = "auto", decode_lengths: str = "auto", kv_dtype: str = "auto"):
        graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
        self.config = cfg = nnx.merge(graphdef, state).config
        self._model_graphdef, self._unrolled = graphdef, unrolled_layout(layout)
        self._model_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)  # update_weights
        if self._unrolled:  # the sampler keeps its own copy of the weights, laid out for the CPU's matmuls
            graphdef = input_major_graphdef(graphdef, state)
        self._graphdef = graphdef
        self._weight_shardings = None  # the first weights' (`_set_state`): every program is compiled for them
        self._set_state(state)
        self.tokenizer, self.max_len, self.mesh = tokenizer, max_len, mesh
        if logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode={logprobs_mode!r}; allowed: 'processed', 'raw'")
        if max_tokens_per_call < 0:
            raise ValueError(f"max_tokens_per_call={max_tokens_per_call}; allowed: 0 (no limit) or > 0")
        multiple = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in get_rules(cfg.sharding_rules)["batch"]]))
        self.shape = engine_shape(max_len=max_len, slots=slots, prefill_chunk=prefill_chunk,
                                  decode_chunk=decode_chunk, max_logprobs=max_logprobs, batch_multiple=multiple,
                                  max_tokens_per_call=max_tokens_per_call, decode_rows=decode_rows,
                                  decode_lengths=decode_lengths, kv_dtype=kv_dtype)
        if eos_ids is None:
            eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            cfg_eos = cfg.eos_token_id
            eos |= set(cfg_eos if isinstance(cfg_eos, tuple) else () if cfg_eos is None else (cfg_eos,))
            eos_ids = sorted(eos)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._eos_arr = np.asarray(sorted(self.eos_ids) or [-1], np.int32)
        allowed = np.zeros(cfg.vocab_size, bool)
        allowed[[i for i in tokenizer.get_vocab().values() if i < cfg.vocab_size]] = True
        self._allowed = allowed if restrict_to_tokenizer and not allowed.all() else None
        self.trace_counts = TRACE_COUNTS
        self._fns = jitted(graphdef, cfg, self.shape, self._unrolled, logprobs_mode == "raw")
        self.table = SlotTable(self.shape.slots)
        self._ds = None  # the device's `DecodeState`, allocated at the first call (or `warm_up`)
        self._warm = False
        self._stops: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.last_stats: dict[str, int] = {}

    def _set_state(self, state) -> None:
        """The weights to sample with: the model's state (HF layout) in the compute dtype and the decode's layout."""
        self._state = None  # the old weights go before the new copy is made
        state = decode_weights(state, self.config.compute_dtype)
        if self._unrolled:
            state = to_input_major(self._model_graphdef)(state)
        if self._weight_shardings is None:
            self._weight_shardings = jax.tree.map(lambda x: x.sharding, state)
        # Committed, in the first weights' shardings: the trainer's updated params may come laid out otherwise (the
        # train step's outputs), and another sharding would compile every program again.
        self._state = jax.block_until_ready(jax.device_put(state, self._weight_shardings))

    def _mesh_ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else _NullCtx()

    # -- the Sampler interface ----------------------------------------------------------------------------------

    def update_weights(self, params_or_path) -> float:
        """New policy weights: a CausalLM, its nnx.State, a pure dict of it (`nnx.to_pure_dict`), or an HF folder.

        Returns the seconds taken. The arrays are cast to the compute dtype and put in the first weights' shardings
        (no copy where they already are): the programs are compiled once, for those.
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
        self.table.clear()
        return time.perf_counter() - t0

    def reset_cache(self) -> None:
        """Forgets every cached row, so that a call does not depend on what earlier calls left in the cache (the
        cache's memory stays: its shape never changes)."""
        self.table.clear()

    def sleep(self) -> None:
        """Frees the weights and cache until the next `update_weights` (the trainer's update gives new ones)."""
        self._state = self._ds = None
        self.table.clear()

    # -- the fixed programs ----------------------------------------------------------------------------------

    def programs(self) -> dict[str, tuple]:
        """Every program this engine runs: {name: (jitted function, abstract arguments)} (`engine_programs`)."""
        ds = self._ds if self._ds is not None else jax.eval_shape(self._fns.init)
        vocab = None if self._allowed is None else len(self._allowed)
        return engine_programs(self._fns, self.shape, self._state, ds, n_eos=len(self._eos_arr), vocab=vocab)

    def warm_up(self) -> float:
        """Compiles every program (lowered one after another, compiled in parallel) and allocates the cache, so that
        no call compiles; returns the seconds taken (0 once done). The first `generate` calls it."""
        if self._warm:
            return 0.0
        if self._state is None:
            raise RuntimeError("JaxSampler.warm_up after sleep(): update_weights first")
        t0 = time.perf_counter()
        with self._mesh_ctx():
            self._device_state()
            lowered = [fn.lower(*args) for fn, args in self.programs().values()]
            with concurrent.futures.ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
                list(pool.map(self._compile, lowered))
        self._warm = True
        return time.perf_counter() - t0

    def _compile(self, lowered):
        """Compiles on a pool thread under the engine's mesh, as its calls run: a thread starts without the mesh
        context, and an executable compiled outside it is not the one a call looks up (each call compiled its
        program again)."""
        with self._mesh_ctx():
            lowered.compile()

    def _device_state(self):
        if self._ds is None:  # committed where it is, as every program's outputs are (else the first call compiles)
            self._ds = jax.tree.map(lambda x: jax.device_put(x, x.sharding), self._fns.init())
        return self._ds

    def _stop_arrays(self, stop: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The stop strings' token sequences the device checks ([Q, M] right-aligned, -1 = none; [Q] enabled): each
        string's tokens alone and after a space or newline, where they decode to text ending with it."""
        if stop not in self._stops:
            q, m = self.shape.stop_seqs, self.shape.stop_len
            seqs: list[list[int]] = []
            for s in (s for s in stop if s):
                for prefix in _STOP_PREFIXES:
                    ids = list(self.tokenizer.encode(prefix + s, add_special_tokens=False))
                    if 0 < len(ids) <= m and ids not in seqs and self.tokenizer.decode(ids).endswith(s):
                        seqs.append(ids)
            arr, on = np.full((q, m), -1, np.int32), np.zeros(q, bool)
            for k, ids in enumerate(seqs[:q]):
                arr[k, m - len(ids):], on[k] = ids, True
            self._stops[stop] = (arr, on)
        return self._stops[stop]

    reports_each = True  # `generate(..., on_result=...)` reports each request as it finishes (`generate_each`)

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings,
                 on_result: Callable[[int, SampleResult], None] | None = None) -> list[SampleResult]:
        """One result per request, in order; `on_result(i, result)` is called as each request finishes (while the
        others go on decoding)."""
        if not requests:
            self.table.begin(set())
            return []
        _check_settings(settings)
        if settings.logprobs > self.shape.max_logprobs:
            raise ValueError(f"logprobs={settings.logprobs} exceeds the engine's max_logprobs="
                             f"{self.shape.max_logprobs}")
        if self._state is None:
            raise RuntimeError("JaxSampler.generate after sleep(): update_weights first")
        try:
            with self._mesh_ctx():
                self.warm_up()
                self._device_state()
                call = _Call(self, requests, settings, on_result)
                results = call.run()
        except BaseException:
            # The cache may be half written (or donated to a program that failed): forget and reallocate it.
            self.table.clear()
            self._ds = None
            raise
        self.last_stats = dict(call.stats)
        return results


class _Call:
    """One `generate` call: requests wait for a row, are admitted (a copy of a parent's row, a prefill of what the
    row lacks), decode in calls dispatched one ahead of the host's reading, and give their row back when they
    finish, to the next waiting request."""

    def __init__(self, engine: JaxSampler, requests: Sequence[SampleRequest], settings: SamplingSettings,
                 on_result: Callable[[int, SampleResult], None] | None = None):
        self.e, self.reqs, self.settings, self.on_result = engine, requests, settings, on_result
        self.ctx = [np.asarray(r.token_ids, np.int32) for r in requests]
        self.limits = [_limit(i, r, c, engine.max_len) for i, (r, c) in enumerate(zip(requests, self.ctx))]
        self.seeds = [request_seed(settings.seed, i, c) for i, c in enumerate(self.ctx)]
        self.rows: list[_Row | None] = [None] * len(requests)
        self.results: list[SampleResult | None] = [None] * len(requests)
        b = engine.shape.slots
        self.occ: list[int | None] = [None] * b  # the request each row runs (or last ran) in this call
        self.row_limit, self.row_ctx = np.zeros(b, np.int32), np.zeros(b, np.int32)
        self.row_seed = np.zeros(b, np.uint32)
        self.row_calls = np.zeros(b, np.int64)  # decode calls dispatched since the row's request was admitted
        self.admit, self.stop = np.zeros(b, bool), np.zeros(b, bool)  # for the next decode call
        self.live: set[int] = set()  # rows whose request the host has not seen finish
        self.knobs, self.stops = _knobs(settings), engine._stop_arrays(tuple(settings.stop))
        self.stats: Counter[str] = Counter(batch=len(requests), batch_bucket=b, cache_len=engine.shape.cache_len)

    def run(self) -> list[SampleResult]:
        t = self.e.table
        t.begin({x for r in self.reqs for x in (r.slot_id, r.parent_id) if x is not None})
        own = [i for i, r in enumerate(self.reqs) if t.lookup(r.slot_id) is not None]
        self.waiting = deque(own + sorted(set(range(len(self.reqs))) - set(own)))  # rows of their own first
        inflight: deque = deque()
        while True:
            self._admit()
            if self.live:
                inflight.append(self._dispatch())
            if not inflight:
                break
            if len(inflight) > 1 or not self.live:
                self._read(*inflight.popleft())
        return self.results

    # -- admission: rows, copies, prefill ----------------------------------------------------------------------

    def _admit(self) -> None:
        """Waiting requests into rows, in order, while rows are free: a request continues in its trajectory's row,
        or takes a free row, copying its parent's row there when that shares a prefix with it."""
        t, plans, changed = self.e.table, [], set()
        protect = {x for i in self.waiting for x in (self.reqs[i].slot_id, self.reqs[i].parent_id) if x is not None}
        while self.waiting:
            r = self.reqs[self.waiting[0]]
            own = t.lookup(r.slot_id, changed)
            own = None if own is not None and t.busy[own] else own  # (a slot id named twice in one call)
            src = own if own is not None else t.lookup(r.parent_id, changed)
            row = own if own is not None else t.free_row(protect)
            if row is None:
                break
            i = self.waiting.popleft()
            # Against what the rows hold before this batch: its copies run before any of its prefills.
            keep = min(common_prefix(t.held[src], self.ctx[i]), len(self.ctx[i]) - 1) if src is not None else 0
            if row != own:
                changed.add(row)
            t.take(row, r.slot_id)
            plans.append((i, row, src, keep))
        self._copy([(src, row) for _, row, src, keep in plans if src is not None and src != row and keep])
        for i, row, _, keep in plans:
            t.held[row] = self.ctx[i]
            self.occ[row] = i
            self.row_limit[row], self.row_ctx[row], self.row_seed[row] = self.limits[i], len(self.ctx[i]), self.seeds[i]
            self.row_calls[row] = 0
            self.rows[i] = _Row(self.e.tokenizer, self.ctx[i], self.limits[i], tuple(self.settings.stop))
            self.admit[row] = True
            self.live.add(row)
            self.stats["reused_tokens"] += keep
            self.stats["prefill_tokens"] += len(self.ctx[i]) - keep
        self._prefill([(row, self.ctx[i], keep) for i, row, _, keep in plans])

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        e, w = self.e, self.e.shape.copy_rows
        for k in range(0, len(pairs), w):
            src, dst = np.zeros(w, np.int32), np.full(w, e.shape.slots, np.int32)  # dst past the end: no copy
            for j, (s, d) in enumerate(pairs[k:k + w]):
                src[j], dst[j] = s, d
            e._ds = e._fns.copy(e._ds, src, dst)
            self.stats["copies"] += min(w, len(pairs) - k)

    def _prefill(self, fills: list[tuple[int, np.ndarray, int]]) -> None:
        """Prefills each row's context from its `keep` on, in calls of the engine's fixed (rows, length) shapes."""
        e = self.e
        pending = [[row, ctx, keep, keep] for row, ctx, keep in fills]  # row, context, kept, done so far
        while pending:
            pending.sort(key=lambda p: p[3] - len(p[1]))  # the longest remainders first
            g, t = _prefill_shape(e.shape.prefill, [len(p[1]) - p[3] for p in pending])
            rows, last, keep = np.full(g, e.shape.slots, np.int32), np.full(g, -1, np.int32), np.full(g, -1, np.int32)
            ids, valid = np.zeros((g, t), np.int32), np.zeros((g, t), bool)
            positions = np.zeros((g, t), np.int32)
            for k, p in enumerate(pending[:g]):
                row, ctx, kept, done = p
                n = min(t, len(ctx) - done)
                rows[k], ids[k, :n], valid[k, :n] = row, ctx[done:done + n], True
                positions[k] = done + np.arange(t)
                keep[k] = kept if done == kept else -1  # its first chunk cuts the row to what it shares
                last[k] = n - 1 if done + n == len(ctx) else -1
                p[3] += n
            e._ds = e._fns.prefill(e._state, e._ds, rows, ids, positions, valid, last, keep)
            self.stats["prefill_calls"] += 1
            pending = [p for p in pending if p[3] < len(p[1])]

    # -- decode: dispatch one call ahead, read the one before -------------------------------------------------

    def _dispatch(self):
        """One decode call over the live rows: the program with the fewest rows that holds them all (the live rows
        picked by an index vector), or the one over every row; and of those, the one over the fewest cache slots
        that holds every live row's tokens by the end of the call."""
        e, b = self.e, self.e.shape.slots
        g = next(n for n in e.shape.decode_rows if n >= len(self.live))
        # The fewest cache slots holding what every live row may hold by the call's end: its context plus the tokens
        # it can have sampled by then (the host reads one call behind: it counts calls, not the tokens it has read).
        live = list(self.live)
        need = np.max(self.row_ctx[live] + np.minimum(self.row_limit[live],
                                                      (self.row_calls[live] + 1) * e.shape.decode_steps))
        length = next(n for n in e.shape.lengths if n >= need)
        rows = None if g == b else np.asarray(sorted(self.live) + [b] * (g - len(self.live)), np.int32)
        sel = np.arange(b) if rows is None else np.minimum(rows, b - 1)  # (copies: the host edits its arrays)
        pad = np.zeros(b, bool) if rows is None else rows == b  # padding entries take nothing
        admit, stop = self.admit[sel] & ~pad, self.stop[sel] & ~pad
        e._ds, outs = e._fns.decode[length](e._state, e._ds, rows, admit, stop, self.row_limit[sel],
                                            self.row_ctx[sel], self.row_seed[sel], e._eos_arr, *self.stops,
                                            e._allowed, self.knobs)
        delivered = np.arange(b) if rows is None else rows[~pad]
        self.admit[delivered], self.stop[delivered] = False, False  # a stop for a row not in this call waits
        self.row_calls[live] += 1
        self.stats["decode_calls"] += 1
        self.stats["decode_rows"] += g  # rows x decode_steps: the row-steps computed, sampling or idle
        self.stats["kv_slots_read"] += g * length  # per step of the call: rows x the slots each attends over
        return outs, list(range(b)) if rows is None else [None if r == b else int(r) for r in rows], list(self.occ)

    def _read(self, outs, rows: list[int | None], occ: list[int | None]) -> None:
        """A decode call's tokens (output k is row rows[k]): into each row's record and its request's result; a
        request that ends frees its row (and stops it on the device, in case only the host saw its stop string)."""
        outs = jax.device_get(outs)
        for k, row in enumerate(rows):
            i = None if row is None else occ[row]
            if i is None or self.occ[row] != i:  # padding, no request, or the row has a new one since
                continue
            out = {key: v[k] for key, v in outs.items()}
            if out["written"].any():
                self.e.table.append(row, out["tok"][out["written"]])
            if self.results[i] is None:
                self._feed(i, row, out)
            if self.results[i] is None and not out["active"]:
                self._finish(i, row, device_stop=True)

    def _feed(self, i: int, row: int, out: dict) -> None:
        r, s = self.rows[i], self.settings
        for j in np.flatnonzero(out["sampled"]):
            tok, tok_lp = out["tok"][j], out["tok_lp"][j]
            lps = None
            if s.logprobs and len(r.gen) < s.logprob_positions:
                lps = _logprob_dict(out["top_vals"][j, :s.logprobs], out["top_ids"][j, :s.logprobs], tok, tok_lp)
            if s.token_logprobs:
                r.token_logprobs.append(float(tok_lp))
            r.add(int(tok), self.e.eos_ids, lps)
            if r.finish is not None:
                self._finish(i, row)
                return

    def _finish(self, i: int, row: int, device_stop: bool = False) -> None:
        r = self.rows[i]
        if device_stop:  # a stop sequence matched on the device, whose text the host's check did not see
            r.finish, r.stop_string = "stop", _matched_stop(r.gen, self.settings.stop, self.e.tokenizer)
            cut = r.text.rfind(r.stop_string) if r.stop_string else -1
            r.text = r.text[:cut] if cut >= 0 else r.text
        self.results[i] = SampleResult(r.gen, r.text, r.finish, r.stop_string, r.top_logprobs,
                                       r.token_logprobs if self.settings.token_logprobs else None)
        self.live.discard(row)
        self.stop[row] = True
        self.e.table.release(row)
        if self.on_result is not None:
            self.on_result(i, self.results[i])


def _limit(i: int, r: SampleRequest, ctx: np.ndarray, max_len: int) -> int:
    if len(ctx) == 0 or len(ctx) >= max_len:
        raise ValueError(f"request {i}: {len(ctx)} context tokens; need 1 .. max_len - 1 = {max_len - 1}")
    if r.max_tokens < 1:
        raise ValueError(f"request {i}: max_tokens={r.max_tokens} (must be >= 1)")
    return min(r.max_tokens, max_len - len(ctx))


def _prefill_shape(shapes: tuple[tuple[int, int], ...], remaining: list[int]) -> tuple[int, int]:
    """The (rows, length) program that advances the most tokens (every call costs about rows x length), the
    longest on a tie; `remaining` sorted longest first."""
    return max(shapes, key=lambda gt: (sum(min(gt[1], n) for n in remaining[:gt[0]]), gt[1]))


def _knobs(s: SamplingSettings) -> Knobs:
    greedy = s.temperature < _SAMPLING_EPS
    return Knobs(np.uint32(s.seed & 0xFFFFFFFF), np.float32(max(s.temperature, _SAMPLING_EPS)), np.int32(s.top_k),
                 np.float32(s.top_p), np.bool_(greedy), np.bool_(not greedy and (s.top_k > 0 or s.top_p < 1.0)),
                 np.int32(s.logprob_positions), np.bool_(s.logprobs > 0), np.bool_(s.token_logprobs))


def _matched_stop(gen: list[int], stop: Sequence[str], tokenizer) -> str | None:
    """The stop string whose token sequence (`JaxSampler._stop_arrays`) ends `gen`."""
    for s in (s for s in stop if s):
        for prefix in _STOP_PREFIXES:
            ids = list(tokenizer.encode(prefix + s, add_special_tokens=False))
            if ids and gen[-len(ids):] == ids:
                return s
    return None


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
