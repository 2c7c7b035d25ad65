"""LoRA adapters: zero B == the base model, adapters-only updates, sharding, the reference = adapters off, merged and
PEFT export (against transformers + peft), PEFT import."""

import importlib.util
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx, traverse_util

import arpo_jax
from arpo_jax import sharding, testing
from arpo_jax.assemble import policy
from arpo_jax.experience import packing
from arpo_jax.models import lora, transformer
from arpo_jax.models.transformer import LORA_TARGETS
from arpo_jax.update import jit
from arpo_jax.update import lora as lora_update
from arpo_jax.update import train_step as ts
from arpo_jax.weights import convert, hf, lora_io

RANK, ALPHA = 4, 8.0
# vLLM vs JAX, float32: 1e-4 elsewhere (tests/test_rollout_engines.py). An engine started with LoRA runs the base
# through vLLM's LoRA-wrapped layers (other kernels): its float32 log-probs of the base alone were 2.9e-4 from JAX's
# in one full-suite run (< 1e-4 in others). A wrong or stale adapter moves them by > 1e-2 (asserted below).
LORA_ENGINE_ATOL = 1e-3
_logits = nnx.jit(lambda model, ids: model(ids))  # one compile per graph (eager calls are slow on a busy CPU)


def _ids(vocab=512, b=2, t=24, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(3, vocab, (b, t)), jnp.int32)


_randomize_b = testing.randomize_lora_b


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    path, torch_model = tiny_hf_dir("qwen2")
    return path, torch_model, arpo_jax.from_pretrained(path)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_zero_b_is_the_base_model_exactly(tiny):
    _, _, base = tiny
    model = lora.with_adapters(base, RANK, ALPHA)
    ids = _ids()
    base_logits, logits = np.asarray(_logits(base, ids)), np.asarray(_logits(model, ids))
    testing.assert_equal_on_cpu(logits, base_logits)
    batch = {"input_ids": ids[None], "targets": jnp.roll(ids, -1, 1)[None],
             "positions": jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)[None],
             "segment_ids": jnp.ones_like(ids)[None]}
    lp_base = ts.jit_forward_logprobs(*jit.split_model(base)[:1], base.config)(jit.split_model(base)[1], batch)[0]
    graphdef, params = jit.split_model(model)
    lp = ts.jit_forward_logprobs(graphdef, model.config)(params, batch)[0]
    testing.assert_equal_on_cpu(lp, lp_base)
    # Adapters on every target, float32 over the base, A [r, in...] / B [out..., r], B zero.
    q = model.layer(0).self_attn.q_proj
    assert q.lora_a.shape == (RANK, base.config.hidden_size) and q.lora_a.dtype == jnp.float32
    assert q.lora_b.shape == (*q.weight.shape[:2], RANK) and not np.any(np.asarray(q.lora_b[...]))
    o = model.layer(0).self_attn.o_proj
    assert o.lora_a.shape == (RANK, *o.weight.shape[1:]) and o.lora_b.shape == (o.weight.shape[0], RANK)
    assert len(lora.trainable_paths(model.config)) == 2 * len(LORA_TARGETS)  # A, B per target, stacked over layers
    assert model.model.layers.self_attn.q_proj.lora_a.shape == (base.config.num_layers, RANK, base.config.hidden_size)
    assert model.lm_head.lora_a is None  # the head stays frozen
    # The check can fail: a non-zero B changes the logits.
    assert not np.allclose(np.asarray(_logits(_randomize_b(model), ids)), base_logits, atol=1e-3)


def test_targets_and_config_validation(tiny):
    _, _, base = tiny
    model = lora.with_adapters(base, RANK, ALPHA, targets=("v_proj", "down_proj"))
    layer = model.layer(1)
    assert layer.self_attn.v_proj.lora_a is not None and layer.mlp.down_proj.lora_b is not None
    assert layer.self_attn.q_proj.lora_a is None and layer.mlp.up_proj.lora_a is None
    with pytest.raises(ValueError, match="lora_targets"):
        base.config.replace(lora_rank=4, lora_targets=("q", "lm_head"))
    with pytest.raises(ValueError, match="lora_alpha"):
        base.config.replace(lora_rank=4, lora_alpha=0.0)


