"""LoRA adapters in files and configs: PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`,
keys `base_model.model.<module path>.lora_A.weight`) that `peft` loads onto the base in transformers, and back;
the policy for `config.model.lora` (`from_config`); `arpo-jax export` (merged HF folder or PEFT folder).

Above `lora` (the adapters themselves) and the I/O layers (`hf`, `checkpoint`, `pretrained`), so those never import
it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import hf, models, sharding
from arpo_jax.lora import (
    LoRAParam,
    base_state,
    config_with,
    with_adapters,
)
from arpo_jax.models.transformer import LORA_TARGETS, CausalLM, Config

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_HF_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


def from_config(model: CausalLM, lora_cfg, *, seed: int = 0, mesh: Mesh | None = None) -> CausalLM:
    """The policy for `config.model.lora`: `model` itself when rank is 0 or when it already holds these adapters
    (restored from a LoRA checkpoint), else `model` with the PEFT folder `lora_cfg.adapter` or fresh adapters."""
    if not lora_cfg.rank:
        return model
    want = config_with(model.config, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets)
    if lora_cfg.adapter:
        model = load_peft(model, os.path.expandvars(lora_cfg.adapter), mesh=mesh)
        if want != model.config:
            raise ValueError(f"model.lora.adapter={lora_cfg.adapter!r} holds rank {model.config.lora_rank}, alpha "
                             f"{model.config.lora_alpha}, targets {model.config.lora_targets}: set model.lora to match")
        return model
    if model.config.lora_rank:
        if want != model.config:
            raise ValueError(f"the starting checkpoint's adapters (rank {model.config.lora_rank}, alpha "
                             f"{model.config.lora_alpha}, {model.config.lora_targets}) differ from model.lora")
        return model
    return with_adapters(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, seed=seed, mesh=mesh)


# --------------------------------------------------------------------------------------------------
# PEFT adapter folders


def _peft_key(path: tuple) -> str:
    *module, name = (str(p) for p in path)
    return PEFT_PREFIX + ".".join(module) + f".{_HF_NAMES[name]}.weight"


def peft_config(cfg: Config, base_model: str = "") -> dict:
    """The `adapter_config.json` of PEFT's LoraConfig for `cfg`'s adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
            "target_modules": sorted(cfg.lora_targets), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base_model}


def save_peft(model: CausalLM, path: str | os.PathLike, *, base_model: str = "", overwrite: bool = False) -> Path:
    """Writes `model`'s adapters as a PEFT folder (float32 safetensors + adapter_config.json), atomically with the
    rules of `hf.write_folder_atomically` (only a previous export is ever replaced)."""

    cfg = model.config
    if not cfg.lora_rank:
        raise ValueError("the model has no LoRA adapters (model.lora.rank = 0): nothing to export as PEFT")
    entries = []
    for key, _, var, i in hf.hf_tensors(nnx.state(model, LoRAParam), cfg.num_layers):  # per layer, as HF's keys
        shape = tuple(var.get_metadata()["hf_shape"])
        fetch = (lambda v=var, i=i, s=shape: hf._to_host(hf.layer_value(v, i)).reshape(s).astype(np.float32,
                                                                                                copy=False))
        entries.append((_peft_key(tuple(key.split("."))), shape, np.dtype(np.float32), fetch))

    def fill(tmp: Path) -> None:
        hf._write_safetensors(tmp / ADAPTER_WEIGHTS, entries, threads=1)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, str(base_model)), indent=2))

    return hf.write_folder_atomically(path, fill, overwrite=overwrite)


def read_peft_config(path: str | os.PathLike) -> dict:
    """A PEFT folder's LoRA settings, checked against what this module implements."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: not a PEFT adapter folder")
    d = json.loads(file.read_text())
    problems = []
    if d.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type={d.get('peft_type')!r} (allowed: LORA)")
    for key, ok in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if d.get(key, ok) != ok:
            problems.append(f"{key}={d[key]!r} (allowed: {ok!r})")
    targets = d.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if not targets or not set(targets) <= set(LORA_TARGETS):
        problems.append(f"target_modules={targets!r} (allowed: a list of {LORA_TARGETS})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if d.get(key):
            problems.append(f"{key}={d[key]!r} (not supported: must be empty)")
    if problems:
        raise ValueError(f"{file}: " + "; ".join(problems))
    return {"rank": int(d["r"]), "alpha": float(d["lora_alpha"]), "targets": tuple(sorted(targets))}


def load_peft(model: CausalLM, path: str | os.PathLike, *, mesh: Mesh | None = None) -> CausalLM:
    """`model` (a base, or a LoRA model whose adapters are replaced) with the adapters of a PEFT folder, e.g. to
    continue training them. Every adapter of the folder's config must be present with its shape."""

    path = Path(path)
    lc = read_peft_config(path)
    cfg = config_with(model.config, lc["rank"], lc["alpha"], lc["targets"])
    abstract = nnx.state(models.abstract_model(cfg), LoRAParam)
    tensors = hf.folder_tensors(path) if (path / ADAPTER_WEIGHTS).is_file() else {}
    if not tensors:
        raise FileNotFoundError(f"{path / ADAPTER_WEIGHTS} not found")
    expected = {_peft_key(tuple(key.split("."))): (p, v, i) for key, p, v, i in hf.hf_tensors(abstract, cfg.num_layers)}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ValueError(f"{path}: adapter tensors do not match the model and {ADAPTER_CONFIG}: "
                         f"unexpected {unknown[:3]}, missing {missing[:3]}")
    rules = sharding.get_rules(cfg.sharding_rules)
    hosts: dict[tuple, list[np.ndarray]] = {}
    for key, (p, var, _) in expected.items():
        src = tensors[key]
        if tuple(src.shape) != tuple(var.get_metadata()["hf_shape"]):
            raise ValueError(f"{path}: tensor {key!r} has shape {tuple(src.shape)}, expected "
                             f"{tuple(var.get_metadata()['hf_shape'])}")
        hosts.setdefault(p, []).append(np.asarray(src.read(), np.float32))  # layers in order (`hf_tensors`)
    flat = []
    for p, var in nnx.to_flat_state(abstract):
        host = np.stack(hosts[tuple(p)]).reshape(var.shape)  # the stacked layers' adapters (small: rank r)
        target = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                  else sharding.param_sharding(var.get_metadata()["axes"], var.shape, mesh, rules))
        flat.append((p, var.replace(jax.device_put(host, target))))
    graphdef, _ = nnx.split(models.abstract_model(cfg))
    return nnx.merge(graphdef, base_state(model), nnx.from_flat_state(flat))
