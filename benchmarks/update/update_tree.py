"""Tree training vs the flat layout: tokens computed, policy-update and log-prob-forward time, on the same batches.

Two synthetic ARPO workloads (token ids random, the tree shapes as ARPO makes them: initial rollouts of tool rounds,
branches forked at tool-round ends of a random earlier trajectory, so depth grows to 2-3):

  demo        the `arpo-jax demo` shape: 8 prompts x n 4 (2 initial + 2 branches), prompt ~105, response ~130
              tokens in 2-3 tool rounds, rows of 768 tokens (actor.max_token_len_per_device);
  deepsearch  the 8B deep-search config (P 2000, R 10000, n 16 from 8 initial, beam 2) scaled down by --scale
              (default 20: P 100, R 500), 2 prompts, rows of 2 (P + R) tokens as the scripts' token budget.

The model is a random-init decoder with SmolLM2-135M's proportions scaled down (--layers, --hidden, --vocab; the
timing does not depend on the weights). For each workload the flat batch (`packing.pack_batch`) and the tree batch
(`tree_packing`) are built from the same trajectories; each one's log-prob forward and its update step (PPO,
AdamW, one optimizer step over all micro-batches) are compiled, then called alternately, flat then tree,
`--repeats` rounds: median wall and CPU seconds. The tree batch's loss equals the flat one (tests/test_tree.py);
the loss of both is printed as a check.

  python benchmarks/update/update_tree.py [--scale 20] [--repeats 3] [--layers 6] [--hidden 256] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from arpo_jax import models
from arpo_jax.experience import packing
from arpo_jax.experience import tree_packing as tp
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts


def arpo_group(rng, *, prompt: int, response: int, n: int, initial: int, vocab: int):
    """One prompt's n trajectories: `initial` roots of tool rounds (~60% model tokens, ~40% tool results), then
    branches forked at a tool-round end of a random earlier trajectory, continued to about `response` tokens."""
    p = list(rng.integers(3, vocab, prompt))

    def grow(tokens, mask, target):
        while len(tokens) < target:
            gen, tool = int(rng.integers(20, 60) * response / 500 + 4), int(rng.integers(10, 50) * response / 500 + 2)
            tokens = tokens + list(rng.integers(3, vocab, gen + tool))
            mask = mask + [1] * gen + [0] * tool
        return tokens[:target], mask[:target]

    trajs = [grow(p, [0] * prompt, prompt + int(response * rng.uniform(0.7, 1.0))) for _ in range(initial)]
    while len(trajs) < n:
        tokens, mask = trajs[int(rng.integers(len(trajs)))]
        ends = [j + 1 for j in range(prompt, len(tokens) - 1) if mask[j] == 0 and mask[j + 1] == 1] or [len(tokens)]
        cut = ends[int(rng.integers(len(ends)))]
        trajs.append(grow(tokens[:cut], mask[:cut], prompt + int(response * rng.uniform(0.7, 1.0))))
    return [(np.array(t, np.int32), np.array(m, np.float32)) for t, m in trajs]


def workload(name: str, scale: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if name == "demo":
        groups, kw, row = 8, dict(prompt=105, response=130, n=4, initial=2), 768
    else:
        p, r = 2000 // scale, 10000 // scale
        groups, kw, row = 2, dict(prompt=p, response=r, n=16, initial=8), 2 * (p + r)
    seqs, masks, group = [], [], []
    for g in range(groups):
        for s, m in arpo_group(rng, vocab=vocab, **kw):
            seqs.append(s)
            masks.append(m)
            group.append(g)
    return seqs, masks, np.array(group), rng.normal(size=len(seqs)).astype(np.float32), row


def timed(fn, repeats_out: list):
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn())
    repeats_out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def run(name: str, args, model_cfg, graphdef, params) -> dict:
    seqs, masks, group, adv, row = workload(name, args.scale, args.vocab)
    n = len(seqs)
    flat, flat_layout = packing.pack_batch(seqs, masks, adv, mini_batch_size=n, row_len=row, rows_per_micro=1)
    layout = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=n, row_len=row, rows_per_micro=1)
    tree = tp.assemble_tree(layout, masks, adv)
    cfg = ts.UpdateConfig(lr=1e-6)
    opt = ts.make_optimizer(cfg, 10)
    fwd = {"flat": ts.jit_forward_logprobs(graphdef, model_cfg),
           "tree": ts.jit_forward_logprobs(graphdef, model_cfg, tree=True)}
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt)
    batches = {"flat": flat, "tree": tree}
    states, minis, times, loss = {}, {}, {k: {"fwd": [], "upd": []} for k in batches}, {}
    for k, b in batches.items():  # compile (and one warm call) outside the timed rounds
        b["old_logp"] = np.asarray(fwd[k](params, b)[0])
        minis[k] = {x: v[0] for x, v in b.items()}
        states[k] = jit.init_train_state(params, opt)
        states[k], m = step(states[k], minis[k])
        loss[k] = float(m["loss"])
    for _ in range(args.repeats):
        for k in batches:
            timed(lambda k=k: fwd[k](params, batches[k]), times[k]["fwd"])
            states[k], _ = timed(lambda k=k: step(states[k], minis[k]), times[k]["upd"])
    med = {k: {p: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for p, v in t.items()}
           for k, t in times.items()}
    out = {"workload": name, "trajectories": n, "row_len": row,
           "tokens_flat": layout.tokens_flat, "tokens_tree": layout.tokens_computed,
           "token_saving": layout.tokens_flat / layout.tokens_computed,
           "micro_batches_flat": int(flat["input_ids"].shape[1]), "micro_batches_tree": int(tree["input_ids"].shape[1]),
           "loss_flat": loss["flat"], "loss_tree": loss["tree"]}
    for part in ("upd", "fwd"):
        for k in batches:
            out[f"{part}_{k}_wall_s"], out[f"{part}_{k}_cpu_s"] = med[k][part]
        out[f"{part}_speedup_wall"] = med["flat"][part][0] / med["tree"][part][0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workloads", default="demo,deepsearch")
    args = ap.parse_args()
    h = args.hidden
    model_cfg = models.Config(model_type="llama", vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 8 // 3,
                              num_layers=args.layers, num_heads=h // 64, num_kv_heads=max(1, h // 192), head_dim=64,
                              tie_word_embeddings=True)
    graphdef, params = jit.split_model(models.init_model(model_cfg, seed=0))
    results = [run(w, args, model_cfg, graphdef, params) for w in args.workloads.split(",")]
    print(f"model: {args.layers} layers, hidden {h}, vocab {args.vocab}; {jax.device_count()} device(s), "
          f"{jax.default_backend()}; medians of {args.repeats}, wall (cpu) seconds")
    print(f"{'workload':<11}{'tokens flat':>12}{'tree':>8}{'saving':>8}{'update flat':>18}{'tree':>16}{'x':>6}"
          f"{'logp fwd flat':>18}{'tree':>16}{'x':>6}")
    for r in results:
        cell = lambda p, k, r=r: f"{r[f'{p}_{k}_wall_s']:.2f} ({r[f'{p}_{k}_cpu_s']:.2f})"
        print(f"{r['workload']:<11}{r['tokens_flat']:>12}{r['tokens_tree']:>8}{r['token_saving']:>7.2f}x"
              f"{cell('upd', 'flat'):>18}{cell('upd', 'tree'):>16}{r['upd_speedup_wall']:>5.2f}x"
              f"{cell('fwd', 'flat'):>18}{cell('fwd', 'tree'):>16}{r['fwd_speedup_wall']:>5.2f}x")
    print(json.dumps({"benchmark": "update_tree", "model": {"layers": args.layers, "hidden": h, "vocab": args.vocab},
                      "scale": args.scale, "results": results}))


if __name__ == "__main__":
    main()
