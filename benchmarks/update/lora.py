"""LoRA against full fine-tuning: the policy update's time and memory on the same model, back to back in one run.

One optimizer step = forward, backward and AdamW over ``--micro`` micro-batches of ``--batch`` sequences of ``--seq``
tokens (PPO-clip, token-mean), on ``--model`` (default the real SmolLM2-135M-Instruct), first with every param
trained (full), then with rank-``--rank`` adapters on all seven projections and the base frozen (LoRA,
``lora_update.freeze_base``). Memory is read from the compiled programs (XLA's own accounting, not a noisy RSS):
the training state (params + optimizer moments) and the step's temporaries (gradient accumulators, activations).
Also timed: the weight-sync export (``hf.save_pretrained``: full weights; LoRA merged) against writing the adapters
alone (``lora_io.save_peft``), with their sizes on disk; and, with vLLM installed, the trainer's real weight sync
(``VllmSampler.update_weights``: export + load into a running engine started with LoRA support) of the merged full
weights (a policy without adapters: the in-place ``reload_weights``) against the adapters alone (a PEFT folder
loaded as a new vLLM ``LoRARequest``), ``--syncs`` times each, alternating, bytes written per sync included.

  python benchmarks/update/lora.py [--model smollm2-135m-instruct|PATH] [--rank 16] [--seq 256 --batch 4 --micro 2]
                            [--no-update] [--no-vllm] [--syncs 3]

Prints a table, then a final JSON line with the ratios (LoRA / full).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np

import arpo_jax
from arpo_jax.experience import packing
from arpo_jax.models import lora, transformer
from arpo_jax.update import accumulate, jit
from arpo_jax.update import lora as lora_update
from arpo_jax.update import train_step as ts
from arpo_jax.weights import hf, lora_io, named_models


def _batch(vocab: int, args) -> dict:
    rng = np.random.RandomState(0)
    n = args.batch * args.micro
    seqs = [rng.randint(3, vocab, args.seq) for _ in range(n)]
    masks = [(np.arange(args.seq) >= 16).astype(np.float32) for _ in seqs]
    batch, _ = packing.pack_batch(seqs, masks, rng.randn(n).astype(np.float32), mini_batch_size=n,
                                  row_len=args.seq, rows_per_micro=args.batch, pack=False)
    batch = {k: v[0] for k, v in batch.items()}
    batch["old_logp"] = np.full(batch["input_ids"].shape, -3.0, np.float32)
    return batch


def _tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(model, args, batch) -> dict:
    """Step time (best of --steps after a warm-up) and memory of one model's update."""
    graphdef, params = jit.split_model(model)
    cfg = ts.UpdateConfig(lr=1e-5)
    opt = lora_update.freeze_base(ts.make_optimizer(cfg, 100), model.config)
    state = jit.init_train_state(params, opt)
    step = ts.jit_train_step(graphdef, model.config, cfg, opt)
    mem = step.lower(state, batch).compile().memory_analysis()
    out = {"params_mb": _tree_bytes(state.params) / 2**20, "opt_state_mb": _tree_bytes(state.opt_state) / 2**20,
           "temp_mb": mem.temp_size_in_bytes / 2**20,
           "trainable_params": sum(x.size for x in jax.tree.leaves(
               lora.partition(state.params, accumulate.trainable_of(opt))[0]))}
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    out["first_call_s"] = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    out["step_s"] = min(times)
    out["total_mb"] = out["params_mb"] + out["opt_state_mb"] + out["temp_mb"]
    return out


def sync(model, tmp: Path) -> dict:
    """Seconds and bytes of the weight-sync export: the full (merged) HF folder vs the adapters alone."""
    res = {}
    writers = {"full": lambda p: hf.save_pretrained(model, p), "adapters": lambda p: lora_io.save_peft(model, p)}
    for name, write in writers.items():
        path = tmp / name
        t0 = time.perf_counter()
        write(path)
        res[f"{name}_s"] = time.perf_counter() - t0
        res[f"{name}_mb"] = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    return res


