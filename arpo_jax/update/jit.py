"""The project's jit and sharding plumbing: shardings of params and train states, `MeshJit` (traced inside
the mesh), `jit_step` for every update (policy, SFT, critic) and `jit_forward` for forward-only passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arpo_jax import models, sharding
from arpo_jax.models.transformer import CausalLM
from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.update.accumulate import PartialOptimizer, TrainState, micro_batch_scope, partition, trainable_of

Array = jax.Array


Batch = dict[str, Array]


def split_model(model: CausalLM) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as a pure dict); ``nnx.merge(graphdef, params)`` rebuilds the model inside jit."""
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def param_shardings(model_cfg: ModelConfig, mesh: Mesh) -> dict:
    """Pure dict of NamedSharding for the params, from their logical ``axes`` and the config's rules table."""
    abstract = nnx.state(models.abstract_model(model_cfg), nnx.Param)
    return nnx.to_pure_dict(sharding.state_shardings(abstract, mesh, sharding.get_rules(model_cfg.sharding_rules)))


def state_shardings(optimizer: optax.GradientTransformation, p_shardings: dict, abstract_params,
                    mesh: Mesh) -> TrainState:
    """TrainState of shardings: optimizer moments follow their params, counters are replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    inner = optimizer.inner if isinstance(optimizer, PartialOptimizer) else optimizer
    trained_sh = partition(p_shardings, trainable_of(optimizer))[0]
    opt = optax.tree_map_params(inner, lambda _, s: s, abstract_opt, trained_sh,
                                transform_non_params=lambda _: replicated)
    return TrainState(p_shardings, opt, replicated, replicated)


def init_train_state(params, optimizer: optax.GradientTransformation,
                     shardings: TrainState | None = None) -> TrainState:
    """TrainState for ``params``; with ``shardings`` the optimizer state is created directly in its shards.

    The params are copied: the train step donates its state, which must not delete the caller's arrays.
    """
    def init(p):
        p = jax.tree.map(jnp.copy, p)
        return TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    if shardings is None:
        return jax.jit(init)(params)
    return jax.jit(init, in_shardings=(shardings.params,), out_shardings=shardings)(params)


def abstract_train_state(optimizer: optax.GradientTransformation, abstract_params,
                         shardings: TrainState) -> TrainState:
    """The TrainState ``init_train_state`` would build, as ShapeDtypeStructs in ``shardings``: a restore target."""
    shapes = jax.eval_shape(lambda p: init_train_state(p, optimizer), abstract_params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


class MeshJit:
    """A jitted function that is traced, lowered and called inside ``jax.set_mesh(mesh)``.

    Tracing inside the mesh context is what makes the model's activation sharding constraints take effect.
    """

    def __init__(self, jitted, mesh: Mesh | None):
        self.jitted, self.mesh = jitted, mesh

    def _ctx(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else _nullcontext()

    def __call__(self, *args):
        with self._ctx():
            return self.jitted(*args)

    def lower(self, *args):
        with self._ctx():
            return self.jitted.lower(*args)


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def jit_step(fn, model_cfg: ModelConfig, mesh: Mesh | None = None, shardings: TrainState | None = None, *,
             name: str = "jit_step") -> MeshJit:
    """``fn(state, batch, grad_shardings) -> (state, metrics)`` jitted once, state donated; with a mesh, explicit
    in/out shardings for state and batch (the policy, SFT and value updates all use this).

    ``shardings`` comes from ``state_shardings`` (required with a mesh). Batch arrays [M, B, T] are split along
    B over the ``batch`` mesh axes, so B must be a multiple of their product.
    """
    step = lambda state, batch: fn(state, batch, None if shardings is None else shardings.params)
    if mesh is None:
        return MeshJit(jax.jit(step, donate_argnums=0), None)
    if shardings is None:
        raise ValueError(f"{name} with a mesh needs shardings=state_shardings(...)")
    batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh, model_cfg.sharding_rules))
    replicated = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated),
                     donate_argnums=0)
    return MeshJit(jitted, mesh)


def map_micro_batches(fn, batch: Batch, keys: tuple[str, ...]):
    """``fn(mb)`` of each [B, T] micro-batch of ``batch``'s [..., B, T] arrays (e.g. [K, M, B, T] for a whole
    rollout), one at a time with ``lax.map``, so peak memory is that of one micro-batch; each output [B, T, ...] is
    reshaped back to the batch's leading axes. Only ``keys`` are read. A micro-batch without a token (the batch's
    shape has room for the worst case: `global_batch.micro_batches`) is not computed: its outputs are zeros."""
    lead = batch[keys[0]].shape[:-2]
    flat = {k: batch[k].reshape((-1,) + batch[k].shape[-2:]) for k in keys}  # [prod(lead), B, T]
    return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), jax.lax.map(micro_batch_scope(skip_empty(fn)), flat))


def skip_empty(fn):
    """``fn(mb)``, or zeros shaped like its outputs for a micro-batch without tokens (segment ids all 0, or a tree
    micro-batch's ``tree_end`` all -1): a ``lax.cond``, so the padding of a fixed-size batch costs no compute."""
    def run(mb):
        if "segment_ids" in mb:
            occupied = jnp.any(mb["segment_ids"] != 0)
        elif "tree_end" in mb:
            occupied = jnp.any(mb["tree_end"] >= 0)
        else:
            return fn(mb)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, mb))
        return jax.lax.cond(occupied, fn, lambda _: zeros, mb)
    return run


def jit_forward(forward, keys: tuple[str, ...], model_cfg: ModelConfig, mesh: Mesh | None = None) -> MeshJit:
    """``forward(params, batch)`` jitted, its batch reduced to ``keys`` and placed first: with a mesh, any number of
    leading axes, the trailing [B, T] split as the train step's batch; the params (policy, reference or critic) keep
    the shardings they were created with."""
    jitted = jax.jit(forward)  # params arrive committed to their shardings, the batch is placed by _ShardBatch
    if mesh is None:
        return MeshJit(_ShardBatch(jitted, keys, None), None)
    spec = sharding.batch_spec(mesh, model_cfg.sharding_rules)
    batch_sh = lambda x: NamedSharding(mesh, PartitionSpec(*(None,) * (x.ndim - 2), *spec[1:]))
    return MeshJit(_ShardBatch(jitted, keys, batch_sh), mesh)


class _ShardBatch:
    """Keeps the keys the forward reads and places them in their shardings before calling the jitted forward."""

    def __init__(self, jitted, keys: tuple[str, ...], batch_sharding):
        self.jitted, self.keys, self.batch_sharding = jitted, keys, batch_sharding

    def _place(self, batch):
        if self.batch_sharding is None:
            return {k: jnp.asarray(batch[k]) for k in self.keys}
        return {k: jax.device_put(batch[k], self.batch_sharding(batch[k])) for k in self.keys}

    def __call__(self, params, batch):
        return self.jitted(params, self._place(batch))

    def lower(self, params, batch):
        return self.jitted.lower(params, {k: batch[k] for k in self.keys})
