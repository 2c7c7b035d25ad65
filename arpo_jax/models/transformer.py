"""The decoder-only transformer shared by Qwen2/2.5, Qwen3 and Llama 3.x, in Flax NNX.

These families differ only in switches of one architecture (q/k/v bias, q/k RMSNorm, RoPE scaling, tied
embeddings), so they share this module; `qwen.py` and `llama.py` read their HF configs into `Config`.

Parameter layout follows HuggingFace exactly up to a free reshape (no transposes): a Linear weight is stored as
`[out..., in...]` (e.g. q_proj `[N, H, D]` for HF's `[N*H, D]`) and applied with an einsum. Module attribute
names equal HF's, so an NNX state path is the HF key up to the layer index: the decoder layers are stored stacked,
one array per weight with a leading [L] layer axis (`model.layers.self_attn.q_proj.weight` [L, N, H, D] holds HF's
`model.layers.{i}.self_attn.q_proj.weight` for every i; `hf_keys` / `split_layer_key` map between the two), so
`lax.scan` runs over them without a per-call stacked copy. Import and export are therefore a reshape per tensor
(and a layer index), and every Param carries `axes` (logical sharding names, None for the layer axis: never split)
and `hf_shape` (one layer's HF shape) metadata, declared once here and used by sharding, conversion and
checkpointing.

Shape letters: B batch, T query length, S key length, D hidden, N query heads, K kv heads, H head dim,
F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax.models.attention import blockwise_causal_attention
from arpo_jax.sharding import constrain

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
ATTENTION_IMPLS = (None, "xla", "cudnn", "blockwise")
# Linears that may carry a LoRA adapter (`arpo_jax.models.lora`), by their HF module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 `llama3` RoPE frequency scaling (the only scaling these families use)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class Config:
    """Architecture (from the HF config) plus runtime choices. Frozen and hashable: it is static under jit."""

    model_type: str  # "qwen2", "qwen3" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # Runtime choices, not part of the architecture.
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # storage dtype of params (and of their gradients / optimizer moments)
    remat: str = "none"  # one of REMAT_POLICIES
    # None: per backend (`resolve_attention`): cuDNN flash attention on a GPU in bfloat16/float16, else the blockwise
    # kernel (`attention.blockwise_causal_attention`); "blockwise", "cudnn" (GPU only), "xla"
    # (jax.nn.dot_product_attention's XLA path: full [B, N, T, T] float32 scores) force one. This is the
    # training-time self-attention; the KV-cache path always uses `cached_attention`.
    attention_impl: str | None = None
    sharding_rules: str = "fsdp_tp"  # name of a table in arpo_jax.sharding.RULES
    # Run the layers as one `lax.scan` over their stacked params (compiled once, whatever the depth) instead of a
    # Python loop (one copy of the layer per layer in the program, each reading its slice of the stacked params).
    # The params are stored stacked either way.
    scan_layers: bool = True
    # LoRA adapters (`arpo_jax.models.lora`): rank 0 = none; else float32 A [r, in...] and B [out..., r] on the Linears
    # named in lora_targets, scaled by lora_alpha / lora_rank. Part of the model's structure (its params, shardings
    # and checkpoints), so it lives here and travels with the config.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.lora_rank < 0 or (self.lora_rank and not self.lora_alpha > 0):
            raise ValueError(f"model config lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}: rank must be "
                             ">= 0 (0 = no adapters) and alpha > 0")
        if self.lora_rank and (not self.lora_targets or not set(self.lora_targets) <= set(LORA_TARGETS)):
            raise ValueError(f"model config lora_targets={tuple(self.lora_targets)!r}; allowed: a non-empty subset "
                             f"of {LORA_TARGETS}")
        # One spelling per set (a JSON list, any order -> the canonical tuple): the config is hashed as static.
        object.__setattr__(self, "lora_targets", tuple(t for t in LORA_TARGETS if t in self.lora_targets))
        for field, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES), ("remat", tuple(REMAT_POLICIES)),
                               ("attention_impl", ATTENTION_IMPLS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"model config {field}={getattr(self, field)!r}; allowed: {allowed}")

    def replace(self, **kw) -> Config:
        return dataclasses.replace(self, **kw)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


class KeyStream:
    """The keys `rngs.params()` draws, in the same order, with the stream's count advanced once (`close`) instead of
    once per key: under a trace (`abstract_model`'s eval_shape, a jitted init) each `rngs.params()` call costs time
    linear in the trace so far (nnx writes its count Variable, and the write's check of the tracer's `sharding`
    builds JAX's error message, which walks every equation traced), so a 30-layer model with adapters took seconds
    to build abstractly, over and over in a run's setup."""

    def __init__(self, rngs: nnx.Rngs):
        self._stream = rngs.params
        self._key, self._start = self._stream.key[...], self._stream.count[...]
        self._drawn = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self._key, self._start + self._drawn)
        self._drawn += 1
        return key

    def close(self) -> None:
        """Advances the nnx stream past the keys drawn, so a later `rngs.params()` continues the sequence."""
        self._stream.count[...] = self._start + self._drawn


def _param(rngs: KeyStream, cfg: Config, shape, axes, hf_shape=None, init="normal") -> nnx.Param:
    dtype = jnp.dtype(cfg.param_dtype)
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, dtype)
    else:
        value = (jnp.ones if init == "ones" else jnp.zeros)(shape, dtype)
    return nnx.Param(value, axes=tuple(axes), hf_shape=tuple(hf_shape or shape))


