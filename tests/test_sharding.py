"""Mesh construction, the rules table, and sharded == unsharded forward on 8 fake CPU devices."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import arpo_jax
from arpo_jax import models, sharding, testing
from arpo_jax.models.published import REAL_CONFIGS

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 8, 1), (1, 2, 4)])
@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_sharded_forward_equals_unsharded(tiny_hf_dir, mesh_shape, variant):
    path, _ = tiny_hf_dir(variant)
    ids = np.random.RandomState(0).randint(0, 512, (8, 16))
    mask = np.ones_like(ids)
    mask[:3, :4] = 0
    reference = np.asarray(arpo_jax.from_pretrained(path)(ids, attention_mask=mask))

    mesh = sharding.make_mesh(mesh_shape)
    model = arpo_jax.from_pretrained(path, mesh=mesh)
    q = model.model.layers.self_attn.q_proj.weight[...]  # [L, ...]: the layers are stored stacked
    assert len(q.sharding.device_set) == 8 and not q.sharding.is_fully_replicated
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    with jax.set_mesh(mesh):
        out = forward(state, ids, mask)
    assert not out.sharding.is_fully_replicated  # activation constraints took effect
    np.testing.assert_allclose(np.asarray(out), reference, atol=1e-5)


def test_make_mesh_fills_minus_one_and_rejects_bad_shapes():
    assert dict(sharding.make_mesh((2, -1, 1)).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(sharding.make_mesh((-1, 2, 2)).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="has 12 devices, but 8 are available"):
        sharding.make_mesh((2, 3, 2))
    with pytest.raises(ValueError, match="at most one -1"):
        sharding.make_mesh((-1, -1, 2))
    with pytest.raises(ValueError, match="not divisible by 3"):
        sharding.make_mesh((3, -1, 1))


def test_rules_table_specs_and_indivisible_fallback():
    rules = sharding.get_rules("fsdp_tp")
    mesh = {"data": 1, "fsdp": 4, "tensor": 2}
    assert sharding.logical_to_spec(("q_heads", "head_dim", "embed"), (32, 128, 4096), mesh, rules) == P(
        "tensor", None, "fsdp")
    assert sharding.logical_to_spec(("batch", "seq", "act_vocab"), (8, 10, 64), mesh, rules) == P("fsdp", None,
                                                                                                    "tensor")
    # 4 KV heads on tensor=8 cannot be split: replicated instead of an error.
    assert sharding.logical_to_spec(("kv_heads", "head_dim", "embed"), (4, 128, 3584), {"tensor": 8, "fsdp": 1},
                                    rules) == P(None, None, None)
    # A batch of 2 on data=2 x fsdp=2 keeps only the axis that divides.
    assert sharding.logical_to_spec(("batch",), (2,), {"data": 2, "fsdp": 2}, rules) == P("data")
    assert sharding.logical_to_spec(("batch",), (8,), {"data": 2, "fsdp": 2}, rules) == P(("data", "fsdp"))
    with pytest.raises(ValueError, match=r"allowed: \['fsdp', 'fsdp_tp'\]"):
        sharding.get_rules("zero3")
    with pytest.raises(KeyError, match="no entry"):
        sharding.logical_to_spec(("heads",), (4,), mesh, rules)


def test_fsdp_only_preset_never_uses_tensor():
    cfg = models.config_from_hf(REAL_CONFIGS["Qwen3-8B"], sharding_rules="fsdp")
    state = nnx.state(models.abstract_model(cfg), nnx.Param)
    plan = sharding.describe(state, sharding.make_mesh((1, 4, 2)), sharding.get_rules("fsdp"))
    assert not any("tensor" in v for v in plan.values())
    assert plan["model.layers.mlp.down_proj.weight"] == "(36, 4096, 12288) -> (None, 'fsdp', None)"


def test_sharding_plan_matches_golden_dump():
    """The reviewed plan for Qwen3-8B on (data=1, fsdp=4, tensor=2), FSDP+TP. UPDATE_GOLDEN=1 rewrites it."""
    cfg = models.config_from_hf(REAL_CONFIGS["Qwen3-8B"])
    state = nnx.state(models.abstract_model(cfg), nnx.Param)
    plan = sharding.describe(state, sharding.make_mesh((1, 4, 2)), sharding.get_rules("fsdp_tp"))
    golden = GOLDEN / "sharding_qwen3_8b_fsdp_tp_1x4x2.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps(plan, indent=1) + "\n")
    assert plan == json.loads(golden.read_text())


def test_init_model_creates_params_in_their_shardings():
    cfg = models.config_from_hf(testing.tiny_hf_config_dict("qwen3"))
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = models.init_model(cfg, seed=3, mesh=mesh)
    plain = models.init_model(cfg, seed=3)
    up = sharded.model.layers.mlp.up_proj.weight[...]
    assert up.sharding.spec == P(None, "tensor", "fsdp")  # the stacked layers' axis is never split
    for a, b in zip(jax.tree.leaves(nnx.state(sharded, nnx.Param)), jax.tree.leaves(nnx.state(plain, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)  # same values; jit may fuse differently
