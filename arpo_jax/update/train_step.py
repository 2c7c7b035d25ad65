"""The jitted, sharded policy update: one optimizer step of PPO-clip / AEPO over one mini-batch.

One call of ``train_step(state, batch)`` is one optimizer step (spec 9): the mini-batch arrives as
[M, B, T] arrays (M micro-batches of B rows of T tokens, built on the host by ``experience/packing.py``), gradients
are accumulated over the micro-batches with ``lax.scan`` (float32 accumulators), then clipped to global norm
1.0 and applied with AdamW. An update whose loss or gradient norm is not finite is skipped: params and
optimizer state are returned unchanged and ``skipped`` is counted (the reference zeroes the gradients). That
skeleton, ``accumulate.accumulate_and_apply``, is shared with the SFT and critic steps, and the forward-only pass
over a whole rollout, ``jit.jit_forward``, with the critic's old values (the jit and sharding plumbing:
``update/jit.py``).

The loss of a micro-batch is ``sum_t w_t * (pg_t + kl_coef * kl_t - entropy_coef * H_t)`` where ``w`` is the
``loss_weight`` array the packer computed; the weights implement the aggregation mode and the micro-batch
normalisation (``packing.loss_weights``), so the step needs no normaliser of its own and the default
(``global_token_mean``) is exactly verl's ``agg_loss`` of the whole mini-batch whatever the split.

Entropy-aware advantages (AEPO, spec 10.2) need the current-policy entropy H. It is always computed here (the
chunked log-prob pass yields it at little cost), which fixes B2; ``reference_compat=True`` applies the
advantage reshaping only when ``entropy_coef != 0``, reproducing the reference's silent no-op. The H
statistics are pooled over the micro-batch in ``reference`` mode (as verl) and over the whole mini-batch in
the default mode, which costs one extra forward pass but keeps the update independent of the split.

Batch keys, each [M, B, T] (per-token values describe the *next* token, see ``packing``): ``input_ids``,
``targets``, ``positions``, ``segment_ids`` (int32); ``loss_weight``, ``advantages``, ``old_logp`` (not with
``recompute_old_logprob=False``) and, when ``kl_coef != 0``, ``ref_logp`` (float32). Optional ``rollout_logp``
(float32): the rollout engine's log-prob of each sampled token (NaN where it has none); with it and the old
log-probs, every step measures the rollout / trainer mismatch and applies ``rollout_correction``
(``algos.rollout_correction`` over the whole mini-batch, before the micro-batches).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import knobs, sharding
from arpo_jax.experience.packing import AGG_MODES, MICRO_NORMS
from arpo_jax.models.transformer import CausalLM
from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.update import algos, logprobs
from arpo_jax.update.accumulate import TrainState, accumulate_and_apply, weighted_means
from arpo_jax.update.jit import MeshJit, jit_forward, jit_step, map_micro_batches

Array = jax.Array
Batch = dict[str, Array]
SCHEDULES = ("constant", "cosine")  # both after a linear warmup; cosine ends at min_lr_ratio * lr
_CLIP = knobs.Rule(lambda v: 0 <= v < 1, "0 <= clip < 1")
_TEMPERATURE = knobs.Rule(lambda v: v > 0, "> 0 (training samples; log-probs divide by it)")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Loss and optimizer hyperparameters of the policy update. Frozen and hashable: static under jit.

    Each ``knob`` field is the config field it names (default and meaning: config/schema.py) under its rule;
    ``components.update_config`` builds this from an experiment config."""

    loss: str = knobs.knob("actor.loss", knobs.one_of(algos.POLICY_LOSSES))
    clip_low: float = knobs.knob("actor.clip_low", _CLIP)  # eps_l, clip_ratio_low
    clip_high: float = knobs.knob("actor.clip_high", _CLIP)  # eps_h, clip_ratio_high
    clip_c: float = knobs.knob("actor.clip_c", algos.DUAL_CLIP)
    # Both act through the loss weights: pass the same values to packing.pack_batch. micro_norm also picks where
    # entropy-aware advantages pool their statistics.
    agg_mode: str = knobs.knob("actor.agg_mode", knobs.one_of(AGG_MODES))
    micro_norm: str = knobs.knob("actor.micro_norm", knobs.one_of(MICRO_NORMS))
    kl_coef: float = knobs.knob("actor.kl_coef", knobs.NONNEG)  # != 0 needs ref_logp in the batch
    kl_kind: str = knobs.knob("actor.kl_kind", knobs.one_of(algos.KL_KINDS))
    # False: on-policy, the micro-batch's own log-probs (gradient stopped) are the old ones: no old_logp in the batch
    recompute_old_logprob: bool = knobs.knob("actor.recompute_old_logprob")
    entropy_coef: float = knobs.knob("actor.entropy_coef", knobs.NONNEG)
    entropy_adv: bool = knobs.knob("actor.entropy_adv")
    entropy_adv_alpha: float = knobs.knob("actor.entropy_adv_alpha", knobs.NONNEG)
    reference_compat: bool = knobs.knob("actor.reference_compat")
    # Rollout / trainer mismatch correction when the batch has rollout_logp (algos.rollout_correction): the resolved
    # mode (actor.rollout_correction.mode's "auto" is components.rollout_correction_mode's).
    rollout_correction: str = "off"
    rollout_correction_level: str = knobs.knob("actor.rollout_correction.level",
                                               knobs.one_of(algos.ROLLOUT_CORRECTION_LEVELS))
    rollout_correction_threshold: float = knobs.knob("actor.rollout_correction.threshold",
                                                     algos.CORRECTION_THRESHOLD)
    # logits / temperature before log-softmax (spec 9): the rollout's sampling temperature
    temperature: float = knobs.knob("rollout.temperature", _TEMPERATURE)
    logprob_chunk: int = knobs.knob("actor.logprob_chunk", knobs.POSITIVE)
    max_grad_norm: float = knobs.knob("actor.max_grad_norm", knobs.POSITIVE)
    lr: float = knobs.knob("actor.lr", knobs.POSITIVE)
    schedule: str = knobs.knob("actor.schedule", knobs.one_of(SCHEDULES))
    warmup_steps: int = knobs.knob("actor.warmup_steps", knobs.NONNEG)
    min_lr_ratio: float = knobs.knob("actor.min_lr_ratio", knobs.UNIT)
    weight_decay: float = knobs.knob("actor.weight_decay", knobs.NONNEG)
    b1: float = 0.9
    b2: float = knobs.knob("actor.adam_beta2", knobs.Rule(lambda v: 0 <= v < 1, "0 <= beta2 < 1"))
    eps: float = 1e-8

    def __post_init__(self):
        knobs.validate(self)
        knobs.one_of(algos.ROLLOUT_CORRECTION_MODES).enforce("UpdateConfig.rollout_correction",
                                                             self.rollout_correction)

    @property
    def uses_entropy_adv(self) -> bool:
        """Whether entropy-aware advantages take effect (the reference needs entropy_coef != 0: B2)."""
        return self.entropy_adv and (not self.reference_compat or self.entropy_coef != 0)


