"""Tree training (experience/tree_packing.py): the layout by hand, the attention rule (kernel == dense == ancestors),
log-probs equal to the flat layout's per trajectory, and loss and gradients equal to the flat layout's for every
aggregation mode, PPO and AEPO, with and without KL, with rollout correction, sharded and unsharded.

Random trees: groups of trajectories sharing a prompt, branched at random tool-round ends or anywhere in a parent's
response (depth up to 4: a branch of a branch of ...), tool results masked out, some failed (all masked), some exact
duplicates.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from arpo_jax import models, sharding
from arpo_jax.experience import packing
from arpo_jax.experience import tree_packing as tp
from arpo_jax.models.attention import blockwise_causal_attention
from arpo_jax.models.transformer import TreeMask
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts
from arpo_jax.update import value as critic_lib

VOCAB = 96


def _model_cfg(**kw):
    return models.Config(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, **kw)


def _random_group(rng, n):
    """n trajectories of one prompt as (tokens, loss mask) lists; branches fork from a parent's prefix."""
    prompt = list(rng.randint(3, VOCAB, rng.randint(3, 9)))
    trajs = []

    def rounds(tokens, mask, count):
        for _ in range(count):
            gen = list(rng.randint(3, VOCAB, rng.randint(2, 7)))
            tool = list(rng.randint(3, VOCAB, rng.randint(1, 4)))
            tokens, mask = tokens + gen + tool, mask + [1] * len(gen) + [0] * len(tool)  # tool result: no loss
        return tokens, mask

    for _ in range(max(1, n // 2)):  # initial rollouts
        trajs.append(rounds(prompt, [0] * len(prompt), rng.randint(1, 4)))
    while len(trajs) < n:
        tokens, mask = trajs[rng.randint(len(trajs))]
        kind = rng.rand()
        if kind < 0.1:  # an exact duplicate
            trajs.append((list(tokens), list(mask)))
            continue
        # Fork at a tool-round end (ARPO) or at any token of the response.
        ends = [j + 1 for j in range(len(prompt), len(tokens) - 1) if mask[j] == 0 and mask[j + 1] == 1]
        cut = ends[rng.randint(len(ends))] if ends and kind < 0.6 else rng.randint(len(prompt), len(tokens) + 1)
        trajs.append(rounds(tokens[:cut], mask[:cut], rng.randint(1, 3)))
    out = []
    for tokens, mask in trajs:
        m = np.array(mask, np.float32)
        if rng.rand() < 0.15:
            m[:] = 0  # a failed trajectory: masked out of the loss
        out.append((np.array(tokens, np.int32), m))
    return out


def _rollout(seed, groups=3, n=6):
    rng = np.random.RandomState(seed)
    seqs, masks, group = [], [], []
    for g in range(groups):
        for s, m in _random_group(rng, n):
            seqs.append(s)
            masks.append(m)
            group.append(g)
    return seqs, masks, np.array(group), rng.randn(len(seqs)).astype(np.float32)


def _ancestors_mask(layout: tp.TreeLayout) -> np.ndarray:
    """[K, M, B, T, T] from the trajectories' slot maps: a query sees exactly the slots on its own path."""
    k, m, b, t = layout.shape
    out = np.zeros((k, m, b, t, t), bool)
    for i, sm in enumerate(layout.slots):
        for j in range(len(sm)):
            out[layout.mini[i], layout.micro[i], layout.row[i], sm[j], sm[:j + 1]] = True
    return out


def test_layout_by_hand():
    seqs = [np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2, 3, 6])]
    masks = [np.array([0, 0, 1, 1]), np.array([0, 0, 1]), np.array([0, 0, 0, 1])]
    layout = tp.plan_tree_layout(seqs, [0, 0, 0], masks, mini_batch_size=3, row_len=8, rows_per_micro=1)
    batch = tp.assemble_tree(layout, masks, [1.0, 2.0, 3.0])
    row = lambda name: batch[name][0, 0, 0].tolist()
    # Depth-first (lexicographic) order 1234, 1236, 125: the pre-order is 1 2 3 4 | 6 | 5.
    assert row("input_ids") == [1, 2, 3, 4, 6, 5, 0, 0]
    assert row("positions") == [0, 1, 2, 3, 3, 2, 0, 0]
    assert row("tree_end") == [5, 5, 4, 3, 4, 5, -1, -1]
    # Heads: the loss tokens 3 (slot 2), 4 (3), 6 (4), 5 (5), each scored from its parent's slot.
    assert row("head_slot")[:4] == [1, 2, 2, 1] and row("head_target")[:4] == [3, 4, 6, 5]
    # Entries in trajectory order: seq 0 tokens 2, 3; seq 1 token 2; seq 2 token 3 (its token 2 has no loss).
    assert row("entry_index")[:4] == [0, 1, 3, 2] and row("segment_ids")[:4] == [1, 1, 2, 3]
    np.testing.assert_allclose(row("advantages")[:4], [1, 1, 2, 3])
    np.testing.assert_allclose(row("loss_weight")[:5], [0.25] * 4 + [0])  # token-mean over 4 loss tokens
    assert (layout.tokens_computed, layout.tokens_flat) == (6, 11)
    # A row of 5 tokens: the tree splits after 1234 + 6 (5 tokens); 125 repeats the prefix 12 in a second part.
    split = tp.plan_tree_layout(seqs, [0, 0, 0], masks, mini_batch_size=3, row_len=5, rows_per_micro=2)
    assert split.tokens_computed == 8 and split.rows["input_ids"][0, 0, 1, :3].tolist() == [1, 2, 5]


