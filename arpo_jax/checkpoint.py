"""Orbax checkpoints: sharded params, optimizer state and JSON metadata, saved per step, restored onto any mesh.

Layout of `directory/<step>/`: `params/` (the model's params as a pure dict of arrays), `opt_state/` (optional,
any pytree of arrays), `meta/` (JSON: the model config, so a checkpoint can be exported without its run's config,
plus whatever the caller stores, e.g. data position and PRNG state). Items are separate so that exporting or
evaluating a checkpoint restores the params alone.

Restore takes abstract targets (`jax.ShapeDtypeStruct` with a sharding) and orbax reads each device's slices
directly, so a checkpoint saved on one mesh shape restores onto another (e.g. (1, 8, 1) -> (2, 2, 2)).
Saves are asynchronous; an interrupted save leaves a temporary folder that orbax never lists as a step.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import models, sharding
from arpo_jax.models.transformer import Config, RopeScaling


def config_to_json(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> Config:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = tuple(d["eos_token_id"])
    return Config(**d)


def abstract_params(cfg: Config, mesh: Mesh | None = None) -> dict:
    """Pure-dict tree of ShapeDtypeStruct for the model's params, with target shardings when `mesh` is given."""
    state = nnx.state(models.abstract_model(cfg), nnx.Param)
    if mesh is not None:
        state = sharding.state_shardings(state, mesh, sharding.get_rules(cfg.sharding_rules), abstract=True)
        return nnx.to_pure_dict(state)
    # No mesh: the first local device, whatever topology saved it (e.g. a multi-host run's checkpoint on a laptop).
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), nnx.to_pure_dict(state))


class Checkpointer:
    """Keep-N, asynchronous, resumable checkpoints of (params, optimizer state, metadata) per step."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, params, *, config: Config, opt_state=None, meta: dict | None = None,
             force: bool = False) -> bool:
        """Starts saving step `step` (asynchronously); `params` is an nnx.State or a pure dict of arrays."""
        items = {
            "params": ocp.args.StandardSave(_pure(params)),
            "meta": ocp.args.JsonSave({"step": int(step), "model_config": config_to_json(config), **(meta or {})}),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    def read_meta(self, step: int | None = None) -> dict:
        step = self._resolve(step)
        return self._restore(step, meta=ocp.args.JsonRestore())["meta"]

    def restore(self, step: int | None = None, *, config: Config | None = None, mesh: Mesh | None = None,
                opt_state_target: Any = None, params_target: Any = None) -> tuple[dict, Any, dict]:
        """Restores (params pure dict, opt_state or None, meta) of `step` (default: latest) onto `mesh`.

        `config` defaults to the one stored in the checkpoint (its runtime fields, e.g. param_dtype, may be
        overridden by passing a config). `opt_state_target` is an abstract tree (ShapeDtypeStruct with shardings);
        None skips the optimizer state. `params_target` replaces the model's abstract params for trees that are not a
        CausalLM's (e.g. the critic's value model).
        """
        step = self._resolve(step)
        meta = self.read_meta(step)
        config = config or config_from_json(meta["model_config"])
        if params_target is None:
            params_target = abstract_params(config, mesh)
        items = {"params": ocp.args.StandardRestore(params_target)}
        if opt_state_target is not None:
            items["opt_state"] = ocp.args.StandardRestore(opt_state_target)
        out = self._restore(step, **items)
        return out["params"], out.get("opt_state"), meta

    def restore_model(self, step: int | None = None, *, mesh: Mesh | None = None, **runtime) -> models.CausalLM:
        """A CausalLM from a checkpoint's params and stored config (runtime fields overridable)."""
        step = self._resolve(step)
        config = config_from_json(self.read_meta(step)["model_config"]).replace(**runtime)
        params, _, _ = self.restore(step, config=config, mesh=mesh)
        graphdef, state = nnx.split(models.abstract_model(config))
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"{self.directory}: no checkpoint found")
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step}; available: {sorted(steps)}")
        return step

    def _restore(self, step: int, **items):
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax/tensorstore errors do not say which checkpoint failed
            raise ValueError(f"checkpoint {self.directory / str(step)} could not be restored "
                             f"(items {sorted(items)}): {type(e).__name__}: {e}") from e

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()
        self.close()


def _pure(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