class Linear(nnx.Module):
    """`y = einsum(x, W) (+ b)` with W in HF layout `[out..., in...]`; `spec` is the einsum, e.g. 'btd,nhd->btnh'."""

    def __init__(self, cfg: Config, spec: str, shape, axes, hf_shape, *, bias: bool = False, rngs: KeyStream):
        self.spec = spec
        self.cfg = cfg
        self.weight = _param(rngs, cfg, shape, axes, hf_shape)
        n_out = len(spec.split("->")[1]) - 2  # output dims after b, t
        out_shape, out_axes = tuple(shape[:n_out]), tuple(axes[:n_out])
        self.bias = _param(rngs, cfg, out_shape, out_axes, (math.prod(out_shape),), "zeros") if bias else None
        # Optional LoRA adapter, attached by `attach_lora`: A [r, in...], B [out..., r], y += scale x A B.
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)  # data: a later Param may replace them
        self.lora_scale = 0.0

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        y = self._base(x, out_dtype)
        if self.lora_a is not None:
            y = y + self._lora(x).astype(y.dtype)
        return y

    def _lora(self, x: jax.Array) -> jax.Array:
        """scale * (x A) B in float32 (the adapters, in the compute dtype, over the unmerged base; B = 0 adds 0)."""
        dt = self.cfg.compute_dtype
        (xs, _), out = self.spec.split("->")[0].split(","), self.spec.split("->")[1]
        r = next(c for c in "zyxwvu" if c not in self.spec)
        xa = jnp.einsum(f"{xs},{r}{xs[2:]}->bt{r}", x, self.lora_a[...].astype(dt),
                        preferred_element_type=jnp.float32)  # [B, T, r]
        delta = jnp.einsum(f"bt{r},{out[2:]}{r}->{out}", xa.astype(dt), self.lora_b[...].astype(dt),
                           preferred_element_type=jnp.float32)
        return self.lora_scale * delta

    def _base(self, x: jax.Array, out_dtype=None) -> jax.Array:
        dt = self.cfg.compute_dtype
        spec, w = self.spec, self.weight[...].astype(dt)
        (xs, ws), out = spec.split("->")[0].split(","), spec.split("->")[1]
        if len(xs) > 3 and ws.startswith(xs[2:]):
            # Input-major (`input_major_linears`) with several input dims (o_proj: n, h): one merged contraction
            # dim (free reshapes), else XLA's CPU dot transposes both operands, the weight at every call.
            k = next(c for c in "zyxwvu" if c not in spec)
            x, w = x.reshape(*x.shape[:2], -1), w.reshape(-1, *w.shape[len(xs) - 2:])
            spec = f"bt{k},{k}{ws[len(xs) - 2:]}->{out}"
        y = jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


def _input_major(spec: str) -> tuple[str, tuple[int, ...]]:
    """(the einsum spec of a Linear whose weight is stored inputs first, the weight's permutation to it)."""
    operands, out = spec.split("->")
    x, w = operands.split(",")
    ins = [c for c in w if c in x[2:]]
    order = ins + [c for c in w if c not in ins]
    return f"{x},{''.join(order)}->{out}", tuple(w.index(c) for c in order)


def input_major_linears(model: nnx.Module) -> nnx.Module:
    """Stores every Linear's weight inputs first (`[in..., out...]`, HF's transpose) and rewrites its einsum to
    match: the same products, in the layout XLA's CPU matmul (XNNPACK) reads in place. From the HF layout it
    copies the weight transposed before every matmul, which in a batch-32 decode step cost ~20% of its CPU time
    (benchmarks/RESULTS.md, issue 20). The layers are unstacked first (`unstack_layers`: this copy runs them
    unrolled). The LM head keeps its layout (`unembedding`). For the sampler's own copy only: the HF key == param
    path design, import, export and checkpoints keep the HF layout (`hf_shape` is unchanged). In place; returns the
    model.
    """
    unstack_layers(model)
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and tuple(path) != ("lm_head",):  # `logits` applies the head itself
            spec, perm = _input_major(module.spec)
            if perm == tuple(range(len(perm))):
                continue  # already inputs first
            w = module.weight
            module.weight = nnx.Param(jnp.transpose(w[...], perm), axes=tuple(w.axes[i] for i in perm),
                                      hf_shape=w.hf_shape)
            module.spec = spec
    return model


