"""Generation throughput of the JAX KV-cache sampler vs transformers `generate`, on the same random model.

Workload (issue 5): batch 32, prompt 256, 256 new tokens, temperature 1, top-10 log-probs of the first 20 positions
(transformers: `output_logits` + log_softmax + top-k over all positions, which is what it offers). EOS is disabled
on both sides so every row generates exactly `--new` tokens. Also: the same 256 tokens generated as 4 rounds of 64
with a 16-token "tool result" appended between rounds, continuing each slot's cache (near 1x the 1-round time
means no re-prefill). Timings exclude the first (compiling / warm-up) call. Prints a table and a final JSON line.

  python benchmarks/rollout_jax.py [--hidden 256 --layers 4 --vocab 4096 --batch 32 --prompt 256 --new 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax
import numpy as np

import arpo_jax
from arpo_jax import testing
from arpo_jax.rollout.jax_sampler import TRACE_COUNTS, JaxSampler
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings


def _time(fn, repeats):
    fn()  # warm-up (compiles)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    import torch

    tmp = tempfile.mkdtemp(prefix="rollout_jax_")
    ref = testing.make_tiny_hf_model(tmp, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                     num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                     intermediate_size=3 * args.hidden,
                                     max_position_embeddings=2 * (args.prompt + args.new))
    tokenizer = testing.make_tiny_tokenizer()
    rng = np.random.RandomState(0)
    prompts = rng.randint(3, min(args.vocab, len(tokenizer)), (args.batch, args.prompt))
    total_new = args.batch * args.new
    settings = SamplingSettings(temperature=1.0, stop=(), logprobs=10, logprob_positions=20, seed=0)

    sampler = JaxSampler(arpo_jax.from_pretrained(tmp), tokenizer, max_len=args.prompt + args.new + 128,
                         eos_ids=[], restrict_to_tokenizer=False)

    def jax_one_round():
        res = sampler.generate([SampleRequest(p.tolist(), args.new) for p in prompts], settings)
        assert all(len(r.token_ids) == args.new for r in res)

    tool = [5] * 16

    runs = iter(range(1 << 30))

    def jax_four_rounds():
        ctx = [p.tolist() for p in prompts]
        base = next(runs) * args.batch  # fresh slot ids: a run does not reuse the previous run's cache
        for rnd in range(4):
            reqs = [SampleRequest(c, args.new // 4, slot_id=base + i) for i, c in enumerate(ctx)]
            res = sampler.generate(reqs, settings)
            ctx = [c + r.token_ids + (tool if rnd < 3 else []) for c, r in zip(ctx, res)]
        return sampler.last_stats

    rows = {}
    t_jax = _time(jax_one_round, args.repeats)
    rows["jax_sampler"] = {"seconds": t_jax, "tokens_per_s": total_new / t_jax}
    t_4 = _time(jax_four_rounds, args.repeats)
    stats = jax_four_rounds()
    compiles = dict(TRACE_COUNTS)
    rows["jax_sampler_4_rounds"] = {"seconds": t_4, "tokens_per_s": total_new / t_4,
                                    "last_round_reused_tokens": stats["reused_tokens"], "jax_compiles": compiles,
                                    "last_round_prefill_tokens": stats["prefill_tokens"]}

    if not args.skip_transformers:
        torch.set_num_threads(os.cpu_count() or 1)
        ids = torch.tensor(prompts)

        def hf_generate():
            with torch.no_grad():
                out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new,
                                   return_dict_in_generate=True, output_logits=True, pad_token_id=0)
                logits = torch.stack(out.logits[:20], 1).float()
                torch.topk(torch.log_softmax(logits, -1), 10, dim=-1)
            assert out.sequences.shape[1] == args.prompt + args.new

        t_hf = _time(hf_generate, args.repeats)
        rows["transformers_generate"] = {"seconds": t_hf, "tokens_per_s": total_new / t_hf}

    print(f"{'engine':<26}{'seconds':>10}{'tokens/s':>12}")
    for name, r in rows.items():
        print(f"{name:<26}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.0f}")
    summary = {
        "benchmark": "rollout_jax", "device": jax.devices()[0].device_kind, "platform": platform.processor(),
        "cpus": os.cpu_count(),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")},
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new,
        **{f"{k}_tokens_per_s": round(v["tokens_per_s"], 1) for k, v in rows.items()},
        "four_rounds_over_one_round_time": round(t_4 / t_jax, 3),
        "last_round_reused_tokens": stats["reused_tokens"], "last_round_prefill_tokens": stats["prefill_tokens"],
        "jax_compiles": compiles,
    }
    if "transformers_generate" in rows:
        summary["jax_over_transformers"] = round(rows["jax_sampler"]["tokens_per_s"]
                                                 / rows["transformers_generate"]["tokens_per_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