@pytest.mark.parametrize("seed", range(4))
def test_tree_mask_is_the_ancestor_relation(seed):
    seqs, masks, group, _ = _rollout(seed)
    layout = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=12, row_len=64, rows_per_micro=2)
    assert layout.tokens_computed < layout.tokens_flat
    t = layout.shape[-1]
    dense = np.asarray(TreeMask(jnp.asarray(layout.rows["tree_end"].reshape(-1, t))).dense())
    expected = _ancestors_mask(layout).reshape(-1, t, t)
    np.testing.assert_array_equal(dense[:, 0], expected)  # padding queries see nothing either
    for i, s in enumerate(seqs):  # every trajectory reads back from its slots, with its positions
        at = (layout.mini[i], layout.micro[i], layout.row[i], layout.slots[i])
        np.testing.assert_array_equal(layout.rows["input_ids"][at], s)
        np.testing.assert_array_equal(layout.rows["positions"][at], np.arange(len(s)))


@pytest.mark.slow
def test_blockwise_tree_kernel_equals_dense_forward_and_backward():
    seqs, masks, group, _ = _rollout(7)
    layout = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=18, row_len=48, rows_per_micro=2)
    key_end = jnp.asarray(layout.rows["tree_end"][0, 0])  # [B, T]
    b, t = key_end.shape
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (b, t, 4, 8))
    k, v = (jax.random.normal(x, (b, t, 2, 8)) for x in ks[1:3])
    d_out = jax.random.normal(ks[3], (b, t, 4, 8))
    dense = TreeMask(key_end).dense()
    real = jnp.asarray(layout.rows["tree_end"][0, 0] >= 0)[:, :, None, None]  # padding rows differ by convention

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out * real, *vjp(d_out * real))

    tree = run(lambda q, k, v: blockwise_causal_attention(q, k, v, key_end=key_end, scale=0.3, block_size=8))
    blockwise_dense = run(lambda q, k, v: blockwise_causal_attention(q, k, v, dense, scale=0.3, block_size=8))
    xla = run(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, scale=0.3))
    for a, x, y in zip(tree, blockwise_dense, xla):
        np.testing.assert_allclose(a, x, atol=1e-6)
        np.testing.assert_allclose(a, y, atol=2e-5)


def _flat_and_tree(seqs, masks, group, adv, *, row_len=64, rows=2, tree_row_len=None, mini=None, **weights):
    n = len(seqs)
    mini = mini or n
    flat, flat_layout = packing.pack_batch(seqs, masks, adv, mini_batch_size=mini, row_len=row_len,
                                           rows_per_micro=rows, **weights)
    layout = tp.plan_tree_layout(seqs, group, masks, mini_batch_size=mini, row_len=tree_row_len or row_len,
                                 rows_per_micro=rows)
    return flat, flat_layout, tp.assemble_tree(layout, masks, adv, **weights), layout


