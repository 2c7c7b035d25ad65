"""Every random draw of a rollout, keyed by what it is for, never by when or where it is made.

A trajectory is named by its place in its prompt's tree: the j-th *fresh* trajectory of prompt b (roots first, then
refills, `fresh_key`), or the attempt that created it (`branch_key`: its source's key, the source's deciding
segment, the attempt's index). The engines seed each request from its trajectory's key and its context
(`sampler.request_seed`), and a branching attempt draws its uniform from its own name (`attempt_draw`), so the
samples and the decisions of a rollout do not depend on which engine call, row or thread produced them: the
streaming schedule (`rollout/streaming.py`) and the round schedule (`agent_loop.py`) give the same trajectories.
"""

from __future__ import annotations

import numpy as np

_FRESH, _BRANCH, _DRAW, _PROBE = 1, 2, 3, 4  # domain tags: no two kinds of name collide


def _hash(*words: int) -> int:
    """A 63-bit integer from non-negative integers (numpy's SeedSequence: a well-mixed, documented hash)."""
    parts = []
    for w in words:
        parts += [w & 0xFFFFFFFF, (w >> 32) & 0xFFFFFFFF]
    lo, hi = np.random.SeedSequence(parts).generate_state(2)
    return (int(hi) << 32 | int(lo)) & 0x7FFFFFFFFFFFFFFF


def fresh_key(prompt: int, index: int) -> int:
    """The `index`-th trajectory of prompt `prompt` that starts from the prompt alone (roots, then refills)."""
    return _hash(_FRESH, prompt, index)


def branch_key(source: int, segment: int, attempt: int) -> int:
    """The trajectory created by attempt `attempt` of source `source` (a key) deciding on its segment `segment`."""
    return _hash(_BRANCH, source, segment, attempt)


def probe_key(prompt: int, phase: int) -> int:
    """AEPO pre-monitoring's requests of prompt `prompt` (phase 0: H_root; 1: the discarded tool rollout)."""
    return _hash(_PROBE, prompt, phase)


def attempt_draw(seed: int, prompt: int, source: int, segment: int, attempt: int) -> float:
    """U ~ U[0, 1) of one branching attempt: 53 random bits of its name under the rollout's `seed`."""
    return (_hash(_DRAW, seed, prompt, source, segment, attempt) >> 10) * 2.0 ** -53
