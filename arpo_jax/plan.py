"""Memory plan of a config's policy-update step, compiled for its mesh on fake devices (`arpo-jax plan`).

The train step is lowered and compiled for abstract inputs (`jax.ShapeDtypeStruct` with shardings: nothing is
allocated), and XLA's `memory_analysis` of the partitioned program gives per-device bytes. Params and optimizer
state are exact (they follow from the shardings). The temporaries are what the backend that compiles plans: on
the CPU (fake devices) they overstate a GPU/TPU run, because the CPU compiler upcasts bf16 dots to f32 and its
memory analysis ignores remat (every layer's attention probabilities count as live at once). Run `plan` on one
accelerator host of the target kind for a realistic temporaries figure.

The model's `config.json` comes from `model.path`; when that folder is not there (planning before downloading) and
its name is a published model this package knows (`models.published`), the published config is used.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax import lora, models, named_models, sharding
from arpo_jax import train_step as ts
from arpo_jax.models.published import REAL_CONFIGS

GB = 1024**3


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, i.e. device 0's)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def total_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def hf_config_for(model_path: str) -> tuple[dict, str]:
    """(config.json dict, where it came from) for `model.path`, falling back to a published model's config."""
    if named_models.cache_folder(model_path) is not None:
        path = named_models.model_folder(model_path)  # converted once (seconds) into the cache
    else:
        path = Path(os.path.expandvars(model_path))
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text()), str(path / "config.json")
    if path.name in REAL_CONFIGS:
        return REAL_CONFIGS[path.name], f"published config of {path.name}"
    raise FileNotFoundError(f"model.path={model_path!r}: no config.json there, and {path.name!r} is not a published "
                            f"model this package knows ({', '.join(sorted(REAL_CONFIGS))})")


def plan(model_cfg: models.Config, mesh_shape, update_cfg: ts.UpdateConfig, *, micro: int, rows: int,
         seq: int) -> dict:
    """Per-device bytes of one optimizer step of [micro, rows, seq] on `mesh_shape`, compiled on this host."""
    mesh = sharding.make_mesh(mesh_shape)
    if model_cfg.attention_impl is None:  # plan the accelerator's attention, not the CPU kernel of these fake devices
        model_cfg = model_cfg.replace(attention_impl="xla")
    graphdef, abstract_state = nnx.split(models.abstract_model(model_cfg), nnx.Param)
    abstract_params = nnx.to_pure_dict(abstract_state)
    opt = lora.freeze_base(ts.make_optimizer(update_cfg, 1000), model_cfg)  # LoRA: no moments for the base
    shardings = ts.state_shardings(opt, ts.param_shardings(model_cfg, mesh), abstract_params, mesh)
    abstract_train_state = jax.eval_shape(lambda p: ts.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32),
                                                                  jnp.zeros((), jnp.int32)), abstract_params)
    state = _with_shardings(abstract_train_state, shardings)

    batch_sh = jax.sharding.NamedSharding(mesh, ts.batch_spec(mesh, model_cfg.sharding_rules))
    ints = ("input_ids", "targets", "positions", "segment_ids")
    floats = ("loss_weight", "advantages", "old_logp") + (("ref_logp",) if update_cfg.kl_coef else ())
    batch = {k: jax.ShapeDtypeStruct((micro, rows, seq), jnp.int32 if k in ints else jnp.float32, sharding=batch_sh)
             for k in ints + floats}

    step = ts.jit_train_step(graphdef, model_cfg, update_cfg, opt, mesh, shardings)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()

    n_dev = mesh.devices.size
    params_dev, opt_dev = device_bytes(state.params), device_bytes(state.opt_state)
    total_state = total_bytes(state.params) + total_bytes(state.opt_state)
    return {
        "mesh": list(mesh.devices.shape), "rules": model_cfg.sharding_rules, "devices": n_dev,
        "backend": jax.default_backend(), "params": models.param_count(abstract_state),
        "param_dtype": model_cfg.param_dtype, "compute_dtype": model_cfg.dtype, "remat": model_cfg.remat,
        "micro_batches": micro, "rows": rows, "seq": seq, "compile_s": round(compile_s, 1),
        "params_per_device": params_dev, "opt_state_per_device": opt_dev, "batch_per_device": device_bytes(batch),
        "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
        "ideal_state_per_device": total_state // n_dev,
        "state_vs_ideal": round((params_dev + opt_dev) / (total_state / n_dev), 4),
        # Donated state aliases its output, so the peak is arguments + temporaries (+ the small metrics output).
        "peak_per_device": mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
        - mem.alias_size_in_bytes,
    }


def plan_config(cfg, *, micro: int = 1) -> dict:
    """The plan of an experiment config: its model, mesh, update settings and micro-batch shape."""
    from arpo_jax.components import update_config
    from arpo_jax.runtime import runtime_options

    hf_cfg, source = hf_config_for(cfg.model.path)
    model_cfg = models.config_from_hf(hf_cfg, **runtime_options(cfg))
    if cfg.model.lora.rank:
        model_cfg = lora.config_with(model_cfg, cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets)
    mesh_shape = tuple(sharding.make_mesh(tuple(cfg.mesh.shape)).devices.shape)
    rules = sharding.get_rules(model_cfg.sharding_rules)
    rows = math.prod(dict(zip(sharding.MESH_AXES, mesh_shape))[a] for a in rules["batch"])
    seq = cfg.actor.max_token_len_per_device or 2 * (cfg.data.max_prompt_length + cfg.data.max_response_length)
    out = plan(model_cfg, mesh_shape, update_config(cfg), micro=micro, rows=rows, seq=seq)
    return {"model": source, **out}


def format_plan(r: dict) -> str:
    lines = [f"{r['model']}: {r['params'] / 1e9:.2f}B params, mesh {tuple(r['mesh'])} rules={r['rules']}, "
             f"{r['param_dtype']} params + AdamW moments, {r['compute_dtype']} compute, remat={r['remat']}; "
             f"micro-batch {r['rows']} x {r['seq']} tokens; compiled for {r['backend']} in {r['compile_s']} s",
             f"{'per device':48s} {'GiB':>8s}"]
    rows = [("params", r["params_per_device"]), ("optimizer state", r["opt_state_per_device"]),
            ("params + optimizer (ideal = total / devices)", r["ideal_state_per_device"]),
            ("batch", r["batch_per_device"]), ("XLA arguments", r["argument_bytes"]),
            ("XLA temporaries", r["temp_bytes"]),
            ("XLA peak (args + temps + outputs - aliased)", r["peak_per_device"])]
    lines += [f"{name:48s} {b / GB:8.2f}" for name, b in rows]
    if r["backend"] == "cpu":
        lines.append("(temporaries planned by the CPU backend: an upper bound; see arpo_jax/plan.py)")
    return "\n".join(lines)
