"""The cost of fixed update shapes (issue 54): the same trajectories packed tight (the layout's own sizes: M the rows
it needs, heads U bucketed by T/4, loss entries E by T: what a step compiled before) and in the run's fixed shapes
(M for the worst case, U = T, E = 8T: `global_batch.GlobalBatch`), each one's log-prob forward and policy update
compiled, then called alternately, tight then fixed, `--repeats` rounds: median wall and CPU seconds.

The workload is the FULL demo's step: 4 prompts x n = 8 trajectories (4 initial, 4 branches forked at tool-round
ends), prompt ~105 tokens, response ~150 in tool rounds, rows of 768 tokens on one device (`update_tree.py`'s
generator), on SmolLM2-135M's architecture (random weights: the time does not depend on them). `--duplicates`
makes that share of the branches copies of their parent (after the demo's SFT most of a group is identical).

  python benchmarks/update/update_fixed_shapes.py [--repeats 3] [--layers 30] [--duplicates 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
from update_tree import arpo_group  # benchmarks/ is the script's folder

from arpo_jax import models
from arpo_jax.experience import tree_packing as tp
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts

ROW, P, R, PROMPTS, N = 768, 128, 256, 4, 8  # the FULL demo: rows of 2 (P + R)


def workload(duplicates: float, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs, masks, group = [], [], []
    for g in range(PROMPTS):
        trajs = arpo_group(rng, prompt=105, response=150, n=N, initial=N // 2, vocab=vocab)
        for i, (s, m) in enumerate(trajs):
            if i >= N // 2 and rng.uniform() < duplicates:
                s, m = trajs[int(rng.integers(N // 2))]
            seqs.append(s[:P + R])
            masks.append(m[:P + R])
            group.append(g)
    return seqs, masks, np.array(group), rng.normal(size=len(seqs)).astype(np.float32)


def batches(seqs, masks, group, adv) -> dict:
    layout = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=len(seqs), row_len=ROW, rows_per_micro=1,
                                 max_entries=tp.max_entries_per_row(ROW))
    fixed = layout.with_sizes(tp.max_tree_rows(len(seqs), ROW, P + R), tp.max_heads_per_row(ROW),
                              tp.max_entries_per_row(ROW))
    return {"tight": (tp.assemble_tree(layout, masks, adv), layout),
            "fixed": (tp.assemble_tree(fixed, masks, adv), fixed)}


def timed(fn, out: list):
    t0, c0 = time.perf_counter(), time.process_time()
    res = jax.block_until_ready(fn())
    out.append((time.perf_counter() - t0, time.process_time() - c0))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--duplicates", type=float, default=0.5)
    args = ap.parse_args()
    model_cfg = models.Config(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_layers=args.layers, num_heads=9, num_kv_heads=3, head_dim=64,
                              tie_word_embeddings=True, remat="dots_no_batch")
    graphdef, params = jit.split_model(models.init_model(model_cfg, seed=0))
    seqs, masks, group, adv = workload(args.duplicates, model_cfg.vocab_size)
    built = batches(seqs, masks, group, adv)
    cfg = ts.UpdateConfig(lr=1e-6, logprob_chunk=768)
    opt = ts.make_optimizer(cfg, 10)
    fwd = ts.jit_forward_logprobs(graphdef, model_cfg, chunk=768, tree=True)
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt)
    minis, states, times, loss, compile_s = {}, {}, {k: {"fwd": [], "upd": []} for k in built}, {}, {}
    for k, (b, _) in built.items():  # compile and one call outside the timed rounds
        t0 = time.perf_counter()
        b["old_logp"] = np.asarray(fwd(params, b)[0])
        minis[k] = {x: v[0] for x, v in b.items()}
        states[k] = jit.init_train_state(params, opt)
        states[k], m = step(states[k], minis[k])
        loss[k] = float(m["loss"])
        compile_s[k] = time.perf_counter() - t0
    for _ in range(args.repeats):
        for k, (b, _) in built.items():
            timed(lambda b=b: fwd(params, b), times[k]["fwd"])
            states[k], _ = timed(lambda k=k: step(states[k], minis[k]), times[k]["upd"])
    med = {k: {p: [statistics.median(x[i] for x in v) for i in (0, 1)] for p, v in t.items()} for k, t in times.items()}
    layout = built["tight"][1]
    out = {"layers": args.layers, "duplicates": args.duplicates, "trajectories": len(seqs),
           "tokens_flat": layout.tokens_flat, "tokens_tree": layout.tokens_computed,
           "shapes": {k: {"M": int(b["input_ids"].shape[1]), "U": int(b["head_slot"].shape[-1]),
                          "E": int(b["entry_index"].shape[-1])} for k, (b, _) in built.items()},
           "loss": loss, "first_call_s": compile_s, "median_wall_cpu_s": med,
           "update_fixed_over_tight_cpu": med["fixed"]["upd"][1] / med["tight"]["upd"][1],
           "forward_fixed_over_tight_cpu": med["fixed"]["fwd"][1] / med["tight"]["fwd"][1]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
