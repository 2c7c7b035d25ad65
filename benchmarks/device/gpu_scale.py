"""The accelerator at real model sizes, in one call (issue 60): the JAX engine alone against its bandwidth bound, the
RL loop's throughput and device-busy share, the update's MFU, LoRA vs full fine-tuning. No weights to bring.

Cases (each in a process of its own, under a timeout; one JSON line each, with `wall_s`, as it ends):

  engine:<shape>   random-init model of that shape (Qwen2.5-0.5B / 1.5B / 7B in bfloat16; `tiny` on CPU), the
                   engine's decode program alone at 64 and 256 rows x 512 and 2048 cached tokens (tiny: 8 / 32 x
                   64 / 256): tokens/s, and the fraction of the bound = rows / ((weight bytes + the rows' live KV
                   bytes) / HBM bandwidth) it reaches. The cache is filled by setting its positions (no prefill: the
                   keys' values do not change the bytes read); the decode program is the engine's own, at the cache
                   length bucket it would pick (`rollout.jax.decode_lengths`), plus the whole-cache program at the
                   shorter context for comparison. Also per program: the matmuls' operand bytes per step and XLA's
                   cost analysis (its step loop counted once).
  loop:<n>         the RL trainer (the demo's ARPO config, the JAX engine, real tools) on a random Qwen2.5-0.5B-shaped
                   model (tiny: the builtin tiny model) with n trajectories a step (n/8 prompts x 8): warm-up, then 3
                   steps, the 2nd under `jax.profiler`, the 3rd timed alone. Generated tokens/s, the step's phases
                   with the device's busy share inside each (from the trace, benchmarks/trace_summary.py
                   `phase_busy`: generation, tools, update, weight sync), compiles per step, host reads per
                   generated token, idle rows per decode step, the update's MFU (XLA's FLOPs of the compiled update
                   over its phase time, and 6 N T).
  lora:<n>         loop:<n> with LoRA (rank 16 on every projection): the parent adds its step time over the full one's.
  demo:full|lora   with --gguf (SmolLM2-135M-Instruct's GGUF): `arpo-jax demo --engine jax --no-vllm` as on the H200
                   (reviews/2026-11-28-h200-demo.md), then `--lora` on the same SFT model; its wall times per phase.

HBM bandwidth and peak FLOPs come from a table of device kinds (H100 SXM 3.35 TB/s and 989 TFLOP/s bf16 dense, H200
4.8 and 989, A100 2.0 and 312), or --hbm-tbps / --peak-tflops; on CPU there is none (fractions are null).

  python benchmarks/device/gpu_scale.py                                 # GPU: every case, within --budget-s (360 s)
  python benchmarks/device/gpu_scale.py --gguf PATH/smollm2.gguf        # + the demo cases (their own 150 s each)
  python benchmarks/device/gpu_scale.py --tiny                          # tiny shapes (the default on CPU)
  python benchmarks/device/gpu_scale.py --cases engine:qwen2.5-7b,loop:256 [--out results.jsonl]

A case that would not fit the remaining budget is skipped (its line says so); one that runs out of time is killed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Qwen2.5 shapes (their config.json fields that matter here).
_QWEN25 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, eos_token_id=2)
SHAPES = {
    "qwen2.5-0.5b": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                         num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(_QWEN25, vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, tie_word_embeddings=False),
}
# (device kind substring, HBM TB/s, bf16 dense TFLOP/s), first match wins.
DEVICE_KINDS = (("H100 PCIe", 2.0, 756.0), ("H100", 3.35, 989.0), ("H200", 4.8, 989.0),
                ("A100-SXM4-40GB", 1.555, 312.0), ("A100", 2.0, 312.0))
# In priority order, with their timeouts (s); the budget skips what no longer fits (then run those with --cases).
FULL_CASES = (("engine:qwen2.5-0.5b", 60), ("loop:32", 75), ("lora:32", 75), ("loop:256", 90),
              ("engine:qwen2.5-7b", 110), ("engine:qwen2.5-1.5b", 80))
TINY_CASES = (("engine:tiny", 240), ("loop:8", 400), ("lora:8", 400), ("loop:16", 400))
DEMO_CASES = (("demo:full", 150), ("demo:lora", 150))


def device_rates(kind: str, hbm_tbps: float | None, peak_tflops: float | None) -> tuple[float | None, float | None]:
    """(HBM bytes/s, peak FLOP/s) of a device kind: the flags, else the table, else None."""
    row = next((r for r in DEVICE_KINDS if r[0] in kind), None)
    bw = hbm_tbps if hbm_tbps is not None else row[1] if row else None
    peak = peak_tflops if peak_tflops is not None else row[2] if row else None
    return (bw * 1e12 if bw else None), (peak * 1e12 if peak else None)


# ----------------------------------------------------------------------------------------------------------------
# Counts from a compiled program


_DEF = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r" dot\(%([^,\s)]+), %([^,\s)]+)\)")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


def dot_operand_bytes(hlo_text: str) -> int:
    """Bytes the matmuls of a compiled program read: the operands of every `dot` in its HLO (a loop's body once,
    as XLA's cost analysis counts it: for the engine's decode program, one decode step). Unlike the cost analysis'
    "bytes accessed", in-place updates (the cache's scatters) are not counted as whole-buffer traffic."""
    sizes = {}
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if m:
            n = 1
            for d in filter(None, m.group(3).split(",")):
                n *= int(d)
            sizes[m.group(1)] = n * _ITEMSIZE.get(m.group(2), 4)
    return sum(sizes.get(a, 0) + sizes.get(b, 0) for a, b in _DOT.findall(hlo_text))


def program_counts(compiled) -> dict:
    ca = compiled.cost_analysis()
    ca = (ca[0] if isinstance(ca, list) else ca) or {}
    return {"dot_operand_bytes_per_step": dot_operand_bytes(compiled.as_text()),
            "xla_bytes_accessed": int(ca.get("bytes accessed", 0)), "xla_flops": int(ca.get("flops", 0))}


# ----------------------------------------------------------------------------------------------------------------
# engine:<shape>


def model_config(shape: str, dtype: str):
    from arpo_jax.models import Config

    return Config(**SHAPES[shape], dtype=dtype, param_dtype=dtype)


def engine_case(shape: str, args) -> dict:
    """The decode program of an engine of g rows (`slots`, every row live, the all-rows program: what the engine runs
    on an accelerator) at each g and context, over the weights of one `JaxSampler` (its own copy, in the decode's
    layout)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from arpo_jax import testing
    from arpo_jax.models import CausalLM
    from arpo_jax.rollout.jax_decode import engine_shape, jitted
    from arpo_jax.rollout.jax_sampler import JaxSampler
    from arpo_jax.rollout.jax_stream import _knobs
    from arpo_jax.rollout.sampler import SamplingSettings

    tiny = shape == "tiny"
    rows_list, contexts, steps = ((8, 32), (64, 256), 8) if tiny else ((64, 256), (512, 2048), 16)
    cfg = model_config(shape, "float32" if tiny else "bfloat16")
    t0 = time.perf_counter()
    graphdef, state = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
    engine = JaxSampler((graphdef, state), testing.make_tiny_tokenizer(), max_len=max(contexts) + steps, slots=1,
                        restrict_to_tokenizer=False)  # for its weights only: its cache is never allocated
    del state  # the engine holds its own copy
    init_s = time.perf_counter() - t0
    weights = sum(x.nbytes for x in jax.tree.leaves(engine._state))
    if not cfg.tie_word_embeddings:  # a step reads the embedding's rows of its tokens only
        weights -= cfg.vocab_size * cfg.hidden_size * jnp.dtype(cfg.dtype).itemsize
    bw, _ = device_rates(jax.devices()[0].device_kind, args.hbm_tbps, args.peak_tflops)
    knobs = _knobs(SamplingSettings(temperature=1.0, seed=0))

    @functools.partial(jax.jit, donate_argnums=(0,))
    def fill(ds, ctx):  # every row holds `ctx` tokens (slots 0 .. ctx - 1) and a hidden state: what a prefill leaves
        s = ds.cache.positions.shape[1]
        pos = jnp.broadcast_to(jnp.where(jnp.arange(s) < ctx, jnp.arange(s), -1), ds.cache.positions.shape)
        h = 0.1 * jax.random.normal(jax.random.key(0), ds.h.shape, ds.h.dtype)
        return ds._replace(cache=ds.cache._replace(positions=pos.astype(jnp.int32),
                                                   lengths=jnp.full_like(ds.cache.lengths, ctx)), h=h)

    out, compile_s, kv_dtype = [], 0.0, None
    for g in rows_list:
        shp = engine_shape(max_len=max(contexts) + steps, slots=g, prefill_chunk=512, decode_chunk=steps,
                           decode_rows="all", decode_lengths=args.decode_lengths, kv_dtype=args.kv_dtype)
        fns = jitted(engine._graphdef, cfg, shp, engine._unrolled)
        ds = fns.init()
        kv_dtype = (ds.cache.k[0] if isinstance(ds.cache.k, tuple) else ds.cache.k).dtype

        # The decode's arguments after (weights, state): every row admitted, with no token limit, EOS or stop.
        def with_ctx(ctx, g=g, shp=shp):
            return (None, np.ones(g, bool), np.zeros(g, bool), np.full(g, 1 << 30, np.int32),
                    np.full(g, ctx, np.int32), np.arange(g, dtype=np.uint32), np.asarray([-1], np.int32),
                    np.full((shp.stop_seqs, shp.stop_len), -1, np.int32), np.zeros(shp.stop_seqs, bool), None, knobs)

        # At each context the length the engine would pick, and at the shorter one the whole cache too.
        plan = [(ctx, next(n for n in shp.lengths if n >= ctx + steps)) for ctx in contexts]
        plan += [(min(contexts), shp.cache_len)] if plan[0][1] != shp.cache_len else []
        t0 = time.perf_counter()
        lengths = sorted({n for _, n in plan})
        with concurrent.futures.ThreadPoolExecutor(min(len(lengths), os.cpu_count() or 1)) as pool:
            lowered = [fns.decode[n].lower(engine._state, ds, *with_ctx(contexts[0])) for n in lengths]
            compiled = dict(zip(lengths, pool.map(lambda low: low.compile(), lowered)))
        compile_s += time.perf_counter() - t0
        for ctx, length in plan:
            exe, call = compiled[length], with_ctx(ctx)
            ds, outs = exe(engine._state, fill(ds, ctx), *call)
            jax.block_until_ready(outs)
            calls, t0 = 3 if tiny else 5, time.perf_counter()
            for _ in range(calls):
                ds, outs = exe(engine._state, fill(ds, ctx), *call)
            jax.block_until_ready(outs)
            tokens_s = g * steps * calls / (time.perf_counter() - t0)
            kv = g * (ctx + steps / 2) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
            bound = g * bw / (weights + kv) if bw else None
            out.append({"rows": g, "context": ctx, "cache_len": length, "tokens_per_s": round(tokens_s, 1),
                        "bound_tokens_per_s": round(bound, 1) if bound else None,
                        "fraction_of_bound": round(tokens_s / bound, 4) if bound else None,
                        "weight_bytes": weights, "live_kv_bytes": int(kv), **program_counts(exe)})
        del ds, compiled, lowered  # the next row count's cache in its place
    return {"shape": shape, "dtype": cfg.dtype, "kv_dtype": str(kv_dtype), "decode_steps": steps,
            "lengths": list(shp.lengths), "init_s": round(init_s, 1), "compile_s": round(compile_s, 1),
            "hbm_bytes_per_s": bw, "programs": out}


# ----------------------------------------------------------------------------------------------------------------
# loop:<n>, lora:<n>


def random_model_folder(dest: Path, shape: str) -> Path:
    """An HF folder of a random model of `shape` with the builtin tiny model's BPE tokenizer (the toy tasks'), whose
    ids the engine samples from."""
    from flax import nnx

    from arpo_jax.data import toy
    from arpo_jax.models import CausalLM
    from arpo_jax.weights import bpe, hf

    tokenizer = bpe.train_bpe_tokenizer(toy.tokenizer_corpus(), vocab_size=1024)
    fields = dict(SHAPES[shape], eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg = model_config(shape, "float32").replace(**{k: fields[k] for k in ("eos_token_id", "pad_token_id")})
    return hf.save_pretrained(CausalLM(cfg, rngs=nnx.Rngs(0)), dest, tokenizer=tokenizer)


def loop_config(folder: Path, workdir: Path, trajectories: int, *, tiny: bool, lora: bool):
    from arpo_jax import demo

    prompts = max(1, trajectories // 8 if not tiny else trajectories // 4)
    size = dataclasses.replace(demo.FULL, rl_prompts=prompts, rl_n=trajectories // prompts, rl_steps=4,
                               train_prompts=8 * prompts, response_length=32 if tiny else 256)
    cfg = demo.demo_config(str(folder), size, "arpo", 0, "jax")
    data = demo.write_data(workdir / "data", size, 0, max_results=cfg.tools.search.max_results,
                           result_length=cfg.tools.search.result_length)
    with cfg.unlocked():
        cfg.data.train_files, cfg.data.val_files = (data["train"],), ()
        cfg.data.max_prompt_length = 256  # the toy tokenizer spends ~150 tokens on a demo prompt (SmolLM2's ~105)
        cfg.model.dtype = "float32" if tiny else "bfloat16"
        cfg.model.remat = "none" if tiny else "dots_no_batch"
        cfg.trainer.val_before_train, cfg.trainer.test_freq, cfg.trainer.save_freq = False, 0, 0
        cfg.trainer.export_hf, cfg.trainer.log_trajectories, cfg.trainer.progress = False, 0, False
        cfg.trainer.loggers = ("jsonl",)
        if lora:
            cfg.model.lora.rank, cfg.model.lora.alpha, cfg.actor.lr = 16, 32.0, 2e-4
    return cfg


def loop_case(trajectories: int, args, *, lora: bool) -> dict:
    import jax

    from arpo_jax.assemble import policy
    from arpo_jax.train import trainer as trainer_lib
    from arpo_jax.train import warmup
    from benchmarks import trace_summary

    tiny = args.tiny
    work = Path(args.workdir) / f"{'lora' if lora else 'loop'}_{trajectories}"
    t0 = time.perf_counter()
    folder = (policy.build_tiny_model(work / "model") if tiny else
              random_model_folder(work / "model", "qwen2.5-0.5b"))
    tr = trainer_lib.Trainer(loop_config(folder, work, trajectories, tiny=tiny, lora=lora), work / "run")
    setup_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        watch = warmup.warm_up(tr)
        warmup_s = time.perf_counter() - t0
        watch.take()
        steps, trace_dir = [], work / "trace"
        for k in range(3):  # the 2nd step under the profiler (the 1st may still compile an eager op or two)
            with trace_summary.traced(trace_dir) if k == 1 else contextlib.nullcontext():
                m = tr.train_step()
            # The engine's counts of the step's rollout (the tokens it sampled, branches' and discarded ones included;
            # one host read, a device_get, per decode call of at most `rollout.jax.decode_chunk` steps: a call
            # returns when a row finishes).
            tokens, decode_steps = m["rollout/sampled_tokens"], m["rollout/decode_steps"]
            calls = m["rollout/decode_calls"]
            steps.append({"tokens": tokens, "compiles": watch.take().get("perf/compiles", 0),
                          "decode_calls": calls, "decode_steps": decode_steps,
                          "critical_path_steps": m["rollout/critical_path_steps"],
                          "host_reads_per_token": round(calls / max(tokens, 1), 5),
                          "idle_rows_per_decode_step": round((m["rollout/computed_row_steps"] - tokens) /
                                                             max(decode_steps, 1), 2),
                          "sequence_tokens": round(m.get("perf/tokens_per_s", 0.0) * m["time/step"]),
                          **{k2: round(v, 4) for k2, v in m.items() if k2.startswith("time/")}})
        phases = trace_summary.phase_busy(trace_dir)
        flops = None
        if not lora:  # the update lowered again (~seconds) and compiled (a cache hit): XLA's FLOPs of one call
            flops = warmup.update_programs(tr)["policy_update"].compile().cost_analysis()
            flops = ((flops[0] if isinstance(flops, list) else flops) or {}).get("flops")
        params = sum(x.size for x in jax.tree.leaves(tr.state.params))
        a, d = tr.cfg.actor, tr.cfg.data
        flops = flops and flops * a.ppo_epochs * (d.train_batch_size // a.ppo_mini_batch_size)  # calls a step
    finally:
        tr.close()
    _, peak = device_rates(jax.devices()[0].device_kind, args.hbm_tbps, args.peak_tflops)
    s = steps[2]  # throughput from the 3rd step (the profiler slows the 2nd, whose trace gives the busy shares)
    gen_s = s.get("time/rollout_generate_s") or s["time/rollout"]
    upd = s.get("time/update", 0.0)
    split = {name: phases.get(key) for name, key in (("generation", "rollout/generate"), ("tools", "rollout/tools"),
                                                      ("update", "phase/update"), ("old_logprob", "phase/old_logprob"),
                                                      ("sync", "phase/weight_sync"), ("step", "span"))}
    return {"trajectories": trajectories, "lora": lora, "setup_s": round(setup_s, 1), "warmup_s": round(warmup_s, 1),
            "steps": steps, "generated_tokens_per_s": round(s["tokens"] / gen_s, 1) if gen_s else None,
            "step_tokens_per_s": round(s["tokens"] / s["time/step"], 1), "step_s": s["time/step"],
            "device_busy": split, "compiles_after_warmup": [x["compiles"] for x in steps],
            "update_flops_xla": flops,  # of a step's update calls
            "update_mfu_xla": round(flops / upd / peak, 4) if flops and upd and peak else None,
            # 6 N T: N all params (with LoRA the base's weight gradients are not computed: an upper bound)
            "update_mfu_6nt": round(6 * params * s["sequence_tokens"] / upd / peak, 4) if upd and peak else None,
            "params": params}


# ----------------------------------------------------------------------------------------------------------------
# demo:full, demo:lora


def demo_case(kind: str, args) -> dict:
    from arpo_jax import demo

    summary = demo.run_demo(Path(args.workdir) / "demo", model=args.gguf, engine="jax", vllm=False,
                            lora=kind == "lora")
    return {"kind": kind, "demo_wall_s": summary.get("wall_s"), "final_val_accuracy": summary.get("final_val_accuracy"),
            "baseline_val_accuracy": summary.get("baseline_val_accuracy")}


# ----------------------------------------------------------------------------------------------------------------
# The parent: cases in processes of their own, under the budget


def run_case(case: str, args) -> dict:
    kind, _, arg = case.partition(":")
    if kind == "engine":
        return engine_case(arg, args)
    if kind in ("loop", "lora"):
        return loop_case(int(arg), args, lora=kind == "lora")
    if kind == "demo":
        return demo_case(arg, args)
    raise ValueError(f"case {case!r}; allowed: engine:<shape>, loop:<n>, lora:<n>, demo:full|lora")


def cases_for(args, on_cpu: bool) -> list[tuple[str, int]]:
    table = list(TINY_CASES if args.tiny else FULL_CASES) + (list(DEMO_CASES) if args.gguf else [])
    if args.cases:
        wanted = args.cases.split(",")
        known = dict(table) | dict(TINY_CASES) | dict(FULL_CASES) | dict(DEMO_CASES)
        table = [(c, known.get(c, 300)) for c in wanted]
    return table


def child_command(case: str, args) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--workdir", args.workdir,
           "--decode-lengths", args.decode_lengths, "--kv-dtype", args.kv_dtype]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--gguf", args.gguf] if args.gguf else []
    for flag, value in (("--hbm-tbps", args.hbm_tbps), ("--peak-tflops", args.peak_tflops)):
        cmd += [flag, str(value)] if value is not None else []
    return cmd


def parent(args) -> list[dict]:
    # The parent never opens the accelerator (JAX would take 75% of its memory): a child says what it is.
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the 7B engine's weights + KV cache + its window
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_scale_")
    # One persistent compilation cache for the cases: the LoRA loop's engine programs are the full loop's.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(args.workdir) / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend()); "
                            "print(jax.devices()[0].device_kind)"], env=env, capture_output=True, text=True,
                           timeout=120)
    lines = probe.stdout.strip().splitlines()
    backend, kind = lines[-2:] if len(lines) >= 2 else ("?", "?")
    on_cpu = backend == "cpu"
    args.tiny = args.tiny or on_cpu
    t_start, lines = time.perf_counter(), []
    demo_budget = sum(t for c, t in DEMO_CASES) if args.gguf else 0
    for case, timeout in cases_for(args, on_cpu):
        left = args.budget_s + (demo_budget if case.startswith("demo:") else 0) - (time.perf_counter() - t_start)
        line = {"case": case, "device": kind, "tiny": args.tiny}
        if left < min(timeout, 30):
            lines.append(line | {"status": "skipped", "reason": f"{left:.0f} s of the budget left"})
            print(json.dumps(lines[-1]), flush=True)
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(child_command(case, args), env=env, capture_output=True, text=True,
                                  timeout=min(timeout, left), cwd=ROOT)
            result = _last_json(proc.stdout)
            status = "ok" if proc.returncode == 0 and result is not None else "error"
            line |= {"status": status, "wall_s": round(time.perf_counter() - t0, 1), **(result or {})}
            if status == "error":
                line["error"] = (proc.stderr or proc.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            line |= {"status": "timeout", "wall_s": round(time.perf_counter() - t0, 1)}
        lines.append(line)
        print(json.dumps(line), flush=True)
    summary = {"case": "summary", "device": kind, "wall_s": round(time.perf_counter() - t_start, 1),
               "lora_over_full_step": _lora_ratio(lines),
               "statuses": {x["case"]: x["status"] for x in lines}}
    print(json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in [*lines, summary]))
    return [*lines, summary]


def _lora_ratio(lines: list[dict]) -> float | None:
    """The LoRA loop's step time over the full one's, at the same trajectories."""
    by = {x["case"]: x for x in lines if x.get("status") == "ok"}
    for case, x in by.items():
        full = by.get(case.replace("lora:", "loop:"))
        if case.startswith("lora:") and full:
            return round(x["step_s"] / full["step_s"], 3)
    return None


def _last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the default on CPU)")
    ap.add_argument("--gguf", default="", help="SmolLM2-135M-Instruct's GGUF: adds the demo cases")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all of the size)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="the cases' total wall time (the demo's aside)")
    ap.add_argument("--hbm-tbps", type=float, default=None)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--decode-lengths", default="auto", help="rollout.jax.decode_lengths of the engine cases")
    ap.add_argument("--kv-dtype", default="auto", help="rollout.jax.kv_dtype of the engine cases")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="", help="also write the lines to this file")
    ap.add_argument("--case", default="", help=argparse.SUPPRESS)  # a child: run this case, print its JSON
    args = ap.parse_args()
    if args.case:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        print(json.dumps(run_case(args.case, args)), flush=True)
        return
    parent(args)


if __name__ == "__main__":
    main()