@pytest.mark.parametrize("impl,split", [("blockwise", False), pytest.param("xla", False, marks=pytest.mark.slow),
                                        pytest.param("blockwise", True, marks=pytest.mark.slow)])
def test_tree_logprobs_equal_flat(impl, split):
    model_cfg = _model_cfg(attention_impl=impl)
    graphdef, params = jit.split_model(models.init_model(model_cfg, seed=1))
    seqs, masks, group, adv = _rollout(3)
    tree_row_len = max(len(s) for s in seqs) if split else 64  # split: a row holds little more than a trajectory
    flat, flat_layout, tree, layout = _flat_and_tree(seqs, masks, group, adv, tree_row_len=tree_row_len)
    if split:
        assert layout.shape[1] > 1  # trees split over rows and micro-batches, prefixes repeated
    flat_out = ts.jit_forward_logprobs(graphdef, model_cfg)(params, flat)
    tree_out = ts.jit_forward_logprobs(graphdef, model_cfg, tree=True)(params, tree)
    for f, t in zip(flat_out, tree_out):
        f, t = packing.unpack(flat_layout, f), tp.unpack_entries(layout, t)
        for i, m in enumerate(masks):
            sel = np.flatnonzero(m[1:] > 0) + 1
            np.testing.assert_allclose(t[i][sel], f[i][sel], rtol=1e-5, atol=1e-5, err_msg=f"trajectory {i}")


