"""The vLLM engines as an `EngineStream` (the streaming rollout's engine): requests in one by one, results out as
each finishes.

Each `step` sends every engine with work a "stream_step" command (vllm_worker.py: the requests submitted since, the
cancellations, then the engine's own steps through vLLM's request-level API until one of its requests finishes) and
gathers their replies, in parallel. A request is sent with its full token ids: a continuation after a tool result or
a branch shares its prefix through vLLM's prefix cache, on the engine that served its trajectory (or its parent)
before. Priorities go to vLLM's priority scheduler: the rollout's committed work first, speculative work after it,
preempted for it; `cancel` aborts. A request's seed is its key's (`sampler.request_seed`), as in a batched call.
"""

from __future__ import annotations

from collections import Counter

from arpo_jax.rollout.sampler import (
    SampleRequest,
    SampleResult,
    SamplingSettings,
    StreamEvent,
    request_seed,
    seed_index,
)
from arpo_jax.rollout.vllm_worker import gather_replies

MAX_STEPS = 32  # engine steps a command may run before it answers with nothing finished (new requests get in then)


class VllmStream:
    def __init__(self, sampler, settings: SamplingSettings):
        import dataclasses

        self.workers = sampler._workers
        self.settings = dataclasses.asdict(settings)
        self.seed = settings.seed
        self.submits: list[list] = [[] for _ in self.workers]  # per engine: requests to send with the next step
        self.cancels: list[list[int]] = [[] for _ in self.workers]
        self.engine_of: dict[int, int] = {}  # handle -> engine, while in flight
        self.slot_engine: dict[int, int] = {}  # trajectory (slot id) -> the engine that served it last
        self.stats: Counter = Counter()

    def submit(self, request: SampleRequest, handle: int, priority: int = 0) -> None:
        ids = [int(t) for t in request.token_ids]
        engine = self._route(request)
        self.engine_of[handle] = engine
        if request.slot_id is not None:
            self.slot_engine[request.slot_id] = engine
        seed = request_seed(self.seed, seed_index(request, handle), ids)
        self.submits[engine].append([handle, ids, int(request.max_tokens), seed, int(priority)])

    def _route(self, request: SampleRequest) -> int:
        """The engine holding the trajectory's (or its parent's) prefix, else the one with the fewest requests."""
        for slot in (request.slot_id, request.parent_id):
            if slot is not None and slot in self.slot_engine:
                return self.slot_engine[slot]
        load = Counter(self.engine_of.values())
        return min(range(len(self.workers)), key=lambda e: load[e])

    def cancel(self, handle: int) -> None:
        engine = self.engine_of.pop(handle, None)
        if engine is None:
            return
        waiting = [s for s in self.submits[engine] if s[0] == handle]
        if waiting:  # not sent yet
            self.submits[engine].remove(waiting[0])
        else:
            self.cancels[engine].append(handle)
            self.stats["cancelled"] += 1

    def prioritize(self, handle: int, priority: int) -> None:
        """Where the request is not sent yet; vLLM keeps a sent request's priority."""
        engine = self.engine_of.get(handle)
        for s in self.submits[engine] if engine is not None else ():
            if s[0] == handle:
                s[4] = int(priority)

    def release(self, slot_id: int) -> None:
        """Nothing held: vLLM frees a finished request's blocks itself (kept for prefix hits until evicted)."""
        self.slot_engine.pop(slot_id, None)

    def busy(self) -> bool:
        return bool(self.engine_of)

    def step(self) -> list[StreamEvent]:
        active = [e for e in range(len(self.workers))
                  if self.submits[e] or self.cancels[e] or e in self.engine_of.values()]
        for e in active:
            self.workers[e].send("stream_step", {"submit": self.submits[e], "cancel": self.cancels[e],
                                                 "settings": self.settings, "max_steps": MAX_STEPS},
                                 "generating (stream)")
            self.submits[e], self.cancels[e] = [], []
        replies = gather_replies([self.workers[e] for e in active], "generating (stream)")
        events = []
        for reply in replies:
            for key, value in reply["stats"].items():
                self.stats[key] += value
            for handle, r in reply["done"]:
                if self.engine_of.pop(handle, None) is None:  # cancelled after it finished
                    continue
                events.append(StreamEvent(handle, SampleResult(r["token_ids"], r["text"], r["finish_reason"],
                                                               r["stop_string"], r["top_logprobs"],
                                                               r.get("token_logprobs"))))
        # Steps run on the engines side by side: the sequential ones are the most any engine ran.
        self.stats["decode_steps"] -= sum(r["stats"]["decode_steps"] for r in replies)
        self.stats["decode_steps"] += max((r["stats"]["decode_steps"] for r in replies), default=0)
        return events

    def close(self) -> None:
        """Aborts what is still in flight."""
        for handle in list(self.engine_of):
            self.cancel(handle)
        active = [e for e in range(len(self.workers)) if self.cancels[e]]
        for e in active:
            self.workers[e].send("stream_step", {"submit": [], "cancel": self.cancels[e], "settings": self.settings,
                                                 "max_steps": 0}, "aborting (stream)")
            self.cancels[e] = []
        gather_replies([self.workers[e] for e in active], "aborting (stream)")
