"""The sampler interface shared by the rollout engines (JAX KV-cache sampler, co-located vLLM).

The agent loop (spec section 3) only needs: continue each trajectory from its token ids until a tool closer
(`</python>`, `</search>`), EOS or `max_tokens`; report which stop string matched; and return the top-k
log-probs of the first generated positions (ARPO's entropy, spec 4.1: top-10 over the first 20 tokens).

Token ids of a matched stop string are *kept* in `token_ids` (the reference relies on it: vLLM's
`include_stop_str_in_output=False` only strips the text). `text` is the decoded new tokens with the stop
string removed, as vLLM returns it.

The rules every engine shares live here: `find_stop` (where a stop string matches), `request_seed` (the seed of
one request) and `finish_generation` (text, finish reason and stop string of a finished generation); and
`generate_each`, which hands each result over as soon as the engine has it (the agent loop starts a tool call there).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Literal, Protocol

import numpy as np

from arpo_jax import knobs

FinishReason = Literal["stop", "eos", "length"]


TOP_P = knobs.Rule(lambda v: 0 < v <= 1, "0 < top_p <= 1")
TOP_K = knobs.Rule(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1")


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Settings shared by all requests of one `generate` call (the `knob` fields: config/schema.py)."""

    temperature: float = knobs.knob("rollout.temperature")  # 0 = greedy
    top_p: float = knobs.knob("rollout.top_p", TOP_P)
    top_k: int = knobs.knob("rollout.top_k", TOP_K)  # -1 = off
    stop: tuple[str, ...] = ("</python>", "</search>")  # stop strings (detected on decoded text)
    logprobs: int = 10  # top-k log-probs per generated position (0 = none)
    logprob_positions: int = 20  # how many leading generated positions need them (ARPO: 20)
    seed: int = 0  # base seed; engines derive per-request keys from it explicitly
    # Also return the log-prob of every sampled token (SampleResult.token_logprobs), for the trainer's rollout
    # correction: the distribution the engine reports its top-k log-probs from (see each engine).
    token_logprobs: bool = False

    def __post_init__(self):
        knobs.validate(self)


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One trajectory to continue.

    `slot_id` / `parent_id` are cache hints for engines that keep per-trajectory KV caches (the JAX sampler):
    a request whose `slot_id` was in the previous `generate` call continues that slot's cache (only the new
    suffix of `token_ids`, e.g. a tool result, is prefilled; the engine checks the cached prefix matches and
    falls back to a full prefill if not); a new slot with `parent_id` starts from a copy of the parent's cache
    (an ARPO branch). Slots absent from a call are finished and their cache may be freed. Engines with prefix
    caching (vLLM) ignore the hints.
    """

    token_ids: Sequence[int]  # the whole context so far (prompt + response + tool results)
    max_tokens: int  # new tokens at most
    slot_id: int | None = None
    parent_id: int | None = None
    # The trajectory's identity (`rollout/identity.py`): the engines seed the request from it and its context
    # (`request_seed`) instead of its position in the call, so its samples do not depend on how a call was assembled.
    key: int | None = None


@dataclasses.dataclass
class SampleResult:
    token_ids: list[int]  # new tokens, the matched stop string's tokens (or the EOS token) included
    text: str  # decoded new tokens, stop string removed
    finish_reason: FinishReason  # "stop": a stop string matched; "eos": EOS sampled; "length": max_tokens
    stop_string: str | None  # the matched stop string (finish_reason == "stop")
    # top_logprobs[t] = {token_id: logprob} for generated position t (t < logprob_positions): the top-k tokens,
    # plus the sampled token if it is not among them (vLLM's convention: k or k + 1 entries).
    top_logprobs: list[dict[int, float]]
    # token_logprobs[t] = log-prob of token_ids[t] when `SamplingSettings.token_logprobs` was set and the engine
    # reports it; None otherwise.
    token_logprobs: list[float] | None = None


class Sampler(Protocol):
    """A rollout engine. `generate` is batched: one result per request, in order.

    Engines subclass it for the no-op defaults of `reset_cache`, `sleep` and `close`, so callers never test for them.
    """

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]: ...

    def update_weights(self, params_or_path) -> float:
        """Makes later `generate` calls use new policy weights; returns the seconds it took."""
        ...

    def reset_cache(self) -> None:
        """Forgets what earlier calls left in a cache, so that the next call does not depend on them."""

    def sleep(self) -> None:
        """Frees the engine's device memory (weights, cache) until the next `update_weights`, where it can."""

    def close(self) -> None:
        """Releases the engine's processes, threads and connections. Safe to call twice."""


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """What an engine stream reports about one request (`EngineStream.step`): that it finished (`result`; None when
    the engine failed on it alone), or, while it goes on decoding, the top log-probs of its first
    `settings.logprob_positions` positions (`window`: the entropy an ARPO branch decides with exists)."""

    handle: int
    result: SampleResult | None = None
    window: list[dict[int, float]] | None = None
    done: bool = True  # False for a `window` report