class RMSNorm(nnx.Module):
    def __init__(self, cfg: Config, dim: int, *, rngs: KeyStream):
        self.eps = cfg.rms_norm_eps
        self.weight = _param(rngs, cfg, (dim,), ("norm",), init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        # As HF: normalise in float32, cast back to the activation dtype, then scale.
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


def rope_inv_freq(cfg: Config) -> jax.Array:
    """Inverse RoPE frequencies `[H/2]` in float32, with Llama 3.1 `llama3` scaling when configured."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    # Same piecewise rule as transformers' _compute_llama3_parameters: keep high frequencies, divide low ones by
    # `factor`, interpolate smoothly in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [B, T, N, H]; positions: [B, T]."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    # HF casts cos/sin to the activation dtype before rotating; do the same for bf16 parity.
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class KVCache(NamedTuple):
    """Per-layer keys/values for the sampler. Slots are written left to right per row.

    `positions[b, s]` is the RoPE position of the token in slot s, or -1 for an empty or padding slot; attention
    masks by it, so rows may hold different lengths, left padding and holes. `lengths[b]` is the next free slot.
    Keys/values are stored heads before slots, so that the decode attention's matmuls read them in place (batch
    dims B, K leading, as XLA's CPU dot wants them) instead of transposing the whole cache every layer and step.
    """

    k: jax.Array  # [L, B, K, S, H] (or a tuple of L [B, K, S, H]: `per_layer`)
    v: jax.Array  # [L, B, K, S, H] (likewise)
    positions: jax.Array  # [B, S] int32
    lengths: jax.Array  # [B] int32

    @classmethod
    def init(cls, cfg: Config, batch: int, max_len: int, dtype=None) -> KVCache:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        dtype = dtype or cfg.compute_dtype
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((batch, max_len), -1, jnp.int32),
                   jnp.zeros((batch,), jnp.int32))

    def per_layer(self) -> KVCache:
        """k, v as tuples of L per-layer arrays [B, K, S, H] (see `CausalLM.extend_hidden`): one copy of the cache
        for a caller that then runs many decode steps; `stacked()` is the way back."""
        n = self.k.shape[0]
        return self._replace(k=tuple(self.k[i] for i in range(n)), v=tuple(self.v[i] for i in range(n)))

    def stacked(self) -> KVCache:
        """The inverse of `per_layer` (a no-op on a stacked cache)."""
        if not isinstance(self.k, tuple):
            return self
        return self._replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    def take_rows(self, rows) -> KVCache:
        """The cache of rows `rows` [B'] (a branch copies its parent's row; finished rows are dropped)."""
        rows = jnp.asarray(rows)
        return KVCache(self.k[:, rows], self.v[:, rows], self.positions[rows], self.lengths[rows])


def _slots(start: jax.Array, t: int) -> jax.Array:
    """[B, T] slot indices of a chunk of T tokens written from per-row offsets start [B]."""
    return start[:, None] + jnp.arange(t)[None]


def _write_positions(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [B, S] <- new [B, T] at slots start[b] ..; slots at or past S are dropped (see `_write_kv`)."""
    return buf.at[jnp.arange(buf.shape[0])[:, None], _slots(start, new.shape[1])].set(new, mode="drop")


def _write_kv(buf: jax.Array, new: jax.Array, start: jax.Array, layer, rows=None) -> jax.Array:
    """Cache buf [L, B, K, S, H] <- new [B', T, K, H] of layer `layer` at slots start[b] ... of rows `rows` [B']
    (None: all B rows; an index past the end is dropped) (`layer` None: buf is one layer's cache [B, K, S, H]).

    One scatter straight into `buf` (in place when the buffer is donated or a loop carry); slots at or past S are
    dropped, so a right-padded chunk may run over the end of a row whose real tokens fit.
    """
    b, t, k = new.shape[:3]
    rows = (jnp.arange(b) if rows is None else rows)[:, None, None]
    heads = jnp.arange(k)[None, :, None]
    idx = (rows, heads, _slots(start, t)[:, None, :])
    return buf.at[idx if layer is None else (layer, *idx)].set(new.transpose(0, 2, 1, 3), mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """Attention of queries q [B, T, N, H] over one layer's cache k, v [B, K, S, H] under mask [B, 1, T, S].

    Exact attention (float32 scores and softmax) in the cache's own layout: grouped-query attention without
    repeating k/v (N = K x G), and no copy of the cache. A query with no visible key gets the uniform average, as
    `jax.nn.dot_product_attention`. The matmuls read the cache in its own dtype (the queries, T tokens, are cast to
    it), so a bfloat16 cache under float32 compute is read as is, not converted copy by copy.
    """
    b, t, n, h = q.shape
    kv = k.shape[1]
    out_dtype, q = q.dtype, q.astype(k.dtype)
    qg = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H] (small: T query tokens)
    s = jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, :, None], s, -1e30)  # [B, 1, 1, T, S] over [B, K, G, T, S]
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksh->bkgth", p, v, preferred_element_type=jnp.float32).astype(out_dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: KeyStream):
        self.cfg = cfg
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg, "btd,nhd->btnh", (n, h, d), ("q_heads", "head_dim", "embed"), (n * h, d),
                             bias=cfg.qkv_bias, rngs=rngs)
        self.k_proj = Linear(cfg, "btd,khd->btkh", (k, h, d), ("kv_heads", "head_dim", "embed"), (k * h, d),
                             bias=cfg.qkv_bias, rngs=rngs)
        self.v_proj = Linear(cfg, "btd,khd->btkh", (k, h, d), ("kv_heads", "head_dim", "embed"), (k * h, d),
                             bias=cfg.qkv_bias, rngs=rngs)
        self.o_proj = Linear(cfg, "btnh,dnh->btd", (d, n, h), ("embed", "q_heads", "head_dim"), (d, n * h),
                             rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, h, rngs=rngs)
            self.k_norm = RMSNorm(cfg, h, rngs=rngs)

    def qkv(self, x: jax.Array, positions: jax.Array):
        cfg = self.cfg
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B,T,N,H], [B,T,K,H], [B,T,K,H]
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = constrain(q, ("batch", "seq", "act_heads", None), cfg.sharding_rules)
        k = constrain(k, ("batch", "seq", "act_kv_heads", None), cfg.sharding_rules)
        return q, k, v

    def attend(self, q, k, v, mask, *, causal_self: bool = False, cached: bool = False):
        """mask: [B, 1, T, S] bool, or a `TreeMask` (training forward only). GQA is native: K kv heads serve N query
        heads. `causal_self`: S == T and the mask is causal (the training forward), where the blockwise kernel may be
        used. `cached`: k, v are one layer of a KVCache ([B, K, S, H]), attended in place by `cached_attention`."""
        scale = self.cfg.head_dim ** -0.5
        impl = resolve_attention(self.cfg.attention_impl, dtype=self.cfg.dtype)
        if cached:
            out = cached_attention(q, k, v, mask, scale=scale)
        elif causal_self and impl == "blockwise":
            out = _blockwise(q, k, v, mask, scale)
        elif causal_self and impl == "cudnn" and self.cfg.attention_impl is None:
            try:  # the GPU default; cuDNN refuses some shapes and versions when the program is traced
                out = _dense_attention(q, k, v, mask, scale, "cudnn")
            except (NotImplementedError, RuntimeError, ValueError) as e:
                _warn_cudnn_fallback(e)
                out = _blockwise(q, k, v, mask, scale)
        else:
            out = _dense_attention(q, k, v, mask, scale, None if impl == "blockwise" else impl)
        return self.o_proj(out)  # [B, T, D]

    def __call__(self, x, positions, mask):
        q, k, v = self.qkv(x, positions)
        return self.attend(q, k, v, mask, causal_self=True)


