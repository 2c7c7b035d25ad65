"""Orbax checkpoints: round trip, restore onto a different mesh shape, keep-N, and clear errors."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import arpo_jax
from arpo_jax import sharding
from arpo_jax.weights import checkpoint


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_save_on_one_mesh_restore_on_another(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen3")
    mesh_a = sharding.make_mesh((1, 8, 1))
    model = arpo_jax.from_pretrained(path, mesh=mesh_a)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: 0.01 * jax.numpy.ones_like(p), params)
    _, opt_state = opt.update(grads, opt_state, params)  # non-trivial moments

    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, params, config=model.config, opt_state=opt_state, meta={"data_position": 123})

    mesh_b = sharding.make_mesh((2, 2, 2))
    target_params = checkpoint.abstract_params(model.config, mesh_b)
    target_opt = jax.eval_shape(opt.init, target_params)
    # Put the optimizer moments on the same shardings as their params (the train step will do the same).
    target_opt = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.NamedSharding(mesh_b, jax.P())),
        target_opt)
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 7
        restored, restored_opt, meta = ckpt.restore(mesh=mesh_b, opt_state_target=target_opt)
    assert meta["data_position"] == 123 and meta["step"] == 7
    q = restored["model"]["layers"]["self_attn"]["q_proj"]["weight"]  # stacked [L, ...]: the layer axis never split
    assert q.sharding.mesh.shape == mesh_b.shape and q.sharding.spec == jax.P(None, "tensor", None, "fsdp")
    for a, b in zip(_leaves(params), _leaves(restored)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(opt_state), _leaves(restored_opt)):
        np.testing.assert_array_equal(a, b)


def test_restore_model_and_keep_n(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("llama31")
    model = arpo_jax.from_pretrained(path)
    params = nnx.state(model, nnx.Param)
    with checkpoint.Checkpointer(tmp_path / "c", max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, params, config=model.config)
    ckpt = checkpoint.Checkpointer(tmp_path / "c")
    assert ckpt.all_steps() == [2, 3]
    again = ckpt.restore_model()
    assert again.config == model.config
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
    bf16 = ckpt.restore_model(2, param_dtype="bfloat16", dtype="bfloat16")
    assert bf16.model.norm.weight[...].dtype == jax.numpy.bfloat16
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 1; available: \[2, 3\]"):
        ckpt.restore(1)


def test_empty_and_corrupt_checkpoints_say_where(tiny_hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        checkpoint.Checkpointer(tmp_path / "empty").restore()
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    with checkpoint.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(5, nnx.state(model, nnx.Param), config=model.config)
    # Damage every array data file of the params item.
    damaged = 0
    for f in (tmp_path / "c" / "5" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 1000:
            f.write_bytes(b"\0" * 64)
            damaged += 1
    assert damaged
    with pytest.raises(ValueError, match=r"checkpoint .*c/5 could not be restored"):
        checkpoint.Checkpointer(tmp_path / "c").restore()


# ---------------------------------------------------------------------------------------------------------------
# Integrity: damaged steps are named in one line and never restored; retention keeps the last intact step.


def _saved(tiny_hf_dir, directory, steps, *, keep=None):
    path, _ = tiny_hf_dir("llama31")
    model = arpo_jax.from_pretrained(path)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with checkpoint.Checkpointer(directory, max_to_keep=keep) as ckpt:
        for step in steps:
            # Distinct params per step, so a fallback is visible in the values.
            ckpt.save(step, jax.tree.map(lambda x, s=step: x + s, params), config=model.config)
    return params


def _largest_params_file(step_dir):
    return max((f for f in (step_dir / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_flipped_bytes_fall_back_to_the_previous_step(tiny_hf_dir, tmp_path, caplog):
    params = _saved(tiny_hf_dir, tmp_path / "c", (1, 2))
    victim = _largest_params_file(tmp_path / "c" / "2")
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])  # same size, other contents
    victim.write_bytes(bytes(data))

    ckpt = checkpoint.Checkpointer(tmp_path / "c")
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"c/2 could not be restored: step 2, params/.*"
                                                                  r"checksum mismatch") as err:
        ckpt.restore(2)
    assert "\n" not in str(err.value) and victim.relative_to(tmp_path / "c" / "2").as_posix() in str(err.value)
    # A reader (export, eval) falls back without touching the folder.
    restored, _, meta = ckpt.restore()
    assert meta["step"] == 1 and ckpt.all_steps() == [1, 2]
    np.testing.assert_array_equal(_leaves(restored)[0], _leaves(params)[0] + 1)
    # A run falls back and moves the damaged step aside (kept, not deleted), logging one line naming it.
    with caplog.at_level("WARNING", logger="arpo_jax.weights.checkpoint"):
        step, (restored, _, _) = ckpt.restore_newest_intact(ckpt.restore)
    assert step == 1 and ckpt.all_steps() == [1]
    assert any("step 2" in r.getMessage() and "falling back" in r.getMessage() and "moved to 2.damaged-"
               in r.getMessage() for r in caplog.records)
    assert [p.name for p in (tmp_path / "c").glob("2.damaged-*")]


def test_truncated_file_gives_one_short_line(tiny_hf_dir, tmp_path):
    _saved(tiny_hf_dir, tmp_path / "c", (3,))
    victim = _largest_params_file(tmp_path / "c" / "3")
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(ValueError) as err:
        checkpoint.Checkpointer(tmp_path / "c").restore()
    msg = str(err.value)
    assert "step 3" in msg and victim.name in msg and "truncated" in msg
    assert "\n" not in msg and len(msg) < 600 and "tensorstore" not in msg.lower()


def test_non_finite_params_are_refused(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("llama31")
    model = arpo_jax.from_pretrained(path)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params["model"]["norm"]["weight"] = params["model"]["norm"]["weight"].at[0].set(jax.numpy.nan)
    with checkpoint.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(4, params, config=model.config)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"step 4, params/model/norm/weight: holds NaN"):
        checkpoint.Checkpointer(tmp_path / "c").restore(4)


def test_retention_never_deletes_an_intact_step_for_an_unverified_one(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("llama31")
    model = arpo_jax.from_pretrained(path)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with checkpoint.Checkpointer(tmp_path / "c", max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, params, config=model.config)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3] and ckpt.is_sealed(2) and ckpt.is_sealed(3)
        (tmp_path / "c" / "3" / checkpoint.INTEGRITY_FILE).unlink()  # step 3 unverified (e.g. killed while hashing)
        ckpt.save(4, params, config=model.config)
        ckpt.wait()
        # Two intact steps are 2 and 4: step 2 stays although two newer steps exist (one is unverified).
        assert ckpt.all_steps() == [2, 3, 4]
        ckpt.save(5, params, config=model.config)
        ckpt.wait()
        assert ckpt.all_steps() == [4, 5]  # two intact steps newer than 2 and 3: both go


def test_read_only_users_never_create_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        checkpoint.Checkpointer(tmp_path / "nope", create=False)
    assert not (tmp_path / "nope").exists()


def test_save_state_round_trip_and_sft_checkpoints_of_the_old_metadata_format(tmp_path):
    """A TrainState comes back with its counters and data position, in the target's shardings; an SFT checkpoint of
    the metadata format before `save_state` (skips as `skipped_updates`, one update per step) restores the same
    counters; a state saved without a data position (the critic's) has none."""
    from arpo_jax import models
    from arpo_jax.data.rl_dataset import DataPosition
    from arpo_jax.update import accumulate, jit

    cfg = models.Config(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, sharding_rules="fsdp_tp")
    _, params = jit.split_model(models.init_model(cfg, seed=0))
    opt = optax.adamw(1e-3)
    grads = jax.tree.map(lambda p: 0.01 * jax.numpy.ones_like(p), params)
    state = accumulate.TrainState(params, opt.update(grads, opt.init(params), params)[1], jax.numpy.asarray(5),
                          jax.numpy.asarray(2))
    with checkpoint.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save_state(7, state, config=cfg, position=DataPosition(1, 3), meta={"seed": 4})
        ckpt.save(8, params, config=cfg, opt_state=state.opt_state,  # as sft.py saved before save_state existed
                  meta={"data_position": {"epoch": 2, "step_in_epoch": 0}, "epoch": 2, "kind": "sft",
                        "skipped_updates": 3})
        ckpt.save_state(9, state, config=cfg)

    mesh = sharding.make_mesh((1, 8, 1))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shardings = jit.state_shardings(opt, jit.param_shardings(cfg, mesh), abstract, mesh)
    target = jit.abstract_train_state(opt, abstract, shardings)
    with checkpoint.Checkpointer(tmp_path / "c", create=False) as ckpt:
        new, position, meta = ckpt.restore_state(7, target)
        old = ckpt.restore_state(8, target)
        critic = ckpt.restore_state(9, target)
    assert position == DataPosition(1, 3) and meta["seed"] == 4 and meta["counters"] == {"updates": 5, "skipped": 2}
    assert (int(new.step), int(new.skipped)) == (5, 2)
    for a, b in zip(_leaves(state.params) + _leaves(state.opt_state), _leaves(new.params) + _leaves(new.opt_state)):
        np.testing.assert_array_equal(a, b)
    for x, s in zip(jax.tree.leaves((new.params, new.opt_state)), jax.tree.leaves((shardings.params,
                                                                                  shardings.opt_state))):
        assert x.sharding == s
    assert (int(old.state.step), int(old.state.skipped), old.position) == (8, 3, DataPosition(2, 0))
    assert critic.position is None and int(critic.state.step) == 5


def test_per_layer_checkpoints_of_before_stacked_layers_restore_stacked(tmp_path):
    """A checkpoint written when the layers were stored per layer (`model.layers.<i>.<weight>`, params and Adam
    moments alike) restores into the stacked layout, in the target's shardings, with every value where it was."""
    from arpo_jax import models
    from arpo_jax.update import jit

    cfg = models.Config(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=2, num_kv_heads=1, head_dim=16, qkv_bias=True, sharding_rules="fsdp_tp")
    model = models.init_model(cfg, seed=0)
    _, params = jit.split_model(model)
    opt = optax.adamw(1e-3)
    opt_state = jax.jit(lambda p: opt.update(jax.tree.map(lambda x: 0.01 + x, p), opt.init(p), p)[1])(params)

    def per_layer(tree):  # the old layout, as nnx.to_pure_dict wrote an nnx.List of layers: int keys
        def one(d):
            if not (isinstance(d, dict) and "layers" in d and "embed_tokens" in d):
                return d
            return {**d, "layers": {i: jax.tree.map(lambda x, i=i: np.asarray(x)[i], d["layers"])
                                    for i in range(cfg.num_layers)}}
        return jax.tree.map(one, tree, is_leaf=lambda d: isinstance(d, dict) and "embed_tokens" in d)

    old = per_layer(params)
    assert set(old["model"]["layers"]) == {0, 1, 2} and old["model"]["layers"][1]["mlp"]["up_proj"]["weight"].ndim == 2
    with checkpoint.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(4, old, config=cfg, opt_state=per_layer(opt_state))
        ckpt.save(5, params, config=cfg, opt_state=opt_state)  # the stacked layout: restored as is
    assert checkpoint.saved_per_layer(tmp_path / "c" / "4") and not checkpoint.saved_per_layer(tmp_path / "c" / "5")

    mesh = sharding.make_mesh((1, 4, 2))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shardings = jit.state_shardings(opt, jit.param_shardings(cfg, mesh), abstract, mesh)
    target = jit.abstract_train_state(opt, abstract, shardings)
    with checkpoint.Checkpointer(tmp_path / "c", create=False) as ckpt:
        for step in (4, 5):
            got = ckpt.restore_state(step, target).state
            assert jax.tree.structure(got.params) == jax.tree.structure(params)
            for a, b in zip(_leaves((params, opt_state)), _leaves((got.params, got.opt_state)), strict=True):
                np.testing.assert_array_equal(a, b)
            for x, s in zip(jax.tree.leaves((got.params, got.opt_state)),
                            jax.tree.leaves((shardings.params, shardings.opt_state)), strict=True):
                assert x.sharding == s
        again = ckpt.restore_model(4)  # no mesh, the stored config: as an export of an old run reads it
    for a, b in zip(_leaves(params), _leaves(jit.split_model(again)[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_intact_step_of_another_config_is_a_mismatch_not_damage(tmp_path):
    """Restoring an intact step into another tree (a LoRA config or the layer count changed) says so and names the
    step; the step is not moved aside as damaged and no older step is tried (they would not fit either)."""
    from arpo_jax import models
    from arpo_jax.update import jit

    cfg = models.Config(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    _, params = jit.split_model(models.init_model(cfg, seed=0))
    with checkpoint.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(1, params, config=cfg)
        ckpt.save(2, params, config=cfg)
    ckpt = checkpoint.Checkpointer(tmp_path / "c")
    other = cfg.replace(num_layers=2)
    with pytest.raises(checkpoint.CheckpointMismatchError, match=r"c/2 does not fit this run: its files are intact"):
        ckpt.restore(2, config=other)
    with pytest.raises(checkpoint.CheckpointMismatchError):
        ckpt.restore_newest_intact(lambda s: ckpt.restore(s, config=other))
    assert ckpt.all_steps() == [1, 2] and not list((tmp_path / "c").glob("*.damaged-*"))
    for a, b in zip(_leaves(ckpt.restore(2)[0]), _leaves(params), strict=True):  # the step's own config fits
        np.testing.assert_array_equal(a, b)
