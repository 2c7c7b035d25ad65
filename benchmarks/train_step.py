"""Policy-update throughput: arpo_jax's jitted train step against the same update in PyTorch + transformers.

One optimizer step = forward, backward and AdamW over a mini-batch of ``--micro`` micro-batches of ``--batch``
sequences of ``--seq`` tokens (gradient accumulation), PPO-clip token-mean loss, grad clip 1.0, AdamW (wd 0.01),
float32, on a random Qwen2 model of ~57M parameters (same weights on both sides). PyTorch computes the loss the
way verl does (full [B, T, V] logits, log_softmax, gather; the entropy metric under no_grad); arpo_jax uses its
chunked hidden-state path. Both run on this machine's CPUs with the same thread count.

MFU = model FLOPs per second / this machine's measured float32 matmul peak (best of a few large ``jnp.dot``).
Model FLOPs per token = 3 x forward (2 x non-embedding params + 4 x layers x seq x heads x head_dim, full
attention as PaLM counts it).

  python benchmarks/train_step.py [--hidden 512 --layers 8 --vocab 32000 --seq 1024 --batch 1 --micro 2 --steps 3]

Prints a table, then a final JSON line: tokens/s of both, the ratio (ours / torch; > 1 means faster) and MFU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import arpo_jax
from arpo_jax import packing, testing
from arpo_jax import train_step as ts

PROMPT = 128  # leading tokens of every sequence without loss


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 FLOP/s of an n x n matmul through XLA on this machine."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = min(_timed(lambda: f(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


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
    masks = [(np.arange(args.seq) >= PROMPT).astype(np.float32) for _ in range(n)]
    return seqs, masks, rng.randn(n).astype(np.float32)


def setup_jax(path: Path, args):
    """Returns (one timed-step closure, compile + first step seconds)."""
    model = arpo_jax.from_pretrained(path, remat=args.remat)
    graphdef, params = ts.split_model(model)
    seqs, masks, adv = _rollout(args, model.config.vocab_size)
    batch, _ = packing.pack_batch(seqs, masks, adv, mini_batch_size=len(seqs), row_len=args.seq,
                                  rows_per_micro=args.batch, pack=False)
    batch["old_logp"] = np.asarray(ts.jit_forward_logprobs(graphdef, model.config)(params, batch)[0])
    mini = {k: jnp.asarray(v[0]) for k, v in batch.items()}  # [M, B, T]
    cfg = ts.UpdateConfig(lr=1e-6)
    opt = ts.make_optimizer(cfg, 100)
    jitted = ts.jit_train_step(graphdef, model.config, cfg, opt)
    holder = [ts.init_train_state(params, opt)]

    def step():
        holder[0], metrics = jitted(holder[0], mini)
        jax.block_until_ready((holder[0], metrics))

    return step, _timed(step)


def _torch_ppo_loss(logp, old_logp, adv, mask, clip=0.2, clip_c=3.0):
    """verl compute_policy_loss (token-mean, dual clip)."""
    ratio = torch.exp(logp - old_logp)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)
    lc = torch.maximum(l1, l2)
    loss = torch.where(adv < 0, torch.minimum(lc, -adv * clip_c), lc)
    return (loss * mask).sum() / (mask.sum() + 1e-8)


def setup_torch(ref_model, args):
    """Returns one timed-step closure (after a warm-up step)."""
    seqs, masks, adv = _rollout(args, ref_model.config.vocab_size)
    ids = torch.tensor(np.stack(seqs)).view(args.micro, args.batch, args.seq)
    mask = torch.tensor(np.stack(masks))[:, 1:].reshape(args.micro, args.batch, args.seq - 1)
    adv_t = torch.tensor(adv).view(args.micro, args.batch, 1).expand(-1, -1, args.seq - 1)
    model = ref_model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def logprobs(x):
        logits = model(x).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits, -1)
        with torch.no_grad():  # verl logs the entropy every step
            (-(logp_all.exp() * logp_all).sum(-1)).mean()
        return torch.gather(logp_all, -1, x[:, 1:, None])[..., 0]

    with torch.no_grad():
        old = [logprobs(ids[m]) for m in range(args.micro)]

    def step():
        opt.zero_grad(set_to_none=True)
        n_tok = mask.sum()
        for m in range(args.micro):  # token-mean over the mini-batch, accumulated over micro-batches
            loss = _torch_ppo_loss(logprobs(ids[m]), old[m], adv_t[m], mask[m]) * mask[m].sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    step()  # warm-up (allocator, optimizer state)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each, interleaved (best is reported)")
    ap.add_argument("--remat", default="none")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)  # XLA's CPU client uses every core by default

    root = Path(tempfile.mkdtemp(prefix="arpo_bench_train_"))
    try:
        heads = args.hidden // 64
        ref = testing.make_tiny_hf_model(root, "qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                                         num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                                         intermediate_size=args.hidden * 3, max_position_embeddings=args.seq,
                                         scale=0.02)
        n_params = sum(p.numel() for p in ref.parameters())
        cfg = arpo_jax.hf.read_config(root)[0]
        peak = matmul_peak_flops()
        ours_step, compile_s = setup_jax(root, args)
        torch_step = setup_torch(ref, args)
        # Interleaved and best-of: the CPUs may be shared, and contention then hits both sides alike.
        ours_t, torch_t = [], []
        for _ in range(args.steps):
            ours_t.append(_timed(ours_step))
            torch_t.append(_timed(torch_step))
        ours_s, torch_s = min(ours_t), min(torch_t)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tokens = args.micro * args.batch * args.seq
    flops = model_flops_per_token(cfg, args.seq) * tokens
    rows = {"arpo_jax": ours_s, "pytorch+transformers": torch_s}
    print(f"{n_params / 1e6:.1f}M params, {args.micro} x {args.batch} x {args.seq} tokens per step, float32, "
          f"{threads} threads, {platform.processor() or platform.machine()}; matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"arpo_jax compile + first step {compile_s:.1f} s")
    print(f"{'update step':24s} {'seconds':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU':>6s}")
    for name, s in rows.items():
        print(f"{name:24s} {s:8.2f} {tokens / s:9.0f} {flops / s / 1e9:8.1f} {flops / s / peak:6.1%}")
    result = {"benchmark": "train_step", "params_m": round(n_params / 1e6, 1), "seq": args.seq,
              "tokens_per_step": tokens, "threads": threads, "peak_gflops": round(peak / 1e9, 1),
              "tokens_s": round(tokens / ours_s, 1), "torch_tokens_s": round(tokens / torch_s, 1),
              "ratio": round(torch_s / ours_s, 2), "mfu": round(flops / ours_s / peak, 3),
              "torch_mfu": round(flops / torch_s / peak, 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