def resolve_attention(impl: str | None, backend: str | None = None, dtype: str = "bfloat16") -> str:
    """The training self-attention `Attention.attend` runs for `Config.attention_impl` on `backend` (default: JAX's)
    in compute `dtype`. None: "cudnn" on a GPU in bfloat16/float16 (cuDNN's fused kernels take no float32), else
    "blockwise". On an H100 (benchmarks/RESULTS.md, "On an H100") cuDNN ran a 517M model's update step 1.6x faster
    than the blockwise kernel (48.8% vs 30.2% MFU), with gradients equal to a float32 reference within bfloat16
    noise on packed rows; jax's `dot_product_attention(implementation=None)` would take the XLA path for these
    inputs (a boolean mask, packed segments), i.e. [B, N, T, T] float32 scores per layer: 13 GiB per row at
    T = 11k (review B2). The blockwise kernel keeps one block pair's scores at a time."""
    if impl is not None:
        return impl
    gpu_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if (backend or jax.default_backend()) == "gpu" and gpu_dtype else "blockwise"


def _blockwise(q, k, v, mask, scale):
    blocks = blockwise_blocks(q.shape[1])
    if isinstance(mask, TreeMask):  # the rule is evaluated per block inside the kernel
        return blockwise_causal_attention(q, k, v, key_end=mask.key_end, scale=scale, **blocks)
    return blockwise_causal_attention(q, k, v, mask, scale=scale, **blocks)


def _dense_attention(q, k, v, mask, scale, implementation):
    """`jax.nn.dot_product_attention` under a [B, 1, T, S] boolean mask (a `TreeMask` made dense). cuDNN's output
    and gradients at a query that sees no key (padding) are not the XLA path's, and do not matter: the loss gives
    those positions a zero cotangent (benchmarks/memory/plan_vs_device.py checks both cases)."""
    mask = mask.dense() if isinstance(mask, TreeMask) else mask
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)


_CUDNN_FALLBACK_WARNED: list[str] = []


def _warn_cudnn_fallback(error: Exception) -> None:
    """Once per process: the default attention on this GPU is the blockwise kernel, and why."""
    if not _CUDNN_FALLBACK_WARNED:
        _CUDNN_FALLBACK_WARNED.append(str(error))
        warnings.warn(f"cuDNN attention is not available for this model or this GPU ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:200]}); using the blockwise kernel. Set "
                      "model.attention_impl=blockwise to choose it without this message.", RuntimeWarning,
                      stacklevel=3)


