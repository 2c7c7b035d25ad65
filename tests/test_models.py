"""Numerical parity of the Flax models with transformers on the same random weights, and model invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import arpo_jax
from arpo_jax import models, testing
from arpo_jax.models import KVCache, transformer
from arpo_jax.models.transformer import KeyStream, input_major_linears
from arpo_jax.weights import hf

VARIANTS = list(testing.TINY_VARIANTS)
# bf16 tolerance on logits of magnitude ~4 (documented in README; measured: max 0.04-0.06, mean 0.008-0.009, less than
# transformers' own bf16-vs-float32 error of max 0.06-0.09). Both sides round weights and activations to
# bf16 (8 bits of mantissa) at different points of the same computation.
BF16_MAX_ABS = 0.1
BF16_MEAN_ABS = 0.015


def _ids(shape, seed=0, vocab=512):
    return np.random.RandomState(seed).randint(3, vocab, shape)


def _torch_logits(model, ids, attention_mask=None, position_ids=None):
    kw = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.tensor(attention_mask)
    if position_ids is not None:
        kw["position_ids"] = torch.tensor(position_ids)
    with torch.no_grad():
        return model(torch.tensor(ids), **kw).logits.float().numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_parity(tiny_hf_dir, variant):
    path, ref = tiny_hf_dir(variant)
    model = arpo_jax.from_pretrained(path)
    ids = _ids((2, 19))
    ours = np.asarray(model(jnp.asarray(ids)))
    theirs = _torch_logits(ref, ids)
    assert ours.shape == theirs.shape == (2, 19, 512)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "llama31"])
def test_bfloat16_parity(tiny_hf_dir, variant):
    import transformers

    path, _ = tiny_hf_dir(variant)
    ids = _ids((2, 19), seed=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    theirs = _torch_logits(ref, ids)
    model = arpo_jax.from_pretrained(path, dtype="bfloat16")
    assert model.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    diff = np.abs(np.asarray(model(jnp.asarray(ids))) - theirs)
    assert diff.max() <= BF16_MAX_ABS and diff.mean() <= BF16_MEAN_ABS, (diff.max(), diff.mean())


def test_left_padding_matches_transformers(tiny_hf_dir):
    """Batched prompts of different lengths, left-padded as the rollout does, with positions from the mask."""
    path, ref = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    ids = _ids((3, 12), seed=2)
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :1] = 0
    ids = np.where(mask == 1, ids, 0)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    theirs = _torch_logits(ref, ids, attention_mask=mask, position_ids=positions)
    ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))  # default positions = same rule
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)


def test_packed_segments_equal_separate_sequences(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen3")
    model = arpo_jax.from_pretrained(path)
    a, b = _ids((1, 7), seed=3), _ids((1, 5), seed=4)
    packed = np.concatenate([a, b, np.zeros((1, 4), int)], axis=1)  # two sequences and padding in one row
    seg = np.array([[1] * 7 + [2] * 5 + [0] * 4])
    out = np.asarray(model(jnp.asarray(packed), segment_ids=jnp.asarray(seg)))
    np.testing.assert_allclose(out[0, :7], np.asarray(model(jnp.asarray(a)))[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 7:12], np.asarray(model(jnp.asarray(b)))[0], atol=1e-5)


@pytest.mark.parametrize("variant", ["qwen2_tied", "llama31"])
def test_kv_cache_prefill_decode_equals_full_forward(tiny_hf_dir, variant):
    """Left-padded prefill, token-by-token decode, then a multi-token append (a tool result) through the cache."""
    path, _ = tiny_hf_dir(variant)
    model = arpo_jax.from_pretrained(path)
    cfg = model.config
    full = _ids((2, 14), seed=5)
    pad = np.array([3, 0])  # row 0 has 3 left-padding tokens
    valid = np.arange(14)[None] >= pad[:, None]
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    expected = np.asarray(model(jnp.asarray(full), attention_mask=jnp.asarray(valid)))

    extend = jax.jit(lambda m, ids, pos, c, v: m.extend(ids, pos, c, v))
    cache = KVCache.init(cfg, batch=2, max_len=32)
    logits, cache = extend(model, jnp.asarray(full[:, :8]), jnp.asarray(positions[:, :8]), cache,
                           jnp.asarray(valid[:, :8]))
    got = [np.asarray(logits)]
    for t in range(8, 10):  # decode one token at a time
        logits, cache = extend(model, jnp.asarray(full[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]), cache,
                               jnp.asarray(valid[:, t:t + 1]))
        got.append(np.asarray(logits))
    logits, cache = extend(model, jnp.asarray(full[:, 10:]), jnp.asarray(positions[:, 10:]), cache,
                           jnp.asarray(valid[:, 10:]))
    got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got[valid], expected[valid], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [14, 14])


@pytest.mark.slow  # > 10 s (compile-bound)
def test_kv_cache_rows_with_ragged_appends_and_branch_copy(tiny_hf_dir):
    """Right-padded chunks reclaim their padding slots; a copied cache row continues like its parent."""
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    seq = _ids((1, 10), seed=6)[0]
    cache = KVCache.init(model.config, batch=2, max_len=24)
    # Both rows get the same 10 tokens, split differently: row 0 as 6 + 4 (+3 padding), row 1 as 3 (+3 padding) + 7.
    chunk1 = np.stack([seq[:6], np.concatenate([seq[:3], [0, 0, 0]])])
    valid1 = np.array([[1] * 6, [1, 1, 1, 0, 0, 0]], bool)
    pos1 = np.stack([np.arange(6), np.array([0, 1, 2, 0, 0, 0])])
    _, cache = model.extend(jnp.asarray(chunk1), jnp.asarray(pos1), cache, jnp.asarray(valid1))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [6, 3])
    chunk2 = np.stack([np.concatenate([seq[6:], [0, 0, 0]]), seq[3:]])
    valid2 = np.array([[1] * 4 + [0] * 3, [1] * 7], bool)
    pos2 = np.stack([np.array([6, 7, 8, 9, 0, 0, 0]), np.arange(3, 10)])
    logits, cache = model.extend(jnp.asarray(chunk2), jnp.asarray(pos2), cache, jnp.asarray(valid2))
    np.testing.assert_allclose(np.asarray(logits)[0, 3], np.asarray(logits)[1, 6], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 10])
    # Branch: copy row 0 into both rows, decode the same token, get the same logits as the full forward.
    branched = cache.take_rows([0, 0])
    nxt = jnp.asarray([[5], [5]])
    logits_b, _ = model.extend(nxt, jnp.asarray([[10], [10]]), branched)
    full = np.asarray(model(jnp.asarray(np.concatenate([seq, [5]])[None])))[0, -1]
    np.testing.assert_allclose(np.asarray(logits_b)[:, 0], np.stack([full, full]), atol=1e-4)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_remat_policies_give_the_same_gradients(tiny_hf_dir, remat):
    from flax import nnx

    path, _ = tiny_hf_dir("qwen3")
    ids = jnp.asarray(_ids((2, 9), seed=7))

    def grads(model):
        def loss(m):
            return jax.nn.log_softmax(m(ids)).mean()
        return nnx.grad(loss)(model)

    g0 = grads(arpo_jax.from_pretrained(path))
    g1 = grads(arpo_jax.from_pretrained(path, remat=remat))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_llama3_rope_scaling_is_applied(tiny_hf_dir):
    """Dropping the llama3 scaling changes the logits: the parity test above does exercise it."""
    from flax import nnx

    path, _ = tiny_hf_dir("llama31")
    cfg, _ = hf.read_config(path)
    assert cfg.rope_scaling is not None
    graphdef, state = hf.load_state(path, cfg)
    unscaled_graphdef, _ = nnx.split(models.abstract_model(cfg.replace(rope_scaling=None)))
    ids = jnp.asarray(_ids((1, 40), seed=8))
    scaled = np.asarray(nnx.merge(graphdef, state)(ids))
    unscaled = np.asarray(nnx.merge(unscaled_graphdef, state)(ids))
    assert np.abs(unscaled - scaled).max() > 1e-2


@pytest.mark.parametrize("field,value", [("dtype", "float64"), ("remat", "some"), ("attention_impl", "flash")])
def test_invalid_runtime_choice_names_the_field(field, value):
    cfg = models.config_from_hf(testing.tiny_hf_config_dict("qwen2"))
    with pytest.raises(ValueError, match=field):
        cfg.replace(**{field: value})


@pytest.mark.slow  # > 10 s (compile-bound)
def test_fully_masked_rows_stay_finite_in_forward_and_gradient(tiny_hf_dir):
    """Padding queries attend to nothing; NaN there would poison gradients even when the loss masks them out."""
    from flax import nnx

    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    ids = jnp.asarray(_ids((2, 8), seed=9))
    mask = jnp.asarray([[0, 0, 0, 0, 1, 1, 1, 1], [1] * 8])
    seg = jnp.asarray([[0, 0, 1, 1, 1, 2, 2, 0], [1] * 8])
    assert bool(jnp.isfinite(model(ids, attention_mask=mask)).all())
    assert bool(jnp.isfinite(model(ids, segment_ids=seg)).all())

    def loss(m):
        logp = jax.nn.log_softmax(m(ids, attention_mask=mask))
        return jnp.sum(jnp.where(mask[..., None] > 0, logp, 0.0))

    grads = nnx.grad(loss)(model)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("block_size,dtype", [(4, jnp.float32), (5, jnp.float32), (64, jnp.float32),
                                              (4, jnp.bfloat16)])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_blockwise_attention_equals_xla_attention_values_and_gradients(block_size, dtype):
    """The CPU training attention (query blocks, hand-written backward) against jax.nn.dot_product_attention:
    grouped-query heads, packed segments, padding, left padding and a ragged last block."""
    from arpo_jax.models.attention import blockwise_causal_attention
    from arpo_jax.models.transformer import attention_mask_4d

    b, t, n, k, h = 3, 19, 4, 2, 8
    rng = np.random.RandomState(0)
    q, kk, v = (jnp.asarray(rng.randn(b, t, heads, h), dtype) for heads in (n, k, k))
    seg = np.zeros((b, t), np.int32)
    seg[0, :7], seg[0, 7:16] = 1, 2  # two packed sequences, then padding
    seg[1, :] = 1
    seg[2, 5:] = 1  # left padding: the first queries see no key at all
    seg = jnp.asarray(seg)
    mask = attention_mask_4d(None, seg, (b, t))
    weights = jnp.asarray(rng.randn(b, t, n, h), jnp.float32) * (seg > 0)[..., None, None]  # loss on real tokens

    def ours(q, kk, v):
        return blockwise_causal_attention(q, kk, v, mask, scale=h ** -0.5, block_size=block_size)

    def reference(q, kk, v):
        return jax.nn.dot_product_attention(q, kk, v, mask=mask, scale=h ** -0.5, implementation="xla")

    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    real = (seg > 0)[..., None, None]
    out, ref = ours(q, kk, v), reference(q, kk, v)
    assert out.dtype == dtype and bool(jnp.isfinite(out.astype(jnp.float32)).all())
    np.testing.assert_allclose(np.where(real, out.astype(jnp.float32), 0), np.where(real, ref.astype(jnp.float32), 0),
                               atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32))[2, :5], 0.0)  # no visible key: output 0

    def loss(fn):
        return lambda *x: jnp.sum(fn(*x).astype(jnp.float32) * weights)

    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, kk, v)
    ref_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, kk, v)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)),
                                   atol=5 * tol, rtol=5 * tol)


def test_cpu_training_forward_uses_blockwise_attention(tiny_hf_dir):
    """attention_impl=None picks the blockwise kernel on CPU; "xla" forces JAX's; both give the same logits."""
    path, _ = tiny_hf_dir("qwen2")
    ids = jnp.asarray(_ids((2, 12), seed=4))
    default, xla = arpo_jax.from_pretrained(path), arpo_jax.from_pretrained(path, attention_impl="xla")
    assert "custom_vjp_call" in str(jax.make_jaxpr(lambda x: default(x))(ids))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(lambda x: xla(x))(ids))
    np.testing.assert_allclose(default(ids), xla(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a real GPU does not refuse cuDNN")
def test_gpu_default_cudnn_attention_falls_back_to_blockwise_when_refused(tiny_hf_dir, monkeypatch):
    """On a GPU in bfloat16 the default is cuDNN; a GPU or shape cuDNN refuses (here: a CPU told it is a GPU, where
    jax raises "cuDNN is not detected" while tracing) runs the blockwise kernel with one warning and the same
    logits. An explicit attention_impl="cudnn" is never replaced."""
    from arpo_jax.models import transformer

    path, _ = tiny_hf_dir("qwen2")
    ids = jnp.asarray(_ids((2, 12), seed=4))
    blockwise = arpo_jax.from_pretrained(path, dtype="bfloat16", attention_impl="blockwise")
    default = arpo_jax.from_pretrained(path, dtype="bfloat16")
    explicit = arpo_jax.from_pretrained(path, dtype="bfloat16", attention_impl="cudnn")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(transformer, "_CUDNN_FALLBACK_WARNED", [])
    assert transformer.resolve_attention(None, dtype="bfloat16") == "cudnn"
    with pytest.warns(RuntimeWarning, match="cuDNN attention is not available"):
        got = default(ids)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(blockwise(ids), np.float32))
    with pytest.raises(RuntimeError, match="cuDNN"):
        explicit(ids)


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_scanned_layers_equal_unrolled(tiny_hf_dir, remat):
    """`scan_layers` (one lax.scan over stacked layer params) == the Python loop over layers: logits, gradients
    of a loss w.r.t. every param (same per-layer tree), and the cached extend path (prefill then decode)."""
    path, _ = tiny_hf_dir("qwen3")
    scanned = arpo_jax.from_pretrained(path, remat=remat)
    unrolled = arpo_jax.from_pretrained(path, remat=remat, scan_layers=False)
    assert scanned.config.scan_layers and scanned.config.num_layers > 1
    ids = jnp.asarray(_ids((2, 13), seed=7))
    seg = jnp.asarray([[1] * 8 + [2] * 5, [1] * 10 + [0] * 3])

    def loss(model):
        logits = model(ids, segment_ids=seg)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 3] * jnp.arange(13)) / 100

    def close(a, b, what):
        # 1e-6, relative to the tensor's scale where that is > 1: float32 summation order differs between the two
        # programs (the unrolled model alone differs by ~8e-7 of the logits' scale between eager and jit).
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-6 * max(np.abs(b).max(), 1.0), (what, np.abs(a - b).max(), np.abs(b).max())

    # Jitted: eager dispatch compiles every op of the unrolled model one by one (minutes on a busy CPU).
    value_and_grad, logits = nnx.jit(nnx.value_and_grad(loss)), nnx.jit(lambda m: m(ids, segment_ids=seg))
    (l_s, g_s), (l_u, g_u) = (value_and_grad(m) for m in (scanned, unrolled))
    close(logits(scanned), logits(unrolled), "logits")
    close(l_s, l_u, "loss")
    flat_s, flat_u = dict(nnx.to_flat_state(g_s)), dict(nnx.to_flat_state(g_u))
    assert flat_s.keys() == flat_u.keys()
    for key, g in flat_s.items():
        assert float(jnp.abs(flat_u[key][...]).max()) > 0, key  # every param gets a gradient
        close(g[...], flat_u[key][...], key)
    @nnx.jit
    def prefill_then_decode(m):
        cache = KVCache.init(m.config, batch=2, max_len=16)
        valid = jnp.asarray([[True] * 6, [True] * 4 + [False] * 2])
        pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
        pre, cache = m.extend(ids[:, :6], pos, cache, valid)
        dec, cache = m.extend(ids[:, 6:7], cache.lengths[:, None], cache)
        return pre, dec, cache

    caches = [prefill_then_decode(m) for m in (scanned, unrolled)]
    for i, (a, b) in enumerate(zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1]), strict=True)):
        close(a, b, f"extend output {i}")


