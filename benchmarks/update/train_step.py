"""Policy-update and forward log-prob throughput: arpo_jax's jitted steps against the same in PyTorch + transformers.

One optimizer step = forward, backward and AdamW over a mini-batch of ``--micro`` micro-batches of ``--batch``
sequences of ``--seq`` tokens (gradient accumulation), PPO-clip token-mean loss, grad clip 1.0, AdamW (wd 0.01),
on ``--model`` (default the real SmolLM2-135M-Instruct, 2 x 4 x 256 tokens; ``--model random`` is the synthetic
~57M Qwen2 of ``--hidden/--layers/--vocab``), same weights on both sides. PyTorch computes the loss the way verl
does (full [B, T, V] logits, log_softmax, gather; the entropy metric under no_grad); arpo_jax uses its chunked
hidden-state path. The forward log-probs (old / reference log-probs of a rollout) are timed the same way, no grad.
Both run on this machine's CPUs with the same thread count (or, on a GPU, both on the GPU; the PyTorch columns are
skipped when torch has no CUDA there).

MFU = model FLOPs per second / this machine's matmul peak measured in the same run (best of a few large
``jnp.dot`` in ``--dtype``). Model FLOPs per token = 3 x forward for the update, 1 x forward for the log-probs
(forward = 2 x matmul params (LM head included) + 4 x layers x seq x heads x head_dim, full attention as PaLM
counts it). Compile seconds = first call (compile + one run) minus a timed run; arpo_jax runs after PyTorch, so
on CPU its first call also carries the switch (~2-3 s, see main()): `benchmarks/update/compile_time.py` times
compiles alone.

  python benchmarks/update/train_step.py [--model smollm2-135m-instruct|PATH|random] [--seq 256 --batch 4 --micro 2]
                                  [--steps 3] [--dtype float32|bfloat16] [--remat none] [--no-scan] [--profile DIR]

The script restarts itself with glibc's huge-page tunable as `arpo-jax train` does (arpo_jax/hugepages.py), which
speeds up arpo_jax and slows PyTorch down on CPU; `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` measures both on glibc's
defaults (benchmarks/RESULTS.md gives both and the cross ratio).

Prints a table, then a final JSON line: tokens/s of both, the ratios (ours / torch; > 1 means faster) and MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch may share the accelerator

import jax
import jax.numpy as jnp
import numpy as np

try:
    import torch
except ImportError:  # the PyTorch columns are skipped
    torch = None

import arpo_jax
from arpo_jax import hugepages, testing
from arpo_jax.experience import packing
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts
from arpo_jax.weights import named_models

DEFAULT_MODEL = "smollm2-135m-instruct"


def matmul_peak_flops(dtype: str = "float32", n: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of an n x n matmul through XLA on this machine's default device (n 2048 on CPU, 8192 else)."""
    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