def vllm_sync(model, folder: Path, args) -> dict:
    """The trainer's weight sync into a running vLLM engine (LoRA enabled), full merged weights vs adapters only:
    the best of `--syncs` of each (export, load, total seconds; bytes written)."""
    from flax import nnx

    from arpo_jax.rollout.vllm_sampler import VllmSampler

    state, cfg = lora.merged_state(model)
    merged = nnx.merge(nnx.split(arpo_jax.models.abstract_model(cfg), nnx.Param)[0], state)  # no adapters: "full"
    out = {}
    t0 = time.perf_counter()
    with VllmSampler(folder, dtype=args.dtype, max_model_len=512, seed=0, lora_rank=args.rank) as sampler:
        out["engine_start_s"] = time.perf_counter() - t0
        assert sampler.info["lora"], sampler.info
        runs = {"full": [], "adapters": []}
        for _ in range(args.syncs):
            for name, m in (("full", merged), ("adapters", model)):
                sampler.update_weights(m)
                assert sampler.last_sync["weights"] == name, sampler.last_sync
                runs[name].append(dict(sampler.last_sync))
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["total_s"])
        out[name] = {"total_s": best["total_s"], "export_s": best["export_s"], "load_s": best["reload_s"],
                     "written_mb": best["written_bytes"] / 2**20}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-update", action="store_true", help="skip the update-step comparison")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM weight-sync comparison")
    ap.add_argument("--syncs", type=int, default=3)
    args = ap.parse_args()

    folder = named_models.model_folder(args.model)
    base = arpo_jax.from_pretrained(folder, dtype=args.dtype, remat="none")
    batch = _batch(base.config.vocab_size, args)
    print(f"[lora] {args.model}: {args.micro} x {args.batch} x {args.seq} tokens, {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} CPUs, rank {args.rank} on {', '.join(transformer.LORA_TARGETS)}", flush=True)
    model = lora.with_adapters(base, args.rank, args.alpha)
    full = low = {}
    if not args.no_update:
        full = measure(base, args, batch)
        print(f"[lora] full: {full}", flush=True)
        low = measure(model, args, batch)
        print(f"[lora] lora: {low}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        sync_res = sync(model, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    engine = {}
    if not args.no_vllm and importlib.util.find_spec("vllm") is not None:
        engine = vllm_sync(model, folder, args)
        print(f"[lora] vllm sync: {engine}", flush=True)

    print(f"\n{'':24s} {'full':>10s} {'LoRA':>10s} {'LoRA/full':>10s}")
    for key in ("trainable_params", "step_s", "first_call_s", "params_mb", "opt_state_mb", "temp_mb", "total_mb"):
        if full:
            print(f"{key:24s} {full[key]:10.3g} {low[key]:10.3g} {low[key] / full[key]:10.3f}")
    for key in ("total_s", "export_s", "load_s", "written_mb"):
        if engine:
            f, a = engine["full"][key], engine["adapters"][key]
            print(f"{'vLLM sync ' + key:24s} {f:10.3g} {a:10.3g} {a / f:10.4f}")
    print(f"{'sync export s':24s} {sync_res['full_s']:10.3g} {sync_res['adapters_s']:10.3g} "
          f"{sync_res['adapters_s'] / sync_res['full_s']:10.3f}")
    print(f"{'sync export MB':24s} {sync_res['full_mb']:10.3g} {sync_res['adapters_mb']:10.3g} "
          f"{sync_res['adapters_mb'] / sync_res['full_mb']:10.4f}")
    result = {"benchmark": "lora", "model": args.model, "rank": args.rank, "tokens": args.micro * args.batch * args.seq,
              "full": {k: round(v, 4) for k, v in full.items()}, "lora": {k: round(v, 4) for k, v in low.items()},
              "sync": {k: round(v, 4) for k, v in sync_res.items()},
              "sync_bytes_ratio": round(sync_res["adapters_mb"] / sync_res["full_mb"], 4)}
    if full:
        result |= {"step_time_ratio": round(low["step_s"] / full["step_s"], 3),
                   "memory_ratio": round(low["total_mb"] / full["total_mb"], 3)}
    if engine:
        result |= {"vllm_sync": json.loads(json.dumps(engine), parse_float=lambda x: round(float(x), 4)),
                   "vllm_sync_time_ratio": round(engine["adapters"]["total_s"] / engine["full"]["total_s"], 4),
                   "vllm_sync_bytes_ratio": round(engine["adapters"]["written_mb"] / engine["full"]["written_mb"], 4)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