# --------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------


def make_schedule(cfg: UpdateConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per optimizer step: linear warmup from 0, then constant or cosine to ``min_lr_ratio * lr``.

    Same shapes as verl / transformers' ``get_constant_schedule_with_warmup`` and
    ``get_cosine_schedule_with_warmup`` (half a cosine period over ``total_steps - warmup_steps``).
    """
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1),
                                                  end_value=cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup_steps > 0:
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                     optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
    return optax.constant_schedule(cfg.lr)


def make_optimizer(cfg: UpdateConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with decoupled weight decay on every param (torch AdamW as verl uses it)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay),
    )


# --------------------------------------------------------------------------------------------------
# Log-probs and the loss of one micro-batch
# --------------------------------------------------------------------------------------------------


def token_logprobs(graphdef: nnx.GraphDef, params, mb: Batch, *, temperature: float = 1.0,
                   chunk: int = 256) -> tuple[Array, Array]:
    """(log p(targets) [B, T], entropy [B, T]) float32 for one micro-batch of [B, T] arrays.

    The final hidden states go through ``logprobs.token_logprobs_and_entropy_from_hidden``, so the [B, T, V] logits
    are never materialised (only [B, chunk, V] at a time, recomputed in the backward pass).
    """
    model = nnx.merge(graphdef, params)
    rules = model.config.sharding_rules
    if "tree_end" in mb:  # a tree batch (arpo_jax.experience.tree_packing): log-probs per loss entry [B, E]
        return _tree_logprobs(model, mb, temperature=temperature, chunk=chunk)
    hidden_btd = model.hidden_states(mb["input_ids"], mb["positions"], segment_ids=mb["segment_ids"])
    hidden_btd = sharding.constrain(hidden_btd, ("batch", "seq", "act_embed"), rules)
    return logprobs.token_logprobs_and_entropy_from_hidden(hidden_btd, _unembed_dv(model, hidden_btd.dtype),
                                                        mb["targets"], temperature=temperature, chunk_size=chunk,
                                                        rules=rules)


def _unembed_dv(model: CausalLM, dtype) -> Array:
    """The output projection [D, V] in the compute dtype, still in its param shards (cast there: the head's gather,
    `rules`, then moves the compute dtype) and its gradient returned in them."""
    unembed_vd = sharding.constrain(model.unembedding().astype(dtype), ("vocab", "embed"), model.config.sharding_rules)
    return unembed_vd.T  # [V, D] -> [D, V]; XLA folds the transpose


def _tree_logprobs(model: CausalLM, mb: Batch, *, temperature: float, chunk: int) -> tuple[Array, Array]:
    """(log p, entropy) [B, E] of a tree micro-batch's entries (``tree_packing``): one forward over the tree tokens
    [B, T], the heads' hidden states (each loss token's parent slot) [B, U] scored against their tokens, then each
    trajectory's entries gathered from the heads. Per entry the values equal the flat layout's at that token."""
    hidden_bud = tree_head_states(model, mb)
    logp_bu, ent_bu = logprobs.token_logprobs_and_entropy_from_hidden(
        hidden_bud, _unembed_dv(model, hidden_bud.dtype), mb["head_target"], temperature=temperature,
        chunk_size=chunk, rules=model.config.sharding_rules)
    take = lambda x: jnp.take_along_axis(x, mb["entry_index"], axis=1)  # [B, E]
    return take(logp_bu), take(ent_bu)


def tree_head_states(model: CausalLM, mb: Batch) -> Array:
    """Final hidden states [B, U, D] at a tree micro-batch's heads (``tree_packing``): one forward over the tree
    tokens [B, T], then each loss token's parent slot, the state the flat layout predicts that token from."""
    hidden_btd = model.hidden_states(mb["input_ids"], mb["positions"], tree_end=mb["tree_end"])
    hidden_btd = sharding.constrain(hidden_btd, ("batch", "seq", "act_embed"), model.config.sharding_rules)
    return jnp.take_along_axis(hidden_btd, mb["head_slot"][..., None], axis=1)