class EngineStream(Protocol):
    """An engine fed requests one by one and reporting each as it finishes (the streaming rollout's view).

    Requests carry their own `max_tokens` and are named by the caller's `handle`; `priority` orders waiting requests
    (0 first: the rollout's committed work; larger: speculative work, which an engine may also preempt and run again
    later, the same samples since seeds come from the request; `prioritize` changes it, for a speculative request
    that was committed). `cancel` drops a request (its tokens are discarded);
    `release(slot_id)` says a trajectory needs its cached prefix no more. `stats` counts, for the rollout's
    metrics: `decode_steps` (sequential decode iterations: the critical path an accelerator pays for), `row_steps`
    (rows live in them, summed), `discarded_tokens` (tokens of cancelled or preempted requests)."""

    stats: Counter

    def submit(self, request: SampleRequest, handle: int, priority: int = 0) -> None: ...

    def cancel(self, handle: int) -> None: ...

    def prioritize(self, handle: int, priority: int) -> None: ...

    def release(self, slot_id: int) -> None: ...

    def step(self) -> list[StreamEvent]: ...

    def busy(self) -> bool: ...

    def close(self) -> None: ...


class BatchStream:
    """`EngineStream` over any batched `Sampler`: each `step` runs one `generate` over every waiting request (lowest
    priority value first) and reports them all. Engines with a stream of their own (`Sampler.stream`: the JAX and
    vLLM engines) decode requests as they come instead."""

    def __init__(self, sampler, settings: SamplingSettings):
        self.sampler, self.settings = sampler, settings
        self.waiting: dict[int, tuple[int, int, SampleRequest]] = {}  # handle -> (priority, order, request)
        self.stats: Counter = Counter()
        self._order = 0

    def submit(self, request: SampleRequest, handle: int, priority: int = 0) -> None:
        self.waiting[handle] = (priority, self._order, request)
        self._order += 1

    def cancel(self, handle: int) -> None:
        self.waiting.pop(handle, None)

    def prioritize(self, handle: int, priority: int) -> None:
        if handle in self.waiting:
            self.waiting[handle] = (priority, *self.waiting[handle][1:])

    def release(self, slot_id: int) -> None:
        """Nothing held: a batched engine's cache hints name the trajectories of each call."""

    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[StreamEvent]:
        batch = sorted(self.waiting.items(), key=lambda kv: kv[1][:2])
        self.waiting = {}
        requests = [req for _, (_, _, req) in batch]
        results = self.sampler.generate(requests, self.settings) if requests else []
        stats = getattr(self.sampler, "last_stats", None) or {}
        lengths = [len(r.token_ids) for r in results if r is not None]
        # An engine's own counts where it has them; else a batched call's: its longest request's steps.
        self.stats["decode_steps"] += int(stats.get("decode_steps", max(lengths, default=0)))
        for key in ("row_steps", "sampled_tokens"):
            self.stats[key] += int(stats.get(key, sum(lengths)))
        for key in ("computed_row_steps", "prefill_tokens"):
            self.stats[key] += int(stats.get(key, 0))
        return [StreamEvent(handle, res) for (handle, _), res in zip(batch, results)]

    def close(self) -> None:
        self.waiting = {}


