"""The round algorithm's decisions as a replay over logical rounds (spec 4.2, 4.3, 5.2).

A trajectory created at logical round c generates its k-th own segment in round c + k; a segment's `Record` holds
all that round's decisions read about it. `PromptReplay.decide(r)` is the round algorithm's step 6 for one prompt:
its round-r trajectories, in creation order, branch (the attempts' draws named by the attempt,
`identity.attempt_draw`) within the budget n, then the refill rule; it can run as soon as those trajectories' round-r
records exist, however far other trajectories or prompts have run. What couples prompts is numbered by `Rounds`
once every prompt has decided a round: the output's slot ids (prompt after prompt, branches before refills, as the
round schedule creates them), AEPO's consecutive-branch counters (5.2: they move only if some prompt got a new
trajectory), and with `reference_compat` B1's stale baselines, which are keyed by slot id: in those two modes a
prompt decides round r only after every prompt's round r - 1 (`needs_numbering`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arpo_jax.rollout import branching, identity
from arpo_jax.rollout.branching import BranchAttempt, BranchParams
from arpo_jax.rollout.trajectory import State, Trajectory


@dataclasses.dataclass(frozen=True)
class Creation:
    """A trajectory a decision creates: a branch of `source` from its state `at`, or the prompt's `fresh`-th fresh
    trajectory (a refill); `key` names it (`identity.py`), `attempt` is the index of the attempt that made it."""

    kind: str  # "branch" | "refill"
    key: int
    source: Trajectory | None = None
    at: State | None = None
    fresh: int = -1
    attempt: int = -1


@dataclasses.dataclass
class Attempt:
    """One branching attempt as decided (`attempt.source` indexes the round's sources), its source and its child."""

    attempt: BranchAttempt
    source: Trajectory
    child: Trajectory | None = None


class PromptReplay:
    """One prompt's committed trajectories (creation order) and its decisions, round by round."""

    def __init__(self, prompt: int, params: BranchParams, seed: int, compat: bool):
        self.prompt, self.params, self.seed, self.compat = prompt, params, seed, compat
        self.members: list[Trajectory] = []
        self.fresh = 0  # fresh trajectories committed (roots, then refills)
        self.round = 0  # the next round to decide
        self.done = False  # no trajectory left, none to come
        self.consecutive = 0  # AEPO's counter (5.2), kept by `Rounds`
        self.attempts: list[Attempt] = []
        self.created: dict[int, list[Trajectory]] = {}  # decided round -> the trajectories it created

    @property
    def count(self) -> int:
        return len(self.members)

    def add(self, t: Trajectory, round_created: int, kind: str) -> None:
        """Commits `t`: a root (round 0), or what the decision of round `round_created - 1` created."""
        t.round_created, t.kind = round_created, kind
        self.members.append(t)
        if kind != "root":
            self.created.setdefault(round_created - 1, []).append(t)

    def active(self, r: int) -> list[Trajectory]:
        """The trajectories that generate a segment in round r, in creation order."""
        return [t for t in self.members if _active(t, r)]

    def ready(self, r: int) -> bool:
        """Whether every round-r trajectory has its round-r record."""
        return all(len(t.records) > r - t.round_created for t in self.active(r))

    def decide(self, r: int, baseline: Callable[[Trajectory], float]) -> list[Creation]:
        """Round r's branching (4.2 / 5.2) and refill (4.3); `baseline(t)`: H_init of a compat source (B1).
        The caller adds what it returns (`add`, round r + 1) before the next round is decided."""
        act = self.active(r)
        if not act:  # (every prompt has a trajectory in its first round: this is a prompt left empty)
            self.round, self.done = r + 1, True
            return []
        rec = {id(t): t.records[r - t.round_created] for t in act}
        keep = [t for t in act if rec[id(t)].alive]
        if self.compat:  # B4 as in the reference: surviving trajectories, entropy of the segment before the call
            sources = [t for t in keep if not rec[id(t)].failed]
            entropy = [(rec[id(t)].entropy, baseline(t)) for t in sources]
        else:  # the segment generated right after this trajectory's own tool result decides
            sources = [t for t in act if rec[id(t)].decision is not None and not rec[id(t)].failed]
            entropy = [(rec[id(t)].entropy, t.baseline) for t in sources]

        def draw(i: int, k: int) -> float:
            return identity.attempt_draw(self.seed, self.prompt, sources[i].key, rec[id(sources[i])].index, k)

        attempts = branching.decide_branches(range(len(sources)), entropy.__getitem__, self.count, self.params,
                                             draw, round_index=r, consecutive=self.consecutive) if sources else []
        out, made = [], {}
        for a in attempts:
            src, record = sources[a.source], rec[id(sources[a.source])]
            k = made[a.source] = made.get(a.source, -1) + 1
            self.attempts.append(Attempt(a, src))
            if a.branched:
                at = record.after if self.compat else record.decision
                out.append(Creation("branch", identity.branch_key(src.key, record.index, k), src, at,
                                    attempt=len(self.attempts) - 1))
        if not keep and not out and self.count < self.params.n:
            out.append(Creation("refill", identity.fresh_key(self.prompt, self.fresh), fresh=self.fresh))
            self.fresh += 1
        self.round = r + 1
        self.done = not keep and not out
        return out

def _active(t: Trajectory, r: int) -> bool:
    c = t.round_created
    if r < c:
        return False
    return r == c or (len(t.records) >= r - c and t.records[r - c - 1].alive)


class Rounds:
    """What couples the prompts, numbered round by round once every prompt has decided it: slot ids (roots prompt
    after prompt; then each round's branches prompt after prompt, then its refills) and AEPO's counters."""

    def __init__(self, replays: list[PromptReplay], aepo: bool):
        self.replays, self.aepo = replays, aepo
        self.numbered = 0  # rounds numbered
        self.next_id = 0

    def number_roots(self) -> None:
        for rp in self.replays:
            for t in rp.members:
                t.id = self._take_id()

    def advance(self) -> bool:
        """Numbers the next round if every prompt has decided it; whether it did."""
        r = self.numbered
        decided = [rp.round > r for rp in self.replays]
        if not any(decided) or not all(d or rp.done for d, rp in zip(decided, self.replays)):
            return False
        made = [rp.created.get(r, []) for rp in self.replays]
        for kind in ("branch", "refill"):
            for created in made:
                for t in created:
                    if t.kind == kind:
                        t.id = self._take_id()
        if self.aepo:
            counters = branching.update_consecutive([rp.consecutive for rp in self.replays], [len(c) for c in made])
            for rp, c in zip(self.replays, counters):
                rp.consecutive = c
        self.numbered += 1
        return True

    def _take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1
