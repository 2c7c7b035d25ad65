"""Model families. `FAMILIES[model_type]` reads and writes that family's HF config."""

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


__all__ = ["CausalLM", "Config", "KVCache", "RopeScaling", "FAMILIES", "abstract_model", "config_from_hf",
           "config_to_hf", "param_count"]
