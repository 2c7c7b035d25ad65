"""Reading and writing the fields that all supported HF configs share, in both spellings of config.json.

transformers >= 5 writes `rope_parameters: {rope_theta, rope_type, ...}` and `dtype`; older releases (and most
published checkpoints) write `rope_theta`, `rope_scaling` and `torch_dtype`. Both are read; both are written, so an
exported folder loads in either era of transformers and in vLLM.
"""

from __future__ import annotations

from arpo_jax.models.transformer import Config, RopeScaling

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _require(d: dict, key: str):
    if key not in d:
        raise KeyError(f"config.json: required field {key!r} is missing (model_type={d.get('model_type')!r})")
    return d[key]


def rope_fields(d: dict) -> dict:
    """rope_theta and llama3 scaling from either spelling."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported; allowed: {SUPPORTED_ROPE_TYPES}")
    out = {"rope_theta": float(theta), "rope_scaling": None}
    if rope_type == "llama3":
        out["rope_scaling"] = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))),
        )
    return out


def common_fields(d: dict) -> dict:
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={d['hidden_act']!r} is not supported; allowed: ['silu']")
    hidden, heads = _require(d, "hidden_size"), _require(d, "num_attention_heads")
    eos = d.get("eos_token_id")
    return dict(
        model_type=d["model_type"],
        vocab_size=_require(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require(d, "intermediate_size"),
        num_layers=_require(d, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=d.get("pad_token_id"),
        **rope_fields(d),
    )


def checkpoint_dtype(d: dict) -> str:
    """The stored weight dtype named by config.json (`dtype` or `torch_dtype`), default float32."""
    return str(d.get("dtype") or d.get("torch_dtype") or "float32").removeprefix("torch.")


def common_hf_fields(cfg: Config, architecture: str) -> dict:
    rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    legacy_scaling = None
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        legacy_scaling = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                          "high_freq_factor": rs.high_freq_factor,
                          "original_max_position_embeddings": rs.original_max_position_embeddings}
        rope_parameters = {**legacy_scaling, "rope_theta": cfg.rope_theta}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return {
        "architectures": [architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": rope_parameters,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": legacy_scaling,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,
    }
