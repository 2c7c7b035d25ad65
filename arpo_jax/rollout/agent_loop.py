"""The engine-agnostic multi-turn tool rollout with ARPO branching / AEPO dynamic rollouts (spec sections 3-5).

`rollout(prompts, sampler, executor, tokenizer, config, settings, rng)` runs rounds until no trajectory slot is
active. Each round: one batched `sampler.generate` over the active slots (max_tokens = the largest remaining
budget, 3.3.1); the segment entropy of every slot (4.1); tool calls detected by the matched stop string, the
call limit (the extra call appends EOS, mask 1), empty tool content (the slot ends silently); the round's tool calls
executed concurrently, results appended as `" <result>\\n{text}\\n</result>"` with loss-mask 0; then branching
(ARPO 4.2 / AEPO 5.2) and the refill rule (4.3), until every prompt has exactly n trajectories. The output
(`rollout/output.py`) is padded numpy arrays (3.4) plus per-trajectory metadata, branching trees and metrics.

Overlap: an engine that reports each request as it finishes (the JAX engine, `sampler.generate_each`) hands a
segment over while the round's other requests still decode; its entropy and tool call are taken then, and with an
executor that runs calls one by one (`run_batch`, the real one) the call starts at once. The overlap stops at the
round's end: the next round starts when the round's last tool result is back, since branching, the refill rule and
AEPO's counter read the whole round (a trajectory re-entering the engine early would change which round its
segments belong to, hence the branching draws).

`RolloutConfig.reference_compat` (default False = the intended algorithm), quirk by quirk (spec section 14):

* B1 entropy baseline. Default: H_init is the trajectory's own first-segment entropy, reset every call; a branch
  inherits its parent's (it shares that first segment). Compat: a slot-id keyed dict that the caller keeps in
  `RolloutState` across calls, so from the second call on slots compare against another prompt's entropy.
* B3 AEPO's `p`. Default: the AEPO formula gets `1 - p`, so a larger p means more branching, as in ARPO (P = p + w*dH
  at f = 1). Compat: the configured p as is (inverted meaning). Identical at p = 0.5.
* B4 which segment decides. Default: a slot that appended its own tool result decides with the entropy of the
  segment it generated right after that result (the paper's "k tokens after the tool call"); its branch copies the
  state right after the tool result and re-samples that segment. Compat: slots still active after this round's tools
  decide with the entropy of the segment *before* the tool call, and the branch copies the state after the result.
  (Engines: with the default, a branch's context is a prefix of its parent's cached context, and the parent may
  have finished in the previous round.)
* B10 tool content. Default: `<tag>` and `</tag>` must both lie in the segment just generated (else the content is
  empty and the slot ends). Compat: last `<tag>` before the last `</tag>` of the whole decoded prompt + response.
* B10 attention. Default: response attention = real tokens up to and including the first EOS (padding 0). Compat:
  `get_response_mask`, where the padding of a response without EOS also gets 1.
* B11 tool text. Default: encoded with no special tokens added and special-token strings split as plain text.
  Compat: `tokenizer.encode(text)` (a BOS for Llama; `<|im_end|>` inside a result becomes EOS and cuts attention).

Both modes: the entropy is the spec's sum over <= 20 positions (`entropy_reduce="mean"` exists), the AEPO
consecutive counter is per prompt and counts refills (B6), and max_tokens is the shared largest budget (3.3.1).

Failure isolation (`RolloutConfig.isolate_failures`, not in the reference): a trajectory is marked failed
(`RolloutOutput.failed` names the cause) when one of its tool calls fails (`tool_error`, `tool_timeout`: the executor
gave up; it still sees the error text and goes on, as in the reference), when its engine request raises
(`engine_error`: `BisectingSampler` retries the round's batch in halves, recursively, so only a request that
raises on its own fails; the trajectory ends there), or when it runs longer than `trajectory_timeout_s` from its
creation (`wall_budget`: it ends after the round). A failed trajectory is never a branching source; the trainer masks it
out of the loss. Without isolation an engine error propagates, as before.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np

from arpo_jax import knobs
from arpo_jax.rollout import branching
from arpo_jax.rollout.bisecting_sampler import BisectingSampler
from arpo_jax.rollout.branching import BranchParams, EntropyBaselines
from arpo_jax.rollout.output import PromptTree, RolloutOutput, TreeNode, pad_rows
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings, generate_each

_Queued = tuple  # a round's tool call: ((slot, tag, content), its Future when started at once, else None)

PREMONITOR_SLOT_BASE = 1 << 30  # slot ids of AEPO's pre-monitoring requests (kept apart from the rollout's)


RULES = ("arpo", "aepo")  # rollout.rule: ARPO's branching (4.2), AEPO's consecutive-branch penalty (5.2)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Static rollout settings (spec 4.2 and 11.3; script values: n 16, m 8, beam 2, p 0.5, w 0.2).

    Each ``knob`` field is the config field it names (default and meaning: configs/base.py) under its rule;
    ``components.rollout_config`` builds this from an experiment config."""

    n: int = knobs.knob("rollout.n", knobs.at_least(1))
    initial_rollouts: int = knobs.knob("rollout.initial_rollouts", knobs.at_least(1))
    beam_size: int = knobs.knob("rollout.beam_size", knobs.at_least(1))
    branch_probability: float = knobs.knob("rollout.branch_probability", knobs.UNIT)  # (see B3 for AEPO)
    entropy_weight: float = knobs.knob("rollout.entropy_weight")
    rule: str = knobs.knob("rollout.rule", knobs.one_of(RULES))
    consecutive_penalty: float = knobs.knob("rollout.consecutive_penalty", knobs.NONNEG)
    enable_dynamic_rollouts: bool = knobs.knob("rollout.enable_dynamic_rollouts")
    initial_entropy_tokens: int = knobs.knob("rollout.initial_entropy_tokens", knobs.at_least(1))
    dynamic_beta: float = knobs.knob("rollout.dynamic_beta")
    call_limit: int = knobs.knob("tools.call_limit", knobs.NONNEG)
    response_length: int = knobs.knob("data.max_response_length", knobs.POSITIVE)  # R
    prompt_length: int | None = None  # P: left-padded prompt width (None: longest prompt of the batch)
    max_model_len: int | None = None  # pre-monitoring guards (5.1); None: P + R
    entropy_window: int = knobs.knob("rollout.entropy_window", knobs.at_least(1))
    # Top log-probs per position requested from the engine; 0 (no entropy) is for validation only, so the config's
    # ">= 1" is config.py's rule.
    entropy_top_k: int = knobs.knob("rollout.entropy_top_k")
    entropy_reduce: str = "sum"  # "sum" over positions (reference) or "mean"
    reference_compat: bool = knobs.knob("rollout.reference_compat")  # B1, B3, B4, B10, B11 (module docstring)
    isolate_failures: bool = knobs.knob("rollout.failures.isolate")  # mark failed trajectories instead of raising
    # Wall budget per trajectory from its creation; 0 = none (needs isolation)
    trajectory_timeout_s: float = knobs.knob("rollout.failures.trajectory_timeout_s",
                                             knobs.Rule(lambda v: v >= 0, "0 (none) or seconds"))

    def __post_init__(self):
        knobs.validate(self)
        knobs.one_of(("sum", "mean")).enforce("RolloutConfig.entropy_reduce", self.entropy_reduce)
        if self.trajectory_timeout_s and not self.isolate_failures:
            raise ValueError("RolloutConfig: trajectory_timeout_s needs isolate_failures")

    def for_validation(self, n: int = 1) -> RolloutConfig:
        """Spec 3.1 validation: no branching, `n` independent samples per prompt (1 in the reference)."""
        return dataclasses.replace(self, n=n, initial_rollouts=n, beam_size=1, enable_dynamic_rollouts=False)


