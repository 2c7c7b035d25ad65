"""Advantages from scored trajectories: outcome (GRPO / ARPO / AEPO) advantages and GAE over a critic's
values, per trajectory, token-aligned (numpy)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.update import algos


def outcome_advantages(traj: Trajectories, estimator: str, *, norm_by_std: bool = True) -> list[np.ndarray]:
    """GRPO-family advantages per prompt group (spec 8.1), as token-aligned arrays (the sequence's value on every
    token; the loss weights select the trained ones). A failed trajectory is its own group: its score must not move
    the baseline of the others (it has no loss)."""
    group = np.where(traj.failed, -1 - np.arange(len(traj.group)), traj.group)
    kwargs = {"norm_by_std": norm_by_std} if estimator == "grpo" else {}
    adv = np.asarray(algos.compute_advantages(estimator, traj.scores, group, **kwargs))
    return [np.full(len(s), a, np.float32) for s, a in zip(traj.sequences, adv)]


def gae_inputs(traj: Trajectories, values: list[np.ndarray], max_response_length: int):
    """Per-trajectory response slices for `algos.gae_advantages`, padded to [N, max_response_length].

    Returns (rewards, values, mask): the score sits on the last response token (spec 7.2), values are the critic's
    token-aligned old values over the whole response (tool results are states too), 0 past its end, and the mask
    is the loss mask (model tokens), over which the advantages are whitened and the losses taken.
    """
    n = len(traj.sequences)
    rew, val, mask = (np.zeros((n, max_response_length), np.float32) for _ in range(3))
    for i, (seq, v, m) in enumerate(zip(traj.sequences, values, traj.loss_masks)):
        p = int(traj.prompt_lengths[i])
        r = len(seq) - p
        if r:
            rew[i, r - 1] = traj.scores[i]
            val[i, :r] = v[p:]
            mask[i, :r] = m[p:]
    return rew, val, mask


def gae(trajs: list[Trajectories], values: list[list[np.ndarray]], *, max_response_length: int, gamma: float,
        lam: float, whiten: Callable[[np.ndarray, np.ndarray], np.ndarray] = algos.masked_whiten
        ) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """PPO with a critic (spec 8.2): GAE per trajectory on its response, advantages whitened over the batch.

    Args:
      trajs: the rollouts of this process's workers.
      values: per rollout, the critic's token-aligned old values of each sequence.
      max_response_length: the response budget (`data.max_response_length`), the width of the GAE arrays.
      gamma, lam: GAE's discount and lambda.
      whiten: (advantages [N, R], mask [N, R]) -> whitened advantages [N, R]; the trainer's whitens over every
        process's trajectories, as the reference's driver does.

    Returns:
      Per rollout: (advantages, returns), each a token-aligned array per sequence (0 over the prompt).
    """
    inputs = [gae_inputs(t, v, max_response_length) for t, v in zip(trajs, values)]
    rew, val, mask = (np.concatenate(x) for x in zip(*inputs))
    _, returns = algos.gae_advantages(rew, val, mask, gamma=gamma, lam=lam)
    returns = np.asarray(returns)
    adv = np.asarray(whiten(returns - val, mask))  # GAE's unwhitened advantages are returns - values
    out, start = [], 0
    for t in trajs:
        sl = slice(start, start + len(t.sequences))
        start = sl.stop
        out.append((response_to_tokens(t, adv[sl]), response_to_tokens(t, returns[sl])))
    return out


def response_to_tokens(traj: Trajectories, per_response: np.ndarray) -> list[np.ndarray]:
    """[N, R] values over each response -> token-aligned arrays over each whole sequence (0 over the prompt)."""
    out = []
    for i, seq in enumerate(traj.sequences):
        p = int(traj.prompt_lengths[i])
        full = np.zeros(len(seq), np.float32)
        full[p:] = per_response[i, :len(seq) - p]
        out.append(full)
    return out
