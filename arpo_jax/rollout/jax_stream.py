"""The JAX engine's host loop: requests stream into the fixed rows of its KV cache and out as they finish.

`JaxStream` is `rollout.sampler.EngineStream` over a `JaxSampler`: `submit` queues a request (waiting requests are
admitted in priority order, then in the order they came), `step` admits what fits, dispatches one decode call and
reads the one before it (the host reads one call behind the device), and returns what finished. So a trajectory's
next request enters decoding as soon as its caller has it (a tool result is back) while the other rows decode on,
an ARPO branch copies its parent's row whenever it comes (its parent may still be decoding there), and each request
stops at its own `max_tokens`. `JaxSampler.generate` is one stream run to the end: the batch API over the same code.

Rows: a request continues in its trajectory's row (`slot_id`: only the new suffix is prefilled) or takes a free one,
copying its parent's row there when they share a prefix (`jax_slots.SlotTable`). A row stays its trajectory's until
`release` (the rollout: the trajectory can need it no more) or until another request needs it; speculative
requests (priority > 0) take only rows nobody holds, and a waiting request of a lower priority value preempts the
most speculative running one (it runs again later from its context: the same samples, per-request seeds).

Outputs depend on neither the rows nor the order of admission (`JaxSampler`'s docstring): each request's PRNG keys
fold in its own seed (`sampler.request_seed`), context length and position.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Sequence

import jax
import numpy as np

from arpo_jax.rollout.jax_decode import Knobs
from arpo_jax.rollout.jax_slots import common_prefix
from arpo_jax.rollout.sampler import (
    SampleRequest,
    SampleResult,
    SamplingSettings,
    StreamEvent,
    find_stop,
    request_seed,
    seed_index,
)

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)
STOP_PREFIXES = ("", " ", "\n")  # a stop string's token sequences checked on the device: alone and after these
_DETOK_PRIME = 5  # prompt tokens that prime the incremental detokenizer (vLLM's initial offset)


class HostRow:
    """Host state of one request while it decodes: generated ids, incremental text, stop detection, log-probs."""

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


class _Request:
    """One submitted request: what it asks, where it runs, what it has generated."""

    def __init__(self, handle: int, request: SampleRequest, priority: int, order: int, ctx: np.ndarray,
                 limit: int, seed: int):
        self.handle, self.req, self.priority, self.order = handle, request, priority, order
        self.ctx, self.limit, self.seed = ctx, limit, seed
        self.row: int | None = None
        self.admissions = 0  # times admitted into a row (a preempted request is admitted again)
        self.host: HostRow | None = None
        self.windowed = False  # its entropy window was reported

    def sort_key(self) -> tuple[int, int]:
        return self.priority, self.order


class JaxStream:
    """Requests in, results out, over one `JaxSampler`'s rows (see the module docstring). Not thread-safe: one
    caller drives it. `stats` counts decode calls and steps, rows live per step, prefill and reused tokens, copies,
    and the tokens of cancelled or preempted requests."""

    def __init__(self, engine, settings: SamplingSettings):
        self.e, self.settings = engine, settings
        self.knobs, self.stops = _knobs(settings), engine._stop_arrays(tuple(settings.stop))
        b = engine.shape.slots
        self.reqs: dict[int, _Request] = {}  # handle -> request, until it finishes or is cancelled
        self.waiting: list[tuple[tuple[int, int], int]] = []  # heap of (sort key, handle)
        self.occ: list[tuple[int, int] | None] = [None] * b  # (handle, admission) of the request each row runs
        self.row_limit, self.row_ctx = np.zeros(b, np.int32), np.zeros(b, np.int32)
        self.row_seed = np.zeros(b, np.uint32)
        self.row_calls = np.zeros(b, np.int64)  # decode calls dispatched since the row's request was admitted
        self.admit, self.stop = np.zeros(b, bool), np.zeros(b, bool)  # for the next decode call
        self.live: set[int] = set()  # rows whose request the host has not seen finish
        self.inflight: deque = deque()
        self.events: list[StreamEvent] = []
        self.stats: Counter[str] = Counter(batch_bucket=b, cache_len=engine.shape.cache_len)
        self._order = 0

    # -- the caller's side --------------------------------------------------------------------------------------

    def submit(self, request: SampleRequest, handle: int, priority: int = 0) -> None:
        ctx = np.asarray(request.token_ids, np.int32)
        limit = _limit(handle, request, ctx, self.e.max_len)
        seed = request_seed(self.settings.seed, seed_index(request, handle), ctx)
        r = _Request(handle, request, priority, self._order, ctx, limit, seed)
        self._order += 1
        self.reqs[handle] = r
        heapq.heappush(self.waiting, (r.sort_key(), handle))
        self.stats["batch"] += 1

    def cancel(self, handle: int) -> None:
        """Drops a request, waiting or running; what it generated is counted as discarded."""
        r = self.reqs.pop(handle, None)
        if r is not None and r.row is not None:
            self._stop_row(r, discarded=True)

    def prioritize(self, handle: int, priority: int) -> None:
        """A request's new priority (a speculative one the rollout committed): where it waits, and for preemption."""
        r = self.reqs.get(handle)
        if r is None or r.priority == priority:
            return
        r.priority = priority
        if r.row is None:  # waiting: queued again under its new key (the old entry is skipped when it comes up)
            heapq.heappush(self.waiting, (r.sort_key(), handle))

    def release(self, slot_id: int) -> None:
        """The trajectory `slot_id` needs its row no more: the row is free for any request."""
        self.e.table.forget_slot(slot_id)

    def busy(self) -> bool:
        return bool(self.reqs) or bool(self.inflight)

    def step(self) -> list[StreamEvent]:
        """Admits what fits, dispatches one decode call, reads the one before; the events of what it read."""
        try:
            with self.e._mesh_ctx():
                self._admit()
                if self.live:
                    self.inflight.append(self._dispatch())
                if self.inflight and (len(self.inflight) > 1 or not self.live):
                    self._read(*self.inflight.popleft())
        except BaseException:
            # The cache may be half written (or donated to a program that failed): forget and reallocate it.
            self.e.table.clear()
            self.e._ds = None
            raise
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        for handle in list(self.reqs):
            self.cancel(handle)
        self.inflight.clear()

    # -- admission: rows, copies, prefill ----------------------------------------------------------------------

    def _admit(self) -> None:
        """Waiting requests into rows, in priority order, while rows are free (or a more speculative request can
        give its row up): a request continues in its trajectory's row, or takes a free row, copying its parent's row
        there when that shares a prefix with it."""
        t, plans, changed, deferred = self.e.table, [], set(), []
        waiting = [r for _, h in self.waiting if (r := self.reqs.get(h)) is not None and r.row is None]
        protect = {x for r in waiting for x in (r.req.slot_id, r.req.parent_id) if x is not None}
        while self.waiting:
            key, handle = self.waiting[0]
            r = self.reqs.get(handle)
            if r is None or r.row is not None or key != r.sort_key():  # cancelled, admitted, or queued again since
                heapq.heappop(self.waiting)
                continue
            if r.priority > 0 and not self._spare(len(self.live) + len(plans)):
                break  # speculative work only in rows the decode computes anyway
            own = t.lookup(r.req.slot_id, changed)
            own = None if own is not None and t.busy[own] else own  # (a slot id named twice at once)
            src = own if own is not None else t.lookup(r.req.parent_id, changed)
            # Speculative work takes only rows nobody holds: a trajectory waiting for its tool keeps its row.
            row = own if own is not None else t.free_row(protect, empty_only=r.priority > 0)
            if row is None:
                victim = self._preemptable(r.priority) if r.priority == 0 else None  # (speculative work waits)
                if victim is None:
                    # No row for it: it waits, and those behind it that continue in their own rows go on (a
                    # speculative trajectory's next segment is not held up by a branch that waits for a row).
                    deferred.append(heapq.heappop(self.waiting))
                    continue
                self._preempt(victim)
                continue
            heapq.heappop(self.waiting)
            # Against what the rows hold before this batch: its copies run before any of its prefills.
            keep = min(common_prefix(t.held[src], r.ctx), len(r.ctx) - 1) if src is not None else 0
            if row != own:
                changed.add(row)
            t.take(row, r.req.slot_id)
            plans.append((r, row, src, keep))
        for entry in deferred:
            heapq.heappush(self.waiting, entry)
        self._copy([(src, row) for _, row, src, keep in plans if src is not None and src != row and keep])
        for r, row, _, keep in plans:
            t.held[row] = r.ctx
            r.row = row
            r.admissions += 1
            self.occ[row] = (r.handle, r.admissions)
            self.row_limit[row], self.row_ctx[row], self.row_seed[row] = r.limit, len(r.ctx), r.seed
            self.row_calls[row] = 0
            r.host = HostRow(self.e.tokenizer, r.ctx, r.limit, tuple(self.settings.stop))
            self.admit[row] = True
            self.live.add(row)
            self.stats["reused_tokens"] += keep
            self.stats["prefill_tokens"] += len(r.ctx) - keep
        self._prefill([(row, r.ctx, keep) for r, row, _, keep in plans])

    def _spare(self, rows: int) -> bool:
        """Whether the decode program that `rows` live rows need computes a row more anyway: the room speculative
        requests get (on an accelerator every idle row; on a CPU the rest of the row bucket, `decode_rows`)."""
        return rows < next(n for n in self.e.shape.decode_rows if n >= max(rows, 1))

    def _preemptable(self, priority: int) -> _Request | None:
        """The running request to preempt for a waiting one of `priority`: the most speculative, newest first,
        whose priority value is larger; None if there is none."""
        running = [self.reqs[self.occ[row][0]] for row in self.live]
        victims = [r for r in running if r.priority > priority]
        return max(victims, key=lambda r: r.sort_key(), default=None)

    def _preempt(self, r: _Request) -> None:
        """Stops `r`'s row and puts `r` back among the waiting: it starts again from its context later."""
        self._stop_row(r, discarded=True)
        self.e.table.forget(r.row)
        r.row, r.host, r.windowed = None, None, False
        heapq.heappush(self.waiting, (r.sort_key(), r.handle))
        self.stats["preempted"] += 1

    def _stop_row(self, r: _Request, *, discarded: bool) -> None:
        row = r.row
        if discarded and r.host is not None:
            self.stats["discarded_tokens"] += len(r.host.gen)
        self.live.discard(row)
        self.stop[row] = True
        self.occ[row] = None
        self.e.table.release(row)

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
        # the host has read, and a full call's for each call not read yet that runs it (this one included).
        live = list(self.live)
        read = np.asarray([len(self.reqs[self.occ[row][0]].host.gen) for row in live])
        unread = np.minimum(self.row_calls[live], len(self.inflight)) + 1
        need = np.max(self.row_ctx[live] + np.minimum(self.row_limit[live], read + unread * e.shape.decode_steps))
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
        self.stats["kv_slots_read"] += g * length  # per step of the call: rows x the slots each attends over
        rows_out = list(range(b)) if rows is None else [None if r == b else int(r) for r in rows]
        return outs, rows_out, list(self.occ), (len(live), g)

    def _read(self, outs, rows: list[int | None], occ: list[int | None], widths: tuple[int, int]) -> None:
        """A decode call's tokens (output k is row rows[k]): into each row's record and its request's result; a
        request that ends frees its row (and stops it on the device, in case only the host saw its stop string).
        `widths`: the rows live when the call was dispatched, and the rows its program computes."""
        outs = jax.device_get(outs)
        steps = int(outs.pop("steps"))  # the call returns at the step a row finishes
        self.stats["decode_steps"] += steps
        self.stats["row_steps"] += widths[0] * steps  # rows live (sampling or about to) x steps
        self.stats["computed_row_steps"] += widths[1] * steps  # the program's rows, live or idle
        for k, row in enumerate(rows):
            tag = None if row is None else occ[row]
            if tag is None or self.occ[row] != tag:  # padding, no request, or the row has a new one since
                continue
            r = self.reqs[tag[0]]
            out = {key: v[k] for key, v in outs.items()}
            if out["written"].any():
                self.e.table.append(row, out["tok"][out["written"]])
            if self._feed(r, out) is None and not out["active"]:
                self._finish(r, device_stop=True)

    def _feed(self, r: _Request, out: dict) -> SampleResult | None:
        """The call's tokens of one row into its request; its result when it finished (else None)."""
        h, s = r.host, self.settings
        sampled = np.flatnonzero(out["sampled"])
        self.stats["sampled_tokens"] += len(sampled)
        for j in sampled:
            tok, tok_lp = out["tok"][j], out["tok_lp"][j]
            lps = None
            if s.logprobs and len(h.gen) < s.logprob_positions:
                lps = _logprob_dict(out["top_vals"][j, :s.logprobs], out["top_ids"][j, :s.logprobs], tok, tok_lp)
            if s.token_logprobs:
                h.token_logprobs.append(float(tok_lp))
            h.add(int(tok), self.e.eos_ids, lps)
            if h.finish is not None:
                return self._finish(r)
        if s.logprobs and not r.windowed and len(h.top_logprobs) >= s.logprob_positions:
            r.windowed = True  # its entropy window is complete while it decodes on
            self.events.append(StreamEvent(r.handle, window=list(h.top_logprobs), done=False))
        return None

    def _finish(self, r: _Request, device_stop: bool = False) -> SampleResult:
        h = r.host
        if device_stop:  # a stop sequence matched on the device, whose text the host's check did not see
            h.finish, h.stop_string = "stop", _matched_stop(h.gen, self.settings.stop, self.e.tokenizer)
            cut = h.text.rfind(h.stop_string) if h.stop_string else -1
            h.text = h.text[:cut] if cut >= 0 else h.text
        result = SampleResult(h.gen, h.text, h.finish, h.stop_string, h.top_logprobs,
                              h.token_logprobs if self.settings.token_logprobs else None)
        self._stop_row(r, discarded=False)
        del self.reqs[r.handle]
        self.events.append(StreamEvent(r.handle, result))
        return result


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
    greedy = s.temperature < SAMPLING_EPS
    return Knobs(np.uint32(s.seed & 0xFFFFFFFF), np.float32(max(s.temperature, SAMPLING_EPS)), np.int32(s.top_k),
                 np.float32(s.top_p), np.bool_(greedy), np.bool_(not greedy and (s.top_k > 0 or s.top_p < 1.0)),
                 np.int32(s.logprob_positions), np.bool_(s.logprobs > 0), np.bool_(s.token_logprobs))


def _matched_stop(gen: list[int], stop: Sequence[str], tokenizer) -> str | None:
    """The stop string whose token sequence (`JaxSampler._stop_arrays`) ends `gen`."""
    for s in (s for s in stop if s):
        for prefix in STOP_PREFIXES:
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
