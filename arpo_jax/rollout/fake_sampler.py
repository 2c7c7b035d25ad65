"""A scripted in-process `Sampler` for tests and demos: it emits given text/token patterns, not a model's.

A *script* decides, for every request of every `generate` call, what the "model" writes next: a `Segment` of text
or token ids, optionally followed by EOS, with a chosen entropy level for its log-probs. The sampler then behaves
like an engine: it stops at the first stop string found in the decoded new text (keeping the ids of the token that
completed it), at EOS, or after `max_tokens` tokens, and reports `finish_reason`, `stop_string`, `text` (stop
string removed) and top-k log-probs for the first `logprob_positions` positions; with `settings.token_logprobs`,
`fake_token_logprob(t)` for every emitted token t (a token-dependent value, so alignment errors show).

    sampler = ScriptedSampler(tok, lambda call: Segment("<python>print(1)</python>"))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from arpo_jax.rollout.sampler import (
    Sampler,
    SampleRequest,
    SampleResult,
    SamplingSettings,
    find_stop,
    finish_generation,
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

    def __init__(self, tokenizer, script: Script, *, seed: int = 0, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.script = script
        self.rng = np.random.default_rng(seed)
        self.eos = tokenizer.eos_token_id
        self.vocab_size = vocab_size or len(tokenizer.get_vocab())
        self.calls: list[tuple[list[SampleRequest], SamplingSettings, list[SampleResult]]] = []
        self.weights_version = 0

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        results = []
        for i, req in enumerate(requests):
            context = self.tokenizer.decode(list(req.token_ids), skip_special_tokens=False)
            seg = self.script(ScriptCall(req, i, len(self.calls), context, self.rng))
            results.append(self._emit(seg, req.max_tokens, settings))
        self.calls.append((list(requests), settings, results))
        return results

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
