"""Advantages from scored trajectories: outcome (GRPO / ARPO / AEPO) advantages and GAE over a critic's
values, per trajectory, token-aligned (numpy), and the estimators themselves: pure float32 functions of arrays
(jax.numpy, jittable; verl ``core_py``, spec 8.1-8.2), with the masked mean and whitening they share with the
losses (update/py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from arpo_jax.experience.trajectories import Trajectories

Array = jax.Array



# verl's masked_mean / token-mean denominator guard (keeps an all-masked batch at 0 instead of NaN).
_MASK_EPS = 1e-8


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def masked_mean(values: Array, mask: Array) -> Array:
    """Mean of ``values`` over ``mask`` (any shape, same for both); 0 when the mask is empty."""
    mask = _f32(mask)
    return jnp.sum(jnp.where(mask > 0, _f32(values) * mask, 0.0)) / (jnp.sum(mask) + _MASK_EPS)


def masked_whiten(values: Array, mask: Array) -> Array:
    """verl ``masked_whiten``: ``(x - mean_m) * rsqrt(var_m + 1e-8)`` with the unbiased masked variance.

    The reference raises when the mask holds fewer than two tokens; we skip the Bessel factor there instead
    (variance of one token = 0), which keeps the result finite.
    """
    values, mask = _f32(values), _f32(mask)
    mean = masked_mean(values, mask)
    var = masked_mean(jnp.square(values - mean), mask)
    n = jnp.sum(mask)
    var = var * jnp.where(n > 1, n / jnp.maximum(n - 1, 1.0), 1.0)
    return (values - mean) * jax.lax.rsqrt(var + 1e-8)


# --------------------------------------------------------------------------------------------------
# Outcome advantages (spec 8.1, 8.2)
# --------------------------------------------------------------------------------------------------


def _dense_group_index(group_ids: Array) -> Array:
    """Maps arbitrary integer ids [B] to dense segment ids in [0, B) (sort-based, no jnp.unique)."""
    order = jnp.argsort(group_ids, stable=True)
    sorted_ids = group_ids[order]
    # A new segment starts wherever the sorted id changes.
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), (sorted_ids[1:] != sorted_ids[:-1]).astype(jnp.int32)])
    return jnp.zeros_like(order).at[order].set(jnp.cumsum(starts))


def _sequence_scores(rewards: Array) -> Array:
    """Scalar score per sequence: rewards [B] as is, token-level rewards [B, T] summed over T (spec 8.1)."""
    rewards = _f32(rewards)
    return rewards if rewards.ndim == 1 else jnp.sum(rewards, axis=-1)


def _group_stats(scores: Array, group_ids: Array) -> tuple[Array, Array, Array]:
    """Per-sequence group size, mean and unbiased std, each [B], gathered back from segment reductions."""
    n = scores.shape[0]
    seg = _dense_group_index(jnp.asarray(group_ids))
    seg_count = jax.ops.segment_sum(jnp.ones_like(scores), seg, num_segments=n)  # [B] (unused segments: 0)
    seg_mean = jax.ops.segment_sum(scores, seg, num_segments=n) / jnp.maximum(seg_count, 1.0)
    count, mean = seg_count[seg], seg_mean[seg]
    # Two-pass variance (sum of squared deviations) is as accurate as torch.std.
    sq_dev = jax.ops.segment_sum(jnp.square(scores - mean), seg, num_segments=n)[seg]
    std = jnp.sqrt(sq_dev / jnp.maximum(count - 1.0, 1.0))
    return count, mean, std


def grpo_advantages(rewards: Array, group_ids: Array, *, norm_by_std: bool = True, eps: float = 1e-6) -> Array:
    """GRPO outcome advantage (verl ``compute_grpo_outcome_advantage``, spec 8.1, B15).

    ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased (N-1) std of the group, or ``s_i - mean_g``
    when ``norm_by_std=False`` (Dr.GRPO). A group of size 1 uses mean 0 and std 1, as the reference does,
    so its advantage is ``s_i / (1 + eps)`` (GRPO) or ``s_i`` (Dr.GRPO).

    Args:
      rewards: [B] scalar reward per sequence, or [B, T] token-level rewards (summed over T).
      group_ids: [B] integer group id per sequence (one per prompt); any values, any order.
      norm_by_std: divide by the group std (``norm_adv_by_std_in_grpo``; static under jit).
      eps: added to the std.

    Returns:
      [B] float32 advantages (one per sequence, for each of its tokens).
    """
    scores = _sequence_scores(rewards)
    count, mean, std = _group_stats(scores, group_ids)
    single = count < 2
    mean = jnp.where(single, 0.0, mean)
    if not norm_by_std:
        return scores - mean
    std = jnp.where(single, 1.0, std)
    return (scores - mean) / (std + eps)


def dr_grpo_advantages(rewards: Array, group_ids: Array, **unused) -> Array:
    """Dr.GRPO: GRPO without the std division, ``A_i = s_i - mean_g`` (spec 8.1). Shapes as ``grpo_advantages``."""
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


def rloo_advantages(rewards: Array, group_ids: Array, **unused) -> Array:
    """RLOO (verl ``compute_rloo_outcome_advantage``, spec 8.2): ``A_i = n/(n-1) * (s_i - mean_g)``.

    This equals ``s_i`` minus the mean of the *other* members of the group. A group of size 1 keeps its raw
    score, as in the reference.

    Args:
      rewards: [B] or [B, T] (summed over T).
      group_ids: [B] integer group ids.

    Returns:
      [B] float32 advantages.
    """
    scores = _sequence_scores(rewards)
    count, mean, _ = _group_stats(scores, group_ids)
    loo = count / jnp.maximum(count - 1.0, 1.0) * (scores - mean)
    return jnp.where(count < 2, scores, loo)


# Name -> estimator(rewards, group_ids, **kwargs) -> [B]. Extra kwargs (norm_by_std, eps) go to GRPO only.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: Array, group_ids: Array, **kwargs) -> Array:
    """Outcome advantages by estimator name (``ADVANTAGE_ESTIMATORS``); returns [B] float32."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](rewards, group_ids, **kwargs)


