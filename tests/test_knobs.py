"""Knobs (arpo_jax/knobs.py): a component's settings dataclass reads its config fields by the paths it declares,
with the config file's defaults and one rule per field, checked by the dataclass and reported by assemble.validate."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax import knobs
from arpo_jax.assemble import components
from arpo_jax.assemble import validate as config
from arpo_jax.config import schema as base
from arpo_jax.rollout.agent_loop import RolloutConfig
from arpo_jax.rollout.sampler import SamplingSettings
from arpo_jax.update import train_step as ts
from arpo_jax.update import value as critic

COMPONENTS = (ts.UpdateConfig, RolloutConfig, SamplingSettings, critic.CriticConfig)


@pytest.mark.parametrize("cls", COMPONENTS, ids=lambda c: c.__name__)
def test_a_component_built_from_the_base_config_is_its_default(cls):
    """Every knob path exists in base.py, its default passes its own rule, and from_config reads the same values."""
    cfg = base.get_config()
    overrides = {"seed": 0} if cls is SamplingSettings else {}
    assert knobs.from_config(cls, cfg, **overrides) == cls()
    assert knobs.problems(cls, config._leaves(cfg.to_dict())) == []


def test_from_config_reads_each_field_by_its_path_and_refuses_unknown_overrides():
    cfg = base.get_config()
    cfg.actor.clip_c, cfg.rollout.temperature, cfg.tools.call_limit = 4.0, 0.7, 2
    cfg.rollout.failures.isolate, cfg.actor.rollout_correction.threshold = False, 1.5
    upd, rollout = components.update_config(cfg), components.rollout_config(cfg)
    assert (upd.clip_c, upd.temperature, upd.rollout_correction_threshold) == (4.0, 0.7, 1.5)
    assert (rollout.call_limit, rollout.isolate_failures, rollout.prompt_length) == (2, False, 1536)
    with pytest.raises(TypeError, match="no field.*clip_cc"):
        knobs.from_config(ts.UpdateConfig, cfg, clip_cc=2.0)


def test_a_dataclass_reports_every_broken_rule_at_once():
    with pytest.raises(ValueError) as err:
        ts.UpdateConfig(clip_c=1.0, lr=0.0, kl_kind="kl4", b2=1.0)
    for words in ("clip_c=1.0 is out of range (allowed: > 1)", "lr=0.0", "kl_kind='kl4' is not a known value",
                  "b2=1.0 is out of range (allowed: 0 <= beta2 < 1)"):
        assert words in str(err.value)
    with pytest.raises(ValueError, match=r"top_k=0 is out of range \(allowed: -1 \(off\) or >= 1\)"):
        SamplingSettings(top_k=0)


def test_adam_beta2_reaches_the_optimizer():
    """actor.adam_beta2 (the knob added as the proof of one place per knob: base.py + UpdateConfig) drives AdamW's
    second moment: two steps of the update match the hand-computed AdamW at that beta2, and not at torch's 0.999."""
    cfg = base.get_config()
    cfg.actor.adam_beta2, cfg.actor.weight_decay, cfg.actor.lr = 0.5, 0.0, 0.1
    upd = components.update_config(cfg)
    opt = ts.make_optimizer(upd, total_steps=10)
    params = {"w": jnp.zeros(())}
    state = opt.init(params)
    g1, g2 = 0.1, 0.05  # below max_grad_norm: no clipping
    for g in (g1, g2):
        updates, state = opt.update({"w": jnp.asarray(g)}, state, params)
    b1, b2, lr = 0.9, 0.5, 0.1
    m = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v = b2 * (1 - b2) * g1 ** 2 + (1 - b2) * g2 ** 2
    expected = -lr * (m / (1 - b1 ** 2)) / (np.sqrt(v / (1 - b2 ** 2)) + 1e-8)
    np.testing.assert_allclose(float(updates["w"]), expected, rtol=1e-5)
    default = dataclasses.replace(upd, b2=0.999)
    state = ts.make_optimizer(default, 10).init(params)
    for g in (g1, g2):
        other, state = ts.make_optimizer(default, 10).update({"w": jnp.asarray(g)}, state, params)
    assert abs(float(other["w"]) - expected) > 1e-3  # the knob changes the step