def _entropy_stats(graphdef, params, batch: Batch, cfg: UpdateConfig) -> tuple[Array, Array]:
    """Mean and unbiased std of the current-policy entropy over every loss token of the mini-batch [M, B, T]."""
    def body(carry, mb):
        _, ent = token_logprobs(graphdef, params, mb, temperature=cfg.temperature, chunk=cfg.logprob_chunk)
        m = (mb["loss_weight"] > 0).astype(jnp.float32)
        n_b = jnp.sum(m)
        mean_b = jnp.sum(jnp.where(m > 0, ent, 0.0)) / jnp.maximum(n_b, 1.0)
        mean_b = mean_b + jnp.sum(jnp.where(m > 0, ent - mean_b, 0.0)) / jnp.maximum(n_b, 1.0)  # two-pass mean
        m2_b = jnp.sum(jnp.where(m > 0, jnp.square(ent - mean_b), 0.0))
        # Chan et al.'s pairwise combination of (count, mean, sum of squared deviations): float32 sum-of-squares
        # minus squared-sum would cancel catastrophically (H ~ 6 nats, std ~ 0.1) and break split invariance.
        n_a, mean_a, m2_a = carry
        n = n_a + n_b
        delta = mean_b - mean_a
        frac = n_b / jnp.maximum(n, 1.0)
        return (n, mean_a + delta * frac, m2_a + m2_b + jnp.square(delta) * n_a * frac), None

    def skip_empty(carry, mb):  # the fixed-size mini-batch's empty micro-batches: nothing to add, no forward
        return jax.lax.cond(jnp.any(mb["loss_weight"] != 0), body, lambda c, _: (c, None), carry, mb)

    zero = jnp.zeros((), jnp.float32)
    (n, mean, m2), _ = jax.lax.scan(skip_empty, (zero, zero, zero), batch)
    std = jnp.sqrt(m2 / jnp.maximum(n - 1.0, 1.0))
    # As algos.entropy_aware_advantages: std 0 up to rounding (or fewer than two tokens) -> 1.
    return mean, algos.robust_std(std, mean, n)


