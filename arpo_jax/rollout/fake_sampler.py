"""A scripted in-process `Sampler` for tests and demos: it emits given text/token patterns, not a model's.

A *script* decides, for every request of every `generate` call, what the "model" writes next: a `Segment` of text
or token ids, optionally followed by EOS, with a chosen entropy level for its log-probs. The sampler then behaves
like an engine: it stops at the first stop string found in the decoded new text (keeping the ids of the token that
completed it), at EOS, or after `max_tokens` tokens, and reports `finish_reason`, `stop_string`, `text` (stop
string removed) and top-k log-probs for the first `logprob_positions` positions; with `settings.token_logprobs`,
`fake_token_logprob(t)` for every emitted token t (a token-dependent value, so alignment errors show).

    sampler = ScriptedSampler(tok, lambda call: Segment("<python>print(1)</python>"))

`stream` gives the same engine as a token clock (`ScriptedStream`): each request is scripted when it is submitted,
then takes one decode step per token in one of `rows` rows, with priorities and preemption as the JAX engine's
stream; a script that draws from `ScriptCall.seed` (the request's own seed) writes the same whichever way it runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from arpo_jax.rollout.sampler import (
    Sampler,
    SampleRequest,
    SampleResult,
    SamplingSettings,
    StreamEvent,
    find_stop,
    finish_generation,
    request_seed,
    seed_index,
)


@dataclasses.dataclass(frozen=True)
class Segment:
    """What the scripted model writes for one request (before the engine's stop/length rules cut it)."""

    text: str = ""  # encoded with the tokenizer (no special tokens added) unless `token_ids` is given
    eos: bool = False  # append the EOS token after the text
    token_ids: tuple[int, ...] | None = None  # explicit ids instead of `text`
    spread: float = 0.5  # log-prob shape: probability mass off the top token, in [0, 1) (0 = certain)
    logprobs: tuple[Mapping[int, float], ...] | None = None  # explicit per-position top log-probs (overrides)


@dataclasses.dataclass
class ScriptCall:
    """What a script sees for one request."""

    request: SampleRequest
    index: int  # position of the request in its generate call
    call: int  # how many generate calls came before this one
    context: str  # the decoded request tokens (special tokens kept)
    rng: np.random.Generator  # the sampler's generator (seeded at construction)
    seed: int = 0  # the request's own seed (`sampler.request_seed`: its key or position, and its token ids)


Script = Callable[[ScriptCall], Segment]


def top_logprobs_for(token: int, k: int, spread: float, vocab_size: int) -> dict[int, float]:
    """k entries: the emitted token with probability 1 - spread, the other k - 1 share `spread` equally."""
    if k <= 0:
        return {}
    others = [t for t in range(vocab_size) if t != token][: k - 1]
    out = {token: math.log(max(1.0 - spread, 1e-12))}
    for t in others:
        out[t] = math.log(max(spread / max(len(others), 1), 1e-12))
    return out


def fake_token_logprob(token: int) -> float:
    """The scripted engine's log-prob of an emitted token: -0.01 .. -0.97, depending on the token id."""
    return -(1 + token % 97) / 100


class ScriptedSampler(Sampler):
    """Scripted engine. `calls` records every (requests, settings, results) for assertions."""

    def __init__(self, tokenizer, script: Script, *, seed: int = 0, vocab_size: int | None = None, rows: int = 64):
        self.tokenizer = tokenizer
        self.rows = rows  # the stream's rows (`stream`)
        self.script = script
        self.rng = np.random.default_rng(seed)
        self.eos = tokenizer.eos_token_id
        self.vocab_size = vocab_size or len(tokenizer.get_vocab())
        self.calls: list[tuple[list[SampleRequest], SamplingSettings, list[SampleResult]]] = []
        self.weights_version = 0

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        results = [self._write(req, i, settings) for i, req in enumerate(requests)]
        self.calls.append((list(requests), settings, results))
        tokens = sum(len(r.token_ids) for r in results)
        self.last_stats = {"decode_steps": max((len(r.token_ids) for r in results), default=0), "row_steps": tokens,
                           "sampled_tokens": tokens}
        return results

    def stream(self, settings: SamplingSettings) -> ScriptedStream:
        return ScriptedStream(self, settings, self.rows)

    def _write(self, req: SampleRequest, index: int, settings: SamplingSettings) -> SampleResult:
        context = self.tokenizer.decode(list(req.token_ids), skip_special_tokens=False)
        seed = request_seed(settings.seed, seed_index(req, index), req.token_ids)
        seg = self.script(ScriptCall(req, index, len(self.calls), context, self.rng, seed))
        return self._emit(seg, req.max_tokens, settings)

    def update_weights(self, params_or_path) -> float:
        self.weights_version += 1
        return 0.0

    def _emit(self, seg: Segment, max_tokens: int, settings: SamplingSettings) -> SampleResult:
        ids = list(seg.token_ids) if seg.token_ids is not None else self.tokenizer.encode(seg.text,
                                                                                          add_special_tokens=False)
        if seg.eos or not ids:  # an engine always produces at least one token: default to EOS
            ids.append(self.eos)
        out: list[int] = []
        for tok in ids[: max(1, max_tokens)]:  # an engine stops at the token that completes a stop string
            out.append(tok)
            if tok == self.eos or find_stop(self.tokenizer.decode(out, skip_special_tokens=False), settings.stop):
                break
        text, finish, stop_string = finish_generation(self.tokenizer.decode(out, skip_special_tokens=True), out,
                                                      settings.stop, {self.eos})
        n_pos = min(len(out), settings.logprob_positions) if settings.logprobs > 0 else 0
        if seg.logprobs is not None:
            top = [dict(lp) for lp in seg.logprobs[:n_pos]]
        else:
            top = [top_logprobs_for(t, settings.logprobs, seg.spread, self.vocab_size) for t in out[:n_pos]]
        token_lp = [fake_token_logprob(t) for t in out] if settings.token_logprobs else None
        return SampleResult(out, text, finish, stop_string, top, token_lp)


class ScriptedStream:
    """`EngineStream` of a `ScriptedSampler`: a token clock over `rows` rows. A request is scripted when submitted;
    admitted in priority order (then submission order) into a free row, or into the row of the most speculative
    running request (larger priority value), which waits again and restarts; each `step` advances every running
    request by one token and reports those that finished, and the entropy window of those that reached it."""

    def __init__(self, sampler: ScriptedSampler, settings: SamplingSettings, rows: int):
        self.sampler, self.settings, self.rows = sampler, settings, rows
        self.pending: dict[int, list] = {}  # handle -> [priority, order, result, tokens done, running]
        self.stats: Counter = Counter()
        self._order = 0

    def submit(self, request: SampleRequest, handle: int, priority: int = 0) -> None:
        result = self.sampler._write(request, handle, self.settings)
        self.sampler.calls.append(([request], self.settings, [result]))
        self.pending[handle] = [priority, self._order, result, 0, False]
        self._order += 1

    def cancel(self, handle: int) -> None:
        entry = self.pending.pop(handle, None)
        if entry is not None:
            self.stats["discarded_tokens"] += entry[3]

    def prioritize(self, handle: int, priority: int) -> None:
        if handle in self.pending:
            self.pending[handle][0] = priority

    def release(self, slot_id: int) -> None:
        """Nothing cached: a scripted engine keeps no rows between requests."""

    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[StreamEvent]:
        self._admit()
        running = [(h, e) for h, e in self.pending.items() if e[4]]
        if running:
            self.stats["decode_steps"] += 1
            self.stats["row_steps"] += len(running)
            self.stats["sampled_tokens"] += len(running)
        events = []
        window = self.settings.logprob_positions if self.settings.logprobs else 0
        for handle, entry in running:
            entry[3] += 1
            result = entry[2]
            if entry[3] >= len(result.token_ids):
                del self.pending[handle]
                events.append(StreamEvent(handle, result))
            elif entry[3] == window:
                events.append(StreamEvent(handle, window=list(result.top_logprobs), done=False))
        return events

    def _admit(self) -> None:
        waiting = sorted((e[:2], h) for h, e in self.pending.items() if not e[4])
        running = [(e[:2], h) for h, e in self.pending.items() if e[4]]
        for key, handle in waiting:
            if len(running) >= self.rows:
                victim = max(running)
                if victim[0][0] <= key[0]:
                    return
                running.remove(victim)
                entry = self.pending[victim[1]]
                self.stats["discarded_tokens"] += entry[3]
                self.stats["preempted"] += 1
                entry[3], entry[4] = 0, False
            self.pending[handle][4] = True
            running.append((key, handle))

    def close(self) -> None:
        self.pending = {}


def by_slot(segments: Mapping[int, Sequence[Segment]], default: Segment = Segment(eos=True)) -> Script:
    """A script from per-slot lists: slot id -> the segments of its successive requests (then `default`)."""
    seen: dict[int, int] = {}

    def script(call: ScriptCall) -> Segment:
        sid = call.request.slot_id
        k = seen.get(sid, 0)
        seen[sid] = k + 1
        segs = segments.get(sid, ())
        return segs[k] if k < len(segs) else default

    return script


def random_segment(r: np.random.Generator, words: Sequence[str], max_words: int, orphans: bool = False) -> Segment:
    """A random segment for property tests: a tool call (most often), an empty call, EOS or plain text, and with
    `orphans` a closing tag without its opener; `max_words` words of `words` before it."""
    text = " ".join(r.choice(words, size=int(r.integers(0, max_words))))
    kind = r.choice(["tool"] * 5 + ["empty", "eos", "eos", "text"] + ["orphan"] * orphans)
    tag = r.choice(["python", "search"])
    spread = float(r.uniform(0.0, 0.95))
    if kind == "tool":
        return Segment(f"{text} <{tag}> {int(r.integers(100))} </{tag}> tail", spread=spread)
    if kind == "empty":
        return Segment(f"{text} <{tag}> </{tag}>", spread=spread)
    if kind == "orphan":
        return Segment(f"{text} </{tag}>", spread=spread)
    return Segment(text, eos=kind == "eos", spread=spread)
