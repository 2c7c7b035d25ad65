"""Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim, no bias): HF config <-> Config."""

from __future__ import annotations

from arpo_jax.models import hf_config as hfc
from arpo_jax.models.transformer import Config

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def from_hf_config(d: dict, **runtime) -> Config:
    model_type = d["model_type"]
    if model_type == "qwen2" and d.get("use_sliding_window", False):
        raise ValueError("config.json: use_sliding_window=true is not supported (Qwen2.5 releases set it false)")
    return Config(
        **hfc.common_fields(d),
        qkv_bias=(model_type == "qwen2") or bool(d.get("attention_bias", False)),
        qk_norm=(model_type == "qwen3"),
        **runtime,
    )


def to_hf_config(cfg: Config) -> dict:
    d = hfc.common_hf_fields(cfg, ARCHITECTURES[cfg.model_type])
    if cfg.model_type == "qwen2":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        d.update(attention_bias=cfg.qkv_bias, attention_dropout=0.0, use_sliding_window=False, sliding_window=None)
    return d