def test_unmerged_forward_equals_merged_weights(tiny):
    """x W + s (x A) B == x (W + s B A): the merged state (the HF export of a LoRA model) in the base graph."""
    _, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    state, cfg = lora.merged_state(model)
    merged = nnx.merge(nnx.split(arpo_jax.models.abstract_model(cfg), nnx.Param)[0], state)
    ids = _ids()
    np.testing.assert_allclose(np.asarray(_logits(merged, ids)), np.asarray(_logits(model, ids)), atol=1e-5, rtol=0)
    # The merged weight of q_proj by hand: W [N, H, D] + s * B [N, H, r] A [r, D].
    q = model.layer(0).self_attn.q_proj
    expect = q.weight[...] + (ALPHA / RANK) * np.einsum("nhr,rd->nhd", q.lora_b[...], q.lora_a[...])
    np.testing.assert_allclose(np.asarray(merged.layer(0).self_attn.q_proj.weight[...]), expect, atol=1e-6)


def test_the_jax_engine_samples_a_lora_policy_with_merged_weights(tiny):
    """Issue 60: the trainer's JAX engine gets the adapters merged into the base weights, on the base graph: with the
    adapters it ran three matmuls per adapted projection and decode step (the `--lora` RL phase took 2.2x the full
    one's on an H200). Its weights are the merged export's (`lora.merged_state`), at setup and after a sync."""
    from types import SimpleNamespace

    from arpo_jax.assemble import components
    from arpo_jax.rollout.jax_decode import decode_weights

    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    graphdef, params = jit.split_model(model)
    policy = SimpleNamespace(graphdef=graphdef, model_cfg=model.config, mesh=None)
    weights = components.sampler_params(params, policy)
    engine_model = nnx.merge(components.sampler_graphdef(policy), weights)
    assert engine_model.config.lora_rank == 0 and not nnx.state(engine_model, transformer.LoRAParam)
    merged, _ = lora.merged_state(model)
    expect = nnx.to_pure_dict(decode_weights(merged, model.config.compute_dtype))
    assert jax.tree.structure(weights) == jax.tree.structure(expect)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), weights, expect)
    # A sync (new adapters) merges again: one program, compiled once.
    params["model"]["layers"]["self_attn"]["q_proj"]["lora_b"] = 2 * params["model"]["layers"]["self_attn"][
        "q_proj"]["lora_b"]
    again = components.sampler_params(params, policy)
    q = np.asarray(again["model"]["layers"]["self_attn"]["q_proj"]["weight"])
    assert not np.allclose(q, np.asarray(weights["model"]["layers"]["self_attn"]["q_proj"]["weight"]))
    assert lora.jit_engine_weights(graphdef, model.config.dtype)._cache_size() == 1


def _rollout_batch(graphdef, params, model_cfg, n=8, seed=0):
    rng = np.random.RandomState(seed)
    seqs = [rng.randint(3, 512, rng.randint(10, 30)) for _ in range(n)]
    masks = [(np.arange(len(s)) >= 3).astype(np.float32) for s in seqs]
    batch, layout = packing.pack_batch(seqs, masks, rng.randn(n).astype(np.float32), mini_batch_size=n, row_len=64,
                                       rows_per_micro=4)
    logp = packing.unpack(layout, ts.jit_forward_logprobs(graphdef, model_cfg)(params, batch)[0])
    batch["old_logp"] = packing.place(layout, [lp + 0.2 * rng.randn(len(lp)) for lp in logp])
    return {k: v[0] for k, v in batch.items()}


def test_update_trains_the_adapters_only(tiny):
    _, _, base = tiny
    model = lora.with_adapters(base, RANK, ALPHA)
    graphdef, params = jit.split_model(model)
    cfg = ts.UpdateConfig(lr=1e-2)
    opt = lora_update.freeze_base(ts.make_optimizer(cfg, 10), model.config)
    state = jit.init_train_state(params, opt)
    # Optimizer moments for the adapters only.
    mu_paths = {k for k, _ in jax.tree_util.tree_flatten_with_path(state.opt_state[1][0].mu)[0]}
    assert len(mu_paths) == len(lora.trainable_paths(model.config))
    step = ts.jit_train_step(graphdef, model.config, cfg, opt)
    mini = _rollout_batch(graphdef, params, model.config)
    for _ in range(3):
        state, metrics = step(state, mini)
        assert float(metrics["skipped"]) == 0 and float(metrics["grad_norm"]) > 0
    trained = lora.trainable_paths(model.config)
    flat0, flat1 = traverse_util.flatten_dict(params), traverse_util.flatten_dict(state.params)
    assert flat0.keys() == flat1.keys()
    for k in flat0:
        if k in trained:
            assert not np.array_equal(np.asarray(flat0[k]), np.asarray(flat1[k])), k
        else:
            np.testing.assert_array_equal(np.asarray(flat1[k]), np.asarray(flat0[k]), err_msg=str(k))