def test_extend_drops_padding_past_the_cache_end(tiny_hf_dir):
    """A right-padded chunk may run over the end of the cache: the padding is dropped, not written over earlier
    slots (a clamped dynamic slice would shift the whole chunk back onto the row's real tokens)."""
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    seq = _ids((1, 6), seed=8)
    cache = KVCache.init(model.config, batch=1, max_len=8)
    _, cache = model.extend(jnp.asarray(seq[:, :4]), jnp.arange(4)[None], cache)
    chunk = np.concatenate([seq[:, 4:], np.zeros((1, 6), int)], axis=1)  # 2 tokens + 6 padding from slot 4: 12 > 8
    valid = np.arange(8)[None] < 2
    logits, cache = model.extend(jnp.asarray(chunk), jnp.asarray(4 + np.arange(8))[None], cache, jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(cache.positions)[0], [0, 1, 2, 3, 4, 5, -1, -1])
    full = np.asarray(model(jnp.asarray(seq)))[0]
    np.testing.assert_allclose(np.asarray(logits)[0, :2], full[4:6], atol=1e-4)


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_fresh_chunk_attends_to_itself_like_the_cache(tiny_hf_dir, per_layer):
    """`extend_hidden(fresh=True)` (a first chunk on empty rows: causal attention over the chunk alone) gives the
    hidden states and cache of attending over the whole cache, right padding included, and decodes on alike."""
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    ids = jnp.asarray(_ids((3, 9), seed=4))
    valid = jnp.asarray([[True] * 9, [True] * 5 + [False] * 4, [True] + [False] * 8])
    positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
    out = []
    for fresh in (False, True):
        cache = KVCache.init(model.config, batch=3, max_len=24)
        cache = cache.per_layer() if per_layer else cache
        hidden, cache = model.extend_hidden(ids, positions, cache, valid, fresh=fresh)
        step, cache = model.extend(ids[:, :1], cache.lengths[:, None], cache)
        out.append((np.asarray(hidden)[np.asarray(valid)], step, cache.stacked()))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    # Not vacuous: the same chunk after a cached prefix attends to it and gets other hidden states.
    cache = KVCache.init(model.config, batch=3, max_len=24)
    _, cache = model.extend_hidden(ids, positions, cache, valid)
    again, _ = model.extend_hidden(ids, positions + 9, cache, valid)
    assert np.abs(np.asarray(again)[np.asarray(valid)] - out[0][0]).max() > 1e-3


