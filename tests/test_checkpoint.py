"""Orbax checkpoints: round trip, restore onto a different mesh shape, keep-N, and clear errors."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import arpo_jax
from arpo_jax import checkpoint, sharding


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
    q = restored["model"]["layers"][0]["self_attn"]["q_proj"]["weight"]
    assert q.sharding.mesh.shape == mesh_b.shape and q.sharding.spec == jax.P("tensor", None, "fsdp")
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