@pytest.mark.slow  # > 10 s: compiles the step on an 8-device mesh
def test_sharded_lora_step_equals_single_device(tiny):
    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    graphdef, params = jit.split_model(model)
    cfg = ts.UpdateConfig(lr=1e-4, kl_coef=0.0)
    opt = lora_update.freeze_base(ts.make_optimizer(cfg, 10), model.config)
    mini = _rollout_batch(graphdef, params, model.config)
    ref_state, ref_metrics = ts.jit_train_step(graphdef, model.config, cfg, opt)(jit.init_train_state(params, opt),
                                                                               mini)
    mesh = sharding.make_mesh((2, 2, 2))
    p_sh = jit.param_shardings(model.config, mesh)
    lq = p_sh["model"]["layers"]["self_attn"]["q_proj"]  # stacked [L, ...]: the layer axis unsplit
    # A follows the base weight's input axis (embed -> fsdp), B its output axes (heads -> tensor); rank unsplit.
    assert lq["lora_a"].spec == jax.sharding.PartitionSpec(None, None, "fsdp")
    assert lq["lora_b"].spec == jax.sharding.PartitionSpec(None, "tensor", None, None)
    ld = p_sh["model"]["layers"]["mlp"]["down_proj"]
    assert ld["lora_a"].spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert ld["lora_b"].spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    sharded_params = jax.tree.map(jax.device_put, params, p_sh)
    shardings = jit.state_shardings(opt, p_sh, sharded_params, mesh)
    state = jit.init_train_state(sharded_params, opt, shardings)
    mu = state.opt_state[1][0].mu["model"]["layers"]["self_attn"]["q_proj"]["lora_b"]
    assert mu.sharding == lq["lora_b"] and not mu.sharding.is_fully_replicated
    new_state, metrics = ts.jit_train_step(graphdef, model.config, cfg, opt, mesh, shardings)(state, mini)
    for x, y in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=3e-6, rtol=0)
    for k in ref_metrics:
        np.testing.assert_allclose(float(metrics[k]), float(ref_metrics[k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_reference_logprobs_are_the_base_model(tiny):
    """The reference of a LoRA policy = its params with the adapters dropped, run in the base graph: exactly the
    base model's log-probs, while the policy (B != 0) differs."""
    _, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    graphdef, params = jit.split_model(model)
    mini = _rollout_batch(graphdef, params, model.config)
    batch = {k: v[None] for k, v in mini.items()}
    ref = lora_update.jit_reference_logprobs(model.config)(params, batch)[0]
    base_graphdef, base_params = jit.split_model(base)
    expect = ts.jit_forward_logprobs(base_graphdef, base.config)(base_params, batch)[0]
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(expect))
    policy = ts.jit_forward_logprobs(graphdef, model.config)(params, batch)[0]
    assert np.abs(np.asarray(policy) - np.asarray(expect)).max() > 1e-3
    # No copy: the reference reads the policy's own base arrays.
    assert lora.base_params(params, model.config)["lm_head"]["weight"] is params["lm_head"]["weight"]


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.double().numpy()


def test_merged_hf_export_matches(tiny, tmp_path):
    """save_pretrained of a LoRA model writes it merged: reloaded in JAX within 1e-5, in transformers within 1e-4."""
    import transformers

    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    out = hf.save_pretrained(model, tmp_path / "merged")
    ids = _ids()
    expect = np.asarray(_logits(model, ids))
    np.testing.assert_allclose(np.asarray(_logits(arpo_jax.from_pretrained(out), ids)), expect, atol=1e-5, rtol=0)
    tm = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(tm, ids), expect, atol=1e-4, rtol=0)


def test_peft_export_loads_in_peft_and_back(tiny, tmp_path):
    import peft
    import transformers

    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA, targets=("q_proj", "v_proj", "o_proj", "down_proj")))
    out = lora_io.save_peft(model, tmp_path / "adapter", base_model=str(path))
    torch_base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tm = peft.PeftModel.from_pretrained(torch_base, str(out)).eval()
    ids = _ids()
    expect = np.asarray(_logits(model, ids))
    got = _torch_logits(tm, ids)
    np.testing.assert_allclose(got, expect, atol=1e-4, rtol=0)
    assert np.abs(got - np.asarray(_logits(base, ids))).max() > 1e-3  # the adapters are in effect
    # Import onto the base (to continue training): the same adapters, bit for bit, and the same config.
    back = lora_io.load_peft(base, out)
    assert back.config == model.config
    adapters = lambda m: jax.tree.leaves(nnx.state(m, transformer.LoRAParam))
    for x, y in zip(adapters(back), adapters(model), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(_logits(back, ids)), expect)
    # Through the config (`model.lora.adapter`): the folder's settings must match model.lora's.
    from ml_collections import ConfigDict

    lc = ConfigDict({"rank": RANK, "alpha": ALPHA, "targets": model.config.lora_targets, "adapter": str(out)})
    assert policy.with_lora(base, lc).config == model.config
    lc.rank = 8
    with pytest.raises(ValueError, match="set model.lora to match"):
        policy.with_lora(base, lc)