def _recorder():
    """An 'optimizer' whose state becomes the gradients and which leaves the params alone: the train step's exact
    gradients, through its real path (rollout correction, entropy statistics, accumulation, skip check)."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def _with_logps(flat, flat_layout, tree, layout, logp, rng, kl, rollout):
    """Old / ref / rollout log-probs drawn per trajectory, token-aligned, placed identically in both layouts."""
    values = {"old_logp": [lp + 0.3 * rng.randn(len(lp)) for lp in logp]}
    if kl:
        values["ref_logp"] = [lp + 0.1 * rng.randn(len(lp)) for lp in logp]
    if rollout:
        values["rollout_logp"] = [np.where(rng.rand(len(lp)) < 0.2, np.nan, lp + 0.2 * rng.randn(len(lp)))
                                  for lp in logp]
    for name, v in values.items():
        flat[name] = packing.place(flat_layout, v)
        tree[name] = tp.place_entries(layout, v)
    return flat, tree


def _rel(a, b):
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = [pytest.param(dict(loss="ppo"), marks=pytest.mark.slow),
         pytest.param(dict(loss="aepo", kl_coef=0.1, entropy_coef=0.01, entropy_adv=True), marks=pytest.mark.slow),
         pytest.param(dict(loss="aepo"), marks=pytest.mark.slow),
         pytest.param(dict(loss="ppo", kl_coef=0.1), marks=pytest.mark.slow),
         pytest.param(dict(loss="ppo", rollout_correction="truncate", rollout_correction_level="sequence"),
                      marks=pytest.mark.slow),
         pytest.param(dict(loss="ppo", rollout_correction="mask", rollout_correction_threshold=1.3),
                      marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_and_gradients_equal_flat(case):
    model_cfg = _model_cfg()
    graphdef, params = jit.split_model(models.init_model(model_cfg, seed=2))
    cfg = ts.UpdateConfig(**case)
    opt = _recorder()
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt)
    seqs, masks, group, adv = _rollout(11)
    flat_fwd = ts.jit_forward_logprobs(graphdef, model_cfg)
    # Every aggregation mode over two micro-batches (filled differently by the two layouts), plus (PPO) the reference
    # micro-normalisation with one micro-batch per mini-batch: its normaliser is the micro-batch's own content.
    modes = [(agg, "global_token_mean", 2) for agg in packing.AGG_MODES]
    modes += [("seq-mean-token-mean", "reference", 16)] if case == {"loss": "ppo"} else []
    # Entropy-aware advantages divide by the entropy's std over the batch, tiny for a random model (near-uniform
    # predictions): float rounding is amplified ~50x. The flat layout itself, packed vs padded, differs by 5.3e-5.
    tol = 2e-4 if cfg.entropy_adv else 2e-6
    for agg, norm, rows in modes:
        weights = dict(agg_mode=agg, micro_norm=norm, norm_len=40)
        flat, flat_layout, tree, layout = _flat_and_tree(seqs, masks, group, adv, rows=rows, **weights)
        assert layout.shape[1] > 1 or rows > 2
        logp = packing.unpack(flat_layout, flat_fwd(params, flat)[0])
        flat, tree = _with_logps(flat, flat_layout, tree, layout, logp, np.random.RandomState(5),
                                 kl=bool(cfg.kl_coef), rollout=cfg.rollout_correction != "off")
        results = []
        for batch in (flat, tree):
            state, metrics = step(jit.init_train_state(params, opt), {k: v[0] for k, v in batch.items()})
            results.append((jax.device_get(state.opt_state), jax.device_get(metrics)))
        (g_flat, m_flat), (g_tree, m_tree) = results
        rel = _rel(g_tree, g_flat)
        print(f"{case} {agg} {norm}: gradient relative error {rel:.2e}, loss {m_tree['loss']:.6g} {m_flat['loss']:.6g}")
        assert rel < tol, (agg, norm, rel)
        for name in m_flat.keys() - {"micro_batches"}:  # the micro-batches computed: the layouts' own counts
            np.testing.assert_allclose(m_tree[name], m_flat[name], rtol=tol * 5, atol=1e-7, err_msg=f"{agg} {name}")
        assert abs(m_flat["loss"]) > 1e-4


@pytest.mark.slow
def test_sharded_tree_step_equals_unsharded():
    model_cfg = _model_cfg()
    model = models.init_model(model_cfg, seed=3)
    graphdef, params = jit.split_model(model)
    cfg = ts.UpdateConfig(loss="aepo", kl_coef=0.1)
    opt = _recorder()
    seqs, masks, group, adv = _rollout(13)
    _, _, tree, layout = _flat_and_tree(seqs, masks, group, adv, rows=8)
    tree_fwd = ts.jit_forward_logprobs(graphdef, model_cfg, tree=True)
    logp = tp.unpack_entries(layout, tree_fwd(params, tree)[0])
    rng = np.random.RandomState(0)
    tree["old_logp"] = tp.place_entries(layout, [lp + 0.3 * rng.randn(len(lp)) for lp in logp])
    tree["ref_logp"] = tp.place_entries(layout, [lp + 0.1 * rng.randn(len(lp)) for lp in logp])
    mini = {k: v[0] for k, v in tree.items()}
    ref_state, ref_metrics = ts.jit_train_step(graphdef, model_cfg, cfg, opt)(jit.init_train_state(params, opt), mini)

    mesh = sharding.make_mesh((2, 2, 2))
    sharded = jit.split_model(models.init_model(model_cfg, seed=3, mesh=mesh))[1]
    shardings = jit.state_shardings(opt, jit.param_shardings(model_cfg, mesh), sharded, mesh)
    step = ts.jit_train_step(graphdef, model_cfg, cfg, opt, mesh, shardings)
    state, metrics = step(jit.init_train_state(sharded, opt, shardings), mini)
    assert _rel(jax.device_get(state.opt_state), jax.device_get(ref_state.opt_state)) < 2e-6
    for k in ref_metrics:
        np.testing.assert_allclose(float(metrics[k]), float(ref_metrics[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    sharded_logp = ts.jit_forward_logprobs(graphdef, model_cfg, mesh=mesh, tree=True)(sharded, tree)[0]
    np.testing.assert_allclose(np.asarray(sharded_logp), np.asarray(tree_fwd(params, tree)[0]), atol=1e-5)


def test_worker_blocks_pad_to_common_sizes():
    """Two workers' blocks side by side (each padded with with_sizes) give the loss of one layout of both halves."""
    seqs, masks, group, adv = _rollout(17, groups=4)
    half = len(seqs) // 2
    parts = [slice(0, half), slice(half, None)]
    layouts = [tp.plan_tree_layout(seqs[p], group[p], masks[p], mini_batch_size=half, row_len=64, rows_per_micro=1)
               for p in parts]
    sizes = [max(x) for x in zip(*(lay.sizes for lay in layouts))]
    layouts = [lay.with_sizes(*sizes) for lay in layouts]
    totals = sum(tp.loss_totals(lay, masks[p]) for lay, p in zip(layouts, parts))
    blocks = [tp.assemble_tree(lay, masks[p], adv[p], totals=totals, workers=2) for lay, p in zip(layouts, parts)]
    assert all(b[k].shape == blocks[0][k].shape for b in blocks for k in b)
    w = np.concatenate([b["loss_weight"] for b in blocks], axis=2)
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)  # token-mean over both workers' loss tokens
    metrics = tp.tree_metrics(layouts)
    assert metrics["perf/tree_tokens_flat"] == sum(len(s) for s in seqs)
    assert metrics["perf/tree_tokens_computed"] < metrics["perf/tree_tokens_flat"]


