"""ARPO adaptive branching and AEPO entropy-balanced rollout decisions (spec sections 4 and 5), engine-agnostic.

Everything here is plain host-side Python/numpy: the agent loop (`agent_loop.py`) feeds in segment entropies and
slot ids, and gets back decisions. Randomness comes only from the caller's `draw(source, attempt)`: the agent loop
names each attempt's uniform by the attempt itself (`identity.attempt_draw`), so a decision does not depend on the
order in which decisions are made.

Reference quirks (spec section 14) and what this module does about them:

* B1 (stale entropy baseline): the reference keeps `H_init` in a dict keyed by per-call slot index that is never
  cleared, so from the second step on a slot compares against another prompt's entropy. Default: the baseline is
  the entropy of the trajectory's own first segment (from the prompt), reset every call, and a branch inherits its
  parent's baseline (it shares the parent's first segment). `reference_compat`: `EntropyBaselines` keyed by slot
  id, persisting across calls as long as the caller keeps the object (the agent loop's `RolloutState`).
* B3 (AEPO inverts the meaning of `branch_probability`): `branch_probability("aepo", ...)` is the reference
  formula `clip(1 - p/f + w*dH)`. The agent loop calls it with `p_ref = 1 - p` by default, so that in both rules a
  larger `p` means more branching (`p + w*dH` at f = 1, identical to ARPO); with `reference_compat` the configured
  `p` goes in as is. Both coincide at p = 0.5, the value every reference script uses.
* B4 (which segment decides): see `agent_loop.py`; the entropy measure itself (a sum over <= 20 positions of the
  top-k truncated entropy, divided by ln|V|) is the spec's in both modes, with `reduce="mean"` available.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

Rule = Literal["arpo", "aepo"]


# ------------------------------------------------------------------------------------------------ entropy (4.1)
def segment_entropy(top_logprobs: Sequence[Mapping[int, float]], vocab_size: int, *, window: int = 20,
                    top_k: int | None = None, normalize: bool = True, reduce: Literal["sum", "mean"] = "sum") -> float:
    """The ARPO step entropy of one generated segment (spec 4.1).

    Args:
      top_logprobs: per generated position, `{token_id: logprob}` of the top-k tokens (plus the sampled token when
        it is not among them: k or k + 1 entries, all of which count, as in the reference).
      vocab_size: |V| = len(tokenizer.get_vocab()); the result is divided by ln|V| when `normalize`.
      window: only the first `window` positions count (reference: 20).
      top_k: keep only the k largest entries of each position (None: all returned entries; the engine already
        returns the top `SamplingSettings.logprobs`).
      reduce: "sum" over positions (reference) or "mean".
    Returns:
      `-sum_{t < K} sum_l exp(l) * l / ln|V|` with K = min(window, #positions); 0 for an empty segment.
    """
    positions = list(top_logprobs[:window])
    if not positions:
        return 0.0
    total = 0.0
    for pos in positions:
        vals = np.fromiter(pos.values(), dtype=np.float64, count=len(pos))
        if top_k is not None and vals.size > top_k:
            vals = np.sort(vals)[::-1][:top_k]
        vals = vals[np.isfinite(vals)]  # a -inf logprob contributes 0 (lim p*log p = 0)
        total += float(-(np.exp(vals) * vals).sum())
    if reduce == "mean":
        total /= len(positions)
    return total / math.log(vocab_size) if normalize else total


# ---------------------------------------------------------------------------------- branch probability (4.2, 5.2)
def consecutive_factor(consecutive: int, penalty: float = 0.05) -> float:
    """AEPO's consecutive-branch factor f = max(0, 1 - penalty * c)."""
    return max(0.0, 1.0 - penalty * consecutive)


def branch_probability(rule: str, delta_h: float, *, p: float, w: float, consecutive: int = 0,
                       penalty: float = 0.05) -> float:
    """Probability that one branching attempt branches, as the reference code behaves (spec 4.2 / 5.2).

    Args:
      rule: "arpo": `clip(p + w*dH, 0, 1)` (reference: branch iff clip(U - w*dH) <= p, U ~ U[0,1)).
        "aepo": `clip(1 - p/f + w*dH, 0, 1)` with f = max(0, 1 - penalty*consecutive), and 0 when f = 0
        (reference: branch iff clip((U + w*dH) * f) >= p). Note the inverted meaning of p (B3).
      delta_h: entropy change dH = H_now - H_init.
      p: `branch_probability` from the config; w: `entropy_weight`.
      consecutive: the prompt's AEPO consecutive-branch counter c (ignored by "arpo").
      penalty: AEPO penalty per consecutive branch (reference: 0.05).
    """
    if rule == "arpo":
        prob = p + w * delta_h
    elif rule == "aepo":
        f = consecutive_factor(consecutive, penalty)
        if f <= 0.0:
            return 0.0
        prob = 1.0 - p / f + w * delta_h
    else:
        raise ValueError(f"unknown branching rule {rule!r}; choose 'arpo' or 'aepo'")
    return float(min(1.0, max(0.0, prob)))


# ------------------------------------------------------------------------------ dynamic initial rollouts (5.1)
def initial_rollouts_dynamic(n: int, h_root: float, h_tool_mean: float, *, beta: float = 0.5) -> int:
    """AEPO's number of root trajectories: `clip(floor(n * sigmoid(beta * (h_root - h_tool_mean))) + 1, 1, n)`.

    Equal entropies give n // 2 + 1 (n = 12 -> 7, n = 16 -> 9). The reference's `int()` is a floor here because
    the argument is positive.
    """
    z = beta * (h_root - h_tool_mean)
    sig = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))  # overflow-safe
    return int(min(n, max(1, math.floor(n * sig) + 1)))


