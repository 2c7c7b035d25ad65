"""The JAX sampler with and without a token budget (`rollout.jax.max_tokens_per_call`, issue 31 item 7).

The toy config's model (`builtin:tiny`, 2 layers, D = 128) on this host's CPU: `--batch` requests of `--prompt`
random tokens, `--new` new tokens each (temperature 1, seeded), one call; the same call with budgets of
`--chunks` rows x the engine's cache length, i.e. fewer rows than requests (a finished row takes the next waiting
request). Reports generated tokens/s (best of `--repeats` after a warm-up call that compiles) and checks that every
budget samples the same tokens as the one with a row per request (per-request seeds).

  python benchmarks/engine/sampler_chunks.py [--batch 32 --prompt 64 --new 64 --chunks 16,8,4 --repeats 3]

Prints a table, then a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunks", default="16,8,4", help="rows per chunk (a budget of rows x the cache length each)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from arpo_jax import sharding
    from arpo_jax.assemble import policy as runtime
    from arpo_jax.assemble.components import make_sampler
    from arpo_jax.config import args as args_lib
    from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings

    cfg = args_lib.load_config(["--config=builtin:toy_cpu"])
    mesh = sharding.make_mesh((1, -1, 1))
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, _ = runtime.load_policy(cfg, tmp, mesh)
    rng = np.random.RandomState(0)
    vocab = len(tokenizer)
    reqs = [SampleRequest(rng.randint(3, vocab, args.prompt).tolist(), args.new) for _ in range(args.batch)]
    settings = SamplingSettings(temperature=1.0, seed=7, stop=())

    rows = {}
    ref = None
    s_len = None  # the engine's cache length (from the config's prompt + response lengths)
    for chunk in [0] + [int(c) for c in args.chunks.split(",")]:
        budget = chunk * (s_len or 0)
        run_cfg = args_lib.load_config(["--config=builtin:toy_cpu",
                                        f"--config.rollout.jax.max_tokens_per_call={budget}",
                                        f"--config.rollout.jax.slots={args.batch}"])
        sampler = make_sampler(run_cfg, tokenizer, model=model, mesh=mesh)
        s_len = sampler.shape.cache_len
        t0 = time.perf_counter()
        out = sampler.generate(reqs, settings)
        first = time.perf_counter() - t0
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = sampler.generate(reqs, settings)
            best = min(best, time.perf_counter() - t0)
        tokens = sum(len(r.token_ids) for r in out)
        ids = [r.token_ids for r in out]
        ref = ids if ref is None else ref
        slots = sampler.shape.slots
        rows[chunk or args.batch] = {"budget": budget, "chunks": -(-args.batch // slots), "rows_per_program": slots,
                                     "first_call_s": round(first, 2), "seconds": round(best, 3),
                                     "tokens": tokens, "tokens_per_s": round(tokens / best, 1),
                                     "same_tokens_as_unchunked": ids == ref}
    print(f"{'rows/program':>12} {'budget':>8} {'chunks':>6} {'first s':>8} {'best s':>8} {'tok/s':>8} {'same':>5}")
    for r in rows.values():
        print(f"{r['rows_per_program']:>12} {r['budget']:>8} {r['chunks']:>6} {r['first_call_s']:>8} "
              f"{r['seconds']:>8} {r['tokens_per_s']:>8} {str(r['same_tokens_as_unchunked']):>5}")
    whole = rows[args.batch]["tokens_per_s"]
    print(json.dumps({"benchmark": "sampler_chunks", "machine": platform.processor() or platform.machine(),
                      "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0], "batch": args.batch,
                      "prompt": args.prompt, "new": args.new, "runs": rows,
                      "throughput_vs_unchunked": {k: round(v["tokens_per_s"] / whole, 3) for k, v in rows.items()}}))


if __name__ == "__main__":
    main()