def greedy_settings(settings: SamplingSettings) -> SamplingSettings:
    """Spec 3.1 `do_sample=False`: temperature 0, top_p 1, top_k off."""
    return dataclasses.replace(settings, temperature=0.0, top_p=1.0, top_k=-1)


class Executor(Protocol):
    """What the loop needs from `arpo_jax.tools.ToolExecutor`."""

    stop_strings: list[str]

    def execute_batch(self, requests: list[tuple[str, str]]) -> list[str]: ...

    # Optional: `run_batch(requests) -> list[ToolResult]` (text and failure cause); without it no call fails.


@dataclasses.dataclass
class RolloutState:
    """State a rollout worker keeps across calls: only the reference's stale entropy dict (B1, compat mode)."""

    baselines: EntropyBaselines = dataclasses.field(default_factory=EntropyBaselines)


@dataclasses.dataclass
class _Slot:
    id: int
    prompt: int
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    kind: str = "root"  # "root", "branch", "refill"; "probe": AEPO pre-monitoring's discarded trajectory
    round_created: int = 0
    parent: int | None = None
    mask: list[int] = dataclasses.field(default_factory=list)  # per response token: 1 model, 0 tool result
    logps: list[float] = dataclasses.field(default_factory=list)  # per response token: engine log-prob or NaN
    calls: int = 0
    segments: int = 0
    branch_point: int = 0
    baseline: float | None = None
    entropy: float = 0.0  # this round's segment entropy
    entropies: list[float] = dataclasses.field(default_factory=list)
    post_tool: bool = False  # the state ends with a tool result this slot appended itself
    decision_point: tuple[int, int, int] | None = None  # (len(tokens), calls, segments) before this round (B4)
    requested: bool = False
    finish: str = ""
    failed: str = ""  # the first failure cause (isolate_failures)
    created: float = 0.0  # time.monotonic() at creation (the wall budget's start)

    @property
    def resp_len(self) -> int:
        return len(self.tokens) - self.prompt_len

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