# ------------------------------------------------------------------------------------- entropy baselines (B1)
class EntropyBaselines:
    """The reference's `initial_entropy_dict`: slot id -> first recorded entropy, never cleared (B1).

    Only used with `reference_compat`; keep one object per rollout worker across calls to reproduce the stale
    baseline of later steps (a fresh object reproduces the very first call).
    """

    def __init__(self):
        self.values: dict[int, float] = {}

    def observe(self, slot_id: int, entropy: float) -> float:
        """Records `entropy` only if `slot_id` was never seen; returns the stored baseline."""
        return self.values.setdefault(slot_id, entropy)

    def get(self, slot_id: int) -> float:
        return self.values.get(slot_id, 0.0)  # missing keys read as 0, as in the reference


# ---------------------------------------------------------------------------- the per-prompt decision (4.2)
@dataclasses.dataclass(frozen=True)
class BranchAttempt:
    """One branching attempt of one source slot (a node of the prompt's branching record)."""

    round: int
    source: int  # slot id the branch would copy
    entropy: float  # H_now of the deciding segment
    baseline: float  # H_init it is compared against
    probability: float  # P(branch) for this attempt
    draw: float  # U ~ U[0,1); branched iff draw < probability
    branched: bool
    consecutive: int = 0  # the prompt's AEPO consecutive-branch counter at the attempt
    child: int | None = None  # the new slot's id (filled in by the agent loop)


@dataclasses.dataclass(frozen=True)
class BranchParams:
    """The static knobs of a branching decision."""

    n: int  # trajectories per prompt (the budget)
    beam_size: int = 2  # at most beam_size - 1 branches per source slot per round
    p: float = 0.5  # branch_probability as passed to `branch_probability` (already sign-adjusted for B3)
    w: float = 0.2  # entropy_weight
    rule: str = "arpo"
    penalty: float = 0.05  # AEPO consecutive-branch penalty


def decide_branches(sources: Sequence[int], entropy: Callable[[int], tuple[float, float]], count: int,
                    params: BranchParams, draw: Callable[[int, int], float], *, round_index: int = 0,
                    consecutive: int = 0) -> list[BranchAttempt]:
    """The spec 4.2 loop for one prompt: which source slots branch this round (in order, budget-bounded).

    Args:
      sources: slot ids eligible to branch this round, in slot order.
      entropy: slot id -> (H_now, H_init); dH = H_now - H_init.
      count: trajectories the prompt already has (roots + branches + refills); slots_left = n - count.
      params: budget, beam size, rule and coefficients.
      draw: (source, k) -> U ~ U[0,1) of the source's k-th attempt this round: the only source of randomness.
      consecutive: the prompt's AEPO consecutive-branch counter.
    Returns:
      Every attempt made, in order; attempts with `branched` create one new slot each (copy of `source`).
    """
    slots_left = params.n - count
    attempts: list[BranchAttempt] = []
    if slots_left <= 0:
        return attempts
    made = 0
    for s in sources:
        k = min(params.beam_size - 1, slots_left - made)
        if k <= 0:
            break
        h_now, h_init = entropy(s)
        prob = branch_probability(params.rule, h_now - h_init, p=params.p, w=params.w, consecutive=consecutive,
                                  penalty=params.penalty)
        for j in range(k):
            u = float(draw(s, j))
            branched = u < prob
            attempts.append(BranchAttempt(round_index, s, h_now, h_init, prob, u, branched, consecutive))
            made += int(branched)
        if made >= slots_left:
            break
    return attempts


# ------------------------------------------------------------------------------------- refill (4.3), AEPO (5.2)
def needs_refill(has_active: bool, count: int, n: int) -> bool:
    """Spec 4.3: a prompt with no active slot left (after branching) and fewer than n trajectories gets one fresh
    root slot this round."""
    return not has_active and count < n


def update_consecutive(counters: Sequence[int], new_slots: Sequence[int]) -> list[int]:
    """AEPO's per-prompt consecutive-branch counters after a round (spec 5.2, quirk B6 kept).

    Only if some prompt got a new slot (branch or refill) this round: c_b += 1 where prompt b got >= 1 new slot,
    else c_b = 0. If no new slot was created anywhere, the counters stay as they are.
    """
    if not any(k > 0 for k in new_slots):
        return list(counters)
    return [c + 1 if k > 0 else 0 for c, k in zip(counters, new_slots)]
