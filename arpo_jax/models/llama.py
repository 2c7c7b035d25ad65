"""Llama 3 / 3.1 / 3.2: `llama3` RoPE scaling (3.1+), tied embeddings (3.2 1B/3B): HF config <-> Config."""

from __future__ import annotations

from arpo_jax.models import hf_config as hfc
from arpo_jax.models.transformer import Config

ARCHITECTURES = {"llama": "LlamaForCausalLM"}


def from_hf_config(d: dict, **runtime) -> Config:
    if d.get("mlp_bias", False):
        raise ValueError("config.json: mlp_bias=true is not supported (no Llama 3.x release uses it)")
    return Config(**hfc.common_fields(d), qkv_bias=bool(d.get("attention_bias", False)), **runtime)


def to_hf_config(cfg: Config) -> dict:
    d = hfc.common_hf_fields(cfg, ARCHITECTURES[cfg.model_type])
    d.update(attention_bias=cfg.qkv_bias, mlp_bias=False, attention_dropout=0.0, pretraining_tp=1)
    return d