def test_export_command_writes_peft_and_merged_from_a_lora_checkpoint(tiny, tmp_path):
    """`arpo-jax export` of a LoRA run's checkpoint (the model config in its metadata carries the adapters)."""
    from arpo_jax import cli
    from arpo_jax.weights.checkpoint import Checkpointer

    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        ckpt.save(3, nnx.state(model, nnx.Param), config=model.config, force=True)
    assert cli.main(["export", "--ckpt", str(tmp_path / "checkpoints"), "--format", "peft", "--base", str(path),
                     "--out", str(tmp_path / "peft")]) == 0
    assert cli.main(["export", "--adapter", str(tmp_path / "peft"), "--base", str(path), "--out",
                     str(tmp_path / "merged")]) == 0
    ids = _ids()
    np.testing.assert_allclose(np.asarray(_logits(arpo_jax.from_pretrained(tmp_path / "merged"), ids)),
                               np.asarray(_logits(model, ids)), atol=1e-5, rtol=0)
    # A checkpoint without adapters is refused with a pointer to the right command.
    with Checkpointer(tmp_path / "plain", async_save=False) as ckpt:
        ckpt.save(1, nnx.state(base, nnx.Param), config=base.config, force=True)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        convert.export_lora(tmp_path / "x", ckpt=tmp_path / "plain")


def test_config_validation_names_the_lora_fields():
    from arpo_jax.assemble import validate as config_lib
    from arpo_jax.config.experiments import experiment

    cfg = experiment("toy_cpu").get_config()
    cfg.model.lora.rank, cfg.model.lora.dropout, cfg.model.lora.targets = 8, 0.1, ("q_proj", "lm_head")
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.validate(cfg, check_files=False)
    text = str(e.value)
    assert "model.lora.dropout" in text and "model.lora.targets" in text
    cfg.model.lora.dropout, cfg.model.lora.targets = 0.0, ("q_proj", "v_proj")
    config_lib.validate(cfg, check_files=False)


