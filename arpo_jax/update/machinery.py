"""The policy's update machinery, built once from the model and the update config (`build_policy`): its optimizer
(LoRA: over the adapters alone) and schedule, the abstract params, the train state's shardings and the jitted step.
The RL trainer and cold-start SFT build it alike (train/skeleton.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.update import accumulate, jit, lora
from arpo_jax.update import train_step as ts

# (graphdef, model config, optimizer, mesh, state shardings) -> the jitted step(state, batch) -> (state, metrics)
JitStep = Callable[[nnx.GraphDef, ModelConfig, optax.GradientTransformation, Mesh, accumulate.TrainState], jit.MeshJit]


def abstract_of(tree):
    """ShapeDtypeStruct leaves (shape and dtype only) of an array pytree."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The policy's update machinery, derived once from the model and the update config."""

    graphdef: nnx.GraphDef
    model_cfg: ModelConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    abstract: Any  # the params as ShapeDtypeStruct leaves
    shardings: accumulate.TrainState  # of the train state
    step_fn: jit.MeshJit
    mesh: Mesh  # the update's

    def init_state(self, params) -> accumulate.TrainState:
        return jit.init_train_state(params, self.optimizer, self.shardings)

    def restore_target(self) -> accumulate.TrainState:
        """The abstract train state a checkpoint restores into (shapes, dtypes, shardings)."""
        return jit.abstract_train_state(self.optimizer, self.abstract, self.shardings)


def build_policy(model, update_cfg: ts.UpdateConfig, total_updates: int, mesh: Mesh,
                 jit_step: JitStep) -> tuple[Policy, dict]:
    """The policy's optimizer (over `total_updates` optimizer steps), state shardings and jitted step; returns it
    with the model's params (a pure dict, to initialise the state from)."""
    optimizer = lora.freeze_base(ts.make_optimizer(update_cfg, total_updates), model.config)  # LoRA: adapters only
    schedule = ts.make_schedule(update_cfg, total_updates)
    graphdef, params = jit.split_model(model)
    abstract = abstract_of(params)
    shardings = jit.state_shardings(optimizer, jit.param_shardings(model.config, mesh), abstract, mesh)
    step_fn = jit_step(graphdef, model.config, optimizer, mesh, shardings)
    return Policy(graphdef, model.config, optimizer, schedule, abstract, shardings, step_fn, mesh), params
