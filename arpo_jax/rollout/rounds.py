"""The rollout's shared state and the round schedule (`agent_loop.py` has the public `rollout`).

`Loop` holds one `rollout` call: the prompts, the segment rules (`trajectory.SegmentRules`), each prompt's replay of
the round algorithm's decisions (`replay.py`), AEPO's pre-monitoring and the output. Its `run_rounds` is the round
schedule, spec 3.3 as written: one batched engine call a round (each request with its own remaining budget), every
tool result of the round awaited, then every prompt's decisions; `streaming.run_stream` is the other schedule over
the same state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np

from arpo_jax.rollout import branching, identity
from arpo_jax.rollout.branching import BranchParams
from arpo_jax.rollout.output import PromptTree, RolloutOutput, TreeNode, pad_rows
from arpo_jax.rollout.replay import Creation, PromptReplay, Rounds
from arpo_jax.rollout.sampler import SampleRequest, SampleResult, generate_each
from arpo_jax.rollout.settings import RolloutConfig
from arpo_jax.rollout.tool_calls import ToolCalls
from arpo_jax.rollout.trajectory import SegmentRules, Trajectory

PREMONITOR_SLOT_BASE = 1 << 30  # slot ids of AEPO's pre-monitoring requests (kept apart from the rollout's)
# What an engine counts of its work, summed into the rollout's metrics (`EngineStream.stats`, `last_stats`): its
# sequential decode steps and the calls that ran them (the JAX engine's host reads; 0 for vLLM), the rows live in
# them, the row-steps its programs computed (a JAX engine on CPU computes a row bucket: `rollout.jax.decode_rows`),
# the tokens it sampled (those it discarded included) and the context tokens it prefilled.
ENGINE_COUNTS = ("decode_steps", "decode_calls", "row_steps", "computed_row_steps", "sampled_tokens", "prefill_tokens")


def branch_params(config: RolloutConfig) -> BranchParams:
    p = config.branch_probability
    if config.rule == "aepo" and not config.reference_compat:
        p = 1.0 - p  # B3: feed the AEPO formula so that larger p means more branching, as in ARPO
    return BranchParams(config.n, config.beam_size, p, config.entropy_weight, config.rule, config.consecutive_penalty)


@contextlib.contextmanager
def timed(times: dict[str, float], name: str):
    """Adds the block's seconds to `times[name]`; a profiler trace shows it as `rollout/<name>`."""
    t = time.perf_counter()
    with jax.profiler.TraceAnnotation(f"rollout/{name}"):
        yield
    times[name] += time.perf_counter() - t


