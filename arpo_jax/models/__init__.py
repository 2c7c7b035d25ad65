"""Model families. `FAMILIES[model_type]` reads and writes that family's HF config."""

import jax
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import sharding
from arpo_jax.models import llama, qwen
from arpo_jax.models.transformer import CausalLM, Config, KVCache, RopeScaling, abstract_model, param_count

FAMILIES = {"qwen2": qwen, "qwen3": qwen, "llama": llama}


def config_from_hf(d: dict, **runtime) -> Config:
    """Config from a config.json dict; `runtime` sets dtype, param_dtype, remat, attention_impl, sharding_rules."""
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json: model_type={model_type!r} is not supported; allowed: {sorted(FAMILIES)}")
    return FAMILIES[model_type].from_hf_config(d, **runtime)


def config_to_hf(cfg: Config) -> dict:
    return FAMILIES[cfg.model_type].to_hf_config(cfg)


def init_model(cfg: Config, *, seed: int = 0, mesh: Mesh | None = None) -> CausalLM:
    """A randomly initialised model. With a mesh, every param is created directly in its target sharding (the
    init is jitted with `out_shardings`), so no device ever holds the whole model."""
    if mesh is None:
        return CausalLM(cfg, rngs=nnx.Rngs(seed))
    graphdef, abstract = nnx.split(abstract_model(cfg))
    shardings = sharding.state_shardings(abstract, mesh, sharding.get_rules(cfg.sharding_rules))

    @jax.jit
    def init():
        state = nnx.state(CausalLM(cfg, rngs=nnx.Rngs(seed)))
        return jax.lax.with_sharding_constraint(state, shardings)

    return nnx.merge(graphdef, init())


__all__ = ["CausalLM", "Config", "KVCache", "RopeScaling", "FAMILIES", "abstract_model", "config_from_hf",
           "config_to_hf", "init_model", "param_count"]
