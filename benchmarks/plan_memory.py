"""Memory plan of the policy-update step: Qwen2.5-7B on an 8-device FSDP mesh, compiled on fake CPU devices.

The train step is lowered and compiled for abstract inputs (``jax.ShapeDtypeStruct`` with shardings: nothing is
allocated), then XLA's ``memory_analysis`` of the partitioned program gives per-device bytes. Params are float32
master weights with float32 AdamW moments (2 per param), compute in bfloat16 with full remat per layer: the usual
mixed-precision setting (verl keeps fp32 params under FSDP with bf16 autocast). The interim stand-in for
``arpo-jax plan --config`` until the configs issue lands.

  python benchmarks/plan_memory.py [--model Qwen2.5-7B-Instruct --mesh 1,8,1 --micro 2 --rows 8 --seq 4096]

Prints a table and a final JSON line; ``state_vs_ideal`` is (params + optimizer state per device) / (their total /
devices). Params and optimizer state are exact (they follow from the shardings). The temporaries are what XLA's
*CPU* backend plans and overstate a GPU/TPU run: the CPU compiler upcasts bf16 dots to f32 (f32 copies of the
gathered weights), and its memory analysis shows the same temporaries with and without remat (even for a toy
stack of ``jax.checkpoint`` layers), so every layer's attention probabilities count as live at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

_N_DEV = 8
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_N_DEV}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.real_configs holds the published configs
from arpo_jax import models, sharding
from arpo_jax import train_step as ts
from tests.real_configs import REAL_CONFIGS

GB = 1024**3


def _device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, i.e. device 0's)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _total_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def plan(model_name: str, mesh_shape, *, micro: int, rows: int, seq: int, rules: str, remat: str,
         kl: bool) -> dict:
    cfg = models.config_from_hf(REAL_CONFIGS[model_name], dtype="bfloat16", param_dtype="float32", remat=remat,
                                sharding_rules=rules)
    mesh = sharding.make_mesh(mesh_shape)
    graphdef, abstract_state = nnx.split(models.abstract_model(cfg), nnx.Param)
    abstract_params = nnx.to_pure_dict(abstract_state)
    ucfg = ts.UpdateConfig(kl_coef=0.001 if kl else 0.0)
    opt = ts.make_optimizer(ucfg, 1000)
    shardings = ts.state_shardings(opt, ts.param_shardings(cfg, mesh), abstract_params, mesh)
    abstract_train_state = jax.eval_shape(lambda p: ts.TrainState(p, opt.init(p), jnp.zeros((), jnp.int32),
                                                                  jnp.zeros((), jnp.int32)), abstract_params)
    state = _with_shardings(abstract_train_state, shardings)

    batch_sh = jax.sharding.NamedSharding(mesh, ts.batch_spec(mesh, rules))
    ints = ("input_ids", "targets", "positions", "segment_ids")
    floats = ("loss_weight", "advantages", "old_logp") + (("ref_logp",) if kl else ())
    batch = {k: jax.ShapeDtypeStruct((micro, rows, seq), jnp.int32 if k in ints else jnp.float32, sharding=batch_sh)
             for k in ints + floats}

    step = ts.jit_train_step(graphdef, cfg, ucfg, opt, mesh, shardings)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()

    n_dev = mesh.devices.size
    params_dev, opt_dev = _device_bytes(state.params), _device_bytes(state.opt_state)
    total_state = _total_bytes(state.params) + _total_bytes(state.opt_state)
    return {
        "model": model_name, "mesh": list(mesh_shape), "rules": rules, "devices": n_dev,
        "params_b": models.param_count(abstract_state), "param_dtype": "float32", "compute_dtype": "bfloat16",
        "remat": remat, "micro_batches": micro, "rows": rows, "seq": seq, "compile_s": round(compile_s, 1),
        "params_per_device": params_dev, "opt_state_per_device": opt_dev,
        "batch_per_device": _device_bytes(batch),
        "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
        "ideal_state_per_device": total_state // n_dev,
        "state_vs_ideal": round((params_dev + opt_dev) / (total_state / n_dev), 4),
        # Donated state aliases its output, so the peak is arguments + temporaries (+ the small metrics output).
        "peak_per_device": mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
        - mem.alias_size_in_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen2.5-7B-Instruct", choices=sorted(REAL_CONFIGS))
    ap.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor")
    ap.add_argument("--rules", default="fsdp", choices=sorted(sharding.RULES))
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--rows", type=int, default=8, help="rows per micro-batch (whole mesh)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--kl", action="store_true", help="include the KL loss (ref_logp input)")
    args = ap.parse_args()
    mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    r = plan(args.model, mesh_shape, micro=args.micro, rows=args.rows, seq=args.seq, rules=args.rules,
             remat=args.remat, kl=args.kl)

    print(f"{r['model']} ({r['params_b'] / 1e9:.2f}B params), mesh {tuple(r['mesh'])} rules={r['rules']}, "
          f"fp32 params + fp32 AdamW moments, bf16 compute, remat={r['remat']}; micro-batch {r['rows']} x "
          f"{r['seq']} tokens, {r['micro_batches']} per step; compiled in {r['compile_s']} s")
    rows = [("params", r["params_per_device"]), ("optimizer state", r["opt_state_per_device"]),
            ("params + optimizer (ideal = total / devices)", r["ideal_state_per_device"]),
            ("batch", r["batch_per_device"]), ("XLA arguments", r["argument_bytes"]),
            ("XLA temporaries", r["temp_bytes"]), ("XLA peak (args + temps + outputs - aliased)",
                                                  r["peak_per_device"])]
    print("(temporaries: XLA CPU backend, an upper bound; remat has no effect on the CPU plan, see the docstring)")
    print(f"{'per device':48s} {'GiB':>8s}")
    for name, b in rows:
        print(f"{name:48s} {b / GB:8.2f}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
