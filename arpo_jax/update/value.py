"""The critic for PPO with GAE (``algorithm.adv_estimator = "gae"``; the reference's CriticWorker, spec 8.2).

The critic is a second backbone of the policy's architecture, initialised from the policy's weights (as verl
initialises its critic from the actor's path), whose final hidden states go through a value head (a float32
Linear D -> 1). It never projects onto the vocabulary, so it has no ``lm_head``.

Alignment (the same as ``packing``'s next-token convention): slot ``t`` of a row holds token ``x_j`` as input and
its value ``V_t = V(x_0..x_j)`` estimates the return of everything generated *from token x_{j+1} on*; so the value
sits in the same slot as ``x_{j+1}``'s target, log-prob, advantage and loss weight. After ``packing.unpack`` the
values are token-aligned: value ``j`` belongs to token ``j`` and is computed from tokens ``< j`` only (token 0
has none). This is verl's ``values[:, -R - 1:-1]`` slice.

GAE runs per trajectory, never on packed rows (a reverse scan over a packed row would run from one trajectory
into the previous one): the trainer unpacks the old values and ``advantages.gae`` slices each trajectory's
response, pads to [N, R] and calls ``advantages.gae_advantages(rewards, values, response_mask)`` (reward on the last
token); the advantages, returns and old values are then packed as token-aligned arrays (``global_batch.worker_batch``).

One call of ``value_step(state, batch)`` is one critic optimizer step over a mini-batch of [M, B, T] arrays:
``input_ids``, ``positions``, ``segment_ids`` (int32), ``loss_weight``, ``old_values``, ``returns`` (float32).
The loss weights are the policy's (``packing.loss_weights``), so the value loss aggregates like the policy loss
and is independent of the micro-batch split. With tree training (``tree_packing``) the mini-batch is a tree batch:
the per-token arrays are per loss entry ([M, B, E]) and the values come from one forward over the shared prefixes
(``ValueModel.tree_values``); the loss and its gradients equal the flat layout's. The old values for GAE still come
from a flat forward (``Critic.values``, once per step).

The state is a ``TrainState`` and everything around the step (optimizer, gradient accumulation,
shardings, init, jit, the forward over a rollout) comes from ``train_step``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import knobs, sharding
from arpo_jax.experience.advantages import masked_mean
from arpo_jax.models.transformer import CausalLM
from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.update import accumulate, jit
from arpo_jax.update import train_step as ts
from arpo_jax.update.accumulate import TrainState

Array = jax.Array
Batch = dict[str, Array]
FORWARD_KEYS = ("input_ids", "positions", "segment_ids")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """Critic loss and optimizer hyperparameters (verl critic defaults). Frozen and hashable: static under jit.

    Each ``knob`` field is the config field it names (default and meaning: config/schema.py); gradient
    clipping and weight decay are the actor's (their rules: ``train_step.UpdateConfig``)."""

    # values move at most this far from the rollout's old values per update
    cliprange_value: float = knobs.knob("critic.cliprange_value", knobs.POSITIVE)
    lr: float = knobs.knob("critic.lr", knobs.POSITIVE)
    max_grad_norm: float = knobs.knob("actor.max_grad_norm")
    weight_decay: float = knobs.knob("actor.weight_decay")
    # True: the reference's value loss, without current verl's 0.5 factor (twice the loss and gradient; value_loss).
    reference_compat: bool = knobs.knob("critic.reference_compat")

    def __post_init__(self):
        knobs.validate(self)

    def update_config(self) -> ts.UpdateConfig:
        """The optimizer part as a policy UpdateConfig, so ``train_step.make_optimizer`` builds the critic's AdamW."""
        return ts.UpdateConfig(lr=self.lr, max_grad_norm=self.max_grad_norm, weight_decay=self.weight_decay)