def blockwise_blocks(t: int, backend: str | None = None) -> dict:
    """Block arguments of `blockwise_causal_attention` for T = `t`, per backend. Every backend skips the blocks
    no query sees (`skip_blocks`: query x key blocks, loops compiled once whatever T). CPU: 128 x 128 blocks
    (fastest on 2 cores at T = 2048/4096, benchmarks/update/attention_skip.py). GPU/TPU: 512 x 512 blocks, so one block
    pair's float32 scores are N x 512 x 512 per row whatever T (the unskipped kernel's were N x 512 x T)."""
    if (backend or jax.default_backend()) == "cpu":
        return {"block_size": CPU_ATTENTION_BLOCK, "skip_blocks": True}
    return {"block_size": ACCELERATOR_ATTENTION_BLOCK, "skip_blocks": True}


CPU_ATTENTION_BLOCK = 128
ACCELERATOR_ATTENTION_BLOCK = 512


class MLP(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: KeyStream):
        self.cfg = cfg
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(cfg, "btd,fd->btf", (f, d), ("mlp", "embed"), (f, d), rngs=rngs)
        self.up_proj = Linear(cfg, "btd,fd->btf", (f, d), ("mlp", "embed"), (f, d), rngs=rngs)
        self.down_proj = Linear(cfg, "btf,df->btd", (d, f), ("embed", "mlp"), (d, f), rngs=rngs)

    def __call__(self, x):
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)  # [B, T, F]
        h = constrain(h, ("batch", "seq", "act_mlp"), self.cfg.sharding_rules)
        return self.down_proj(h)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: KeyStream):
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg, cfg.hidden_size, rngs=rngs)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg, cfg.hidden_size, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, ("batch", "seq", "act_embed"), self.cfg.sharding_rules)

    def extend(self, x, positions, mask, k_all, v_all, i, start, self_mask=None, rows=None):
        """Cached step of layer i: writes this chunk's k/v at slots `start` [B] of the cache, attends over it.
        `k_all`, `v_all`: every layer's cache [L, B, K, S, H], or (i None) this layer's own [B, K, S, H].
        `self_mask` [B, 1, T, T] (a chunk that starts every row: nothing cached before it): the chunk attends to
        its own keys only, as the training forward does, instead of reading the whole cache. `rows` [B']: the chunk
        extends these rows of the cache (`CausalLM.extend_hidden`)."""
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
        k_all = _write_kv(k_all, k.astype(k_all.dtype), start, i, rows)
        v_all = _write_kv(v_all, v.astype(v_all.dtype), start, i, rows)
        if self_mask is not None:
            x = x + self.self_attn.attend(q, k, v, self_mask, causal_self=True)
        else:
            k_i, v_i = (k_all, v_all) if i is None else (k_all[i], v_all[i])
            if rows is not None:  # this layer's rows only: one layer's [B', K, S, H] at a time
                k_i, v_i = (jnp.take(a, rows, axis=0, mode="fill", fill_value=0) for a in (k_i, v_i))
            x = x + self.self_attn.attend(q, k_i, v_i, mask, cached=True)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_all, v_all


class Embed(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: KeyStream):
        self.weight = _param(rngs, cfg, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))


class Decoder(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: KeyStream):
        self.embed_tokens = Embed(cfg, rngs=rngs)
        # Initialised layer by layer (the same random draws as per-layer storage), stored stacked.
        self.layers = stack_layers([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg, cfg.hidden_size, rngs=rngs)


# Stacked layer storage: `Decoder.layers` is one DecoderLayer whose every Variable has a leading [L] axis.

LAYERS_PATH = ("model", "layers")
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer holding `layers`' Variables stacked on a new leading axis (logical axis None: not split)."""
    graphdef, _ = nnx.split(layers[0])

    def stack(*vs):
        return vs[0].replace(jnp.stack([v[...] for v in vs]), axes=(None, *vs[0].get_metadata()["axes"]))

    return nnx.merge(graphdef, jax.tree.map(stack, *(nnx.state(layer) for layer in layers), is_leaf=_is_var))


def layer_slice(state: nnx.State, i) -> nnx.State:
    """Layer i's Variables of a stacked layers state (index static or traced), with their per-layer metadata."""
    return jax.tree.map(lambda v: v.replace(v[...][i], axes=tuple(v.get_metadata()["axes"][1:])), state,
                        is_leaf=_is_var)


def is_stacked_path(path) -> bool:
    """Whether a state path (tuple of keys) is inside the stacked layers."""
    return tuple(path[:2]) == LAYERS_PATH and (len(path) < 3 or not isinstance(path[2], int))


def hf_keys(path, num_layers: int) -> list[tuple[str, int | None]]:
    """[(HF key, layer index or None)] that the state path `path` holds: one key per layer for a stacked weight
    (`model.layers.q.weight` -> `model.layers.0.q.weight`, ...), else the path itself."""
    key = ".".join(str(p) for p in path)
    if not is_stacked_path(path):
        return [(key, None)]
    rest = ".".join(str(p) for p in path[2:])
    return [(f"model.layers.{i}.{rest}", i) for i in range(num_layers)]


def split_layer_key(key: str) -> tuple[str, int | None]:
    """The inverse of `hf_keys`: (state path as a dotted key, layer index or None) of an HF key."""
    m = _LAYER_KEY.fullmatch(key)
    return (f"model.layers.{m.group(2)}", int(m.group(1))) if m else (key, None)


def unstack_layers(model: CausalLM) -> CausalLM:
    """Stores the layers as a list of L per-layer modules (in place; a no-op if they already are): a copy for a
    program that runs the layers unrolled many times (the JAX sampler on CPU), where XLA's CPU backend would copy
    each layer's slice out of the stacked arrays before every matmul. Returns the model."""
    layers = model.model.layers
    if isinstance(layers, DecoderLayer):
        graphdef, state = nnx.split(layers)
        model.model.layers = nnx.List([nnx.merge(graphdef, layer_slice(state, i))
                                       for i in range(model.config.num_layers)])
    return model


def default_positions(attention_mask: jax.Array | None, segment_ids: jax.Array | None, shape) -> jax.Array:
    """Positions as the reference computes them: cumsum(mask) - 1 clipped at 0; restarting at each segment."""
    b, t = shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is not None:
        starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    if attention_mask is not None:
        return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)
    return idx


