"""The critic of a run (PPO with GAE): its value model's state, jitted update and forward, checkpoints, and
the GAE advantages of a step from its values (the maths: `update/value.py`)."""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from arpo_jax import distributed, knobs
from arpo_jax.experience import advantages, global_batch
from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.update import jit
from arpo_jax.update import value as critic_lib
from arpo_jax.update.accumulate import TrainState
from arpo_jax.update.value import (
    CriticConfig,
    jit_value_forward,
    jit_value_step,
    make_optimizer,
    value_graphdef,
    value_param_shardings,
    value_params_from_policy,
)
from arpo_jax.weights.checkpoint import Checkpointer

Array = jax.Array


Batch = dict[str, Array]


class Critic:
    """The value model of one run: its optimizer, train state, jitted update and forward, and checkpoints.

    Saved in step with the policy in its own folder (`directory`), in the background unless `async_save` is off
    (`trainer.async_save`, as the policy's); `state` is None until `init_state` or `restore` sets it.
    """

    def __init__(self, cfg: CriticConfig, model_cfg: ModelConfig, mesh: Mesh, policy_abstract, total_updates: int,
                 directory: str | os.PathLike, *, keep: int | None = 3, async_save: bool = True):
        self.model_cfg = model_cfg
        self.optimizer = make_optimizer(cfg, total_updates)
        self.param_shardings = value_param_shardings(model_cfg, mesh)
        self.abstract = jax.eval_shape(value_params_from_policy, policy_abstract)
        self.shardings = jit.state_shardings(self.optimizer, self.param_shardings, self.abstract, mesh)
        graphdef = value_graphdef(model_cfg)
        self.step_fn = jit_value_step(graphdef, model_cfg, cfg, self.optimizer, mesh, self.shardings)
        self.value_fn = jit_value_forward(graphdef, model_cfg, mesh)
        self.ckpt = Checkpointer(directory, max_to_keep=keep, async_save=async_save)
        self.state: TrainState | None = None

    def init_state(self, policy_params) -> TrainState:
        """A fresh state: the backbone copied from the policy's params, a zero head."""
        params = value_params_from_policy(policy_params)
        params["value_head"] = jax.tree.map(jax.device_put, params["value_head"], self.param_shardings["value_head"])
        return jit.init_train_state(params, self.optimizer, self.shardings)

    def restore(self, step: int) -> TrainState:
        target = jit.abstract_train_state(self.optimizer, self.abstract, self.shardings)
        return self.ckpt.restore_state(step, target).state

    def save(self, step: int) -> None:
        self.ckpt.save_state(step, self.state, config=self.model_cfg, force=True)

    def values(self, batch: Batch) -> Array:
        """Values of a global [K, M, B, T] batch (``forward_values``) with the current params."""
        return self.value_fn(self.state.params, batch)

    def update(self, minis: list[Batch], epochs: int) -> list[dict[str, Array]]:
        """`epochs` passes of one optimizer step per mini-batch; the per-step metrics (on device)."""
        metrics = []
        for _ in range(epochs):
            for batch in minis:
                self.state, m = self.step_fn(self.state, batch)
                metrics.append(m)
        return metrics


def critic_advantages(trajs: dict[int, Trajectories], critic: Critic, batches: global_batch.GlobalBatch,
                      cfg) -> dict[int, dict[str, list[np.ndarray]]]:
    """Per local worker, GAE's token-aligned `advantages`, `returns` and the critic's `old_values` per sequence."""
    a, local = cfg.algorithm, batches.local_workers
    # The critic's values of every sequence: one forward pass over the packed global batch (GAE itself runs per
    # trajectory: a reverse scan over a packed row would cross into another trajectory).
    batch, layouts = batches.forward_batch(trajs, critic_lib.FORWARD_KEYS)
    values = batches.unpack(critic.values(batch), layouts)
    n_local = sum(len(t.sequences) for t in trajs.values())
    rows = slice(jax.process_index() * n_local, (jax.process_index() + 1) * n_local)
    # Whitened over every trajectory of the step (as the reference's driver does), not per process.
    g = distributed.gather
    whiten = lambda adv, mask: np.asarray(advantages.masked_whiten(g(adv), g(mask)))[rows]
    out = advantages.gae([trajs[w] for w in local], [values[w] for w in local],
                         max_response_length=cfg.data.max_response_length, gamma=a.gamma, lam=a.lam, whiten=whiten)
    return {w: {"advantages": adv, "returns": ret, "old_values": values[w]} for w, (adv, ret) in zip(local, out)}


def critic_config(cfg) -> critic_lib.CriticConfig:
    return knobs.from_config(critic_lib.CriticConfig, cfg)