@pytest.mark.slow
def test_lora_sft_trains_adapters_only_and_exports_merged(tmp_path):
    """The SFT loop with model.lora: the checkpoint's base equals the starting weights bit for bit, the adapters
    moved, and the exported HF folder is the merged model."""
    from arpo_jax.train import metrics, sft
    from arpo_jax.weights.checkpoint import Checkpointer
    from tests.test_sft import _toy_config

    cfg = _toy_config(2)
    cfg.model.lora.rank, cfg.model.lora.alpha = 8, 16.0
    cfg.sft.save_freq = 2
    out = sft.run_sft(cfg, tmp_path)
    assert out["steps"] == 2 and out["skipped"] == 0
    assert all(np.isfinite(r["sft/loss"]) for r in metrics.read_jsonl(tmp_path / "metrics.jsonl"))
    start = arpo_jax.from_pretrained(tmp_path / "builtin_tiny")
    with Checkpointer(tmp_path / "checkpoints", async_save=False) as ckpt:
        trained = ckpt.restore_model(2)
    assert trained.config.lora_rank == 8
    base_now, base_then = lora.base_state(trained), nnx.state(start, nnx.Param)
    for (p, x), (_, y) in zip(nnx.to_flat_state(base_now), nnx.to_flat_state(base_then), strict=True):
        np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(p))
    assert any(np.any(np.asarray(v[...])) for p, v in nnx.to_flat_state(nnx.state(trained, transformer.LoRAParam))
               if p[-1] == "lora_b")
    ids = _ids(vocab=start.config.vocab_size)
    np.testing.assert_allclose(np.asarray(_logits(arpo_jax.from_pretrained(tmp_path / "hf"), ids)),
                               np.asarray(_logits(trained, ids)),
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_rl_run_on_the_toy_config(tmp_path):
    """`arpo-jax train --config.model.lora.rank=16` with a KL loss (reference = adapters off), 1 step, then resumed
    for a 2nd: the checkpoints hold the adapters and a pointer to the base, not the base; the resume restores the
    base from the pointer; the base of the step-2 model is the starting one bit for bit, the adapters moved."""
    from arpo_jax.train import metrics
    from arpo_jax.weights.checkpoint import Checkpointer
    from tests.test_trainer import REWARD, _command, _env

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    workdir = tmp_path / "run"
    for steps in (1, 2):
        cmd = _command(workdir, reward, "--config.model.lora.rank=16", "--config.model.lora.alpha=32",
                       "--config.actor.kl_coef=0.05", f"--config.trainer.max_steps={steps}")
        proc = subprocess.run(cmd, env=_env(2), capture_output=True, text=True, timeout=900,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    log = metrics.read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in log] == [1, 2]
    assert any(k.endswith("kl_loss") and np.isfinite(v) for k, v in log[-1].items())
    start_model = arpo_jax.from_pretrained(workdir / "builtin_tiny")
    start = nnx.to_pure_dict(nnx.state(start_model, nnx.Param))
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        meta = ckpt.read_meta(2)
        model = ckpt.restore_model(2)
    pointer = meta[lora_io.BASE_POINTER]
    assert meta["model_config"]["lora_rank"] == 16 and Path(pointer["folder"]).name == "builtin_tiny", pointer
    saved = sum(f.stat().st_size for f in (workdir / "checkpoints" / "2").rglob("*") if f.is_file())
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(start))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, transformer.LoRAParam)))
    print(f"LoRA RL checkpoint {saved} bytes: adapters {adapter_bytes}, base (not saved) {base_bytes}")
    assert saved < 3 * adapter_bytes + 500_000 < base_bytes  # adapters + 2 Adam moments + metadata: no base
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    flat0 = traverse_util.flatten_dict(start)
    assert set(flat) - set(flat0) and all(k[-1] in ("lora_a", "lora_b") for k in set(flat) - set(flat0))
    for k, v in flat0.items():
        np.testing.assert_array_equal(np.asarray(flat[k]), np.asarray(v), err_msg=str(k))
    assert any(np.any(np.asarray(v)) for k, v in flat.items() if k[-1] == "lora_b")


@pytest.mark.slow  # > 10 s: compiles the step on an 8-device mesh
def test_plan_has_no_optimizer_state_for_the_frozen_base(tiny):
    """`arpo-jax plan` of a LoRA config: the moments of the adapters only (2 x their float32 bytes)."""
    from arpo_jax.plan import plan

    _, _, base = tiny
    cfg = base.config
    full = plan.plan(cfg, (1, 8, 1), ts.UpdateConfig(), micro=1, rows=8, seq=32)
    low = plan.plan(lora.config_with(cfg, RANK, ALPHA), (1, 8, 1), ts.UpdateConfig(), micro=1, rows=8, seq=32)
    adapters = nnx.state(arpo_jax.models.abstract_model(lora.config_with(cfg, RANK, ALPHA)), transformer.LoRAParam)
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(adapters))
    assert low["opt_state_per_device"] <= 2 * adapter_bytes + 64 < full["opt_state_per_device"] / 3
    assert low["params_per_device"] > full["params_per_device"]