def _micro_loss(params, graphdef, mb: Batch, h_stats, cfg: UpdateConfig) -> tuple[Array, dict[str, Array]]:
    """Weighted loss of one micro-batch and its weighted metric sums (divided by the weight total later)."""
    logp, ent = token_logprobs(graphdef, params, mb, temperature=cfg.temperature, chunk=cfg.logprob_chunk)
    w = mb["loss_weight"].astype(jnp.float32)
    mask = w > 0
    adv = mb["advantages"]
    if cfg.uses_entropy_adv:
        if h_stats is None:  # reference: statistics of this micro-batch (spec 10.2)
            adv = algos.entropy_aware_advantages(adv, ent, mask, alpha=cfg.entropy_adv_alpha)
        else:  # default: statistics of the whole mini-batch, computed before the scan
            h_hat = jnp.where(mask, (jax.lax.stop_gradient(ent) - h_stats[0]) / h_stats[1], 0.0)
            adv = adv * (1.0 + cfg.entropy_adv_alpha * h_hat)
    # w already holds the aggregation and its normaliser (packing.loss_weights): the loss is sum(w * per-token).
    old_logp = mb["old_logp"] if cfg.recompute_old_logprob else jax.lax.stop_gradient(logp)
    pg_token, pg_metrics = algos.POLICY_LOSSES[cfg.loss](
        logp, old_logp, adv, w, clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c,
        is_weights=mb.get("is_weight"))
    pg_loss = jnp.sum(w * pg_token)
    w_sum = jnp.sum(w)
    ent_term = jnp.sum(jnp.where(mask, w * ent, 0.0))
    loss = pg_loss - cfg.entropy_coef * ent_term if cfg.entropy_coef else pg_loss
    metrics = {"pg_loss": pg_loss, "entropy": jax.lax.stop_gradient(ent_term), "weight": w_sum}
    # pg_* metrics are w-weighted means within the micro-batch: times w_sum gives a sum over micro-batches.
    metrics.update({k: v * w_sum for k, v in pg_metrics.items()})
    if cfg.kl_coef:
        kl = algos.kl_penalty(logp, mb["ref_logp"], cfg.kl_kind)
        kl_term = jnp.sum(jnp.where(mask, w * kl, 0.0))  # where: padding's garbage log-probs must not leak
        loss = loss + cfg.kl_coef * kl_term
        metrics["kl_loss"] = kl_term
    metrics["loss"] = loss
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _rollout_correction(batch: Batch, cfg: UpdateConfig) -> tuple[Batch, dict[str, Array]]:
    """The mini-batch with its rollout-correction weights (``is_weight``) and, in mask mode, rejected tokens' loss
    weights at 0, plus the ``rollout_corr/*`` metrics.

    Measured and corrected: loss tokens with a finite engine log-prob (tool results, prompts and an appended
    call-limit EOS have none). Mask mode rescales the kept weights so the mini-batch's total weight is unchanged:
    with token-mean weights that is verl's rule (rejected tokens leave the normaliser); with the sequence means it
    keeps the total instead of recounting sequences.
    """
    w = batch["loss_weight"]
    has = (w > 0) & jnp.isfinite(batch["rollout_logp"])
    rollout = jnp.where(has, batch["rollout_logp"], batch["old_logp"])
    weights, keep, metrics = algos.rollout_correction(
        batch["old_logp"], rollout, has, level=cfg.rollout_correction_level, mode=cfg.rollout_correction,
        threshold=cfg.rollout_correction_threshold, segment_ids=batch["segment_ids"])
    out = batch | {"is_weight": weights}
    if cfg.rollout_correction == "mask":
        kept = jnp.where(keep, w, 0.0)
        out["loss_weight"] = kept * (jnp.sum(w) / jnp.maximum(jnp.sum(kept), 1e-30))
    return out, {f"rollout_corr/{k}": v for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


def train_step(state: TrainState, batch: Batch, *, graphdef: nnx.GraphDef, cfg: UpdateConfig,
               optimizer: optax.GradientTransformation, grad_shardings=None) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer step over one mini-batch of [M, B, T] arrays; pure, jit it with ``jit_train_step``.

    Args:
      state: the TrainState.
      batch: dict of [M, B, T] arrays (module docstring).
      graphdef: the model's graph definition (static).
      cfg: the UpdateConfig (static).
      optimizer: from ``make_optimizer`` (static).
      grad_shardings: optional shardings (params tree) for the gradient accumulators.

    Returns:
      (new state, metrics): scalar float32 metrics ``loss``, ``pg_loss``, ``kl_loss`` (when kl_coef != 0),
      ``entropy``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (loss-weighted means over the mini-batch;
      with token-mean weights, plain token means), ``grad_norm`` (before clipping), ``skipped`` (0 or 1),
      ``micro_batches`` (computed, i.e. not all-zero-weight padding); with
      ``rollout_logp`` in the batch also the ``rollout_corr/*`` metrics of ``algos.rollout_correction``.
    """
    rc_metrics = {}
    if "rollout_logp" in batch and cfg.recompute_old_logprob:
        batch, rc_metrics = _rollout_correction(batch, cfg)
    h_stats = None
    if cfg.uses_entropy_adv and cfg.micro_norm == "global_token_mean":
        h_stats = jax.lax.stop_gradient(_entropy_stats(graphdef, state.params, batch, cfg))
    micro_loss = lambda params, mb: _micro_loss(params, graphdef, mb, h_stats, cfg)
    # Entropy-aware advantages from the micro-batch's own statistics couple its rows (not a sum of row terms).
    separable = not (cfg.uses_entropy_adv and h_stats is None)
    new_state, sums = accumulate_and_apply(state, batch, micro_loss, optimizer, grad_shardings,
                                           rows_separable=separable)
    return new_state, weighted_means(sums, totals=("loss", "pg_loss", "kl_loss")) | rc_metrics


# --------------------------------------------------------------------------------------------------
# Shardings, init and jit
# --------------------------------------------------------------------------------------------------


def jit_train_step(graphdef: nnx.GraphDef, model_cfg: ModelConfig, cfg: UpdateConfig,
                   optimizer: optax.GradientTransformation, mesh: Mesh | None = None,
                   shardings: TrainState | None = None) -> MeshJit:
    """``train_step`` jitted once with ``jit_step``."""
    fn = lambda state, batch, grad_sh: train_step(state, batch, graphdef=graphdef, cfg=cfg, optimizer=optimizer,
                                                  grad_shardings=grad_sh)
    return jit_step(fn, model_cfg, mesh, shardings, name="jit_train_step")


# --------------------------------------------------------------------------------------------------
# Forward-only passes over a whole rollout (old / reference log-probs here, the critic's old values)
# --------------------------------------------------------------------------------------------------

LOGPROB_KEYS = ("input_ids", "targets", "positions", "segment_ids")
TREE_LOGPROB_KEYS = ("input_ids", "positions", "tree_end", "head_slot", "head_target", "entry_index")


def forward_logprobs(graphdef: nnx.GraphDef, params, batch: Batch, *, temperature: float = 1.0,
                     chunk: int = 256) -> tuple[Array, Array]:
    """Forward-only (log p(targets), entropy) for old / reference log-probs, in the batch's own layout.

    ``batch`` arrays are [..., B, T], walked one [B, T] micro-batch at a time (``map_micro_batches``). Returns
    float32 arrays shaped like ``batch["input_ids"]`` (a tree batch: like its entries, [..., B, E]). Only
    ``LOGPROB_KEYS`` (a tree batch: ``TREE_LOGPROB_KEYS``) are read.
    """
    fn = lambda mb: token_logprobs(graphdef, params, mb, temperature=temperature, chunk=chunk)
    return map_micro_batches(fn, batch, TREE_LOGPROB_KEYS if "tree_end" in batch else LOGPROB_KEYS)


def jit_forward_logprobs(graphdef: nnx.GraphDef, model_cfg: ModelConfig, *, temperature: float = 1.0,
                         chunk: int = 256, mesh: Mesh | None = None, tree: bool = False) -> MeshJit:
    """``forward_logprobs`` jitted with ``jit_forward``: ``fn(params, batch) -> (logp, entropy)``; ``tree``: for
    ``tree_packing`` batches."""
    fn = lambda params, batch: forward_logprobs(graphdef, params, batch, temperature=temperature, chunk=chunk)
    return jit_forward(fn, TREE_LOGPROB_KEYS if tree else LOGPROB_KEYS, model_cfg, mesh)
