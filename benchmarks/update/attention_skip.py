"""Block skipping in the blockwise attention kernel: forward + backward time with and without it.

`models/attention.py`'s kernel either computes every query block against all earlier keys (the unrolled kernel,
`skip_blocks=False`: causality is its only saving) or splits the keys into blocks too and computes only the
(query block, key block) pairs in which some query sees some key (`skip_blocks=True`). Rows of T tokens, one per
call (B = 1, as `GlobalBatch` gives each device), SmolLM2-135M's attention shape (9 query heads, 3 kv heads,
head_dim 64), float32:

  causal   one sequence filling the row (nothing to skip beyond causality: the overhead of the skip kernel);
  packed   sequences of 2 (P + R) / 5 to 2 (P + R) / 3 tokens packed first-fit, then padding (the flat layout's
           rows, `packing.plan_layout`), as a [T, T] mask from segment ids (`attention_mask_4d`);
  tree     one ARPO group (n 16 from 8 initial, `benchmarks/update/update_tree.py`'s shapes: P = T / 12, R = 5 P) as
           prefix trees (`tree_packing`), the first row, as key_end ints (`TreeMask`).

For each case and T (default 2048 and 4096): the unskipped kernel at its defaults (query blocks of
max(128, T / 8)) and the skip kernel at `--blocks`, each jitted as value_and_grad of sum(out * w) w.r.t. q, k, v,
compiled once, then called `--repeats` times alternately: median wall and CPU seconds, the fraction of block pairs the
skip kernel computes, and the largest difference from the unskipped kernel (output and gradients).

  python benchmarks/update/attention_skip.py [--seqs 2048 4096] [--blocks 128 256 512] [--repeats 5]

Final line: JSON with every (case, T) result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from arpo_jax.experience import packing
from arpo_jax.experience import tree_packing as tp
from arpo_jax.models.attention import _pairs_needed, blockwise_causal_attention
from arpo_jax.models.transformer import attention_mask_4d

N, K, H = 9, 3, 64


def case_mask(name: str, t: int, rng) -> dict:
    """The kernel's mask argument for one row of T tokens: {"mask": [1, 1, T, T]} or {"key_end": [1, T]}."""
    if name == "causal":
        return {"mask": jnp.tril(jnp.ones((t, t), bool))[None, None]}
    if name == "packed":
        lengths = rng.integers(2 * t // 5, 2 * t // 3, 6) // 2  # trajectories of a row of 2 (P + R) tokens
        layout = packing.plan_layout(lengths, mini_batch_size=len(lengths), row_len=t, rows_per_micro=1)
        seg = np.zeros(t, np.int32)
        for i, n in enumerate(lengths):
            if layout.mini[i] == 0 and layout.micro[i] == 0:
                seg[layout.start[i]:layout.start[i] + n] = i + 1
        return {"mask": attention_mask_4d(None, jnp.asarray(seg)[None], (1, t))}
    import update_tree  # benchmarks/, beside this file

    p = t // 12
    group = update_tree.arpo_group(rng, prompt=p, response=5 * p, n=16, initial=8, vocab=1000)
    seqs, masks = [s for s, _ in group], [m for _, m in group]
    layout = tp.plan_tree_layout(seqs, [0] * len(seqs), masks, mini_batch_size=len(seqs), row_len=t,
                                 rows_per_micro=1)
    return {"key_end": jnp.asarray(layout.rows["tree_end"][0, 0, :1])}


def pair_fraction(info: dict, t: int, block: int) -> float:
    n = -(-t // block)
    if "mask" in info:
        m = jnp.pad(info["mask"][:, :, None], [(0, 0)] * 3 + [(0, n * block - t)] * 2)
        return float(_pairs_needed(m, n, block, False).sum()) / (n * n)
    key_end = jnp.pad(info["key_end"].astype(jnp.int32), [(0, 0), (0, n * block - t)], constant_values=-1)
    return float(_pairs_needed(key_end, n, block, True).sum()) / (n * n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--cases", nargs="+", default=["causal", "packed", "tree"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = []
    for t in args.seqs:
        ks = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(ks[0], (1, t, N, H))
        k, v = (jax.random.normal(x, (1, t, K, H)) for x in ks[1:3])
        w = jax.random.normal(ks[3], (1, t, N, H))
        for name in args.cases:
            info = case_mask(name, t, np.random.default_rng(t))
            variants = {"unskipped": {}} | {f"skip{b}": {"skip_blocks": True, "block_size": b} for b in args.blocks}
            fns = {}
            for label, kw in variants.items():
                def loss(q, k, v, info, kw=kw, w=w):  # the mask is an argument, as in the model (no constant folding)
                    return jnp.sum(blockwise_causal_attention(q, k, v, scale=H ** -0.5, **info, **kw) * w)
                fns[label] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            outs, times, compile_s = {}, {label: [] for label in fns}, {}
            for label, fn in fns.items():
                t0 = time.perf_counter()
                outs[label] = jax.block_until_ready(fn(q, k, v, info))
                compile_s[label] = time.perf_counter() - t0
            cpu = {label: [] for label in fns}
            for _ in range(args.repeats):
                for label, fn in fns.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    jax.block_until_ready(fn(q, k, v, info))
                    times[label].append(time.perf_counter() - t0)
                    cpu[label].append(time.process_time() - c0)
            base = jax.tree.leaves(outs["unskipped"])
            r = {"case": name, "seq": t, "unskipped_s": statistics.median(times["unskipped"]),
                 "unskipped_cpu_s": statistics.median(cpu["unskipped"])}
            for label in fns:
                if label == "unskipped":
                    continue
                b = variants[label]["block_size"]
                diff = max(float(jnp.max(jnp.abs(x - y)) / (1 + jnp.max(jnp.abs(y))))
                           for x, y in zip(jax.tree.leaves(outs[label]), base))
                r[label] = {"s": statistics.median(times[label]), "cpu_s": statistics.median(cpu[label]),
                            "pairs": round(pair_fraction(info, t, b), 3),
                            "speedup": statistics.median(times["unskipped"]) / statistics.median(times[label]),
                            "cpu_speedup": statistics.median(cpu["unskipped"]) / statistics.median(cpu[label]),
                            "max_rel_diff": diff, "compile_s": round(compile_s[label], 1)}
            results.append(r)
            print(f"T={t} {name:7s} unskipped {r['unskipped_s'] * 1e3:7.1f} ms  "
                  + "  ".join(f"{lb}: {r[lb]['s'] * 1e3:7.1f} ms (x{r[lb]['speedup']:.2f},"
                              f" cpu x{r[lb]['cpu_speedup']:.2f}, pairs {r[lb]['pairs']:.2f},"
                              f" diff {r[lb]['max_rel_diff']:.1e})"
                              for lb in r if lb.startswith("skip")),
                  flush=True)
    print(json.dumps({"backend": jax.default_backend(), "heads": [N, K, H], "results": results}))


if __name__ == "__main__":
    main()