def test_sync_kind_falls_back_to_merged_weights_with_the_reason_logged_once(caplog):
    """Where the engine cannot take adapters, a LoRA policy syncs merged full weights: the reason is logged once."""
    from arpo_jax.rollout.vllm_sampler import VllmEngineConfig, VllmSampler
    from arpo_jax.rollout.vllm_start import _lora_engine_kwargs

    sampler = VllmSampler.__new__(VllmSampler)  # no engine: only the decision
    sampler.config, sampler._lora_fallback, sampler.info = VllmEngineConfig("m", lora_rank=0), "", {"lora": False}
    assert sampler.sync_kind(8) == "full" and not caplog.text  # no LoRA layers by choice (lora_sync=merged): quiet
    sampler.config = VllmEngineConfig("m", lora_rank=8)
    sampler.info = {"lora": True, "max_lora_rank": 8, "lora_error": ""}
    assert sampler.sync_kind(0) == "full" and sampler.sync_kind(8) == "adapters"
    assert sampler.sync_kind(16) == "full" and "rank 16 > the engine's max_lora_rank 8" in caplog.text
    sampler.info = {"lora": False, "lora_error": "vLLM could not start the engine with LoRA (X)"}
    for _ in range(3):
        assert sampler.sync_kind(8) == "full"
    assert caplog.text.count("could not start the engine with LoRA (X)") == 1
    assert _lora_engine_kwargs(0) == ({}, "")  # (rank 4 -> vLLM's max_lora_rank 8: the vLLM test below)


@pytest.mark.slow  # a vLLM engine
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_adapter_only_sync_matches_the_jax_policy(tiny, tmp_path):
    """The engine serves the base it started from; each sync of a LoRA policy writes the adapters alone (a PEFT
    folder, loaded as a new vLLM LoRA adapter) and vLLM's log-probs then match the JAX policy's. `base=True` sends a
    different base once (full weights), then its adapters."""
    from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings
    from arpo_jax.rollout.vllm_sampler import VllmSampler

    path, _, base = tiny
    greedy = SamplingSettings(temperature=0.0, stop=(), logprobs=0, token_logprobs=True)
    prompts = [np.random.RandomState(i).randint(3, 500, 8 + 3 * i).tolist() for i in range(3)]
    requests = [SampleRequest(p, 12) for p in prompts]
    fwd = nnx.jit(lambda model, ids: jax.nn.log_softmax(model(ids).astype(jnp.float32), -1))

    def max_logp_diff(model, results):
        """max |vLLM - JAX| log-prob of the sampled tokens (JAX: a forward over prompt + sample)."""
        worst = 0.0
        for prompt, r in zip(prompts, results):
            seq = prompt + list(r.token_ids)
            lp = np.asarray(fwd(model, jnp.asarray([seq])))[0, len(prompt) - 1:-1]
            mine = lp[np.arange(len(r.token_ids)), r.token_ids]
            worst = max(worst, float(np.max(np.abs(mine - np.asarray(r.token_logprobs)))))
        return worst

    with VllmSampler(path, dtype="float32", max_model_len=128, seed=0, lora_rank=RANK, logprobs_mode="raw_logprobs",
                     export_dir=tmp_path / "sync") as sampler:
        assert sampler.info["lora"] and sampler.info["max_lora_rank"] == 8, sampler.info
        before = sampler.generate(requests, greedy)
        assert max_logp_diff(base, before) < LORA_ENGINE_ATOL
        adapters = nnx.state(lora.with_adapters(base, RANK, ALPHA), transformer.LoRAParam)
        adapters_bytes = hf.export_nbytes(adapters, "float32")
        base_bytes = hf.export_nbytes(nnx.state(base, nnx.Param), "float32")
        for seed in (1, 2):  # two versions: the second replaces the first (lora_int_id 2, id 1 removed)
            model = _randomize_b(lora.with_adapters(base, RANK, ALPHA), seed=seed, scale=0.3)
            sampler.update_weights(model)
            sync = sampler.last_sync
            assert sync["weights"] == "adapters" and sync["export_bytes"] == adapters_bytes
            # On disk: the adapter tensors, their header and adapter_config.json; not the base.
            assert adapters_bytes < sync["written_bytes"] < adapters_bytes + 16384 < base_bytes / 10
            after = sampler.generate(requests, greedy)
            assert max_logp_diff(model, after) < LORA_ENGINE_ATOL
            assert max_logp_diff(base, after) > 10 * LORA_ENGINE_ATOL  # the check can fail: the adapters change them
        assert list((tmp_path / "sync").iterdir()) == []  # each version removed once loaded

        # A new base (full weights, once) under adapters: the JAX model's log-probs again.
        # From a fresh copy: with_adapters shares the base's weights, and nnx.update below changes them in place.
        other = _randomize_b(lora.with_adapters(arpo_jax.from_pretrained(path), RANK, ALPHA), seed=3, scale=0.3)
        noisy = jax.tree.map(lambda x: x * 1.1, nnx.state(lora.base_model(other), nnx.Param))
        nnx.update(other, noisy)
        sampler.update_weights(other, base=True)
        assert sampler.last_sync["weights"] == "adapters"
        assert max_logp_diff(other, sampler.generate(requests, greedy)) < LORA_ENGINE_ATOL