class TreeMask(NamedTuple):
    """Attention over prefix trees packed in pre-order (`arpo_jax.experience.tree_packing`): query t sees key s iff
    `s <= t <= key_end[b, s]`, i.e. s is an ancestor of t or t itself (the slot is the pre-order index, key_end the
    last slot of the key's subtree; -1: padding, seen by nobody). One int per token instead of a [T, T] array: the
    blockwise kernel evaluates it per block; `dense` builds the boolean mask inside the jitted function for the
    other attention paths."""

    key_end: jax.Array  # [B, T] int32

    def dense(self) -> jax.Array:
        """[B, 1, T, T] bool."""
        t = self.key_end.shape[1]
        slot = jnp.arange(t, dtype=jnp.int32)
        return ((slot[None, :] <= slot[:, None])[None] & (slot[None, :, None] <= self.key_end[:, None, :]))[:, None]


def attention_mask_4d(attention_mask: jax.Array | None, segment_ids: jax.Array | None, shape) -> jax.Array:
    """[B, 1, T, T] bool: causal, within a segment (segment id 0 = padding), keys not padded."""
    b, t = shape
    mask = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, T]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids != 0)[:, None, :]
    if attention_mask is not None:
        mask = mask & attention_mask.astype(bool)[:, None, :]
    return jnp.broadcast_to(mask, (b, t, t))[:, None]