class Loop:
    """One `rollout` call's state, shared by both schedules: the prompts, the segment rules, each prompt's replay
    of the decisions, the output. `run_rounds` is the round schedule (spec 3.3, one round at a time)."""

    def __init__(self, prompts, sampler, executor, tokenizer, config: RolloutConfig, settings, seed: int, state):
        self.prompts = [list(p) for p in prompts]
        self.sampler, self.executor, self.tok, self.cfg, self.state = sampler, executor, tokenizer, config, state
        self.compat = config.reference_compat
        closers = tuple(executor.stop_strings)
        # The loop's own fields (see `rollout`): tool-call detection and the entropy need exactly these.
        self.settings = dataclasses.replace(settings, stop=closers, logprobs=config.entropy_top_k,
                                            logprob_positions=config.entropy_window)
        self.rules = SegmentRules(tokenizer, closers, tokenizer.eos_token_id, config.call_limit,
                                  config.response_length, self.compat, len(tokenizer.get_vocab()),
                                  config.entropy_window, config.entropy_reduce, config.trajectory_timeout_s)
        self.R = config.response_length
        self.P = config.prompt_length or max((len(p) for p in self.prompts), default=1)
        if any(len(p) > self.P for p in self.prompts):
            raise ValueError(f"a prompt is longer than prompt_length={self.P} (the reference's truncation: error)")
        B = len(self.prompts)
        self.seed = seed
        self.params = branch_params(config)
        self.replays = [PromptReplay(b, self.params, seed, self.compat) for b in range(B)]
        # AEPO's counters and B1's stale baselines (keyed by slot id) couple the prompts: numbered round by round.
        self.rounds = Rounds(self.replays, aepo=config.rule == "aepo")
        self.needs_numbering = config.rule == "aepo" or self.compat
        self.prior = dict(state.baselines.values)  # B1: the stale dict as this call found it
        self.trees = [PromptTree(b, 0, [], []) for b in range(B)]
        self.m = {k: 0.0 for k in ("rounds", "tool_calls", "branches", "branch_attempts", "refills",
                                   "call_limit_reached", "empty_tool_content", "premonitor_tool_calls",
                                   *ENGINE_COUNTS, "speculative_tokens_discarded",
                                   "speculative_trajectories", "speculative_committed", "tool_s", "tool_hidden_s")}
        self.times = {k: 0.0 for k in ("generate", "tools", "branching", "premonitor", "finalize")}
        self.calls = ToolCalls(executor)

    # ---------------------------------------------------------------------------------- shared by both schedules
    def fresh(self, b: int, j: int) -> Trajectory:
        """The j-th trajectory of prompt b that starts from the prompt alone (a root or a refill)."""
        return Trajectory(-1, b, list(self.prompts[b]), len(self.prompts[b]), key=identity.fresh_key(b, j),
                          created=time.monotonic())

    def make(self, rp: PromptReplay, c: Creation) -> Trajectory:
        """The trajectory of a decision's creation (not yet committed: `commit`)."""
        if c.kind == "refill":
            return self.fresh(rp.prompt, c.fresh)
        return c.source.fork(c.at, id=-1, key=c.key, baseline=None if self.compat else c.source.baseline)

    def commit(self, rp: PromptReplay, c: Creation, t: Trajectory, r: int) -> None:
        """`t` (made for `c`, or started early under its key) joins its prompt, created by round r's decision."""
        rp.add(t, r + 1, c.kind)
        if c.kind == "branch":
            rp.attempts[c.attempt].child = t
            self.m["branches"] += 1
        else:
            self.m["refills"] += 1

    def baseline(self, t: Trajectory) -> float:
        """B1 (compat): the stale dict's entry for t's slot id, else t's own first segment's entropy."""
        return self.prior.get(t.id, t.entropies[0] if t.entropies else 0.0)

    def commit_roots(self, initial: list[int]) -> None:
        for rp, m in zip(self.replays, initial):
            self.trees[rp.prompt].initial_rollouts = m
            for j in range(m):
                rp.add(self.fresh(rp.prompt, j), 0, "root")
            rp.fresh = m
        self.rounds.number_roots()

    def decide(self, rp: PromptReplay, r: int) -> list[Creation]:
        """Round r's decisions for one prompt (`PromptReplay.decide`), counted."""
        creations = rp.decide(r, self.baseline)
        self.m["branch_attempts"] = sum(len(x.attempts) for x in self.replays)
        self.m["rounds"] = max(self.m["rounds"], r + 1)
        return creations

    def sample(self, requests: list[SampleRequest], on_result=None) -> list[SampleResult | None]:
        """One batched engine call (None for a request that failed on its own: `BisectingSampler`, isolation);
        `on_result(i, result)` as each comes back (`sampler.generate_each`)."""
        results = generate_each(self.sampler, requests, self.settings, on_result or (lambda i, res: None))
        if len(results) != len(requests):
            raise RuntimeError(f"sampler returned {len(results)} results for {len(requests)} requests")
        stats = getattr(self.sampler, "last_stats", None) or {}
        for key in ENGINE_COUNTS:
            self.m[key] += stats.get(key, 0)
        return results

    def add_results(self, results, counter: str = "tool_calls", max_len: int | None = None) -> None:
        """Appends each (trajectory, text, failure, seconds) tool result (`SegmentRules.add_result`); counts the
        calls."""
        for t, text, failure, seconds in results:
            self.rules.add_result(t, text, failure, isolate=self.cfg.isolate_failures, seconds=seconds,
                                  max_len=max_len)
        self.m[counter] += len(results)

    # ---------------------------------------------------------------------------------------- the round schedule
    def run_rounds(self) -> RolloutOutput:
        t0 = time.perf_counter()
        with self.calls.running():
            self.commit_roots(self.initial_rollouts())
            active = [t for rp in self.replays for t in rp.members]
            r = 0
            while active:
                queued = self._generate(active)
                with timed(self.times, "tools"):
                    self.add_results(self.calls.end(active, queued))
                for t in active:
                    self.rules.close(t)
                with timed(self.times, "branching"):
                    for rp in self.replays:
                        if not rp.done:
                            for c in self.decide(rp, r):
                                self.commit(rp, c, self.make(rp, c), r)
                    self.rounds.advance()
                survivors = [t for t in active if t.records[-1].alive]
                active = sorted(survivors + [t for rp in self.replays for t in rp.created.get(r, [])],
                                key=lambda t: t.id)
                r += 1
        self.m["tool_s"] = self.calls.seconds
        self.m["tool_hidden_s"] = max(0.0, self.calls.seconds - self.times["tools"])  # the calls started at once
        return self.finalize(time.perf_counter() - t0)

    def _generate(self, active: list[Trajectory]) -> list:
        """Spec 3.3 steps 1-3: one batched call, each request with its own remaining budget; as each segment comes
        back, its entropy, its absorption and, where the executor runs calls one by one, its tool call's start (the
        other requests still decoding). Returns the round's tool calls."""
        requests = []
        for t in active:
            parent = t.parent.id if t.parent is not None and not t.requested else None  # a branch: the parent's row
            requests.append(SampleRequest(list(t.tokens), max(1, self.R - t.resp_len), slot_id=t.id,
                                          parent_id=parent, key=t.key))
            t.requested = True
        queued: list = []

        def each(k: int, res: SampleResult | None) -> None:
            call = self.rules.take(active[k], res)
            if call is not None:
                self.calls.start(call, queued)

        with timed(self.times, "generate"):
            self.sample(requests, each)
        return queued

    # ------------------------------------------------------------------------------ AEPO pre-monitoring (5.1)
    def initial_rollouts(self) -> list[int]:
        cfg = self.cfg
        fixed = max(1, min(cfg.initial_rollouts, cfg.n))
        if not cfg.enable_dynamic_rollouts or cfg.n == 1:  # n = 1: the formula gives 1 whatever the entropies
            return [fixed] * len(self.prompts)
        max_len = cfg.max_model_len or (self.P + self.R)
        valid = [b for b, p in enumerate(self.prompts) if len(p) < max_len]  # longer prompts are dropped
        with timed(self.times, "premonitor"):
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
                              slot_id=PREMONITOR_SLOT_BASE + b, key=identity.probe_key(b, 0)) for b in valid]
        results = self.sample(reqs)
        return {b: self.rules.entropy(res) for b, res in zip(valid, results) if res is not None}

    def _premonitor_tool_rollout(self, valid: list[int], max_len: int) -> dict[int, list[float]]:
        """H_tool: one complete, discarded tool rollout per prompt; every segment's entropy (the first included).

        Its probe trajectories run the rollout's own tool rounds; they are never branched, returned or counted as
        trajectories. A probe that reaches the call limit or an empty call just ends (its EOS is never read)."""
        base = PREMONITOR_SLOT_BASE + len(self.prompts)
        probes = [Trajectory(base + b, b, list(self.prompts[b]), len(self.prompts[b]), "probe",
                             key=identity.probe_key(b, 1)) for b in valid]
        active = probes
        while active:
            queued: list = []

            def each(k: int, res: SampleResult | None, active=active, queued=queued) -> None:
                s = active[k]
                if res is None:  # the engine failed: this prompt's pre-monitoring ends with what it has
                    s.finish = "engine_error"
                    return
                s.entropies.append(self.rules.entropy(res))
                call = self.rules.absorb(s, res)
                if call is not None:
                    self.calls.start(call, queued)

            # Each probe's own budget, within this phase's extra guard (max_len).
            self.sample([SampleRequest(list(s.tokens), max(1, min(self.R - s.resp_len, max_len - len(s.tokens))),
                                       slot_id=s.id, key=s.key) for s in active], each)
            self.add_results(self.calls.end(active, queued), "premonitor_tool_calls", max_len)
            active = [s for s in active if not s.finish and s.resp_len < self.R and len(s.tokens) < max_len]
        return {s.prompt: s.entropies for s in probes}

    # ------------------------------------------------------------------------------------ finalisation (3.4)
    def finalize(self, seconds: float) -> RolloutOutput:
        with timed(self.times, "finalize"):
            out = self._output()
        self.times["total"] = seconds + self.times["finalize"]
        out.metrics.update({f"time/rollout_{k}_s": v for k, v in self.times.items()})
        return out

    def _output(self) -> RolloutOutput:
        rows = self.members()
        if self.compat:  # B1: every slot id of this call keeps its first entropy for the calls that follow
            for rp in self.replays:
                for t in rp.members:
                    if t.entropies:
                        self.state.baselines.observe(t.id, t.entropies[0])
        pad = self.rules.eos if self.tok.pad_token_id is None else self.tok.pad_token_id
        arrays = pad_rows(self.prompts, [(s.prompt, s.tokens[s.prompt_len:], s.mask, s.logps) for s in rows],
                          R=self.R, P=self.P, pad=pad, eos=self.rules.eos, compat=self.compat)
        return RolloutOutput(
            **arrays, slot_id=np.asarray([s.id for s in rows], np.int32),
            parent_id=np.asarray([-1 if s.parent is None else s.parent.id for s in rows], np.int32),
            tool_calls=np.asarray([s.calls for s in rows], np.int32),
            rounds=np.asarray([s.segments for s in rows], np.int32),
            truncated=np.asarray([s.resp_len > self.R for s in rows]),
            finish_reason=np.asarray([s.finish for s in rows], dtype=object),
            failed=np.asarray([s.failed for s in rows], dtype=object),
            trees=self._trees(), metrics=self._metrics(rows))

    def members(self) -> list[Trajectory]:
        """The output's rows: n trajectories per prompt, prompt after prompt, each prompt's in creation order."""
        rows = []
        for rp in self.replays:
            mine = sorted(rp.members, key=lambda t: t.id)[:self.cfg.n]
            mine += [mine[-1]] * (self.cfg.n - len(mine))  # the reference's safeguard; unreachable (4.4)
            rows.extend(mine)
        return rows

    def _trees(self) -> list[PromptTree]:
        for tree, rp in zip(self.trees, self.replays):
            tree.nodes = [TreeNode(s.id, None if s.parent is None else s.parent.id, s.kind, s.round_created,
                                   s.branch_point, None if self.compat else s.baseline, list(s.entropies))
                          for s in sorted(rp.members, key=lambda t: t.id)]
            tree.attempts = [dataclasses.replace(a.attempt, source=a.source.id,
                                                 child=None if a.child is None else a.child.id)
                             for a in rp.attempts]
        return self.trees

    def _metrics(self, rows: list[Trajectory]) -> dict[str, float]:
        members = [t for rp in self.replays for t in rp.members]
        for key, finish in (("call_limit_reached", "call_limit"), ("empty_tool_content", "empty_tool_content")):
            self.m[key] = sum(s.finish == finish for s in members)
        out = {f"rollout/{k}": float(v) for k, v in self.m.items()}
        ents = [e for s in members for e in s.entropies]
        steps = self.m["decode_steps"]
        step_s = self.times["generate"] / steps if steps else 0.0
        out.update({
            "rollout/trajectories": float(len(rows)),
            "rollout/initial_rollouts_mean": float(np.mean([t.initial_rollouts for t in self.trees] or [0])),
            "rollout/truncated_fraction": float(np.mean([s.resp_len > self.R for s in rows] or [0])),
            "rollout/segment_entropy_mean": float(np.mean(ents)) if ents else 0.0,
            "rollout/rows_per_decode_step": self.m["row_steps"] / steps if steps else 0.0,
            # The longest chain of sequential decode steps a trajectory needed (its tokens and those it inherited):
            # what the rollout would take with rows to spare and tools that answer at once.
            "rollout/critical_path_steps": float(max((sum(t.mask) for t in rows), default=0)),
            # The same chain in seconds: its steps at the rollout's mean seconds a decode step, and its tool calls.
            "rollout/critical_path_s": max((sum(t.mask) * step_s + sum(t.call_seconds) for t in rows), default=0.0),
        })
        return out
