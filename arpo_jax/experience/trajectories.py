"""`Trajectories`: one rollout worker's rollout as training data, and `select_groups` (dynamic sampling's pick
of prompt groups over several draws)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from arpo_jax.rollout.output import RolloutOutput, select_rows

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trajectories:
    """One worker's rollout as training data: unpadded sequences and what the metrics need."""

    sequences: list[np.ndarray]  # prompt + kept response tokens
    prompt_lengths: np.ndarray  # [N] tokens of the prompt at the start of each sequence
    loss_masks: list[np.ndarray]  # 0 over the prompt and tool results, 1 over model tokens
    scores: np.ndarray  # [N] reward
    group: np.ndarray  # [N] prompt index (GRPO group)
    responses: list[str]
    reward_infos: list[dict]
    out: RolloutOutput
    rollout_logps: list[np.ndarray]  # token-aligned engine log-probs (NaN: none), for the rollout correction

    @property
    def failed(self) -> np.ndarray:
        """[N] bool: failed trajectories (out.failed names the cause), masked out of the loss and the baselines."""
        return self.out.failed != ""


def select_groups(parts: list[tuple[Trajectories, list[int]]]) -> Trajectories:
    """The rows of the chosen groups (prompt indices) of one or more rollouts, as one rollout (dynamic sampling)."""
    picks = [(t, np.concatenate([np.flatnonzero(t.group == g) for g in groups]).astype(np.int64))
             for t, groups in parts if groups]
    out = select_rows([(t.out, rows) for t, rows in picks])
    fields = {"out": out, "group": out.prompt_index}
    for f in dataclasses.fields(Trajectories):  # every other field holds one entry per row
        if f.name not in fields:
            rows = [getattr(t, f.name)[i] for t, idx in picks for i in idx]
            fields[f.name] = np.asarray(rows) if isinstance(getattr(picks[0][0], f.name), np.ndarray) else rows
    return Trajectories(**fields)