# LoRA adapters on the Linears (`models/lora.py` has the rest of the adapters and the merge, `update/lora.py` the
# training and the reference, `weights/lora_io.py` the PEFT files).


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: a Param (saved, sharded, restored as one), told apart by its type."""


def lora_scale(cfg: Config) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def lora_letters(linear: Linear) -> tuple[str, str]:
    """(input letters, output letters) of a Linear's weight, in its weight's (HF) order."""
    (xs, ws), out = linear.spec.split("->")[0].split(","), linear.spec.split("->")[1]
    return "".join(c for c in ws if c in xs[2:]), "".join(c for c in ws if c in out[2:])


def lora_linears(model: nnx.Module, cfg: Config):
    """(path, Linear) of every Linear the config puts an adapter on (matched by its HF module name)."""
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in cfg.lora_targets:
            yield path, module


def attach_lora(model: CausalLM, rngs: nnx.Rngs) -> None:
    """Gives each targeted Linear of `model` its adapters (in place): A ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT's
    default (kaiming-uniform with a = sqrt(5)), B = 0. A stacked Linear (the layers') gets stacked adapters
    [L, r, in...] / [L, out..., r], drawn layer by layer as per-layer storage drew them."""
    keys = KeyStream(rngs)
    _attach_lora(model, keys)
    keys.close()


def _attach_lora(model: CausalLM, rngs: KeyStream) -> None:
    cfg = model.config
    r = cfg.lora_rank
    linears = [lin for _, lin in lora_linears(model, cfg)]
    shapes = []
    for lin in linears:
        ins, outs = lora_letters(lin)
        ws, w = lin.spec.split("->")[0].split(",")[1], lin.weight
        lead = w.ndim - len(ws)  # 1 for the stacked layers' Linears
        axes, shape = tuple(w.axes)[lead:], w.shape[lead:]
        in_shape, in_axes = tuple(shape[ws.index(c)] for c in ins), tuple(axes[ws.index(c)] for c in ins)
        out_shape, out_axes = tuple(shape[ws.index(c)] for c in outs), tuple(axes[ws.index(c)] for c in outs)
        shapes.append((w.shape[:lead], in_shape, in_axes, out_shape, out_axes, (None,) * lead))
    n = max((math.prod(s[0]) for s in shapes), default=1)
    draws = [[] for _ in linears]
    for _ in range(n):  # layer-major, then Linear: the order of per-layer storage
        for j, (_, in_shape, *_rest) in enumerate(shapes):
            bound = 1.0 / math.sqrt(math.prod(in_shape))
            draws[j].append(jax.random.uniform(rngs.params(), (r, *in_shape), jnp.float32, -bound, bound))
    for lin, (lead, in_shape, in_axes, out_shape, out_axes, lead_axes), a in zip(linears, shapes, draws):
        a = jnp.stack(a).reshape(*lead, r, *in_shape)
        lin.lora_a = LoRAParam(a, axes=(*lead_axes, None, *in_axes), hf_shape=(r, math.prod(in_shape)))
        lin.lora_b = LoRAParam(jnp.zeros((*lead, *out_shape, r), jnp.float32), axes=(*lead_axes, *out_axes, None),
                               hf_shape=(math.prod(out_shape), r))
        lin.lora_scale = lora_scale(cfg)


class CausalLM(nnx.Module):
    """Qwen2/2.5/3 or Llama 3.x causal LM. `model(input_ids, positions, attention_mask, segment_ids) -> logits`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.config = cfg
        keys = KeyStream(rngs)
        self.model = Decoder(cfg, rngs=keys)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg, "btd,vd->btv", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                  (cfg.vocab_size, cfg.hidden_size), rngs=keys)
        if cfg.lora_rank:
            _attach_lora(self, keys)
        keys.close()

    def unembedding(self) -> jax.Array:
        """The output projection `[V, D]` (the embedding itself when tied)."""
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return w[...]

    def embed(self, input_ids: jax.Array) -> jax.Array:
        cfg, rules = self.config, self.config.sharding_rules
        # The lookup where the table lies: each replica group's ids (a few KB) gathered over the devices that split
        # the table's `embed` dimension, looked up there, then the rows handed out (all-to-all). Left to itself,
        # GSPMD gathered the looked-up rows over every batch device, across hosts too (HSDP).
        input_ids = constrain(input_ids, ("batch_replicas", "seq"), rules)
        x = jnp.take(self.model.embed_tokens.weight[...], input_ids, axis=0).astype(cfg.compute_dtype)
        x = constrain(x, ("batch_replicas", "seq", "embed"), rules)
        return constrain(x, ("batch", "seq", "act_embed"), rules)

    def hidden_states(self, input_ids, positions=None, attention_mask=None, segment_ids=None,
                      tree_end=None) -> jax.Array:
        """Final-norm hidden states `[B, T, D]` (compute dtype), for chunked log-prob computation. `tree_end`
        [B, T] int: rows of prefix trees in pre-order (`TreeMask`; positions are then required)."""
        cfg = self.config
        shape = input_ids.shape
        if positions is None:
            positions = default_positions(attention_mask, segment_ids, shape)
        if tree_end is not None:
            mask = TreeMask(jnp.asarray(tree_end, jnp.int32))
        else:
            mask = attention_mask_4d(attention_mask, segment_ids, shape)
        x = self.embed(input_ids)
        if cfg.scan_layers:
            graphdef, stacked = self.stacked_layers()

            def body(x, layer_state):
                return nnx.merge(graphdef, layer_state)(x, positions, mask), None

            if cfg.remat != "none":  # per layer: the backward recomputes one layer at a time
                body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
            x, _ = jax.lax.scan(body, x, stacked)
        else:
            for layer in self.layer_modules():
                x = _remat_layer(cfg.remat)(layer, x, positions, mask)
        return self.model.norm(x)

    def stacked_layers(self):
        """(graphdef of one layer, the layers' state with its leading [L] axis), for `lax.scan` over layers: the
        stored params themselves (no copy). Only a per-layer copy (`unstack_layers`) is stacked here, a copy."""
        layers = self.model.layers
        if isinstance(layers, DecoderLayer):
            return nnx.split(layers)
        graphdef, _ = nnx.split(layers[0])
        return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in layers))

    def layer(self, i: int) -> DecoderLayer:
        """Layer i as a per-layer module: a view of the stacked params (a slice of each: a copy, outside jit), or the
        module itself after `unstack_layers`."""
        layers = self.model.layers
        if not isinstance(layers, DecoderLayer):
            return layers[i]
        graphdef, state = nnx.split(layers)
        return nnx.merge(graphdef, layer_slice(state, i))

    def layer_modules(self) -> list[DecoderLayer]:
        """The L layers as per-layer modules (`layer`), for the unrolled paths."""
        return [self.layer(i) for i in range(self.config.num_layers)]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits `[B, T, V]` from hidden states (the matmul accumulates in float32)."""
        cfg = self.config
        w = self.unembedding().astype(cfg.compute_dtype)
        out = jnp.einsum("btd,vd->btv", hidden, w, preferred_element_type=jnp.float32)
        return constrain(out, ("batch", "seq", "act_vocab"), cfg.sharding_rules)

    def __call__(self, input_ids, positions=None, attention_mask=None, segment_ids=None) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, attention_mask, segment_ids))

    def extend(self, input_ids, positions, cache: KVCache, valid=None) -> tuple[jax.Array, KVCache]:
        """Appends a chunk to the KV cache and returns its logits: prefill (empty cache) and decode (T = 1).

        Args:
          input_ids: [B, T] tokens; positions: [B, T] their RoPE positions.
          cache: the KVCache; the chunk is written at slots `lengths[b] .. lengths[b] + T - 1` of each row. The
            caller keeps each row's real tokens within max_len; writes past the end (right padding) are dropped.
          valid: [B, T] bool, False for padding tokens (they get position -1 and are never attended to).
            Trailing padding slots are reclaimed by the next write; leading/middle padding stays as a hole.
        Returns:
          (float32 logits [B, T, V], the updated cache).
        """
        hidden, cache = self.extend_hidden(input_ids, positions, cache, valid)
        return self.logits(hidden), cache

    def extend_hidden(self, input_ids, positions, cache: KVCache, valid=None, layers=None, fresh: bool = False,
                      rows=None) -> tuple[jax.Array, KVCache]:
        """`extend` without the vocab projection: (final-norm hidden states [B, T, D], cache). A sampler that
        needs logits at one position per row projects only those ([B, T, V] would dominate prefill memory).
        `layers`: `stacked_layers()` taken once by a caller that extends many times (scan_layers only).

        The cache's k / v may also be tuples of L per-layer arrays [B, K, S, H] (`KVCache.per_layer`): the layers
        then run unrolled, each reading and writing its own buffer in place. XLA's CPU backend copies a layer's
        slice out of a stacked [L, ...] array (weights under a scan, caches always) before every matmul that reads
        it: for a decode step that is most of its memory traffic (benchmarks/RESULTS.md, issue 20).

        `fresh` (static): the caller guarantees that every row of the cache is empty before this chunk (a first
        prefill chunk), so the chunk's own keys are all a query can see: attention runs
        causal over the chunk (`DecoderLayer.extend`'s `self_mask`; blockwise on CPU) instead of over all S
        slots of the cache, most of them empty. Same result up to float rounding.

        `rows` [B] (an engine's prefill): the chunk's rows are these rows of the cache (an index past its end: a
        padding row, dropped), written in place; each layer reads only its own rows (a [B, K, S, H] gather per
        layer, not a copy of the rows' whole cache)."""
        b, t = input_ids.shape
        if valid is None:
            valid = jnp.ones((b, t), bool)
        cache_pos, cache_len = cache.positions, cache.lengths
        if rows is not None:
            cache_pos = jnp.take(cache_pos, rows, axis=0, mode="fill", fill_value=-1)
            cache_len = jnp.take(cache_len, rows, axis=0, mode="fill", fill_value=0)
        start = cache_len
        kv_pos = _write_positions(cache_pos, jnp.where(valid, positions, -1).astype(jnp.int32), start)
        # Attend to every filled slot at or before the query's position (positions are increasing along a row).
        mask = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= positions[:, :, None])  # [B, T, S]
        mask = mask[:, None]
        self_mask = attention_mask_4d(valid, None, (b, t)) if fresh else None
        x = self.embed(input_ids)
        k_all, v_all = cache.k, cache.v
        if isinstance(k_all, tuple):
            k_all, v_all = list(k_all), list(v_all)
            for i, layer in enumerate(self.layer_modules()):
                x, k_all[i], v_all[i] = layer.extend(x, positions, mask, k_all[i], v_all[i], None, start, self_mask,
                                                     rows)
            k_all, v_all = tuple(k_all), tuple(v_all)
        elif self.config.scan_layers:
            graphdef, stacked = layers if layers is not None else self.stacked_layers()

            def body(carry, xs):
                x, k_all, v_all = carry
                layer_state, i = xs
                return nnx.merge(graphdef, layer_state).extend(x, positions, mask, k_all, v_all, i, start,
                                                               self_mask, rows), None

            n = self.config.num_layers
            (x, k_all, v_all), _ = jax.lax.scan(body, (x, k_all, v_all), (stacked, jnp.arange(n, dtype=jnp.int32)))
        else:
            for i, layer in enumerate(self.layer_modules()):
                x, k_all, v_all = layer.extend(x, positions, mask, k_all, v_all, i, start, self_mask, rows)
        last_valid = jnp.max(jnp.where(valid, jnp.arange(t)[None] + 1, 0), axis=1)
        lengths = cache_len + last_valid.astype(jnp.int32)
        if rows is not None:
            kv_pos = cache.positions.at[rows].set(kv_pos, mode="drop")
            lengths = cache.lengths.at[rows].set(lengths, mode="drop")
        return self.model.norm(x), KVCache(k_all, v_all, kv_pos, lengths)


def _remat_layer(policy_name: str):
    def call(layer, x, positions, mask):
        return layer(x, positions, mask)
    if policy_name == "none":
        return call
    return nnx.remat(call, policy=REMAT_POLICIES[policy_name])


def abstract_model(cfg: Config) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: shapes, dtypes and metadata without allocating anything. A new module
    each call (its own Variables), merged from the config's traced split: a run's setup asks for the same abstract
    model about ten times (shardings, checkpoints, LoRA paths, exports), and tracing a 30-layer model's init takes
    ~0.5 s where the merge takes ~1 ms."""
    return nnx.merge(*_abstract_split(cfg), copy=True)


@functools.lru_cache(maxsize=16)
def _abstract_split(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))


def param_count(model_or_state: Any) -> int:
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))