def test_tree_training_config_is_validated():
    from arpo_jax.assemble import validate as config
    from arpo_jax.config import args

    cfg = args.load_config(["--config=builtin:toy_cpu"]).to_dict()
    assert cfg["actor"]["tree_training"] is True  # on by default
    cfg["actor"]["pack"] = False
    with pytest.raises(config.ConfigError) as err:
        config.validate(ml_collections.ConfigDict(cfg, type_safe=False), check_files=False)
    problems = err.value.problems
    assert any(p.startswith("actor.tree_training:") and "actor.pack=true" in p for p in problems), problems
    cfg["actor"]["tree_training"] = False
    cfg["algorithm"]["adv_estimator"] = "gae"
    config.validate(ml_collections.ConfigDict(cfg, type_safe=False), check_files=False)  # flat, unpacked: valid
    cfg["actor"].update(pack=True, tree_training=True)  # a critic with tree training: valid too
    config.validate(ml_collections.ConfigDict(cfg, type_safe=False), check_files=False)


@pytest.mark.parametrize("agg", [a if a == "token-mean" else pytest.param(a, marks=pytest.mark.slow)
                                 for a in packing.AGG_MODES])
def test_value_loss_and_gradients_equal_flat(agg):
    """The critic's update on a tree batch (values per loss entry from the heads) equals the flat one: loss,
    metrics and gradients, for every aggregation mode, with clipped values."""
    model_cfg = _model_cfg()
    graphdef = critic_lib.value_graphdef(model_cfg)
    policy = jit.split_model(models.init_model(model_cfg, seed=4))[1]
    params = critic_lib.value_params_from_policy(policy)
    rng = np.random.RandomState(9)
    params["value_head"] = {"weight": jnp.asarray(rng.randn(1, 64) * 0.1, jnp.float32),
                            "bias": jnp.asarray([0.2], jnp.float32)}  # a non-zero head: the values depend on x
    seqs, masks, group, adv = _rollout(21)
    flat, flat_layout, tree, layout = _flat_and_tree(seqs, masks, group, adv, agg_mode=agg, norm_len=40)
    assert layout.tokens_computed < layout.tokens_flat and layout.shape[1] > 1
    values = [rng.randn(len(s)).astype(np.float32) * 0.3 for s in seqs]
    for name, v in (("old_values", values), ("returns", [x + rng.randn(len(x)) * 0.5 for x in values])):
        flat[name], tree[name] = packing.place(flat_layout, v), tp.place_entries(layout, v)
    cfg = critic_lib.CriticConfig(cliprange_value=0.2, lr=1e-5, max_grad_norm=1.0, weight_decay=0.0,
                                  reference_compat=False)
    opt = _recorder()
    step = critic_lib.jit_value_step(graphdef, model_cfg, cfg, opt)
    results = []
    for batch in (flat, tree):
        state, metrics = step(jit.init_train_state(params, opt), {k: v[0] for k, v in batch.items()})
        results.append((jax.device_get(state.opt_state), jax.device_get(metrics)))
    (g_flat, m_flat), (g_tree, m_tree) = results
    assert _rel(g_tree, g_flat) < 2e-6
    assert m_flat["vf_clipfrac"] > 0 and abs(m_flat["vf_loss"]) > 1e-3  # the clip and the loss are exercised
    for name in m_flat.keys() - {"micro_batches"}:
        np.testing.assert_allclose(m_tree[name], m_flat[name], rtol=1e-5, atol=1e-7, err_msg=name)