def extract_tool_content(text: str, tag: str) -> str:
    """The text between the last `<tag>` preceding the last `</tag>`, stripped ("" if either is missing)."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, max(end, 0))
    if end < 0 or start < 0:
        return ""
    return text[start + len(tag) + 2:end].strip()


def wrap_tool_result(text: str) -> str:
    return " <result>\n" + text + "\n</result>"


def encode_tool_result(tokenizer, text: str, reference_compat: bool = False) -> list[int]:
    """Token ids of the wrapped result (B11: the reference's `encode` adds BOS and parses special tokens)."""
    wrapped = wrap_tool_result(text)
    if reference_compat:
        return list(tokenizer.encode(wrapped))
    try:
        return list(tokenizer(wrapped, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:  # tokenizers without split_special_tokens
        return list(tokenizer.encode(wrapped, add_special_tokens=False))


def _run_calls(executor: Executor, requests: list[tuple[str, str]]) -> list[tuple[str, str | None]]:
    """(text, failure cause or None) per tool call; executors without `run_batch` never report a failure."""
    if hasattr(executor, "run_batch"):
        return [(r.text, r.failure) for r in executor.run_batch(requests)]
    return [(text, None) for text in executor.execute_batch(requests)]


def _branch_params(config: RolloutConfig) -> BranchParams:
    p = config.branch_probability
    if config.rule == "aepo" and not config.reference_compat:
        p = 1.0 - p  # B3: feed the AEPO formula so that larger p means more branching, as in ARPO
    return BranchParams(config.n, config.beam_size, p, config.entropy_weight, config.rule, config.consecutive_penalty)


def _members(slots: list[_Slot], prompts: int, n: int) -> list[_Slot]:
    """The output's rows: n slots per prompt, prompt after prompt, each prompt's in creation order."""
    rows = []
    for b in range(prompts):
        mine = [s for s in slots if s.prompt == b][:n]
        mine += [mine[-1]] * (n - len(mine))  # the reference's safeguard; unreachable (4.4)
        rows.extend(mine)
    return rows


def rollout(prompts_token_ids: Sequence[Sequence[int]], sampler: Sampler, executor: Executor, tokenizer,
            config: RolloutConfig, settings: SamplingSettings | None = None,
            rng: np.random.Generator | int = 0, *, state: RolloutState | None = None) -> RolloutOutput:
    """Runs the tool rollout for a batch of (unpadded) prompts; returns exactly n trajectories per prompt.

    `rng` drives every branching draw (an int seeds a fresh generator); the engine's own sampling randomness
    comes from `settings.seed`. `state` matters only with `reference_compat` (B1); keep one per worker.

    `settings` gives the sampling distribution, the seed and `token_logprobs`; the loop owns the fields that follow
    from its own inputs and sets them whatever the caller passed: `stop` (the executor's closing tags, which is how
    a tool call is detected) and `logprobs` / `logprob_positions` (the entropy's top-k and window, `config`).
    """
    rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    settings = settings or SamplingSettings()
    if config.isolate_failures:  # an engine error fails only the requests that raise on their own
        sampler = BisectingSampler(sampler)
    return _Loop(prompts_token_ids, sampler, executor, tokenizer, config, settings, rng,
                 state or RolloutState()).run()


class _ToolCalls:
    """A rollout's tool calls. With an executor that runs calls one by one (`run_batch`: the real one), each starts
    as soon as its segment is back, on a thread of its own that waits for it; else the round's calls run together at
    its end. Either way the results are appended in the round's slot order."""

    def __init__(self, executor: Executor, tokenizer, compat: bool, isolate: bool):
        self.executor, self.tok, self.compat, self.isolate = executor, tokenizer, compat, isolate
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def running(self):
        if not hasattr(self.executor, "run_batch"):
            yield
            return
        workers = getattr(getattr(self.executor, "config", None), "max_workers", 32)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rollout-call") as pool:
            self.pool = pool
            try:
                yield
            finally:
                self.pool = None

    def start(self, call: tuple[_Slot, str, str], queued: list[_Queued]) -> None:
        queued.append((call, self.pool.submit(_run_calls, self.executor, [call[1:]]) if self.pool else None))

    def end(self, active: list[_Slot], queued: list[_Queued], max_len: int | None = None) -> int:
        """The round's tool results (the calls not started yet run now, all at once) appended with mask 0; returns
        the number of calls. The next round starts when the last is back: its branching and refill rules (4.2, 4.3)
        read the whole round. `max_len` is pre-monitoring's guard: a context that a result would push past it is
        first cut to `max_len - len(result) - 100` tokens, as in the reference."""
        order = {s.id: k for k, s in enumerate(active)}
        queued = sorted(queued, key=lambda q: order[q[0][0].id])
        later = [q for q, future in queued if future is None]
        batch = iter(_run_calls(self.executor, [(tag, content) for _, tag, content in later]) if later else ())
        for (s, _, _), future in queued:
            text, failure = future.result()[0] if future is not None else next(batch)
            if failure and self.isolate:
                s.fail(failure)
            ids = encode_tool_result(self.tok, text, self.compat)
            if max_len is not None and len(s.tokens) + len(ids) > max_len:
                del s.tokens[max(0, max_len - len(ids) - 100):]  # a probe's mask and log-probs are never read
            s.append(ids, 0)
            s.post_tool = True
        return len(queued)


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str):
    """Adds the block's seconds to `times[name]`; a profiler trace shows it as `rollout/<name>`."""
    t = time.perf_counter()
    with jax.profiler.TraceAnnotation(f"rollout/{name}"):
        yield
    times[name] += time.perf_counter() - t


class _Loop:
    """One `rollout` call's state. Methods follow the round structure of spec 3.3."""

    def __init__(self, prompts, sampler, executor, tokenizer, config: RolloutConfig, settings, rng, state):
        self.prompts = [list(p) for p in prompts]
        self.sampler, self.executor, self.tok, self.cfg, self.rng, self.state = (sampler, executor, tokenizer,
                                                                                 config, rng, state)
        self.compat = config.reference_compat
        self.closers = tuple(executor.stop_strings)
        # The loop's own fields (see `rollout`): tool-call detection and the entropy need exactly these.
        self.settings = dataclasses.replace(settings, stop=self.closers, logprobs=config.entropy_top_k,
                                            logprob_positions=config.entropy_window)
        self.eos = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer.get_vocab())
        self.R = config.response_length
        self.P = config.prompt_length or max((len(p) for p in self.prompts), default=1)
        if any(len(p) > self.P for p in self.prompts):
            raise ValueError(f"a prompt is longer than prompt_length={self.P} (the reference's truncation: error)")
        B = len(self.prompts)
        self.slots: list[_Slot] = []
        self.count = [0] * B
        self.consecutive = [0] * B
        self.params = _branch_params(config)
        self.trees = [PromptTree(b, 0, [], []) for b in range(B)]
        self.m = {k: 0.0 for k in ("rounds", "tool_calls", "branches", "branch_attempts", "refills",
                                   "call_limit_reached", "empty_tool_content", "premonitor_tool_calls")}
        self.times = {k: 0.0 for k in ("generate", "tools", "branching", "premonitor", "finalize")}
        self.calls = _ToolCalls(executor, tokenizer, self.compat, config.isolate_failures)

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> RolloutOutput:
        with self.calls.running():
            return self._rounds()

    def _rounds(self) -> RolloutOutput:
        t0 = time.perf_counter()
        initial = self._initial_rollouts()
        for b, m in enumerate(initial):
            self.trees[b].initial_rollouts = m
            for _ in range(m):
                self._new_slot(b, "root", 0)
        active = list(self.slots)
        r = 0
        while active:
            queued = self._generate(active)
            with _timed(self.times, "tools"):
                self._end_calls(active, queued)
            keep = []
            budget, now = self.cfg.trajectory_timeout_s, time.monotonic()
            for s in active:
                if not s.finish and s.resp_len >= self.R:
                    s.finish = "length"  # spec 3.3 step 5: the budget is spent (possibly by a tool result)
                if not s.finish and budget and now - s.created > budget:
                    s.fail("wall_budget", end=True)
                if not s.finish:
                    keep.append(s)
            with _timed(self.times, "branching"):
                active = keep + self._branch_and_refill(active, keep, r)
            r += 1
        self.m["rounds"] = r
        with _timed(self.times, "finalize"):
            out = self._finalize()
        self.times["total"] = time.perf_counter() - t0
        out.metrics.update({f"time/rollout_{k}_s": v for k, v in self.times.items()})
        return out

    def _new_slot(self, b: int, kind: str, r: int) -> _Slot:
        s = _Slot(len(self.slots), b, list(self.prompts[b]), len(self.prompts[b]), kind, r,
                  created=time.monotonic())
        self.slots.append(s)
        self.count[b] += 1
        return s

    def _entropy(self, res: SampleResult) -> float:
        # All returned entries count (top-k plus the sampled token when outside it), as in the reference.
        return branching.segment_entropy(res.top_logprobs, self.vocab_size, window=self.cfg.entropy_window,
                                         reduce=self.cfg.entropy_reduce)

    def _generate(self, active: list[_Slot]) -> list[_Queued]:
        """Spec 3.3 steps 1-3: one batched call with the largest remaining budget; as each segment comes back, its
        entropy, its absorption and, where the executor runs calls one by one, its tool call's start (the other
        requests still decoding). Returns the round's tool calls."""
        max_tokens = max(1, max(self.R - s.resp_len for s in active))
        requests = []
        for s in active:
            parent = s.parent if not s.requested else None  # a branch's first request: copy the parent's cache
            requests.append(SampleRequest(list(s.tokens), max_tokens, slot_id=s.id, parent_id=parent))
            s.requested = True
        queued: list[_Queued] = []

        def each(k: int, res: SampleResult | None) -> None:
            s = active[k]
            if res is None:  # the engine failed on this request: the trajectory ends here
                s.fail("engine_error", end=True)
                return
            s.entropy = self._entropy(res)
            s.entropies.append(s.entropy)
            if self.compat:
                self.state.baselines.observe(s.id, s.entropy)  # B1: set only for never-seen slot ids
            elif s.baseline is None:
                s.baseline = s.entropy  # the first segment from the prompt (branches inherit theirs)
            self._start_call(s, res, queued)

        with _timed(self.times, "generate"):
            self._sample(requests, each)
        return queued

    def _sample(self, requests: list[SampleRequest], on_result=None) -> list[SampleResult | None]:
        """One batched engine call (None for a request that failed on its own: `BisectingSampler`, isolation);
        `on_result(i, result)` as each comes back (`sampler.generate_each`)."""
        results = generate_each(self.sampler, requests, self.settings, on_result or (lambda i, res: None))
        if len(results) != len(requests):
            raise RuntimeError(f"sampler returned {len(results)} results for {len(requests)} requests")
        return results

    def _absorb(self, s: _Slot, res: SampleResult | None) -> tuple[_Slot, str, str] | None:
        """Spec 3.3 step 3 for one slot: append the segment, detect a tool call; returns a queued call or None."""
        if res is None:
            return None
        s.decision_point = (len(s.tokens), s.calls, s.segments) if s.post_tool else None
        s.post_tool = False
        s.append(res.token_ids, 1, res.token_logprobs)
        s.segments += 1
        if res.finish_reason == "stop" and res.stop_string in self.closers:
            tag = res.stop_string[2:-1]
            if s.calls >= self.cfg.call_limit:
                s.append([self.eos], 1)  # the extra call: EOS, trained (mask 1), not sampled (no log-prob)
                s.finish = "call_limit"
                return None
            s.calls += 1
            text = self.tok.decode(s.tokens if self.compat else res.token_ids, skip_special_tokens=False)
            content = extract_tool_content(text, tag)
            if content:
                return s, tag, content
            s.finish = "empty_tool_content"  # ends silently, no EOS (B10)
        elif res.finish_reason == "length":
            if not res.token_ids or s.resp_len >= self.R:
                s.finish = "length"
        else:
            s.finish = "eos" if res.finish_reason == "eos" else "stop"
        return None

    def _start_call(self, s: _Slot, res: SampleResult | None, queued: list[_Queued]) -> None:
        """Spec 3.3 step 3 for one segment (`_absorb`); its tool call starts at once where it can (`_ToolCalls`)."""
        q = self._absorb(s, res)
        if q is not None:
            self.calls.start(q, queued)

    def _end_calls(self, active: list[_Slot], queued: list[_Queued], counter: str = "tool_calls",
                   max_len: int | None = None) -> None:
        """Spec 3.3 step 4 (`_ToolCalls.end`), rollout and pre-monitoring (5.1); `counter` counts the calls."""
        self.m[counter] += self.calls.end(active, queued, max_len)

    def _branch_and_refill(self, active: list[_Slot], keep: list[_Slot], r: int) -> list[_Slot]:
        """Spec 4.2 / 5.2 branching, then the 4.3 refill, then AEPO's counter update; returns the new slots."""
        if self.compat:  # B4 as in the reference: surviving slots, entropy of the segment before the tool call
            sources = keep
            entropy = {s.id: (s.entropy, self.state.baselines.get(s.id)) for s in sources}
        else:  # the segment generated right after this slot's own tool result decides
            sources = [s for s in active if s.decision_point is not None]
            entropy = {s.id: (s.entropy, s.baseline) for s in sources}
        sources = [s for s in sources if not s.failed]  # a branch would inherit the failure
        by_id = {s.id: s for s in sources}
        new: list[_Slot] = []
        new_per_prompt = [0] * len(self.prompts)
        for b in range(len(self.prompts)):
            src = [s.id for s in sources if s.prompt == b]
            if not src:
                continue
            attempts = branching.decide_branches(src, entropy.__getitem__, self.count[b], self.params, self.rng,
                                                 round_index=r, consecutive=self.consecutive[b])
            for a in attempts:
                child = self._branch(by_id[a.source], r) if a.branched else None
                self.trees[b].attempts.append(dataclasses.replace(a, child=child.id) if child else a)
                if child:
                    new.append(child)
                    new_per_prompt[b] += 1
            self.m["branch_attempts"] += len(attempts)
        self.m["branches"] += len(new)
        busy = {s.prompt for s in keep} | {s.prompt for s in new}
        for b in range(len(self.prompts)):
            if branching.needs_refill(b in busy, self.count[b], self.cfg.n):
                new.append(self._new_slot(b, "refill", r + 1))
                new_per_prompt[b] += 1
                self.m["refills"] += 1
        if self.cfg.rule == "aepo":
            self.consecutive = branching.update_consecutive(self.consecutive, new_per_prompt)
        return new

    def _branch(self, src: _Slot, r: int) -> _Slot:
        """A copy of `src`: its current state (compat) or its state right after its last tool result (default)."""
        length, calls, segments = (len(src.tokens), src.calls, src.segments) if self.compat else src.decision_point
        child = self._new_slot(src.prompt, "branch", r + 1)
        child.tokens = list(src.tokens[:length])
        child.mask = list(src.mask[:length - src.prompt_len])
        child.logps = list(src.logps[:length - src.prompt_len])
        child.calls, child.segments, child.parent = calls, segments, src.id
        child.branch_point = length - src.prompt_len
        child.baseline = None if self.compat else src.baseline
        return child

    # ------------------------------------------------------------------------------ AEPO pre-monitoring (5.1)
    def _initial_rollouts(self) -> list[int]:
        cfg = self.cfg
        fixed = max(1, min(cfg.initial_rollouts, cfg.n))
        if not cfg.enable_dynamic_rollouts or cfg.n == 1:  # n = 1: the formula gives 1 whatever the entropies
            return [fixed] * len(self.prompts)
        max_len = cfg.max_model_len or (self.P + self.R)
        valid = [b for b, p in enumerate(self.prompts) if len(p) < max_len]  # longer prompts are dropped
        with _timed(self.times, "premonitor"):
            h_root = self._premonitor_root(valid, max_len)
            h_tool = self._premonitor_tool_rollout(valid, max_len)
        out = [fixed] * len(self.prompts)
        for b in valid:
            if b not in h_root:  # its pre-monitoring request failed (isolate_failures): the fixed m
                continue
            hs = h_tool[b]
            mean = float(np.mean(hs)) if hs else h_root[b]
            out[b] = branching.initial_rollouts_dynamic(cfg.n, h_root[b], mean, beta=cfg.dynamic_beta)
            self.trees[b].h_root, self.trees[b].h_tool_mean = h_root[b], mean
        return out

    def _premonitor_root(self, valid: list[int], max_len: int) -> dict[int, float]:
        """H_root: one generation of `initial_entropy_tokens` from each prompt."""
        if not valid:
            return {}
        reqs = [SampleRequest(list(self.prompts[b]), max(1, min(self.cfg.initial_entropy_tokens,
                                                                max_len - len(self.prompts[b]))),
                              slot_id=PREMONITOR_SLOT_BASE + b) for b in valid]
        results = self._sample(reqs)
        return {b: self._entropy(res) for b, res in zip(valid, results) if res is not None}

    def _premonitor_tool_rollout(self, valid: list[int], max_len: int) -> dict[int, list[float]]:
        """H_tool: one complete, discarded tool rollout per prompt; every segment's entropy (the first included).

        Its probe slots run the rollout's own tool round; they are never branched, returned or counted as
        trajectories. A probe that reaches the call limit or an empty call just ends (its EOS is never read)."""
        base = PREMONITOR_SLOT_BASE + len(self.prompts)
        probes = [_Slot(base + b, b, list(self.prompts[b]), len(self.prompts[b]), "probe") for b in valid]
        active = probes
        while active:
            budget = max(1, max(self.R - s.resp_len for s in active))
            cap = max_len - max(len(s.tokens) for s in active)  # extra guard of this phase only
            queued: list[_Queued] = []

            def each(k: int, res: SampleResult | None, active=active, queued=queued) -> None:
                s = active[k]
                if res is None:  # the engine failed: this prompt's pre-monitoring ends with what it has
                    s.finish = "engine_error"
                    return
                s.entropies.append(self._entropy(res))
                self._start_call(s, res, queued)

            self._sample([SampleRequest(list(s.tokens), max(1, min(budget, cap)), slot_id=s.id) for s in active],
                         each)
            self._end_calls(active, queued, "premonitor_tool_calls", max_len)
            active = [s for s in active if not s.finish and s.resp_len < self.R and len(s.tokens) < max_len]
        return {s.prompt: s.entropies for s in probes}

    # ------------------------------------------------------------------------------------ finalisation (3.4)
    def _finalize(self) -> RolloutOutput:
        rows = _members(self.slots, len(self.prompts), self.cfg.n)
        pad = self.eos if self.tok.pad_token_id is None else self.tok.pad_token_id
        arrays = pad_rows(self.prompts, [(s.prompt, s.tokens[s.prompt_len:], s.mask, s.logps) for s in rows],
                          R=self.R, P=self.P, pad=pad, eos=self.eos, compat=self.compat)
        return RolloutOutput(
            **arrays, slot_id=np.asarray([s.id for s in rows], np.int32),
            parent_id=np.asarray([-1 if s.parent is None else s.parent for s in rows], np.int32),
            tool_calls=np.asarray([s.calls for s in rows], np.int32),
            rounds=np.asarray([s.segments for s in rows], np.int32),
            truncated=np.asarray([s.resp_len > self.R for s in rows]),
            finish_reason=np.asarray([s.finish for s in rows], dtype=object),
            failed=np.asarray([s.failed for s in rows], dtype=object),
            trees=self._trees(), metrics=self._metrics(rows))

    def _trees(self) -> list[PromptTree]:
        for tree in self.trees:
            tree.nodes = [TreeNode(s.id, s.parent, s.kind, s.round_created, s.branch_point,
                                   None if self.compat else s.baseline, list(s.entropies))
                          for s in self.slots if s.prompt == tree.prompt_index]
        return self.trees

    def _metrics(self, rows: list[_Slot]) -> dict[str, float]:
        # From the trajectories' finish reasons: `_absorb` also ends pre-monitoring's probes, which must not count.
        for key, finish in (("call_limit_reached", "call_limit"), ("empty_tool_content", "empty_tool_content")):
            self.m[key] = sum(s.finish == finish for s in self.slots)
        out = {f"rollout/{k}": float(v) for k, v in self.m.items()}
        ents = [e for s in self.slots for e in s.entropies]
        out.update({
            "rollout/trajectories": float(len(rows)),
            "rollout/initial_rollouts_mean": float(np.mean([t.initial_rollouts for t in self.trees] or [0])),
            "rollout/truncated_fraction": float(np.mean([s.resp_len > self.R for s in rows] or [0])),
            "rollout/segment_entropy_mean": float(np.mean(ents)) if ents else 0.0,
        })
        return out