@pytest.mark.parametrize("variant", ["qwen2", "llama31"])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_sampler_unrolled_layout_equals_the_model(tiny_hf_dir, variant):
    """The JAX sampler's unrolled layout (the CPU and GPU default): Linear weights stored inputs first
    (`input_major_linears`, einsums rewritten) and the layers unrolled over per-layer cache buffers
    (`KVCache.per_layer`) give the model's logits and cache."""
    path, _ = tiny_hf_dir(variant)
    model = arpo_jax.from_pretrained(path)
    graphdef, state = nnx.split(model)
    fast = input_major_linears(nnx.merge(graphdef, state))
    q = fast.model.layers[0].self_attn.q_proj
    cfg = model.config
    assert q.spec == "btd,dnh->btnh" and q.weight.shape == (cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    assert q.weight.axes == ("embed", "q_heads", "head_dim") and q.weight.hf_shape == (cfg.num_heads * cfg.head_dim,
                                                                                        cfg.hidden_size)
    assert nnx.split(input_major_linears(fast))[0] == nnx.split(fast)[0]  # a second call changes nothing
    ids = jnp.asarray(_ids((2, 7), seed=9))
    np.testing.assert_allclose(np.asarray(fast(ids)), np.asarray(model(ids)), atol=1e-5, rtol=0)
    results = []
    for m, per_layer in ((model, False), (fast, True)):
        cache = KVCache.init(cfg, batch=2, max_len=16)
        cache = cache.per_layer() if per_layer else cache
        assert isinstance(cache.k, tuple) == per_layer
        valid = jnp.asarray([[True] * 6, [True] * 4 + [False] * 2])
        pre, cache = m.extend(ids[:, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)), cache, valid)
        dec, cache = m.extend(ids[:, 6:7], cache.lengths[:, None], cache)
        results.append((pre, dec, cache.stacked()))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_models_draw_the_keys_of_nnx_rngs_and_continue_its_stream():
    """The model's init draws `rngs.params()`'s keys in order through `KeyStream` (one count update instead of one a
    key: inside a trace each update cost time linear in the trace), so its weights and adapters are what nnx.Rngs
    drawing key by key gives, and the stream continues after the model as if nnx had drawn them. `abstract_model`
    (merged from a cached split per config) gives the same shapes, with new Variables each call."""

    rngs, reference = nnx.Rngs(3), nnx.Rngs(3)
    keys = KeyStream(rngs)
    drawn = [keys.params() for _ in range(5)]
    keys.close()
    for key in drawn:
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(reference.params()))
    np.testing.assert_array_equal(jax.random.key_data(rngs.params()), jax.random.key_data(reference.params()))

    cfg = models.config_from_hf(testing.tiny_hf_config_dict("qwen2"))
    model = models.CausalLM(cfg, rngs=nnx.Rngs(0))
    reference = nnx.Rngs(0)  # nnx drawing key by key: the decoder's modules take an nnx.Rngs as well
    decoder = transformer.Decoder(cfg, rngs=reference)
    head = transformer.Linear(cfg, "btd,vd->btv", model.lm_head.weight.shape, ("vocab", "embed"),
                              model.lm_head.weight.shape, rngs=reference)
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(model)),
                                 nnx.to_flat_state(nnx.state(nnx.Dict(model=decoder, lm_head=head))), strict=True):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(path))
    abstract = models.abstract_model(cfg.replace(lora_rank=4, lora_alpha=8.0))  # shapes only, nothing allocated
    with_adapters = models.CausalLM(cfg.replace(lora_rank=4, lora_alpha=8.0), rngs=nnx.Rngs(0))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(abstract)) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(with_adapters))
    again = models.abstract_model(cfg.replace(lora_rank=4, lora_alpha=8.0))  # the cached split: new Variables
    assert again.model.norm.weight is not abstract.model.norm.weight
    assert nnx.graphdef(again) == nnx.graphdef(abstract)