def gae_advantages(rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[Array, Array]:
    """GAE with masked whitening (verl ``compute_gae_advantage_return``, spec 8.2).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (V beyond the last index = 0) and
    ``A_t = delta_t + gamma * lam * A_{t+1}``, a reverse scan over the full padded length, as in the
    reference; ``returns = A + V`` before whitening; then ``A <- masked_whiten(A, mask)`` over the whole batch.
    Padding positions are not zeroed (the loss masks them), matching the reference.

    Args:
      rewards: [B, T] token-level rewards.
      values: [B, T] critic values.
      mask: [B, T] response mask (1 = valid token).
      gamma: discount.
      lam: GAE lambda.

    Returns:
      (advantages [B, T], returns [B, T]), float32.
    """
    rewards, values = _f32(rewards), _f32(values)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values  # [B, T]

    def step(carry, delta_b):  # carry, delta_b: [B]
        adv = delta_b + gamma * lam * carry
        return adv, adv

    _, adv_tb = jax.lax.scan(step, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    advantages = adv_tb.T  # [T, B] -> [B, T]
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


# --------------------------------------------------------------------------------------------------
# Per trajectory
# --------------------------------------------------------------------------------------------------


def outcome_advantages(traj: Trajectories, estimator: str, *, norm_by_std: bool = True) -> list[np.ndarray]:
    """GRPO-family advantages per prompt group (spec 8.1), as token-aligned arrays (the sequence's value on every
    token; the loss weights select the trained ones). A failed trajectory is its own group: its score must not move
    the baseline of the others (it has no loss)."""
    group = np.where(traj.failed, -1 - np.arange(len(traj.group)), traj.group)
    kwargs = {"norm_by_std": norm_by_std} if estimator == "grpo" else {}
    adv = np.asarray(compute_advantages(estimator, traj.scores, group, **kwargs))
    return [np.full(len(s), a, np.float32) for s, a in zip(traj.sequences, adv)]


def gae_inputs(traj: Trajectories, values: list[np.ndarray], max_response_length: int):
    """Per-trajectory response slices for `gae_advantages`, padded to [N, max_response_length].

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
        lam: float, whiten: Callable[[np.ndarray, np.ndarray], np.ndarray] = masked_whiten
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
    _, returns = gae_advantages(rew, val, mask, gamma=gamma, lam=lam)
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
