"""The streaming schedule of the tool rollout: no trajectory waits for another (`agent_loop.py` has the rounds).

Trajectories go through an engine stream (`sampler.EngineStream`: the JAX and vLLM engines' own, else one batched
call per step) segment by segment, each on its own: its next segment is submitted as soon as its tool result is
back, with its own remaining budget, while the tool calls of others run on a pool (`tool_calls.ToolRunner`). The
round algorithm's decisions are replayed over logical rounds (`replay.py`): a prompt decides round r once its round-r
trajectories have their round-r records, and what the decision creates joins as if the rounds had run one by one.

What a decision will create can start before it (`RolloutConfig.speculate`), at a lower priority that an engine
serves from rows nobody else needs and preempts for committed work:
* a branch, as soon as its source's deciding entropy exists (the engine reports the entropy window while the
  source decodes on; a shorter segment: when it ends) and its attempt's draw says it branches: its tokens depend on
  its name and context only, so the decision, when it comes, only commits it or, where the budget ran out first,
  cancels it;
* the prompt's next fresh trajectories (the refills), up to the budget no trajectory claims yet.
A cancelled trajectory's tokens never reach the output; `rollout/speculative_tokens_discarded` counts them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from arpo_jax.rollout import branching, identity
from arpo_jax.rollout.bisecting_sampler import BisectingSampler
from arpo_jax.rollout.output import RolloutOutput
from arpo_jax.rollout.replay import PromptReplay
from arpo_jax.rollout.rounds import ENGINE_COUNTS, Loop, timed
from arpo_jax.rollout.sampler import SampleRequest, StreamEvent, open_stream
from arpo_jax.rollout.tool_calls import ToolRunner
from arpo_jax.rollout.trajectory import State, Trajectory

# Request priorities: committed work first, then branches whose draw says they branch, branches started before
# their source's entropy exists, then the refills (the next one first).
COMMITTED, BRANCH, PROVISIONAL, FRESH = 0, 1, 2, 3


@dataclasses.dataclass(eq=False)
class _Run:
    """A trajectory as the stream schedules it."""

    t: Trajectory
    slot: int  # its rows' name in the engine (`SampleRequest.slot_id`)
    committed: bool
    parent: _Run | None = None
    fresh: int = -1  # a fresh trajectory's index in its prompt (roots, refills)
    segment: int = -1  # a branch started early: its source's segment it was forked on
    provisional: bool = False  # started before its source's deciding entropy existed: its draw is still to come
    phase: str = "ready"  # ready (to submit its next segment) | decoding | tool | done
    request: int | None = None  # the handle of its request in the engine
    forks: set[int] = dataclasses.field(default_factory=set)  # segments it has been considered as a source for
    children: list[_Run] = dataclasses.field(default_factory=list)  # speculative or committed branches of it
    calls_run: int = 0
    released: bool = False
    cancelled: bool = False


def run_stream(loop: Loop, engine) -> RolloutOutput:
    """The rollout over `engine`'s stream (see the module docstring); `loop` is the call's shared state."""
    t0 = time.perf_counter()
    with ToolRunner(loop.executor).open() as tools, loop.calls.running():
        loop.commit_roots(loop.initial_rollouts())
        _Stream(loop, engine, tools).run()
    return loop.finalize(time.perf_counter() - t0)


class _Stream:
    def __init__(self, loop: Loop, engine, tools: ToolRunner):
        self.loop, self.engine, self.tools = loop, engine, tools
        self.cfg, self.rules = loop.cfg, loop.rules
        self.stream = open_stream(engine, loop.settings)
        self.slots = itertools.count()
        self.handles = itertools.count()
        self.runs: dict[int, _Run] = {}  # key -> every run of this rollout, committed or speculative
        self.requests: dict[int, tuple[_Run, SampleRequest]] = {}  # handle -> its run and request, in the engine
        self.ready: list[_Run] = []  # runs whose next segment is to be submitted
        self.params = loop.params

    def run(self) -> None:
        for rp in self.loop.replays:
            for j, t in enumerate(rp.members):
                self._start(t, committed=True, fresh=j)
        try:
            self._loop()
        finally:
            for run in list(self.runs.values()):
                if not run.committed:
                    self._cancel(run)
            self._account()
            self.stream.close()

    def _loop(self) -> None:
        self._advance()
        while not all(rp.done for rp in self.loop.replays):
            self._submit()
            if self.stream.busy():
                for event in self._step():
                    self._on_event(event)
            idle = not self.stream.busy() and not self.ready
            if idle and not self.tools.running:
                self._advance()
                if not self.ready and not all(rp.done for rp in self.loop.replays):
                    raise RuntimeError(f"streaming rollout stalled: {self._describe()}")
                continue
            for run, text, failure, seconds in self.tools.done(block=idle):  # idle: until a result is back
                self._on_tool(run, text, failure, seconds)
            self._advance()

    def _advance(self) -> None:
        """What the new records allow: decisions, early starts, rows given back."""
        self._commit()
        self._speculate()
        self._release()

    # -- the engine -------------------------------------------------------------------------------------------

    def _step(self) -> list[StreamEvent]:
        with timed(self.loop.times, "generate"):
            try:
                return self.stream.step()
            except Exception:
                if not self.cfg.isolate_failures:
                    raise
                return self._recover()

    def _recover(self) -> list[StreamEvent]:
        """After an engine error: the requests in flight again, batched, so that only one that raises on its own
        fails (`BisectingSampler`: its trajectory ends as engine_error); then a new stream."""
        inflight = list(self.requests.items())
        results = BisectingSampler(self.engine).generate([req for _, (_, req) in inflight], self.loop.settings)
        self.stream = open_stream(self.engine, self.loop.settings)
        return [StreamEvent(handle, res) for (handle, _), res in zip(inflight, results)]

    def _submit(self) -> None:
        ready, self.ready = self.ready, []
        for run in ready:
            if run.cancelled:
                continue
            t = run.t
            parent = run.parent.slot if run.parent is not None and not t.requested else None  # fork its row
            request = SampleRequest(list(t.tokens), max(1, self.rules.R - t.resp_len), slot_id=run.slot,
                                    parent_id=parent, key=t.key)
            if t.post_tool and not self.loop.compat:  # this segment decides: its branches may start with it
                self._fork_early(run)
            handle = next(self.handles)
            self.stream.submit(request, handle, self._priority(run))
            self.requests[handle] = (run, request)
            run.request, run.phase, t.requested = handle, "decoding", True

    def _priority(self, run: _Run) -> int:
        if run.committed:
            return COMMITTED
        if run.fresh < 0:
            return PROVISIONAL if run.provisional else BRANCH
        return FRESH + run.fresh - self.loop.replays[run.t.prompt].fresh  # the next refill first

    def _on_event(self, event: StreamEvent) -> None:
        if event.handle not in self.requests:  # a request cancelled after the engine reported it
            return
        run = self.requests[event.handle][0]
        if not event.done:  # the segment's entropy window: a branch of it may start now
            if not self.loop.compat and run.t.post_tool:
                self._fork(run, self.rules.window_entropy(event.window), run.t.state(), run.t.segments)
            return
        del self.requests[event.handle]
        run.request = None
        call = self.rules.take(run.t, event.result)
        if call is None:
            self._close(run)
            return
        run.phase = "tool"
        self.tools.start(run, call[1], call[2])

    def _on_tool(self, run: _Run, text: str, failure: str | None, seconds: float) -> None:
        if run.cancelled:
            return
        run.calls_run += 1
        self.rules.add_result(run.t, text, failure, isolate=self.cfg.isolate_failures, seconds=seconds)
        self._close(run)

    def _close(self, run: _Run) -> None:
        record = self.rules.close(run.t)
        run.phase = "ready" if record.alive else "done"
        if record.alive:
            self.ready.append(run)
        if record.failed:
            return
        if self.loop.compat:  # B4 compat: a surviving trajectory decides with the segment before its call
            if record.alive:
                self._fork(run, record.entropy, record.after, record.index)
        elif record.decision is not None:  # (a segment shorter than the entropy window)
            self._fork(run, record.entropy, record.decision, record.index)

    # -- speculation ----------------------------------------------------------------------------------------

    def _fork_early(self, run: _Run) -> None:
        """Default mode (B4): the segment `run` is about to generate right after its own tool result decides; its
        branches start from the same state now, alongside it (`provisional`), and `_fork` keeps those whose draw
        says they branch once the entropy exists."""
        t, rp = run.t, self.loop.replays[run.t.prompt]
        if not self.cfg.speculate or rp.done or rp.count >= self.params.n:
            return
        for k in range(self.params.beam_size - 1):
            key = identity.branch_key(t.key, t.segments, k)
            if key not in self.runs:
                self._branch(run, key, t.state(), t.segments).provisional = True

    def _fork(self, run: _Run, entropy: float, at: State, segment: int) -> None:
        """Once `run`'s deciding entropy on `segment` exists: the branches its draws say it makes start (or stay:
        `_fork_early`'s), the others are cancelled. All speculative: the decision of their round commits them."""
        t, rp = run.t, self.loop.replays[run.t.prompt]
        if not self.cfg.speculate or segment in run.forks or rp.done or rp.count >= self.params.n:
            return
        run.forks.add(segment)
        p = self.params
        baseline = self.loop.baseline(t) if self.loop.compat else t.baseline  # (compat: a guess until numbered)
        prob = branching.branch_probability(p.rule, entropy - baseline, p=p.p, w=p.w, consecutive=rp.consecutive,
                                            penalty=p.penalty)
        for k in range(p.beam_size - 1):
            key = identity.branch_key(t.key, segment, k)
            child = self.runs.get(key)
            if identity.attempt_draw(rp.seed, rp.prompt, t.key, segment, k) >= prob:
                if child is not None and child.provisional:
                    self._cancel(child)
            elif child is None:
                self._branch(run, key, at, segment)
            elif child.provisional:
                child.provisional = False
                if child.request is not None:
                    self.stream.prioritize(child.request, BRANCH)

    def _branch(self, run: _Run, key: int, at: State, segment: int) -> _Run:
        """A speculative branch of `run` from its state `at`, named by its attempt (`key`) on `segment`."""
        t = run.t
        child = self._start(t.fork(at, id=-1, key=key, baseline=None if self.loop.compat else t.baseline),
                            committed=False, parent=run)
        child.segment = segment
        return child

    def _speculate(self) -> None:
        """Each prompt's next fresh trajectories, up to the budget no committed or speculative one claims."""
        if not self.cfg.speculate:
            return
        spec: dict[int, list[_Run]] = {}  # prompt -> its speculative trajectories (one pass: many prompts at once)
        for r in self.runs.values():
            if not r.committed and not r.cancelled:
                spec.setdefault(r.t.prompt, []).append(r)
        for rp in self.loop.replays:
            if rp.done:
                continue
            mine = spec.get(rp.prompt, [])
            fresh = [r.fresh for r in mine if r.fresh >= 0]
            j = max(fresh, default=rp.fresh - 1) + 1
            for _ in range(self.params.n - rp.count - len(mine)):
                self._start(self.loop.fresh(rp.prompt, j), committed=False, fresh=j)
                j += 1

    def _start(self, t: Trajectory, *, committed: bool, parent: _Run | None = None, fresh: int = -1) -> _Run:
        run = _Run(t, next(self.slots), committed, parent, fresh)
        self.runs[t.key] = run
        self.ready.append(run)
        if parent is not None:
            parent.children.append(run)
        if not committed:
            self.loop.m["speculative_trajectories"] += 1
        return run

    def _cancel(self, run: _Run) -> None:
        """Drops a speculative trajectory and its speculative branches: what they generated is discarded."""
        if run.cancelled:
            return
        run.cancelled = True
        for child in run.children:
            self._cancel(child)
        if run.request is not None:
            self.stream.cancel(run.request)
            self.requests.pop(run.request, None)
            run.request = None
        self.stream.release(run.slot)
        run.released = True
        t = run.t
        self.loop.m["speculative_tokens_discarded"] += sum(t.mask[t.branch_point:])
        del self.runs[t.key]

    # -- the replay ------------------------------------------------------------------------------------------

    def _commit(self) -> None:
        """Decides every round whose inputs are in, prompt by prompt, and numbers the rounds every prompt has
        decided; adopts what was started early under a created key, cancels what was not to be."""
        loop, progress = self.loop, True
        while progress:
            progress = False
            for rp in loop.replays:
                while not rp.done and self._decidable(rp):
                    self._decide(rp)
                    progress = True
            while loop.rounds.advance():
                progress = True

    def _decidable(self, rp: PromptReplay) -> bool:
        r = rp.round
        return (not self.loop.needs_numbering or self.loop.rounds.numbered >= r) and rp.ready(r)

    def _decide(self, rp: PromptReplay) -> None:
        r = rp.round
        decided = [(t, t.records[r - t.round_created].index) for t in rp.active(r)]
        created = set()
        for c in self.loop.decide(rp, r):
            run = self.runs.get(c.key)
            if run is None:
                parent = self.runs[c.source.key] if c.source is not None else None
                run = self._start(self.loop.make(rp, c), committed=True, parent=parent, fresh=c.fresh)
            elif not run.committed:  # started early: it is the one; its waiting request goes first now
                run.committed = True
                self.loop.m["speculative_committed"] += 1
                if run.request is not None:
                    self.stream.prioritize(run.request, COMMITTED)
            self.loop.commit(rp, c, run.t, r)
            created.add(c.key)
        for t, segment in decided:  # a branch started early from a decided segment that was not created
            for child in list(self.runs[t.key].children):
                if not child.committed and child.segment == segment and child.t.key not in created:
                    self._cancel(child)
        if rp.done or rp.count >= self.params.n:  # no refill or branch to come: drop what was started for one
            for run in [r for r in self.runs.values() if r.t.prompt == rp.prompt and not r.committed]:
                self._cancel(run)

    def _release(self) -> None:
        """Gives back the rows of finished trajectories once nothing can fork from them any more: their prompt has
        decided past their last segment and their branches have their rows."""
        for run in self.runs.values():
            if run.released or run.phase != "done" or not run.committed:
                continue
            t, rp = run.t, self.loop.replays[run.t.prompt]
            if rp.round > t.round_created + len(t.records) - 1 and all(c.t.requested for c in run.children):
                self.stream.release(run.slot)
                run.released = True

    def _account(self) -> None:
        m, stats = self.loop.m, self.stream.stats
        for key in ENGINE_COUNTS:
            m[key] += stats.get(key, 0)
        m["speculative_tokens_discarded"] += stats.get("discarded_tokens", 0)
        m["tool_calls"] += sum(r.calls_run for r in self.runs.values() if r.committed)
        m["tool_s"] = self.tools.seconds
        m["tool_hidden_s"] = max(0.0, self.tools.seconds - self.tools.waited)
        self.loop.times["tools"] += self.tools.waited

    def _describe(self) -> str:
        phases = [(r.t.prompt, r.phase, r.committed, len(r.t.records)) for r in self.runs.values()]
        rounds = [(rp.prompt, rp.round, rp.done, rp.count) for rp in self.loop.replays]
        return f"runs (prompt, phase, committed, records) {phases}; prompts (prompt, round, done, count) {rounds}"
