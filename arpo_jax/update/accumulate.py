"""One optimizer step over micro-batches: the skeleton the policy, SFT and critic updates share.

``accumulate_and_apply`` sums a micro-batch loss's gradients over the [M, ...] micro-batches of a mini-batch with
``lax.scan`` (float32 accumulators; on an HSDP mesh one accumulator per data group, summed once), then applies the
optimizer, skipping a non-finite update. ``TrainState`` is what it carries from step to step; ``PartialOptimizer``
trains some params only (LoRA's adapters; ``models.lora.partition`` / ``combine`` split and join a params tree by
key paths).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from arpo_jax import sharding
from arpo_jax.models.lora import combine, partition

Array = jax.Array
Batch = dict[str, Array]


class TrainState(NamedTuple):
    """Everything that changes across optimizer steps; a pytree of arrays."""

    params: Any  # pure dict of the model's params (nnx.to_pure_dict)
    opt_state: Any  # optax state; moments shaped and sharded like params
    step: Array  # int32 scalar: train_step calls
    skipped: Array  # int32 scalar: updates skipped because the loss or gradient norm was not finite


class PartialOptimizer(NamedTuple):
    """An optimizer over some of the params only (LoRA: the adapters, ``lora.freeze_base``): ``init`` and ``update``
    see the ``trainable`` leaves alone, and ``accumulate_and_apply`` differentiates those alone, so the frozen rest
    gets no gradient, no accumulator and no optimizer state. The TrainState still holds every param (the frozen ones
    pass through the step unchanged)."""

    inner: optax.GradientTransformation
    trainable: frozenset  # key paths (tuples) of the trainable leaves in the params' pure dict

    def init(self, params):
        return self.inner.init(partition(params, self.trainable)[0])

    def update(self, updates, state, params=None):
        return self.inner.update(updates, state, params)


def trainable_of(optimizer) -> frozenset | None:
    """The key paths an optimizer trains (a ``PartialOptimizer``'s), None for all."""
    return optimizer.trainable if isinstance(optimizer, PartialOptimizer) else None


MICRO_BATCH_SCOPE = "micro_batch"  # the name scope of the work done once per micro-batch (`plan` counts by it)


def micro_batch_scope(fn):
    """`fn` traced inside the `MICRO_BATCH_SCOPE` name scope: its ops' HLO metadata say they run per micro-batch."""
    def scoped(*args):
        with jax.named_scope(MICRO_BATCH_SCOPE):
            return fn(*args)
    return scoped


def accumulate_and_apply(state: TrainState, batch: Batch, micro_loss, optimizer: optax.GradientTransformation,
                         grad_shardings=None, *, rows_separable: bool = True) -> tuple[TrainState, dict[str, Array]]:
    """One optimizer step over the [M, ...] micro-batches of ``batch``: the policy, SFT and critic updates all use it.

    ``micro_loss(params, mb) -> (loss, metrics)``'s gradients are summed over the micro-batches with ``lax.scan``
    (float32 accumulators), then ``optimizer`` is applied. An update whose summed loss or gradient norm is not finite
    is skipped: params and optimizer state are returned unchanged and ``skipped`` is counted.

    On a mesh with a ``data`` axis (HSDP: params replicated over it), each data-parallel group sums the gradients of
    its own rows over all micro-batches and the groups' sums are added once, after the loop: one reduction over
    ``data`` (the axis that crosses hosts) a step instead of one per micro-batch. That needs ``micro_loss`` to be a
    sum of per-row terms (``rows_separable``): every loss here is (its normalisers are in the loss weights), except
    entropy-aware advantages with the micro-batch's own entropy statistics (``micro_norm="reference"``).

    Returns:
      (new state, metrics): each of ``micro_loss``'s metrics summed over the micro-batches, plus float32 scalars
      ``grad_norm`` (before clipping), ``skipped`` (0 or 1) and ``micro_batches`` (micro-batches computed: those
      whose ``loss_weight`` is all zero are skipped, their loss and gradients being exactly zero).
    """
    # A PartialOptimizer (LoRA) trains some params only: differentiate those, pass the frozen rest through.
    params, frozen = partition(state.params, trainable_of(optimizer))
    grad_fn = jax.value_and_grad(lambda p, mb: micro_loss(combine(p, frozen), mb), has_aux=True)
    groups = _data_groups(batch) if rows_separable else 1
    if groups > 1:
        # [M, B, ...] -> [M, groups, B / groups, ...], the groups split over `data`; each group's gradient is its own
        # (vmap), summed into its own accumulator: nothing crosses `data` until the scan ends.
        batch = jax.tree.map(lambda x: x.reshape(x.shape[0], groups, -1, *x.shape[2:]), batch)
        batch = jax.lax.with_sharding_constraint(batch, jax.tree.map(lambda _: PartitionSpec(None, "data"), batch))
        grad_fn = _per_data_group(grad_fn)

    def run(acc, mb):
        (loss, metrics), grads = grad_fn(params, mb)
        return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads), (loss, metrics)

    @micro_batch_scope
    def body(acc, mb):
        if "loss_weight" not in mb:
            acc, out = run(acc, mb)
            return acc, (out, jnp.ones((), jnp.float32))
        # Every mini-batch is padded to the largest micro-batch count (packing.plan_layout): a micro-batch without
        # any loss weight contributes exactly nothing, so its forward and backward are skipped (review W3).
        _, zeros = jax.eval_shape(run, acc, mb)
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zeros)
        has_weight = jnp.any(mb["loss_weight"] != 0)
        acc, out = jax.lax.cond(has_weight, run, lambda a, _: (a, zeros), acc, mb)
        return acc, (out, has_weight.astype(jnp.float32))

    lead = (groups,) if groups > 1 else ()  # one accumulator per data group, split over `data`
    acc = jax.tree.map(lambda p: jnp.zeros((*lead, *p.shape), jnp.float32), params)
    if grad_shardings is not None:
        specs = partition(grad_shardings, trainable_of(optimizer))[0]
        specs = jax.tree.map(lambda s: PartitionSpec(*(("data",) if lead else ()), *s.spec), specs)
        acc = jax.lax.with_sharding_constraint(acc, specs)
    # losses: [M]; micro_metrics: {name: [M]}; ran: [M] 1.0 where the micro-batch was computed
    grads, ((losses, micro_metrics), ran) = jax.lax.scan(body, acc, batch)
    if lead:  # the one reduction over `data`; the groups' losses and metrics ([M, groups]) added
        grads = jax.tree.map(lambda g: g.sum(0), grads)
        losses, micro_metrics = jax.tree.map(lambda x: x.sum(1), (losses, micro_metrics))
    sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), micro_metrics) | {"micro_batches": jnp.sum(ran)}

    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(jnp.sum(losses)) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    def apply(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # A cond, not where(ok, new, old): the update then writes params and moments in place (the state is donated);
    # a select keeps old and new alive together, and XLA copies every moment (~0.3 CPU-s a step on SmolLM2-135M).
    new_params, opt_state = jax.lax.cond(ok, apply, lambda p, s, _: (p, s), params, state.opt_state, grads)
    skipped = 1 - ok.astype(jnp.int32)
    new_state = TrainState(combine(new_params, frozen), opt_state, state.step + 1, state.skipped + skipped)
    return new_state, sums | {"grad_norm": grad_norm, "skipped": skipped.astype(jnp.float32)}


def _per_data_group(grad_fn):
    """``grad_fn(params, mb)`` over a micro-batch's leading [groups] axis, the groups split over `data`."""
    per_group = jax.vmap(grad_fn, in_axes=(None, 0), spmd_axis_name="data")

    def grads(params, mb):
        with sharding.axes_taken("data"):  # the model's constraints leave `data` to the vmap (spmd_axis_name)
            return per_group(params, mb)
    return grads


def _data_groups(batch: Batch) -> int:
    """The size of the current mesh's ``data`` axis when it splits ``batch``'s [M, B, ...] rows evenly, else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    groups = 1 if mesh.empty else dict(mesh.shape).get("data", 1)
    rows = jax.tree.leaves(batch)[0].shape[1]
    return groups if groups > 1 and rows % groups == 0 else 1


def weighted_means(sums: dict[str, Array], *, totals: tuple[str, ...]) -> dict[str, Array]:
    """``accumulate_and_apply``'s metric sums as loss-weighted means over the mini-batch (each divided by the summed
    ``weight``, which is dropped), except the loss ``totals``, ``grad_norm``, ``skipped`` and ``micro_batches``, kept
    as they are."""
    w_total = jnp.maximum(sums["weight"], 1e-30)
    keep = (*totals, "grad_norm", "skipped", "micro_batches")
    return {k: v if k in keep else v / w_total for k, v in sums.items() if k != "weight"}