def machine() -> dict:
    """The device and, on CPU, the CPU's model and its vector-unit flags (the peak depends on them)."""
    info = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
            "malloc_hugetlb": hugepages.active()}
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {**info, "cpu": platform.processor() or platform.machine()}
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {**info, "cpu": model.group(1).strip() if model else platform.machine(),
            "cpu_flags": [f for f in wanted if f in flags]}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_flops_per_token(cfg, seq: int) -> float:
    """3 x forward FLOPs per token (PaLM's 6N + 12 L T N H form with the embedding lookup excluded)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * (nh * h) * 2 + d * (kh * h) * 2 + 3 * d * f  # q, o, k, v, gate, up, down
    matmul_params = cfg.num_layers * per_layer + v * d  # + lm_head
    return 3 * (2 * matmul_params + 4 * cfg.num_layers * seq * nh * h)


def _rollout(args, vocab: int):
    rng = np.random.RandomState(0)
    n = args.micro * args.batch
    seqs = [rng.randint(3, vocab, args.seq) for _ in range(n)]
    masks = [(np.arange(args.seq) >= args.prompt).astype(np.float32) for _ in range(n)]
    return seqs, masks, rng.randn(n).astype(np.float32)


def setup_jax(path: Path, args):
    """Returns (timed update-step closure, its compile + first step seconds, timed forward-log-probs closure, its
    compile + first call seconds)."""
    model = arpo_jax.from_pretrained(path, dtype=args.dtype, remat=args.remat, scan_layers=not args.no_scan,
                                     attention_impl=args.attention or None)
    graphdef, params = jit.split_model(model)
    seqs, masks, adv = _rollout(args, model.config.vocab_size)
    batch, _ = packing.pack_batch(seqs, masks, adv, mini_batch_size=len(seqs), row_len=args.seq,
                                  rows_per_micro=args.batch, pack=False)
    forward = ts.jit_forward_logprobs(graphdef, model.config)
    out = {}

    def fwd():
        out["logp"] = forward(params, batch)[0]
        jax.block_until_ready(out["logp"])

    fwd_first = _timed(fwd)
    batch["old_logp"] = np.asarray(out["logp"])
    mini = {k: jnp.asarray(v[0]) for k, v in batch.items()}  # [M, B, T]
    cfg = ts.UpdateConfig(lr=1e-6)
    opt = ts.make_optimizer(cfg, 100)
    jitted = ts.jit_train_step(graphdef, model.config, cfg, opt)
    holder = [jit.init_train_state(params, opt)]

    def step():
        holder[0], metrics = jitted(holder[0], mini)
        jax.block_until_ready((holder[0], metrics))

    return step, _timed(step), fwd, fwd_first


def _torch_ppo_loss(logp, old_logp, adv, mask, clip=0.2, clip_c=3.0):
    """verl compute_policy_loss (token-mean, dual clip)."""
    ratio = torch.exp(logp - old_logp)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    lc = torch.maximum(l1, l2)
    loss = torch.where(adv < 0, torch.minimum(lc, -adv * clip_c), lc)
    return (loss * mask).sum() / (mask.sum() + 1e-8)


def setup_torch(ref_model, args, device):
    """Returns (timed update-step closure, timed forward-log-probs closure), after a warm-up of each."""
    seqs, masks, adv = _rollout(args, ref_model.config.vocab_size)
    ids = torch.tensor(np.stack(seqs)).view(args.micro, args.batch, args.seq).to(device)
    mask = torch.tensor(np.stack(masks))[:, 1:].reshape(args.micro, args.batch, args.seq - 1).to(device)
    adv_t = torch.tensor(adv).view(args.micro, args.batch, 1).expand(-1, -1, args.seq - 1).to(device)
    model = ref_model.to(device).train()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def logprobs(x):
        logits = model(x).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, -1)
        with torch.no_grad():  # verl logs the entropy every step
            (-(logp_all.exp() * logp_all).sum(-1)).mean()
        return torch.gather(logp_all, -1, x[:, 1:, None])[..., 0]

    def forward():
        with torch.no_grad():
            out = [logprobs(ids[m]) for m in range(args.micro)]
        sync()
        return out

    old = forward()

    def step():
        opt.zero_grad(set_to_none=True)
        n_tok = mask.sum()
        for m in range(args.micro):  # token-mean over the mini-batch, accumulated over micro-batches
            loss = _torch_ppo_loss(logprobs(ids[m]), old[m], adv_t[m], mask[m]) * mask[m].sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()

    step()  # warm-up (allocator, optimizer state)
    return step, forward


def torch_device(args) -> str | None:
    """Where PyTorch runs: beside JAX (the CPU, or CUDA when JAX is on a GPU); None: skip (no CUDA torch there)."""
    if jax.default_backend() == "cpu":
        return "cpu"
    return "cuda" if torch is not None and torch.cuda.is_available() else None


def main() -> None:
    hugepages.reexec_with_hugepages()  # as `arpo-jax train` runs: arpo_jax/hugepages.py
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a named model, an HF folder, or 'random'")
    ap.add_argument("--hidden", type=int, default=512, help="--model random only")
    ap.add_argument("--layers", type=int, default=8, help="--model random only")
    ap.add_argument("--vocab", type=int, default=32000, help="--model random only")
    ap.add_argument("--seq", type=int, default=None, help="default 256 (real model) or 1024 (random)")
    ap.add_argument("--prompt", type=int, default=None, help="leading tokens without loss (default seq / 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 4 or 1)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each, back to back (best is reported)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--remat", default="none")
    ap.add_argument("--no-scan", action="store_true", help="unrolled layers (scan_layers=False)")
    ap.add_argument("--attention", default="", help="model.attention_impl (default blockwise; cudnn on a GPU)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument("--profile", default="", help="a folder: one more arpo_jax update step traced there "
                                                  "(benchmarks/trace_summary.py), its summary printed")
    args = ap.parse_args()
    real = args.model != "random"
    args.seq = args.seq or (256 if real else 1024)
    args.batch = args.batch or (4 if real else 1)
    args.prompt = args.seq // 2 if args.prompt is None else args.prompt
    threads = os.cpu_count() or 1
    device = torch_device(args)
    if torch is not None:
        torch.set_num_threads(threads)  # XLA's CPU client uses every core by default
    tdtype = getattr(torch, args.dtype) if torch is not None else None

    root = Path(tempfile.mkdtemp(prefix="arpo_bench_train_"))
    try:
        if real:
            path = named_models.model_folder(args.model)
            ref = None
            if device is not None:
                import transformers
                ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=tdtype)
        else:
            path = root
            heads = args.hidden // 64
            ref = testing.make_tiny_hf_model(root, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                             num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                                             intermediate_size=args.hidden * 3, max_position_embeddings=args.seq,
                                             scale=0.02)
            if tdtype is not None:
                ref = ref.to(tdtype)
        cfg = arpo_jax.hf.read_config(path)[0]
        n_params = arpo_jax.models.param_count(arpo_jax.models.abstract_model(cfg))
        peak = matmul_peak_flops(args.dtype)
        print(f"[train_step] matmul peak {peak / 1e9:.1f} GFLOP/s", flush=True)
        # Each program's timed calls back to back, best of --steps; PyTorch first, before arpo_jax allocates
        # anything. Not interleaved: on CPU a call right after the other framework's step ran ~35% slower
        # (arpo_jax's update 8.8 s instead of 6.3 s on SmolLM2; PyTorch's ~15%) and recovered on the next call, so
        # interleaving measured the switch, not either side's steady state (benchmarks/RESULTS.md, issue 20).
        # Contention on a shared machine is then not shared evenly: run it quiet.
        t = {}

        def time_calls(calls: dict) -> None:
            for name, fn in calls.items():
                t[name] = [_timed(fn) for _ in range(args.steps)]
                print(f"[train_step] {name} seconds: {[round(x, 2) for x in t[name]]}", flush=True)

        if ref is not None and device is not None and not args.no_torch:
            torch_step, torch_fwd = setup_torch(ref, args, device)
            time_calls({"torch_step": torch_step, "torch_fwd": torch_fwd})
            del torch_step, torch_fwd
        ours_step, step_first, ours_fwd, fwd_first = setup_jax(path, args)
        print(f"[train_step] arpo_jax first forward {fwd_first:.1f} s, first step {step_first:.1f} s", flush=True)
        time_calls({"step": ours_step, "fwd": ours_fwd})
        if args.profile:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, trace_summary.py
            from trace_summary import summarise, traced

            with traced(args.profile):
                ours_step()
            print(f"[train_step] profile: {json.dumps(summarise(args.profile, top=15))}", flush=True)
        best = {k: min(v) for k, v in t.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tokens = args.micro * args.batch * args.seq
    fwd_flops = model_flops_per_token(cfg, args.seq) / 3 * tokens
    flops = {"step": 3 * fwd_flops, "fwd": fwd_flops, "torch_step": 3 * fwd_flops, "torch_fwd": fwd_flops}
    mach = machine()
    print(f"{args.model}: {n_params / 1e6:.1f}M params, {args.micro} x {args.batch} x {args.seq} tokens, {args.dtype}, "
          f"{threads} threads, {mach}; matmul peak {peak / 1e9:.1f} GFLOP/s; scan_layers={not args.no_scan}; "
          f"arpo_jax first update step {step_first:.1f} s, first forward {fwd_first:.1f} s")
    print(f"{'':30s} {'seconds':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU':>6s}")
    names = {"step": "update arpo_jax", "torch_step": "update pytorch+transformers", "fwd": "log-probs arpo_jax",
             "torch_fwd": "log-probs pytorch+transformers"}
    for k, sec in ((k, best[k]) for k in names if k in best):
        print(f"{names[k]:30s} {sec:8.2f} {tokens / sec:9.0f} {flops[k] / sec / 1e9:8.1f} {flops[k] / sec / peak:6.1%}")
    result = {"benchmark": "train_step", "model": args.model, "params_m": round(n_params / 1e6, 1),
              "dtype": args.dtype, "seq": args.seq, "tokens_per_step": tokens, "threads": threads, **mach,
              "peak_gflops": round(peak / 1e9, 1), "scan_layers": not args.no_scan, "remat": args.remat,
              "attention": args.attention or "blockwise",
              "tokens_s": round(tokens / best["step"], 1), "mfu": round(flops["step"] / best["step"] / peak, 3),
              "fwd_tokens_s": round(tokens / best["fwd"], 1),
              "fwd_mfu": round(flops["fwd"] / best["fwd"] / peak, 3),
              "compile_step_s": round(step_first - best["step"], 1), "compile_fwd_s": round(fwd_first - best["fwd"], 1)}
    if "torch_step" in best:
        result.update({
            "torch_device": device, "torch_tokens_s": round(tokens / best["torch_step"], 1),
            "torch_mfu": round(flops["step"] / best["torch_step"] / peak, 3),
            "torch_fwd_tokens_s": round(tokens / best["torch_fwd"], 1),
            "torch_fwd_mfu": round(flops["fwd"] / best["torch_fwd"] / peak, 3),
            "ratio": round(best["torch_step"] / best["step"], 2),
            "fwd_ratio": round(best["torch_fwd"] / best["fwd"], 2)})
    else:
        why = ("--no-torch" if args.no_torch else "torch is not installed" if torch is None
               else "no CUDA build of torch here")
        result["torch"] = f"skipped: {why}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
