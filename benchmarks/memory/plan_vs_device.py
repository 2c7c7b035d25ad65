"""`arpo-jax plan` held against a real accelerator: predicted vs measured memory of the update step, and the
training attention kernels (blockwise, cuDNN, XLA) at a long packed row.

Part 1 (`memory`): one optimizer step of a published model at reduced depth (default Qwen2.5-7B with 4 of its 28
layers: every per-layer shape real, 2.0B params) on ONE device, rows x seq tokens per micro-batch, float32 params,
bfloat16 compute, remat full. Three figures of the same step's peak, per device:
  - `model`: the itemised memory model `arpo-jax plan` uses for a GPU/TPU (`memory_model.update_items`);
  - `compiled`: this backend's compiled program (`memory_analysis`: arguments + temporaries + outputs - aliased);
  - `measured`: the allocator's `peak_bytes_in_use` running the step on random weights (state and batch resident
    before it; nothing else alive). Ratios measured / model and measured / compiled.

Part 2 (`attention`): one layer's self-attention (the model's heads, head_dim, GQA) on a [1, T] row packed with 3
segments, forward + backward, bfloat16: each kernel's max |error| against a float32 XLA reference over the tokens of
the segments (`grad_err`: the cotangent zero at padding queries, as the loss gives; `grad_err_padding_cotangent`:
non-zero there too, every position compared), seconds per fwd+bwd (median of 5) and the allocator's peak. "cudnn"
is `attention_impl=cudnn` as the model runs it (the [T, T] boolean mask passed to cuDNN), "cudnn_causal" the flash
kernel's best case (one segment, `is_causal`, no mask), "xla" the full-scores path. Results on an H100:
benchmarks/RESULTS.md, "On an H100".

  python benchmarks/memory/plan_vs_device.py [--model Qwen2.5-7B-Instruct --layers 4 --rows 1 --seq 11264 --micro 2]
                                      [--parts memory,attention] [--attn-seq 8192]

Prints a table per part and a final JSON line. On CPU the measured peak is not available (no allocator stats).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arpo_jax import models, sharding
from arpo_jax.models import transformer
from arpo_jax.models.attention import blockwise_causal_attention
from arpo_jax.models.published import REAL_CONFIGS
from arpo_jax.models.transformer import attention_mask_4d, blockwise_blocks, default_positions
from arpo_jax.plan import memory_model as mm
from arpo_jax.plan.plan import _memory  # the compiled-figure arithmetic `arpo-jax plan` uses
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts

GB = 1024**3


def _stats() -> dict:
    return jax.devices()[0].memory_stats() or {}


def _segments(rows: int, seq: int, n_seg: int = 3) -> np.ndarray:
    """[rows, seq] segment ids: `n_seg` packed trajectories of unequal length, then a little padding (0)."""
    cuts = np.linspace(0, seq - seq // 32, n_seg + 1).astype(int)
    seg = np.zeros((rows, seq), np.int32)
    for i in range(n_seg):
        seg[:, cuts[i]:cuts[i + 1]] = i + 1
    return seg


def _batch(cfg, micro: int, rows: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    seg = _segments(rows, seq)
    pos = np.asarray(default_positions(None, jnp.asarray(seg), seg.shape))
    shape = (micro, rows, seq)
    ids = rng.integers(3, cfg.vocab_size, size=shape).astype(np.int32)
    return {"input_ids": ids, "targets": np.roll(ids, -1, axis=-1), "positions": np.broadcast_to(pos, shape).copy(),
            "segment_ids": np.broadcast_to(seg, shape).copy(),
            "loss_weight": np.broadcast_to((seg > 0).astype(np.float32), shape).copy(),
            "advantages": rng.normal(size=shape).astype(np.float32),
            "old_logp": np.full(shape, -3.0, np.float32)}


def memory(args) -> dict:
    hf = dict(REAL_CONFIGS[args.model], num_hidden_layers=args.layers,
              **({"vocab_size": args.vocab} if args.vocab else {}))
    cfg = models.config_from_hf(hf, dtype="bfloat16", param_dtype="float32", remat=args.remat,
                                sharding_rules="fsdp", attention_impl=args.attention or None)
    mesh_shape = (1, 1, 1)
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices()[:1])
    update_cfg = ts.UpdateConfig()
    sh = mm.Shapes(command="train", rows=args.rows, seq=args.seq, micro_batches=args.micro,
                   logprob_chunk=update_cfg.logprob_chunk, engine="vllm", gpu_memory_utilization=0.0, critic=False,
                   ref_on_device=False, processes=1, sampler_batch=0, sampler_len=0, prefill_chunk=0)
    backend = jax.default_backend()
    target = "gpu" if backend == "cpu" else backend
    impl = transformer.resolve_attention(cfg.attention_impl, backend, cfg.dtype)
    items = mm.update_items(cfg, mm.param_sizes(cfg, mesh_shape), sh, target, impl)

    model = models.init_model(cfg, seed=0, mesh=mesh)
    graphdef, params = jit.split_model(model)
    del model
    opt = ts.make_optimizer(update_cfg, 100)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shardings = jit.state_shardings(opt, jit.param_shardings(cfg, mesh), abstract, mesh)
    state = jit.init_train_state(params, opt, shardings)
    del params
    batch_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec(mesh, cfg.sharding_rules))
    batch = {k: jax.device_put(v, batch_sh) for k, v in _batch(cfg, args.micro, args.rows, args.seq).items()}
    step = ts.jit_train_step(graphdef, cfg, update_cfg, opt, mesh, shardings)
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    resident = _stats().get("bytes_in_use", 0)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    st = _stats()
    out = {"model": args.model, "layers": args.layers, "params": models.param_count(nnx.state(
        models.abstract_model(cfg), nnx.Param)), "rows": args.rows, "seq": args.seq, "micro": args.micro,
        "remat": cfg.remat, "attention": impl, "backend": backend,
        "device": str(jax.devices()[0].device_kind), "compile_s": round(compile_s, 1),
        "step_s": [round(x, 3) for x in times], "loss": float(metrics["loss"]),
        "model_gib": round(sum(items.values()) / GB, 3), "items_gib": {k: round(v / GB, 3) for k, v in items.items()},
        "compiled_gib": round(_memory(compiled)["peak_per_device"] / GB, 3),
        "resident_before_gib": round(resident / GB, 3)}
    if "peak_bytes_in_use" in st:
        out["measured_gib"] = round(st["peak_bytes_in_use"] / GB, 3)
        out["measured_vs_model"] = round(out["measured_gib"] / out["model_gib"], 3)
        out["measured_vs_compiled"] = round(out["measured_gib"] / out["compiled_gib"], 3)
        out["bytes_limit_gib"] = round(st.get("bytes_limit", 0) / GB, 2)
    return out


def _attention_fns(cfg, seq: int):
    scale = cfg.head_dim ** -0.5
    seg = jnp.asarray(_segments(1, seq))
    mask = attention_mask_4d(None, seg, seg.shape)  # [1, 1, T, T] bool: causal, packed, padding
    blocks = blockwise_blocks(seq)
    return {
        "blockwise": lambda q, k, v: blockwise_causal_attention(q, k, v, mask, scale=scale, **blocks),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale,
                                                              implementation="cudnn"),
        "cudnn_causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                     implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla"),
    }, mask


def attention(args) -> dict:
    cfg = models.config_from_hf(dict(REAL_CONFIGS[args.model], num_hidden_layers=1))
    t, n, kv, h = args.attn_seq, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, t, n, h), jnp.float32)
    k = jax.random.normal(keys[1], (1, t, kv, h), jnp.float32)
    v = jax.random.normal(keys[2], (1, t, kv, h), jnp.float32)
    fns, mask = _attention_fns(cfg, t)
    # The cotangent training gives: zero at padding queries (loss weight 0); `d_pad` also non-zero there.
    valid = (jnp.asarray(_segments(1, t)) > 0)[:, :, None, None]
    d_pad = jax.random.normal(keys[3], (1, t, n, h), jnp.float32)
    d_out = jnp.where(valid, d_pad, 0.0)

    def fwd_bwd(fn, dtype):
        def run(q, k, v, d_out):
            out, vjp = jax.vjp(fn, q.astype(dtype), k.astype(dtype), v.astype(dtype))
            return out, vjp(d_out.astype(dtype))
        return jax.jit(run)

    ref_out, ref_grads = fwd_bwd(fns["xla"], jnp.float32)(q, k, v, d_out)
    pad_ref = fwd_bwd(fns["xla"], jnp.float32)(q, k, v, d_pad)[1]
    causal_ref = fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, scale=cfg.head_dim ** -0.5, is_causal=True, implementation="xla"), jnp.float32)
    results = {}
    for name, fn in fns.items():
        if name in args.skip_kernels:
            continue
        try:
            jitted = fwd_bwd(fn, jnp.bfloat16)
            out, grads = jitted(q, k, v, d_out)
            jax.block_until_ready((out, grads))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(jitted(q, k, v, d_out))
                times.append(time.perf_counter() - t0)
            r_out, r_grads = causal_ref(q, k, v, d_out) if name == "cudnn_causal" else (ref_out, ref_grads)
            err = lambda a, b: float(jnp.max(jnp.abs(jnp.where(valid, a.astype(jnp.float32) - b, 0.0))))
            results[name] = {"fwd_bwd_ms": round(1e3 * statistics.median(times), 2),
                             "out_err": err(out, r_out), "grad_err": max(err(a, b) for a, b in zip(grads, r_grads)),
                             "grad_err_padding_cotangent": None if name == "cudnn_causal" else max(
                                 float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                                 for a, b in zip(jitted(q, k, v, d_pad)[1], pad_ref)),
                             "peak_gib_so_far": round(_stats().get("peak_bytes_in_use", 0) / GB, 2)}
        except Exception as e:  # a kernel this backend lacks (cuDNN on CPU) is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"model": args.model, "seq": t, "heads": n, "kv_heads": kv, "head_dim": h, "segments": 3,
            "visible_fraction": round(float(jnp.mean(mask)), 4), "kernels": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen2.5-7B-Instruct", choices=sorted(REAL_CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--seq", type=int, default=11264, help="tokens per row (the 7B reasoning config's 2 (P + R))")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the model's; smaller for a CPU try)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--attention", default="", help="model.attention_impl (default blockwise)")
    ap.add_argument("--attn-seq", type=int, default=8192)
    ap.add_argument("--skip-kernels", default="", help="comma-separated attention kernels not to run")
    ap.add_argument("--parts", default="memory,attention")
    args = ap.parse_args()
    args.skip_kernels = set(filter(None, args.skip_kernels.split(",")))
    out = {"devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__}
    for part in args.parts.split(","):
        try:
            out[part] = {"memory": memory, "attention": attention}[part](args)
        except Exception as e:  # one part failing still reports the others
            out[part] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        print(json.dumps({part: out[part]}, indent=1), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
