"""Which trajectories train, and on what reward: DAPO's overlong shaping and dynamic sampling (pure numpy).

None of this is in the reference ARPO/AEPO code; all of it is off by default (config/schema.py, `algorithm.*`).

* Soft overlong punishment (DAPO, arXiv 2503.14476 eq. 13; verl's `overlong_buffer`): a response of |y| tokens
  with L_max = `data.max_response_length` and L_cache = `algorithm.overlong_buffer_len` gets
  `factor * min(0, ((L_max - L_cache) - |y|) / L_cache)` added to its reward: 0 up to L_max - L_cache, then linear
  down to -factor at L_max. A truncated response was cut to L_max, so it gets -factor: the paper's -1 beyond L_max.
* Overlong masking (`algorithm.overlong = "mask"`, DAPO's overlong filtering): a response that did not end within
  L_max (finish reason `length`) is kept in its group's baseline but masked out of the loss.
* Dynamic sampling: a group whose rewards are all equal has zero GRPO advantage everywhere and only dilutes the
  loss. `informative_groups` finds the others; `pick_groups` fills the batch with them across rollout rounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arpo_jax import knobs, rewards
from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.rollout.output import RolloutOutput

OVERLONG_MODES = ("none", "penalty", "mask")


def overlong_penalty(lengths, *, max_length: int, buffer_length: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment per response (module docstring): [N] lengths -> [N] float32 in [-factor, 0].

    Lengths above `max_length` (a response cut to it) count as `max_length`.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length={buffer_length} must be in 1..max_length={max_length}")
    length = np.minimum(np.asarray(lengths, np.float64), max_length)
    exceed = length - (max_length - buffer_length)
    return np.minimum(-exceed / buffer_length * factor, 0.0).astype(np.float32)


def informative_groups(scores, group, valid=None) -> tuple[np.ndarray, np.ndarray]:
    """Groups whose valid members' scores are not all equal (they carry a group-relative signal).

    Args:
      scores: [N] rewards.
      group: [N] group (prompt) id of each row.
      valid: [N] bool, rows that count (False: failed trajectories, masked out anyway); None = all.
    Returns:
      (ids, informative): the sorted group ids and, per id, whether its valid scores take two or more values.
    """
    scores, group = np.asarray(scores, np.float64), np.asarray(group)
    valid = np.ones(len(scores), bool) if valid is None else np.asarray(valid, bool)
    ids = np.unique(group)
    informative = np.zeros(len(ids), bool)
    for k, g in enumerate(ids):
        s = scores[(group == g) & valid]
        informative[k] = s.size > 1 and s.max() > s.min()
    return ids, informative


def pick_groups(informative: Sequence[np.ndarray], need: int) -> list[tuple[int, int]]:
    """The (round, group index) pairs of a batch of `need` groups drawn over rollout rounds.

    The first `need` informative groups in draw order; when there are fewer, the batch is topped up with the
    earliest uninformative ones (zero signal, but every rollout worker keeps the same batch shape). Sorted by
    draw order.
    """
    order = [(r, k) for r, inf in enumerate(informative) for k in range(len(inf))]
    good = [p for p in order if informative[p[0]][p[1]]][:need]
    rest = [p for p in order if not informative[p[0]][p[1]]][:max(0, need - len(good))]
    if len(good) + len(rest) < need:
        raise ValueError(f"{len(order)} groups drawn, {need} needed")
    return sorted(good + rest)


def score_rollout(out: RolloutOutput, examples, tokenizer, reward_fn) -> Trajectories:
    """Decodes each valid response (spec 7.2: up to its response mask, special tokens skipped) and scores it."""
    seqs, masks, texts, prompt_lengths, rollout_logps = [], [], [], [], []
    for i in range(len(out.responses)):
        n_resp = int(out.response_mask[i].sum())
        prompt = out.input_ids[i, :-out.responses.shape[1]][out.attention_mask[i, :-out.responses.shape[1]] > 0]
        resp = out.responses[i, :n_resp]
        seqs.append(np.concatenate([prompt, resp]).astype(np.int32))
        prompt_lengths.append(len(prompt))
        masks.append(np.concatenate([np.zeros(len(prompt), np.int32), out.loss_mask[i, :n_resp]]))
        no_logp = np.full(len(prompt), np.nan, np.float32)  # the prompt was not sampled
        rollout_logps.append(np.concatenate([no_logp, out.rollout_logp[i, :n_resp]]))
        texts.append(tokenizer.decode(resp, skip_special_tokens=True))
    ex = [examples[int(p)] for p in out.prompt_index]
    infos = rewards.score_responses(reward_fn, [e.data_source for e in ex], texts, [e.ground_truth for e in ex],
                                    [e.extra_info for e in ex])
    scores = np.asarray([float(r["score"]) for r in infos], np.float32)
    return Trajectories(seqs, np.asarray(prompt_lengths), masks, scores, np.asarray(out.prompt_index), texts, infos,
                        out, rollout_logps)


@dataclasses.dataclass(frozen=True)
class ShapingConfig:
    """The overlong handling of `shape_rollout` (the knobs: config/schema.py, `algorithm.overlong*`)."""

    overlong: str = knobs.knob("algorithm.overlong", knobs.one_of(OVERLONG_MODES))
    buffer_len: int = knobs.knob("algorithm.overlong_buffer_len")  # L_cache (checked against L_max by the loader)
    penalty_factor: float = knobs.knob("algorithm.overlong_penalty_factor", knobs.NONNEG)
    max_response_length: int = knobs.knob("data.max_response_length", knobs.POSITIVE)  # L_max

    def __post_init__(self):
        knobs.validate(self)


def shape_rollout(traj: Trajectories, shaping: ShapingConfig) -> Trajectories:
    """The training signal of a scored rollout: failed trajectories (and with `overlong = mask` the truncated ones)
    masked out of the loss, the DAPO overlong penalty added to the scores (module docstring)."""
    scores = traj.scores
    if shaping.overlong == "penalty":
        scores = scores + overlong_penalty(traj.out.response_length, max_length=shaping.max_response_length,
                                           buffer_length=shaping.buffer_len, factor=shaping.penalty_factor)
    drop = traj.failed | ((traj.out.finish_reason == "length") if shaping.overlong == "mask" else False)
    masks = [np.zeros_like(m) if d else m for m, d in zip(traj.loss_masks, drop)]
    return dataclasses.replace(traj, scores=np.asarray(scores, np.float32), loss_masks=masks)
