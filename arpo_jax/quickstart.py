"""`arpo-jax quickstart`: the foundation end to end on a tiny model, offline, in under a minute on a CPU.

Trains a BPE tokenizer on a small corpus of tool-call-shaped lines, fits a tiny Qwen2-architecture model to it
(plain next-token loss), exports it as an HF folder, converts it to an orbax checkpoint and back, checks that the
round trip is bit-identical (and, when transformers' PyTorch backend is installed, that transformers computes the
same logits), then samples a continuation with the KV cache. The sample should look like the corpus.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file

from arpo_jax.models import CausalLM, Config, KVCache
from arpo_jax.weights import bpe, convert, hf, pretrained


def _log(msg: str) -> None:
    print(f"[quickstart] {msg}", flush=True)


def generate(model: CausalLM, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
             eos_id: int | None) -> list[int]:
    """Prefill once, then decode token by token through the KV cache (one jitted function, cache donated)."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, ids, positions, cache, key):
        logits, cache = nnx.merge(graphdef, state).extend(ids, positions, cache)
        last = logits[:, -1] / max(temperature, 1e-6)
        nxt = jax.random.categorical(key, last) if temperature > 0 else jnp.argmax(last, -1)
        return nxt.astype(jnp.int32), cache

    cache = KVCache.init(model.config, batch=1, max_len=len(prompt_ids) + max_new_tokens)
    key = jax.random.key(seed)
    ids = jnp.asarray([prompt_ids], jnp.int32)
    positions = jnp.arange(len(prompt_ids), dtype=jnp.int32)[None]
    out: list[int] = []
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok, cache = step(state, ids, positions, cache, sub)
        out.append(int(tok[0]))
        if out[-1] == eos_id:
            break
        ids, positions = tok[:, None], jnp.asarray([[len(prompt_ids) + i]], jnp.int32)
    return out


def fit(model: CausalLM, token_rows: np.ndarray, *, steps: int, lr: float = 3e-3, seed: int = 0) -> list[float]:
    """Next-token cross-entropy on random batches of `token_rows` [N, T] (0 = padding); returns the losses."""
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, 20, steps), weight_decay=0.01)
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch[:, :-1], attention_mask=batch[:, :-1] != 0)
            logp = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
            mask = batch[:, 1:] != 0
            return jnp.sum(nll * mask) / jnp.sum(mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        batch = jnp.asarray(token_rows[rng.integers(0, len(token_rows), 16)])
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    nnx.update(model, params)
    return losses


def _transformers_max_diff(hf_dir: Path, model: CausalLM, ids: np.ndarray) -> float | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits.numpy()
    return float(np.abs(np.asarray(model(jnp.asarray(ids))) - theirs).max())


def run(workdir: str | Path, *, seed: int = 0, max_new_tokens: int = 40, fit_steps: int = 300) -> dict:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    times = {}
    t = time.perf_counter()
    corpus = [f"<search> who wrote book {i} </search> <python> print({i} * {i + 7}) </python> answer {i * (i + 7)}"
              for i in range(300)]
    tokenizer = bpe.train_bpe_tokenizer(corpus, vocab_size=600)
    cfg = Config(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,
                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True, rope_theta=10000.0,
                 max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    model = CausalLM(cfg, rngs=nnx.Rngs(seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    _log(f"built a {n_params:,}-parameter Qwen2-style model and a {len(tokenizer)}-token BPE tokenizer")
    rows = [tokenizer.encode(line) + [tokenizer.eos_token_id] for line in corpus]
    width = max(map(len, rows))
    token_rows = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    losses = fit(model, token_rows, steps=fit_steps, seed=seed)
    _log(f"fitted it to the corpus for {fit_steps} steps: loss {losses[0]:.2f} -> {np.mean(losses[-10:]):.2f}")
    hf_dir = hf.save_pretrained(model, workdir / "tiny_hf", tokenizer=tokenizer)
    times["build_and_fit_s"] = time.perf_counter() - t

    t = time.perf_counter()
    shutil.rmtree(workdir / "orbax", ignore_errors=True)  # a rerun starts the conversion afresh
    convert.hf_to_orbax(hf_dir, workdir / "orbax")
    convert.orbax_to_hf(workdir / "orbax", workdir / "export")
    times["convert_s"] = time.perf_counter() - t
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(workdir / "export" / "model.safetensors"))
    identical = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    _log(f"HF -> orbax ({workdir / 'orbax'}) -> HF ({workdir / 'export'}): tensors bit-identical: {identical}")

    reloaded = pretrained.from_pretrained(workdir / "export")
    ids = np.asarray([tokenizer.encode("<search> who wrote book 12 </search>")])
    diff = _transformers_max_diff(workdir / "export", reloaded, ids)
    parity = "skipped (torch not installed)" if diff is None else f"max |logit diff| {diff:.2e}"
    _log(f"transformers parity: {parity}")

    prompt = "<search> who wrote book 123 </search> <python> print("
    t = time.perf_counter()
    new = generate(reloaded, tokenizer.encode(prompt), max_new_tokens=max_new_tokens, temperature=0.0, seed=seed,
                   eos_id=tokenizer.eos_token_id)
    times["sample_s"] = time.perf_counter() - t
    _log(f"greedy continuation through the KV cache: {prompt!r} + {tokenizer.decode(new, skip_special_tokens=True)!r}")
    summary = {"params": int(n_params), "loss_first": round(losses[0], 3), "loss_last": round(losses[-1], 3),
               "round_trip_bit_identical": bool(identical), "transformers_max_abs_diff": diff,
               "sampled_tokens": len(new), **{k: round(v, 3) for k, v in times.items()}, "workdir": str(workdir)}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