def test_rl_checkpoint_holds_the_adapters_and_a_pointer_to_the_base(tiny, tmp_path):
    """A LoRA RL checkpoint: the adapters and their optimizer state plus the base's pointer (its folder and hash),
    a fraction of the model's bytes; the resume puts the loaded base back (bit for bit), `restore_model` (export,
    init_checkpoint) loads it from the pointer, and a changed base is refused."""
    from ml_collections import ConfigDict

    from arpo_jax.weights.checkpoint import Checkpointer

    path, _, base = tiny
    model = _randomize_b(lora.with_adapters(base, RANK, ALPHA))
    graphdef, params = jit.split_model(model)
    opt = lora_update.freeze_base(ts.make_optimizer(ts.UpdateConfig(lr=1e-2), 10), model.config)
    state = jit.init_train_state(params, opt)
    state = state._replace(opt_state=jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, state.opt_state))
    run_cfg = ConfigDict({"model": {"path": str(path), "init_checkpoint": ""}})
    # what the trainer saves/restores
    view = lora_io.CheckpointView.for_run(run_cfg.model.path, run_cfg.model.init_checkpoint, path, params, model.config)
    pointer = view.pointer
    assert pointer["folder"] == str(path) and len(pointer["hash"]) == 32
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        saved, meta = view.saved(state, {"seed": 0})
        assert meta == {"seed": 0, lora_io.BASE_POINTER: pointer}
        ckpt.save_state(2, saved, config=model.config, meta=meta, force=True)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora_io.adapters_only(params, model.config)))
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.base_params(params, model.config)))
    print(f"checkpoint {on_disk} bytes; adapters {adapter_bytes}, base {base_bytes}")
    assert on_disk < 3 * adapter_bytes + 200_000 < base_bytes  # adapters + 2 moments + orbax's files; no base

    abstract = jit.abstract_train_state(opt, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params),
                                       jax.tree.map(lambda x: x.sharding, state))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        restored = ckpt.restore_state(2, view.target(abstract))
        fresh = nnx.to_pure_dict(nnx.state(lora.with_adapters(arpo_jax.from_pretrained(path), RANK, ALPHA)))
        back = lora_io.CheckpointView(model.config, pointer, fresh).restored(restored.state, restored.meta)
        for a, b in zip(jax.tree.leaves((back.params, back.opt_state)), jax.tree.leaves((state.params,
                                                                                        state.opt_state)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ids = _ids()
        np.testing.assert_array_equal(np.asarray(_logits(ckpt.restore_model(2), ids)),
                                      np.asarray(_logits(model, ids)))
        flat = traverse_util.flatten_dict(fresh)
        key = next(k for k in sorted(flat) if k not in lora.trainable_paths(model.config))
        changed = traverse_util.unflatten_dict(flat | {key: flat[key].at[0].add(1e-3)})  # one weight, a little
        with pytest.raises(ValueError, match="base weights changed"):
            lora_io.with_base(restored.state, changed, restored.meta[lora_io.BASE_POINTER], model.config)
