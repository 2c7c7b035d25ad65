"""One trajectory of a rollout and what one generated segment does to it (spec 3.3 steps 2-5, 4.1).

Both schedules (`agent_loop.py`'s rounds, `streaming.py`'s stream) apply the same rules (`SegmentRules`) to a
trajectory, segment by segment: `take` absorbs a segment (its entropy, its tokens, a tool call or the end),
`add_result` appends a tool result, `close` ends the segment with a `Record`: everything the round algorithm's
decisions (`replay.py`) read about that segment, so they can be made later than the segment, in any order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from arpo_jax.rollout import branching
from arpo_jax.rollout.sampler import SampleResult
from arpo_jax.rollout.tool_calls import encode_tool_result, extract_tool_content

State = tuple[int, int, int]  # (len(tokens), calls, segments): a point of a trajectory a branch can start from


@dataclasses.dataclass(frozen=True)
class Record:
    """What one segment left once its tool result (if any) is in."""

    index: int  # the segment's index in the trajectory (inherited segments counted)
    entropy: float  # its entropy (4.1)
    decision: State | None  # the state before it, when it came right after the trajectory's own tool result (B4)
    after: State  # the state after it and its tool result
    alive: bool  # the trajectory goes on with another segment
    failed: bool  # the trajectory has failed by now (isolate_failures)


@dataclasses.dataclass(eq=False)
class Trajectory:
    id: int  # the output's slot id (the streaming schedule: its handle until the rounds' commits number it)
    prompt: int
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    kind: str = "root"  # "root", "branch", "refill"; "probe": AEPO pre-monitoring's discarded trajectory
    round_created: int = 0
    parent: Trajectory | None = None
    key: int = 0  # identity (`identity.py`): the engines seed its requests from it
    mask: list[int] = dataclasses.field(default_factory=list)  # per response token: 1 model, 0 tool result
    logps: list[float] = dataclasses.field(default_factory=list)  # per response token: engine log-prob or NaN
    calls: int = 0
    segments: int = 0
    branch_point: int = 0
    baseline: float | None = None
    entropy: float = 0.0  # the last segment's entropy
    entropies: list[float] = dataclasses.field(default_factory=list)
    post_tool: bool = False  # the state ends with a tool result this trajectory appended itself
    decision_point: State | None = None  # the state before the last segment, when it came right after a tool result
    requested: bool = False
    finish: str = ""
    failed: str = ""  # the first failure cause (isolate_failures)
    created: float = 0.0  # time.monotonic() at creation (the wall budget's start)
    records: list[Record] = dataclasses.field(default_factory=list)
    call_seconds: list[float] = dataclasses.field(default_factory=list)  # each tool call's, inherited ones first

    @property
    def resp_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def state(self) -> State:
        return len(self.tokens), self.calls, self.segments

    def append(self, ids: Sequence[int], mask: int, logps: Sequence[float] | None = None) -> None:
        """Response tokens with their loss mask (1 model, 0 tool result) and engine log-probs (NaN without)."""
        self.tokens.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logps.extend(logps if logps is not None and len(logps) == len(ids) else [np.nan] * len(ids))

    def fail(self, cause: str, *, end: bool = False) -> None:
        """Marks a failure (a trajectory keeps its first cause); `end`: the trajectory also ends with it."""
        self.failed = self.failed or cause
        if end:
            self.finish = cause

    def fork(self, at: State, **fields) -> Trajectory:
        """A new trajectory that starts from this one's state `at` (an ARPO branch), inheriting its segments."""
        length, calls, segments = at
        child = Trajectory(prompt=self.prompt, tokens=list(self.tokens[:length]), prompt_len=self.prompt_len,
                           parent=self, created=time.monotonic(), **fields)
        child.mask = list(self.mask[:length - self.prompt_len])
        child.logps = list(self.logps[:length - self.prompt_len])
        child.calls, child.segments = calls, segments
        child.call_seconds = list(self.call_seconds[:calls])
        child.branch_point = length - self.prompt_len
        return child


