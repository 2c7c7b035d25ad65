"""Compile seconds of the jitted programs on a real model's shapes, layers scanned vs unrolled (nothing runs).

Lowers and compiles, from abstract shapes (no weights are loaded or allocated), what the first RL step compiles:
the update step (``--micro`` x ``--batch`` x ``--seq`` tokens, PPO-clip + AdamW), the forward log-probs, and the
JAX engine's fixed programs (prefill shapes, row copy, decode: ``--sampler-batch`` rows, a cache of ``--prompt``
+ ``--new`` tokens, top-20 log-probs), laid out as `JaxSampler` does on this backend (on CPU its decode runs the
layers unrolled in either mode). Wall and CPU seconds of each (CPU seconds are what a loaded machine
inflates least: XLA compiles on one thread). No persistent compilation cache is used.

  python benchmarks/update/compile_time.py [--model smollm2-135m-instruct|PATH] [--modes scan,unrolled]
      [--dtype float32]

Prints one line per program, then a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from arpo_jax import models  # noqa: E402
from arpo_jax.rollout import jax_decode as jd  # noqa: E402
from arpo_jax.update import jit  # noqa: E402
from arpo_jax.update import train_step as ts  # noqa: E402
from arpo_jax.weights import (
    hf,  # noqa: E402
    named_models,  # noqa: E402
)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _compile(fn, *args, **kw) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn.lower(*args, **kw).compile()
    return round(time.perf_counter() - t, 2), round(time.process_time() - c, 2)


def programs(cfg, args) -> dict[str, tuple[float, float]]:
    graphdef, params = nnx.split(models.abstract_model(cfg), nnx.Param)
    params = _abstract(nnx.to_pure_dict(params))
    m, b, t = args.micro, args.batch, args.seq
    i32 = jax.ShapeDtypeStruct((1, m, b, t), jnp.int32)
    batch = {"input_ids": i32, "targets": i32, "positions": i32, "segment_ids": i32}
    out = {"forward_logprobs": _compile(ts.jit_forward_logprobs(graphdef, cfg), params, batch)}
    ucfg = ts.UpdateConfig(lr=1e-6)
    opt = ts.make_optimizer(ucfg, 100)
    state = jax.eval_shape(lambda p: jit.init_train_state(p, opt), params)
    mini = {**{k: jax.ShapeDtypeStruct((m, b, t), v.dtype) for k, v in batch.items()},
            **{k: jax.ShapeDtypeStruct((m, b, t), jnp.float32) for k in ("loss_weight", "advantages", "old_logp")}}
    out["update_step"] = _compile(ts.jit_train_step(graphdef, cfg, ucfg, opt), state, mini)
    # The sampler: its fixed programs (every prefill shape, the copy, the decode), on the shapes of the workload.
    sgraph, sstate = nnx.split(models.abstract_model(cfg))
    cpu = jd.unrolled_by_default()  # as JaxSampler lays itself out on this backend (layout auto)
    if cpu:
        sgraph, sstate = jd.input_major_graphdef(sgraph, sstate), jax.eval_shape(jd.to_input_major(sgraph), sstate)
    shape = jd.engine_shape(max_len=args.prompt + args.new, slots=args.sampler_batch, prefill_chunk=512,
                            decode_chunk=16)
    fns = jd.jitted(sgraph, cfg, shape, cpu, True)
    programs = jd.engine_programs(fns, shape, _abstract(sstate), jax.eval_shape(fns.init), n_eos=1, vocab=None)
    for name, (fn, fn_args) in programs.items():
        if name != "init":
            out[f"sampler_{name}"] = _compile(fn, *fn_args)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--modes", default="scan,unrolled")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--sampler-batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=150)
    ap.add_argument("--new", type=int, default=100)
    args = ap.parse_args()
    base = hf.read_config(named_models.model_folder(args.model), dtype=args.dtype)[0]
    result = {"benchmark": "compile_time", "model": args.model, "dtype": args.dtype, "layers": base.num_layers,
              "device": jax.devices()[0].device_kind, "cpus": os.cpu_count()}
    for mode in args.modes.split(","):
        cfg = base.replace(scan_layers=mode == "scan")
        res = programs(cfg, args)
        for name, (wall, cpu) in res.items():
            print(f"{mode:9s} {name:18s} {wall:7.1f} s wall {cpu:7.1f} s CPU", flush=True)
        result[mode] = {name: {"wall_s": w, "cpu_s": c} for name, (w, c) in res.items()}
        result[mode]["total_wall_s"] = round(sum(w for w, _ in res.values()), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