def open_stream(sampler, settings: SamplingSettings) -> EngineStream:
    """The engine's own stream where it has one (`sampler.stream(settings)`), else a `BatchStream` over it."""
    own = getattr(sampler, "stream", None)
    return own(settings) if callable(own) else BatchStream(sampler, settings)


def generate_each(sampler, requests: Sequence[SampleRequest], settings: SamplingSettings,
                  on_result: Callable[[int, SampleResult | None], None]) -> list:
    """`sampler.generate`, calling `on_result(i, result)` with each request's result as soon as it is known: as each
    finishes on an engine that reports them one by one (`reports_each`: `generate(..., on_result=...)`, the JAX
    engine), else once all are done, in order."""
    if getattr(sampler, "reports_each", False):
        return sampler.generate(requests, settings, on_result=on_result)
    results = sampler.generate(requests, settings)
    for i, res in enumerate(results):
        on_result(i, res)
    return results


def find_stop(text: str, stop: Sequence[str], new_chars: int | None = None) -> tuple[int, str] | None:
    """The first match of a stop string in `text`: (where it starts, which one), or None.

    The earliest match wins (on a tie, the string listed first). With `new_chars`, only matches that end inside the
    last `new_chars` characters count: incremental detection, where the older text was searched before (vLLM's
    check_stop_strings).
    """
    best = None
    for s in stop:
        if not s:
            continue
        start = 0 if new_chars is None else max(0, len(text) - new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def finish_generation(text: str, token_ids: Sequence[int], stop: Sequence[str],
                      eos_ids: Collection[int]) -> tuple[str, FinishReason, str | None]:
    """(text without the stop string, finish reason, matched stop string) of a finished generation.

    `text` is the decoded `token_ids` (special tokens skipped). "stop" when a stop string is in it (the text is cut
    where it starts), else "eos" when the last token is an EOS id, else "length".
    """
    hit = find_stop(text, stop)
    if hit is not None:
        return text[:hit[0]], "stop", hit[1]
    if token_ids and token_ids[-1] in eos_ids:
        return text, "eos", None
    return text, "length", None


def request_seed(base: int, index: int, token_ids: Sequence[int]) -> int:
    """The seed of one request: a function of (settings.seed, its identity, the request's token ids) only; the
    identity is `seed_index`'s (the request's key, else its position in the call).

    No engine state (a call counter, a cache) goes in, so a call is reproducible on its own: a resumed evaluation
    chunk, a retry or a restarted engine draws the same samples. Copies of one prompt differ by key (or position),
    and the rounds of one trajectory by their grown context. A uint32 (what every engine accepts).
    """
    digest = zlib.crc32(np.asarray(token_ids, np.int64).tobytes())
    return int(np.random.SeedSequence([base & 0xFFFFFFFF, (base >> 32) & 0xFFFFFFFF, index, digest])
               .generate_state(1)[0])


def seed_index(request: SampleRequest, position: int) -> int:
    """What identifies a request in its seed: its trajectory's key, else its position in the call (evaluation's
    copies of one question; a call whose requests name no trajectory)."""
    return position if request.key is None else request.key


# The engines behind this interface, by the names the configs and commands use.
ROLLOUT_ENGINES = ("jax", "vllm")  # rollout.engine (training); eval and demo also take the others
ENGINES = (*ROLLOUT_ENGINES, "openai", "transformers")
LORA_SYNCS = ("adapters", "merged")  # rollout.vllm.lora_sync
# rollout.vllm.cuda_graphs -> vLLM's enforce_eager (None: the worker picks by platform, graphs on a GPU only)
CUDA_GRAPHS = {"auto": None, "on": False, "off": True}


def worker_seed(seed: int, step: int, worker: int, salt: str = "") -> int:
    """A 31-bit seed that depends only on (seed, step, worker, salt): the same in every process layout."""
    return zlib.crc32(f"{seed}/{step}/{worker}/{salt}".encode()) & 0x7FFFFFFF
