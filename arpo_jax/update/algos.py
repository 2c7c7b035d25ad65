"""Pure RL maths for ARPO / AEPO: per-token policy losses, KL estimators, entropy, rollout correction (the
advantage estimators are experience/advantages.py's, where the advantages are computed).

Everything here is a pure function of arrays plus explicit Python scalars: no model, no config object, no
host sync, no Python loop over the batch, so every function can be jitted (string arguments such as
``kind`` are static). Computation is float32 whatever the input dtype. Losses are per token: their aggregation
(verl's ``agg_loss`` modes, micro-batch normalisation) is the packer's loss weights (``packing.loss_weights``).

Semantics follow ``spec/arpo_aepo_reference.md`` sections 8-10 (verl 0.3.1 ``core_algos.py`` and the AEPO
fork). Where the reference divides by zero (single-token whitening, single-token entropy std, all-masked
rows) we return the finite value the formula intends and say so next to the code.

Shape letters: B = sequences, T = response length, V = vocabulary, D = model width.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from arpo_jax import knobs
from arpo_jax.experience.advantages import masked_mean

Array = jax.Array

def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


# --------------------------------------------------------------------------------------------------
# Policy losses: PPO-clip (spec 8.3) and AEPO entropy-balanced clipping (spec 10.1)
# --------------------------------------------------------------------------------------------------


DUAL_CLIP = knobs.Rule(lambda c: c > 1, "> 1")  # the dual-clip constant c bounds -A * r by -A * c for A < 0


def _clipped_policy_loss(logp, old_logp, advantages, mask, *, clip_low, clip_high, clip_c, entropy_balanced: bool,
                         is_weights=None) -> tuple[Array, dict[str, Array]]:
    """Shared PPO / AEPO body; only the upper clip bound differs (see the public functions)."""
    if isinstance(clip_c, (int, float)):
        DUAL_CLIP.enforce("dual-clip constant clip_c", clip_c)  # the reference asserts this
    mask = _f32(mask)
    valid = mask > 0
    # Double-where: padding may hold garbage log-probs; a zero log-ratio there keeps exp() and its gradient finite.
    log_ratio = jnp.where(valid, _f32(logp) - _f32(old_logp), 0.0)
    adv = jnp.where(valid, _f32(advantages), 0.0)
    # Clamp log r to [-20, 20] (as later verl does) so exp() cannot overflow into an inf*0 = NaN gradient. Beyond
    # it every PPO branch is already clipped or O(e^-20), so values move by <= |A| e^-20 and gradients by as much.
    ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))

    lower = 1.0 - clip_low  # constant: no gradient when the lower bound is selected
    if entropy_balanced:
        # AEPO: (1+eps_h) * r / sg(r), value 1+eps_h, gradient (1+eps_h) * dlogpi, so an A>0 token above the
        # bound keeps its gradient. Written as exp(x - sg(x)): same value and gradient, but no 0/0 when r underflows.
        upper = (1.0 + clip_high) * jnp.exp(log_ratio - jax.lax.stop_gradient(log_ratio))
    else:
        upper = 1.0 + clip_high
    # min(max(.)) rather than jnp.clip so the gradient flows into whichever (tensor) bound is selected.
    clipped_ratio = jnp.minimum(jnp.maximum(ratio, lower), upper)

    loss1 = -adv * ratio
    loss2 = -adv * clipped_ratio
    loss_clip = jnp.maximum(loss1, loss2)
    loss3 = -adv * clip_c  # dual clip: bounds the loss of A<0 tokens whose ratio explodes
    per_token = jnp.where(adv < 0, jnp.minimum(loss_clip, loss3), loss_clip)  # [B, T]
    if is_weights is not None:  # rollout correction (``rollout_correction``): a constant factor per token, as verl
        per_token = per_token * jnp.where(valid, jax.lax.stop_gradient(_f32(is_weights)), 0.0)

    per_token = jnp.where(valid, per_token, 0.0)
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).astype(jnp.float32), mask),
        "pg_clipfrac_lower": masked_mean(((loss_clip > loss3) & (adv < 0)).astype(jnp.float32), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return per_token, metrics


def ppo_policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *, clip_low: float = 0.2,
                    clip_high: float = 0.2, clip_c: float = 3.0, is_weights=None) -> tuple[Array, dict[str, Array]]:
    """PPO-clip policy loss with dual clip (verl ``compute_policy_loss``, spec 8.3).

    With ``r = exp(clip(logp - old_logp, -20, 20))`` (the clamp only avoids overflow, see the code):
    ``L1 = -A r``, ``L2 = -A clip(r, 1-eps_l, 1+eps_h)``, ``L_clip = max(L1, L2)``;
    for ``A < 0`` the loss is ``min(L_clip, -A c)``, else ``L_clip``.

    Args:
      logp: [B, T] log-probs of the sampled tokens under the current policy (differentiated).
      old_logp: [B, T] log-probs under the behaviour (old) policy.
      advantages: [B, T] per-token advantages.
      mask: [B, T] loss mask (1 = model-generated response token).
      clip_low: eps_l (``clip_ratio_low``).
      clip_high: eps_h (``clip_ratio_high``).
      clip_c: dual-clip constant c > 1 (``clip_ratio_c``).
      is_weights: optional [B, T] rollout-correction weights (``rollout_correction``): each token's loss is
        multiplied by its (constant, no-gradient) weight, as verl's ``rollout_is_weights``.

    Returns:
      (per-token loss [B, T], 0 outside ``mask``; metrics): aggregate the loss as ``sum(w * loss)`` with the
      packer's loss weights ``w`` (``packing.loss_weights``, the one owner of the aggregation modes). Metrics are
      scalars over ``mask`` (means weighted by it): ``pg_clipfrac`` (share of tokens with ``L2 > L1``),
      ``pg_clipfrac_lower`` (share with ``A < 0`` and ``L_clip > -A c``) and ``ppo_kl`` (``old_logp - logp``).
    """
    return _clipped_policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                clip_c=clip_c, entropy_balanced=False, is_weights=is_weights)


def entropy_balanced_policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
                                 clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                                 is_weights=None) -> tuple[Array, dict[str, Array]]:
    """AEPO entropy-balanced clipping (``compute_policy_loss_entropy_balanced_clipping``, spec 10.1, B7).

    Same as ``ppo_policy_loss`` except that the upper bound of the clipped ratio is the tensor
    ``(1 + eps_h) * r / stop_gradient(r)``: its value is ``1 + eps_h`` (loss values and metrics are unchanged)
    but an ``A > 0`` token with ``r > 1 + eps_h`` now gets the gradient ``-A (1 + eps_h)`` w.r.t. ``logp``
    instead of 0. The lower bound stays a constant, and, as in the reference (B7), no entropy threshold is
    applied: every such token keeps its gradient. Entropy-aware advantages are a separate step
    (``entropy_aware_advantages``), applied to ``advantages`` before this call.

    Args:
      logp, old_logp, advantages, mask: [B, T], as in ``ppo_policy_loss``.
      clip_low, clip_high, clip_c, is_weights: as in ``ppo_policy_loss``.

    Returns:
      (per-token loss [B, T], metrics), as ``ppo_policy_loss``.
    """
    return _clipped_policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                clip_c=clip_c, entropy_balanced=True, is_weights=is_weights)


# Name -> per-token policy loss with the ppo_policy_loss signature.
POLICY_LOSSES: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "ppo": ppo_policy_loss,
    "aepo": entropy_balanced_policy_loss,
}


def entropy_aware_advantages(advantages: Array, entropy: Array, mask: Array, *, alpha: float = 0.2) -> Array:
    """AEPO entropy-aware advantage (spec 10.2): ``A <- A * (1 + alpha * stop_gradient(H_hat))``.

    ``H_hat = (H - mean(H[M])) / std(H[M])`` with the unbiased std pooled over every valid token of the
    arrays given (the reference pools one micro-batch; pass a whole mini-batch to pool that instead).
    ``std == 0`` is replaced by 1 as in the reference; with fewer than two valid tokens the reference std is
    NaN, here it is 1, so a single valid token gets ``H_hat = 0`` and keeps its advantage (finite, not NaN).
    Padding positions get ``H_hat = 0`` (advantage unchanged; the loss masks them anyway).

    Equal entropies give a factor of exactly 1 (``entropy_moments``: a corrected two-pass mean, and a std below
    ``ENTROPY_STD_RTOL`` of the mean counts as 0). The reference's float32 torch.std gets exactly 0 only in some
    of those cases; otherwise it divides rounding noise by rounding noise (factors 0.8-1.2 instead of 1).

    Args:
      advantages: [B, T] per-token advantages.
      entropy: [B, T] current-policy token entropies (no gradient flows into them).
      mask: [B, T] loss mask (model tokens only).
      alpha: scale of the entropy term (hard-coded 0.2 in the reference).

    Returns:
      [B, T] float32 advantages. For ``H_hat < -1/alpha`` the factor is negative, as in the reference.
    """
    valid = _f32(mask) > 0
    h = jax.lax.stop_gradient(_f32(entropy))
    mean, std = entropy_moments(h, valid)
    h_hat = jnp.where(valid, (h - mean) / std, 0.0)
    return _f32(advantages) * (1.0 + alpha * h_hat)


# A pooled entropy std below this fraction of max(|mean|, 1) is float32 rounding of equal values: it counts as 0.
ENTROPY_STD_RTOL = 1e-6


def robust_std(std: Array, mean: Array, n: Array) -> Array:
    """The entropy-aware divisor: ``std``, or 1 where it is 0 up to rounding (``ENTROPY_STD_RTOL``) or n < 2."""
    tiny = std <= ENTROPY_STD_RTOL * jnp.maximum(jnp.abs(mean), 1.0)
    return jnp.where(tiny | (n < 2), 1.0, std)


def entropy_moments(h: Array, valid: Array) -> tuple[Array, Array]:
    """(mean, divisor) of ``h`` over ``valid``: corrected two-pass mean, unbiased std through ``robust_std``.

    The second pass (``mean += mean(h - mean)``) removes the rounding of ``sum / n``: for equal values every
    ``h - mean`` is then exactly 0, and so is the std.
    """
    valid = jnp.asarray(valid, bool)
    h = jnp.where(valid, _f32(h), 0.0)
    n = jnp.sum(valid.astype(jnp.float32))
    denom = jnp.maximum(n, 1.0)
    mean = jnp.sum(h) / denom
    mean = mean + jnp.sum(jnp.where(valid, h - mean, 0.0)) / denom
    var = jnp.sum(jnp.where(valid, jnp.square(h - mean), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    std = jnp.sqrt(var)
    return mean, robust_std(std, mean, n)


# --------------------------------------------------------------------------------------------------
# Rollout / trainer mismatch correction (verl's rollout correction, decoupled mode)
# --------------------------------------------------------------------------------------------------

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
ROLLOUT_CORRECTION_MODES = ("off", "truncate", "mask")
CORRECTION_THRESHOLD = knobs.Rule(lambda c: c > 1, "> 1")  # C: the band [1/C, C] must hold rho = 1
_LOG_RATIO_BOUND = 20.0  # verl's SAFETY_BOUND: ratios are formed as exp(clip(log r, -20, 20))


def _sequence_keys(shape: tuple[int, ...], segment_ids: Array | None) -> tuple[Array, int]:
    """A flat sequence index per position of a [..., T] array, and the number of indices.

    A sequence is one row (``segment_ids`` None) or one (row, segment) of a packed row.
    """
    t = shape[-1]
    rows = math.prod(shape[:-1])
    seg = jnp.ones(shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    keys = jnp.arange(rows, dtype=jnp.int32).reshape(shape[:-1] + (1,)) * (t + 1) + seg
    return keys.reshape(-1), rows * (t + 1)


def rollout_correction(old_logp: Array, rollout_logp: Array, mask: Array, *, level: str = "token",
                       mode: str = "truncate", threshold: float = 2.0,
                       segment_ids: Array | None = None) -> tuple[Array, Array, dict[str, Array]]:
    """Correction for the gap between the engine that sampled (pi_rollout) and the trainer's old policy (pi_old).

    verl's rollout correction in its decoupled mode: the PPO ratio stays pi / pi_old, and each token's loss is
    reweighted by the importance ratio ``rho = pi_old / pi_rollout`` of the token (``level="token"``) or of its
    whole sequence (``"sequence"``: ``prod_t rho_t``, broadcast to every token), formed as
    ``exp(clip(log rho, -20, 20))``. Modes, with ``C = threshold``:

    * ``truncate`` (TIS, verl ``rollout_is``): weight ``min(rho, C)``;
    * ``mask`` (rejection, verl ``rollout_rs`` with the default lower bound ``1/C``): tokens (or every token of the
      sequences) with ``rho`` outside ``[1/C, C]`` are dropped: ``keep = 0``, weight 1;
    * ``off``: weights 1, keep 1, metrics only.

    Outside ``mask`` the weights and keep are 1 (padding, prompt and tool tokens, tokens without an engine
    log-prob: pass their mask as 0).

    Args:
      old_logp: [..., T] log-probs of the sampled tokens under the trainer's old policy.
      rollout_logp: [..., T] log-probs the rollout engine reported for them (finite where ``mask``).
      mask: [..., T] tokens to correct and to measure (model tokens with an engine log-prob).
      level: ``ROLLOUT_CORRECTION_LEVELS`` (static).
      mode: ``ROLLOUT_CORRECTION_MODES`` (static).
      threshold: C > 1.
      segment_ids: optional [..., T] packed-row segment ids: a sequence is then a (row, segment).

    Returns:
      (weights [..., T] float32, keep [..., T] bool, metrics): scalar float32 metrics over the masked tokens:
      ``tokens``; ``abs_logp_diff_mean`` / ``abs_logp_diff_max`` (of ``|logp_rollout - logp_old|``); ``kl``
      (``mean(logp_rollout - logp_old)``, the k1 estimate of KL(pi_rollout || pi_old) on tokens drawn from
      pi_rollout) and ``k3_kl`` (``mean(rho - log rho - 1)``); ``ratio_fraction_high`` / ``ratio_fraction_low``
      (tokens whose level ratio is above C / below 1/C); ``truncated_fraction`` and ``masked_fraction`` (tokens
      whose weight was truncated / that were dropped; 0 in the other modes) and ``seq_truncated_fraction`` /
      ``seq_masked_fraction`` (sequences with at least one such token).
    """
    knobs.one_of(ROLLOUT_CORRECTION_LEVELS).enforce("rollout correction level", level)
    knobs.one_of(ROLLOUT_CORRECTION_MODES).enforce("rollout correction mode", mode)
    if isinstance(threshold, (int, float)):
        CORRECTION_THRESHOLD.enforce("rollout correction threshold", threshold)
    shape = jnp.shape(old_logp)
    valid = _f32(mask) > 0
    old = jax.lax.stop_gradient(_f32(old_logp))
    rollout = jax.lax.stop_gradient(_f32(rollout_logp))
    log_rho = jnp.where(valid, old - rollout, 0.0)  # log pi_old / pi_rollout; 0 (and finite) outside the mask
    keys, n_keys = _sequence_keys(shape, segment_ids)
    seq_sum = lambda x: jax.ops.segment_sum(x.reshape(-1), keys, num_segments=n_keys)  # [n_keys]
    if level == "token":
        level_log_rho = log_rho
    else:
        level_log_rho = seq_sum(log_rho)[keys].reshape(shape)
    rho = jnp.exp(jnp.clip(level_log_rho, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    high = valid & (rho > threshold)
    low = valid & (rho < 1.0 / threshold)
    ones = jnp.ones(shape, jnp.float32)
    weights, keep = ones, jnp.ones(shape, bool)
    if mode == "truncate":
        weights = jnp.where(valid, jnp.minimum(rho, threshold), 1.0)
    elif mode == "mask":
        keep = ~(high | low)
    truncated = high if mode == "truncate" else jnp.zeros(shape, bool)
    metrics = _correction_metrics(old, rollout, valid, log_rho, high, low, truncated, ~keep, seq_sum)
    return weights, keep, metrics


def _correction_metrics(old, rollout, valid, log_rho, high, low, truncated, dropped, seq_sum) -> dict[str, Array]:
    """``rollout_correction``'s metrics (its docstring lists them)."""
    has_seq = seq_sum(valid.astype(jnp.float32)) > 0
    n_seq = jnp.maximum(jnp.sum(has_seq.astype(jnp.float32)), 1.0)
    seq_fraction = lambda flag: jnp.sum(((seq_sum(flag.astype(jnp.float32)) > 0) & has_seq).astype(jnp.float32)) / n_seq
    diff = jnp.where(valid, rollout - old, 0.0)
    k3_log = jnp.clip(log_rho, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    fraction = lambda flag: masked_mean(flag.astype(jnp.float32), valid)
    return {
        "tokens": jnp.sum(valid.astype(jnp.float32)),
        "abs_logp_diff_mean": masked_mean(jnp.abs(diff), valid),
        "abs_logp_diff_max": jnp.max(jnp.abs(diff)),
        "kl": masked_mean(diff, valid),
        "k3_kl": masked_mean(jnp.exp(k3_log) - k3_log - 1.0, valid),
        "ratio_fraction_high": fraction(high),
        "ratio_fraction_low": fraction(low),
        "truncated_fraction": fraction(truncated),
        "masked_fraction": fraction(dropped),
        "seq_truncated_fraction": seq_fraction(truncated),
        "seq_masked_fraction": seq_fraction(dropped),
    }


# --------------------------------------------------------------------------------------------------
# KL estimators (spec 8.4)
# --------------------------------------------------------------------------------------------------

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logp: Array, ref_logp: Array, kind: str = "low_var_kl") -> Array:
    """Per-token KL estimate between the policy and the reference (verl ``kl_penalty``, spec 8.4).

    * ``k1`` / ``kl``: ``logp - ref``;  ``abs``: ``|logp - ref|``;  ``k2`` / ``mse``: ``0.5 (logp - ref)^2``;
    * ``k3`` / ``low_var_kl``: with ``kappa = ref - logp``, ``exp(kappa) - kappa - 1`` clamped to [-10, 10].
      ``kappa`` is first clamped to [-20, 20]: k3 already exceeds 10 there, so values and gradients are
      unchanged, but ``exp`` can no longer overflow into an inf/NaN gradient.

    Args:
      logp: [...] log-probs under the policy.
      ref_logp: [...] log-probs under the reference model.
      kind: estimator name (static); ``full`` raises NotImplementedError as in the reference.

    Returns:
      [...] float32 per-token KL; aggregate as ``sum(w * kl)`` with the loss weights (``packing``).
    """
    logp, ref_logp = _f32(logp), _f32(ref_logp)
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind == "abs":
        return jnp.abs(logp - ref_logp)
    if kind in ("k2", "mse"):
        return 0.5 * jnp.square(logp - ref_logp)
    if kind in ("k3", "low_var_kl"):
        kappa = jnp.clip(ref_logp - logp, -20.0, 20.0)
        return jnp.clip(jnp.exp(kappa) - kappa - 1.0, -10.0, 10.0)
    if kind == "full":
        raise NotImplementedError("full-distribution KL is not implemented (nor in the reference)")
    raise ValueError(f"unknown KL kind {kind!r}; choose from {KL_KINDS}")
