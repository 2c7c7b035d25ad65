"""The demo's policy update shape, timed in CPU seconds: packed micro-batches of 768 tokens on SmolLM2-135M.

`arpo-jax demo` (FULL) trains 32 trajectories of ~105 prompt + ~130 response tokens a step, packed into rows of
`actor.max_token_len_per_device` = 768 tokens (3 sequences a row), one optimizer step (PPO-clip, AdamW), float32,
remat none. This script builds that batch with `packing.pack_batch` and the step as the trainer does
(`components.update_config`, `ts.jit_train_step` on the config's mesh, starting from builtin:toy_cpu), for each
`--variant` (comma-separated config overrides), then calls every variant's step at M = 1 and M = `--micro`
micro-batches in turn, `--repeats` rounds, on one train state: interleaved, so a shared machine's changing load
hits every variant alike. Per variant: median CPU seconds (`time.process_time`, all threads) and wall seconds of a
step; (M-step - 1-step) / (M - 1) is one micro-batch, the rest of the 1-step the optimizer's share.

  python benchmarks/update/update_packed.py [--micro 3] [--repeats 3] [--variant actor.logprob_chunk=128 ...]
                                     [--no-scan] [--hugepages]

A variant's `+trim` hands the freed heap back after each of its steps, inside the timing
(`distributed.trim_host_memory`, what the trainer does after every update), so its next step faults its temporaries in
again. `--hugepages`: large
allocations on transparent huge pages, as `arpo-jax` commands run (`hugepages.reexec_with_hugepages`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np

from arpo_jax import distributed, sharding
from arpo_jax.assemble import components
from arpo_jax.assemble import policy as runtime
from arpo_jax.config import args as args_lib
from arpo_jax.experience import packing
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts
from arpo_jax.weights import named_models, pretrained

PROMPT, RESPONSE, ROW, PER_ROW = 105, 130, 768, 3


def demo_batch(micro: int, vocab: int, seed: int = 0) -> dict:
    """`micro` rows of PER_ROW packed sequences of PROMPT + RESPONSE tokens, loss on the responses, [M, 1, ROW]."""
    rng = np.random.default_rng(seed)
    n = PER_ROW * micro
    seqs = [rng.integers(0, vocab, PROMPT + RESPONSE).astype(np.int32) for _ in range(n)]
    masks = [np.r_[np.zeros(PROMPT), np.ones(RESPONSE)].astype(np.int32) for _ in range(n)]
    batch, _ = packing.pack_batch(seqs, masks, rng.normal(size=n).astype(np.float32), mini_batch_size=n,
                                  row_len=ROW, rows_per_micro=1)
    batch = {k: v[0] for k, v in batch.items()}  # the one worker's [M, B, T]
    assert batch["input_ids"].shape == (micro, 1, ROW), batch["input_ids"].shape
    batch["old_logp"] = (-3.0 + rng.normal(scale=0.1, size=batch["input_ids"].shape)).astype(np.float32)
    return batch


def load_config(model: str, overrides: list[str]):
    return args_lib.load_config(["--config=builtin:toy_cpu", f"--config.model.path={model}",
                                   *(f"--config.{s}" for s in overrides)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--micro", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=None,
                    help="comma-separated config overrides, e.g. actor.logprob_chunk=768 (repeatable)")
    ap.add_argument("--no-scan", action="store_true", help="the layers unrolled (models.Config.scan_layers=False)")
    ap.add_argument("--hugepages", action="store_true", help="re-executes with glibc.malloc.hugetlb=1")
    args = ap.parse_args()
    if args.hugepages:
        from arpo_jax import hugepages

        hugepages.reexec_with_hugepages()
    names = [[s for s in v.split(",") if s] for v in (args.variant or [""])]
    variants = [[s for s in v if s != "+trim"] for v in names]
    trims = ["+trim" in v for v in names]
    base = load_config(args.model, [])
    mesh = components.make_mesh(base)
    model = pretrained.from_pretrained(named_models.model_folder(args.model), mesh=mesh, scan_layers=not args.no_scan,
                               **runtime.runtime_options(base))
    vocab = model.config.vocab_size
    graphdef, params = jit.split_model(model)
    p_sh = jit.param_shardings(model.config, mesh)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    batch_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec(mesh, base.mesh.rules))
    batches = {m: jax.device_put(demo_batch(m, vocab), batch_sh) for m in (1, args.micro)}
    steps, state = [], None
    for overrides in variants:
        ucfg = components.update_config(load_config(args.model, overrides))
        opt = ts.make_optimizer(ucfg, 100)  # the same optax structure for every variant: one state serves all
        state_sh = jit.state_shardings(opt, p_sh, abstract, mesh)
        if state is None:
            state = jit.init_train_state(params, opt, state_sh)
        steps.append(ts.jit_train_step(graphdef, model.config, ucfg, opt, mesh, state_sh))
    del model, params
    times = {(i, m): [] for i in range(len(steps)) for m in batches}
    for r in range(args.repeats + 1):  # round 0 compiles
        for (i, m), runs in times.items():
            c, w = time.process_time(), time.perf_counter()
            state, metrics = steps[i](state, batches[m])
            jax.block_until_ready(metrics)
            if trims[i]:
                distributed.trim_host_memory()
            if r:
                runs.append((time.process_time() - c, time.perf_counter() - w))
    for i in range(len(variants)):
        one, many = (statistics.median(x[0] for x in times[(i, m)]) for m in (1, args.micro))
        micro = (many - one) / (args.micro - 1)
        print(json.dumps({"variant": names[i], "scan_layers": not args.no_scan, "hugepages": args.hugepages,
                          "step_cpu_s": {m: [round(x[0], 2) for x in times[(i, m)]] for m in batches},
                          "step_wall_s": {m: [round(x[1], 2) for x in times[(i, m)]] for m in batches},
                          "micro_cpu_s": round(micro, 3), "optimizer_cpu_s": round(one - micro, 3),
                          "tokens_per_cpu_s": round(ROW / micro, 1), "load": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
