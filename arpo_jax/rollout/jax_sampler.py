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
* decode in calls of up to `decode_chunk` steps over every row (on CPU, over the live rows when 1/4 or 1/16 of the
  rows hold them: `decode_rows`), a call returning at the step a row finishes; EOS, each row's token limit and the
  stop strings' usual token sequences stop a row on the device. The host dispatches decode call k + 1 before it
  reads call k, then reads k's tokens and checks the stop strings on their incrementally decoded text (as vLLM does;
  authoritative: a stop string the device did not see ends its row at most one call later, the extra tokens
  dropped).

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
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import device_memory
from arpo_jax.rollout.jax_decode import (
    TRACE_COUNTS,
    decode_weights,
    engine_programs,
    engine_shape,
    input_major_graphdef,
    jitted,
    to_input_major,
    unrolled_layout,
)
from arpo_jax.rollout.jax_slots import SlotTable
from arpo_jax.rollout.jax_stream import STOP_PREFIXES, JaxStream
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings
from arpo_jax.sharding import get_rules


def pow2_buckets(lo: int, hi: int, *, half_steps: bool = False, quarter_steps: bool = False) -> tuple[int, ...]:
    """Powers of two from `lo` up to the first one >= `hi` (with `half_steps`, also 1.5x each: 64, 96, 128, ...;
    with `quarter_steps`, also 1.25x, 1.5x and 1.75x: 64, 80, 96, 112, 128, ...)."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    steps = (5, 6, 7) if quarter_steps else (6,) if half_steps else ()
    return tuple(sorted(set(out) | {b * m // 4 for b in out[:-1] for m in steps}))


def abstract_programs(kw: dict, max_len: int, graphdef, abstract_state, *, batch_multiple: int = 1, n_eos: int = 1,
                      vocab_mask: bool = True) -> dict[str, tuple]:
    """The programs a JAX engine of `JaxSampler(**kw, max_len=max_len)` compiles, from the model's abstract state
    alone (nothing is allocated): {name: (jitted function, abstract arguments)} as `JaxSampler.programs`, for
    `arpo-jax plan` (`components.engine_kwargs` gives a run's `kw`). `n_eos` / `vocab_mask`: what the tokenizer
    gives (its EOS ids; a mask when it covers less than the vocab)."""
    shape = engine_shape(max_len=max_len, slots=kw["slots"],
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
      decode_chunk: the most sampling steps per decode call (a call returns at the step a row finishes).
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
                for prefix in STOP_PREFIXES:
                    ids = list(self.tokenizer.encode(prefix + s, add_special_tokens=False))
                    if 0 < len(ids) <= m and ids not in seqs and self.tokenizer.decode(ids).endswith(s):
                        seqs.append(ids)
            arr, on = np.full((q, m), -1, np.int32), np.zeros(q, bool)
            for k, ids in enumerate(seqs[:q]):
                arr[k, m - len(ids):], on[k] = ids, True
            self._stops[stop] = (arr, on)
        return self._stops[stop]

    reports_each = True  # `generate(..., on_result=...)` reports each request as it finishes (`generate_each`)

    def stream(self, settings: SamplingSettings) -> JaxStream:
        """A stream of requests over this engine's rows (`jax_stream.JaxStream`: the streaming rollout's engine);
        it starts with every row forgotten (rows are named by the stream's own trajectories)."""
        stream = self._open(settings)
        self.table.begin(set())
        return stream

    def _open(self, settings: SamplingSettings) -> JaxStream:
        _check_settings(settings)
        if settings.logprobs > self.shape.max_logprobs:
            raise ValueError(f"logprobs={settings.logprobs} exceeds the engine's max_logprobs="
                             f"{self.shape.max_logprobs}")
        if self._state is None:
            raise RuntimeError("JaxSampler.generate after sleep(): update_weights first")
        with self._mesh_ctx():
            self.warm_up()
            self._device_state()
        return JaxStream(self, settings)

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings,
                 on_result: Callable[[int, SampleResult], None] | None = None) -> list[SampleResult]:
        """One result per request, in order; `on_result(i, result)` is called as each request finishes (while the
        others go on decoding). A stream run to its end, the requests with rows of their own admitted first; the
        rows of trajectories the call does not name are forgotten."""
        if not requests:
            self.table.begin(set())
            return []
        stream = self._open(settings)
        self.table.begin({x for r in requests for x in (r.slot_id, r.parent_id) if x is not None})
        own = [i for i, r in enumerate(requests) if self.table.lookup(r.slot_id) is not None]
        for i in own + sorted(set(range(len(requests))) - set(own)):
            stream.submit(requests[i], handle=i)
        results: list[SampleResult | None] = [None] * len(requests)
        while stream.busy():
            for event in stream.step():
                if event.done:
                    results[event.handle] = event.result
                    if on_result is not None:
                        on_result(event.handle, event.result)
        self.last_stats = dict(stream.stats)
        return results


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


def check_cache_fits(sampler: JaxSampler) -> None:
    """Refuses, before a JAX engine allocates it (at its warm-up or first call), a KV cache larger than the free
    memory (`device_memory`): one line with the sizes and the settings to change, not the OOM killer."""
    init, args = sampler.programs()["init"]
    devices = list(sampler.mesh.devices.flat) if sampler.mesh is not None else jax.local_devices()[:1]
    total, cpu = device_memory.tree_bytes(jax.eval_shape(init, *args)), devices[0].platform == "cpu"
    device_memory.require_fits(  # CPU devices share the host's memory
        total if cpu else -(-total // len(devices)), device_memory.available_bytes(devices[0]),
        f"the JAX engine's KV cache ({sampler.shape.slots} rows x {sampler.shape.cache_len} tokens)", "give it fewer "
        "rows (rollout.jax.slots; `arpo-jax eval`: --batch-size x --k), shorter contexts (data.max_prompt_length + "
        "data.max_response_length) or a cap (rollout.jax.max_tokens_per_call)")