def make_optimizer(cfg: CriticConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clip then AdamW, constant lr: ``train_step.make_optimizer`` with the critic's values."""
    return ts.make_optimizer(cfg.update_config(), total_steps)


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class ValueModel(nnx.Module):
    """A CausalLM backbone without lm_head plus a value head: ``(input_ids, positions, segment_ids) -> [B, T]``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        # Built as a tied model only so that no lm_head is created: the critic never uses it, and an untied [V, D]
        # head plus its two Adam moments would be dead weight (the largest tensor of a small model). The flag changes
        # nothing else in CausalLM.
        self.backbone = CausalLM(cfg.replace(tie_word_embeddings=True), rngs=rngs)
        # Zero init: V = 0 everywhere at first, a neutral baseline. A random head on RMS-normed hidden states would
        # give values of size ~0.02 sqrt(D) (about 1 for D = 3584), noise of the order of the rewards.
        # Layout [1, D] + [1] as HF's ``score`` of *ForTokenClassification (verl's critic model); replicated.
        pdt = jnp.dtype(cfg.param_dtype)
        self.value_head = nnx.Dict(
            weight=nnx.Param(jnp.zeros((1, cfg.hidden_size), pdt), axes=(None, None), hf_shape=(1, cfg.hidden_size)),
            bias=nnx.Param(jnp.zeros((1,), pdt), axes=(None,), hf_shape=(1,)))

    def __call__(self, input_ids: Array, positions: Array | None = None, segment_ids: Array | None = None) -> Array:
        """float32 values [B, T] (slot t: the value of the state after the token at t); 0 at padding (segment 0)."""
        hidden_btd = self.backbone.hidden_states(input_ids, positions, segment_ids=segment_ids)
        hidden_btd = sharding.constrain(hidden_btd, ("batch", "seq", "act_embed"), self.config.sharding_rules)
        values = self._head(hidden_btd)
        if segment_ids is not None:
            values = jnp.where(segment_ids != 0, values, 0.0)
        return values

    def tree_values(self, mb: Batch) -> Array:
        """float32 values [B, E] of a tree micro-batch's entries (``tree_packing``). A loss token's value sits in
        the flat slot of its parent token (module docstring), i.e. at its head: one value per head, then each
        trajectory's entries gathered from the heads, as the policy's log-probs are."""
        values_bu = self._head(ts.tree_head_states(self.backbone, mb))
        return jnp.take_along_axis(values_bu, mb["entry_index"], axis=1)

    def _head(self, hidden: Array) -> Array:
        """float32 values [...] of final hidden states [..., D]. A float32 head: returns are O(1) and regress on
        small differences that bf16 (3 digits) would round away."""
        w_od = self.value_head["weight"][...].astype(jnp.float32)
        values = jnp.einsum("...d,od->...o", hidden.astype(jnp.float32), w_od)[..., 0]
        return values + self.value_head["bias"][...].astype(jnp.float32)[0]


def abstract_value_model(cfg: ModelConfig) -> ValueModel:
    """The ValueModel with ShapeDtypeStruct leaves (shapes, dtypes, axes) without allocating anything."""
    return nnx.eval_shape(lambda: ValueModel(cfg, rngs=nnx.Rngs(0)))


def value_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """The static graph definition; ``nnx.merge(graphdef, params)`` rebuilds the ValueModel inside jit."""
    return nnx.split(abstract_value_model(cfg), nnx.Param)[0]


def value_params_from_policy(policy_params: dict) -> dict:
    """Critic params (pure dict) from the policy's: the backbone shares the policy's arrays, the head is zero.

    Nothing is copied here: ``jit.init_train_state`` copies the params (and places them in their
    shardings, which for the backbone are the policy's own), so the critic's updates never touch the policy.
    """
    w = policy_params["model"]["norm"]["weight"]  # [D], in param_dtype
    head = {"weight": jnp.zeros((1, w.shape[0]), w.dtype), "bias": jnp.zeros((1,), w.dtype)}
    return {"backbone": {"model": policy_params["model"]}, "value_head": head}


def value_param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Pure dict of NamedSharding for the critic params (the backbone sharded exactly like the policy's)."""
    abstract = nnx.state(abstract_value_model(cfg), nnx.Param)
    return nnx.to_pure_dict(sharding.state_shardings(abstract, mesh, sharding.get_rules(cfg.sharding_rules)))


def values_of(graphdef: nnx.GraphDef, params, mb: Batch) -> Array:
    """float32 values [B, T] for one micro-batch of [B, T] arrays (only FORWARD_KEYS are read); a tree micro-batch
    (recognised by its ``tree_end``): [B, E], one per loss entry (``ValueModel.tree_values``)."""
    model = nnx.merge(graphdef, params)
    if "tree_end" in mb:
        return model.tree_values(mb)
    return model(mb["input_ids"], mb["positions"], mb["segment_ids"])


# --------------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------------


def value_loss(values: Array, old_values: Array, returns: Array, weights: Array, cliprange_value: float, *,
               reference_compat: bool = False) -> tuple[Array, dict[str, Array]]:
    """Clipped value loss (verl ``compute_value_loss``), aggregated by the loss weights.

    ``L1 = (v - R)^2``, ``L2 = (clip(v, v_old - c, v_old + c) - R)^2``, ``loss = 0.5 * sum(w * max(L1, L2))``:
    the pessimistic max keeps an update from moving a value more than ``c`` away from the rollout's estimate.
    The 0.5 is current verl's (the gradient of ``0.5 (v - R)^2`` is ``v - R``); the reference's verl 0.3.1 has
    ``agg(max(L1, L2))`` without it, i.e. twice the loss and gradient (an effective critic lr of 2x):
    ``reference_compat=True`` reproduces that.

    Args:
      values: [B, T] current values (differentiated).
      old_values: [B, T] values of the critic that scored the rollout.
      returns: [B, T] GAE returns (advantages + old values, before whitening).
      weights: [B, T] loss weights (``packing.loss_weights``: they hold the aggregation mode and its normaliser,
        the policy's, so the value loss aggregates like the policy loss); 0 = not a loss token.
      cliprange_value: c.
      reference_compat: drop the 0.5 factor, as the reference does.

    Returns:
      (scalar loss, metrics): ``vf_clipfrac`` (share of tokens with ``L2 > L1``) and ``vpred_mean``, both means
      weighted by ``weights``.
    """
    valid = weights > 0
    # Double-where: padding may hold garbage; zeros there keep the squares and their gradients finite.
    v = jnp.where(valid, values.astype(jnp.float32), 0.0)
    v_old = jnp.where(valid, old_values.astype(jnp.float32), 0.0)
    ret = jnp.where(valid, returns.astype(jnp.float32), 0.0)
    v_clipped = jnp.clip(v, v_old - cliprange_value, v_old + cliprange_value)
    loss1 = jnp.square(v - ret)
    loss2 = jnp.square(v_clipped - ret)
    factor = 1.0 if reference_compat else 0.5
    loss = factor * jnp.sum(jnp.where(valid, weights * jnp.maximum(loss1, loss2), 0.0))
    metrics = {"vf_clipfrac": masked_mean((loss2 > loss1).astype(jnp.float32), weights),
               "vpred_mean": masked_mean(jax.lax.stop_gradient(v), weights)}
    return loss, metrics


def _micro_value_loss(params, graphdef, mb: Batch, cfg: CriticConfig) -> tuple[Array, dict[str, Array]]:
    """``sum(w * loss)`` of one micro-batch and its metric sums (weighted by w; divided by the total later)."""
    w = mb["loss_weight"].astype(jnp.float32)
    loss, m = value_loss(values_of(graphdef, params, mb), mb["old_values"], mb["returns"], w,
                         cfg.cliprange_value, reference_compat=cfg.reference_compat)
    w_sum = jnp.sum(w)
    metrics = {"vf_loss": loss, "weight": w_sum, **{k: v * w_sum for k, v in m.items()}}
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


def value_step(state: TrainState, batch: Batch, *, graphdef: nnx.GraphDef, cfg: CriticConfig,
               optimizer: optax.GradientTransformation, grad_shardings=None) -> tuple[TrainState, dict[str, Array]]:
    """One critic optimizer step over a mini-batch of [M, B, T] arrays (module docstring) with
    ``accumulate.accumulate_and_apply``; jit with ``jit_value_step``.

    Returns:
      (new state, metrics): float32 scalars ``vf_loss`` (the mini-batch loss), ``vf_clipfrac``, ``vpred_mean``
      (loss-weighted means), ``grad_norm`` (before clipping), ``skipped`` (0 or 1).
    """
    micro = lambda params, mb: _micro_value_loss(params, graphdef, mb, cfg)
    new_state, sums = accumulate.accumulate_and_apply(state, batch, micro, optimizer, grad_shardings)
    return new_state, accumulate.weighted_means(sums, totals=("vf_loss",))


def jit_value_step(graphdef: nnx.GraphDef, model_cfg: ModelConfig, cfg: CriticConfig,
                   optimizer: optax.GradientTransformation, mesh: Mesh | None = None,
                   shardings: TrainState | None = None) -> jit.MeshJit:
    """``value_step`` jitted once with ``jit.jit_step`` (shardings: ``jit.state_shardings`` over
    ``value_param_shardings``)."""
    fn = lambda state, batch, grad_sh: value_step(state, batch, graphdef=graphdef, cfg=cfg, optimizer=optimizer,
                                                  grad_shardings=grad_sh)
    return jit.jit_step(fn, model_cfg, mesh, shardings, name="jit_value_step")


# --------------------------------------------------------------------------------------------------
# Old values for a whole rollout
# --------------------------------------------------------------------------------------------------


def forward_values(graphdef: nnx.GraphDef, params, batch: Batch) -> Array:
    """float32 values shaped like ``batch["input_ids"]`` ([..., B, T], e.g. [K, M, B, T]), one [B, T] micro-batch
    at a time (``jit.map_micro_batches``)."""
    return jit.map_micro_batches(lambda mb: values_of(graphdef, params, mb), batch, FORWARD_KEYS)


def jit_value_forward(graphdef: nnx.GraphDef, model_cfg: ModelConfig, mesh: Mesh | None = None) -> jit.MeshJit:
    """``forward_values`` jitted with ``jit.jit_forward``: ``fn(params, batch) -> values``, the batch split
    like the train step's."""
    return jit.jit_forward(lambda params, batch: forward_values(graphdef, params, batch), FORWARD_KEYS, model_cfg, mesh)


# --------------------------------------------------------------------------------------------------
# The critic of a run
# --------------------------------------------------------------------------------------------------