@dataclasses.dataclass(frozen=True)
class SegmentRules:
    """The rules of spec 3.3 for one trajectory's segment, with what they need from the rollout."""

    tokenizer: object
    closers: tuple[str, ...]  # the executor's stop strings: a matched one is a tool call
    eos: int
    call_limit: int
    R: int  # response budget
    compat: bool  # reference_compat (B4, B10, B11)
    vocab_size: int
    entropy_window: int
    entropy_reduce: str
    wall_budget_s: float  # trajectory_timeout_s (0: none)

    def entropy(self, res: SampleResult) -> float:
        # All returned entries count (top-k plus the sampled token when outside it), as in the reference.
        return self.window_entropy(res.top_logprobs)

    def window_entropy(self, top_logprobs) -> float:
        return branching.segment_entropy(top_logprobs, self.vocab_size, window=self.entropy_window,
                                         reduce=self.entropy_reduce)

    def take(self, t: Trajectory, res: SampleResult | None) -> tuple[Trajectory, str, str] | None:
        """Spec 3.3 steps 2-3 for one segment: its entropy (the trajectory's first from the prompt is its baseline;
        branches inherit theirs), its tokens, and a tool call (returned: (t, tag, content)) or the trajectory's end.
        None: the engine failed on it, which ends the trajectory."""
        if res is None:
            t.fail("engine_error", end=True)
            return None
        t.entropy = self.entropy(res)
        t.entropies.append(t.entropy)
        if not self.compat and t.baseline is None:
            t.baseline = t.entropy
        return self.absorb(t, res)

    def absorb(self, t: Trajectory, res: SampleResult) -> tuple[Trajectory, str, str] | None:
        t.decision_point = t.state() if t.post_tool else None
        t.post_tool = False
        t.append(res.token_ids, 1, res.token_logprobs)
        t.segments += 1
        if res.finish_reason == "stop" and res.stop_string in self.closers:
            tag = res.stop_string[2:-1]
            if t.calls >= self.call_limit:
                t.append([self.eos], 1)  # the extra call: EOS, trained (mask 1), not sampled (no log-prob)
                t.finish = "call_limit"
                return None
            t.calls += 1
            text = self.tokenizer.decode(t.tokens if self.compat else res.token_ids, skip_special_tokens=False)
            content = extract_tool_content(text, tag)
            if content:
                return t, tag, content
            t.finish = "empty_tool_content"  # ends silently, no EOS (B10)
        elif res.finish_reason == "length":
            if not res.token_ids or t.resp_len >= self.R:
                t.finish = "length"
        else:
            t.finish = "eos" if res.finish_reason == "eos" else "stop"
        return None

    def add_result(self, t: Trajectory, text: str, failure: str | None, *, isolate: bool, seconds: float = 0.0,
                   max_len: int | None = None) -> None:
        """Spec 3.3 step 4 for one call: the wrapped result appended with mask 0 (a failed call is marked with
        isolation). `max_len` is pre-monitoring's guard: a context that the result would push past it is first cut
        to `max_len - len(result) - 100` tokens, as in the reference."""
        if failure and isolate:
            t.fail(failure)
        ids = encode_tool_result(self.tokenizer, text, self.compat)
        if max_len is not None and len(t.tokens) + len(ids) > max_len:
            del t.tokens[max(0, max_len - len(ids) - 100):]  # a probe's mask and log-probs are never read
        t.append(ids, 0)
        t.post_tool = True
        t.call_seconds.append(seconds)

    def close(self, t: Trajectory) -> Record:
        """Spec 3.3 step 5 and the wall budget, then the segment's record."""
        if not t.finish and t.resp_len >= self.R:
            t.finish = "length"  # the budget is spent (possibly by a tool result)
        if not t.finish and self.wall_budget_s and time.monotonic() - t.created > self.wall_budget_s:
            t.fail("wall_budget", end=True)
        record = Record(t.segments - 1, t.entropy, t.decision_point, t.state(), not t.finish, bool(t.failed))
        t.records.append(record)
        return record
