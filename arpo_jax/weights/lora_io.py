"""LoRA adapters in files and configs: PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`,
keys `base_model.model.<module path>.lora_A.weight`) that `peft` loads onto the base in transformers, and back;
the checkpoints of a LoRA run (its adapters and a pointer to the base); `arpo-jax export` (merged HF folder or PEFT
folder). The policy for `config.model.lora` is `assemble.policy.with_lora`.

Above `lora` (the adapters themselves) and the I/O layers (`hf`, `checkpoint`, `pretrained`), so those never import
it back.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jax.sharding import Mesh

from arpo_jax import models, sharding
from arpo_jax.models import lora
from arpo_jax.models.lora import base_state, config_with
from arpo_jax.models.transformer import LORA_TARGETS, CausalLM, Config, LoRAParam
from arpo_jax.weights import hf

ADAPTER_CONFIG = "adapter_config.json"
# Beside the PEFT files: the experiment settings the adapter was trained with, which `arpo-jax eval --adapter` uses
# unless told otherwise (its --config.* flags win): config field -> value.
TRAINING_SETTINGS = "training_settings.json"
TRAINED_FIELDS = ("data.system_prompt", "data.max_prompt_length", "data.max_response_length", "tools.call_limit",
                  "tools.search.enabled", "tools.python.enabled")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_HF_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


# --------------------------------------------------------------------------------------------------
# RL checkpoints of a LoRA policy: the adapters (and their optimizer state) plus a pointer to the frozen base

BASE_POINTER = "lora_base"  # the checkpoint metadata key of the pointer


def _leaf_digest(x: jax.Array) -> jax.Array:
    """Two uint32 sums over every bit pattern of `x`, position-weighted: exact modular integer arithmetic, so the
    same on any sharding or number of devices (no float reduction order)."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    idx = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
    return jnp.stack([jnp.sum(bits * (idx * jnp.uint32(2654435761) + 1)), jnp.sum(bits ^ idx)])


_tree_digest = jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))  # one program for the whole base


def base_fingerprint(params: dict, cfg: Config) -> str:
    """A hash of a LoRA model's frozen base (every bit of every base weight, computed where the weights live): what
    a checkpoint's base pointer is checked against on resume."""
    flat = {".".join(map(str, k)): v for k, v in traverse_util.flatten_dict(lora.base_params(params, cfg)).items()}
    digests = jax.device_get(_tree_digest(flat))
    h = hashlib.sha256()
    for k in sorted(flat):
        h.update(f"{k}:{flat[k].shape}:{flat[k].dtype}:{digests[k].tolist()}\n".encode())
    return h.hexdigest()[:32]


def base_pointer(model_path: str, init_checkpoint: str, folder, params: dict, model_cfg: Config) -> dict:
    """Where a LoRA run's base comes from (`init_checkpoint`'s newest step, else the HF folder `folder` that
    `model_path` resolved to: the config's `model.path` and `model.init_checkpoint`) and its hash."""
    return {"model_path": str(model_path), "folder": str(folder),
            "init_checkpoint": os.path.expandvars(str(init_checkpoint or "")),
            "hash": base_fingerprint(params, model_cfg)}


def adapters_only(tree, cfg: Config):
    """The adapters of a params-shaped tree (a TrainState: its params): what a LoRA checkpoint saves."""

    if hasattr(tree, "params"):
        return tree._replace(params=adapters_only(tree.params, cfg))
    return lora.partition(tree, lora.trainable_paths(cfg))[0]


def with_base(state, base: dict, pointer: dict, cfg: Config, shardings=None):
    """A restored adapters-only TrainState with the frozen `base` params (pure dict, loaded from the pointer's
    source) put back, copied into `shardings` (a TrainState's: the train step donates its state, `base` stays the
    caller's); raises when `base` is not the one the checkpoint was trained on (its hash)."""

    got = base_fingerprint(base, cfg)
    if got != pointer["hash"]:
        raise ValueError(f"the LoRA checkpoint's base (model.path={pointer['model_path']!r}, init_checkpoint="
                         f"{pointer['init_checkpoint']!r}) has hash {pointer['hash']}, the loaded base {got}: the "
                         "base weights changed since the checkpoint was written; restore them or start a new run")
    params = lora.combine(state.params, lora.base_params(base, cfg))
    copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=None if shardings is None else shardings.params)
    return state._replace(params=copy(params))


class CheckpointView:
    """What a run's checkpoints hold of its policy's TrainState. A LoRA run (`pointer`: `base_pointer`) saves the
    adapters, their optimizer state and the base's pointer, never the frozen base, and a restore puts the loaded
    `base` back (checking its hash); any other run saves the state as it is."""

    def __init__(self, model_cfg: Config, pointer: dict | None = None, base: dict | None = None):
        self.model_cfg, self.pointer, self.base = model_cfg, pointer, base

    @classmethod
    def for_run(cls, model_path: str, init_checkpoint: str, folder, params: dict, model_cfg: Config
                ) -> CheckpointView:
        """The view for the policy `params` loaded from `folder` (a LoRA run when `model_cfg` has adapters; the
        other arguments: `base_pointer`'s)."""
        if not model_cfg.lora_rank:
            return cls(model_cfg)
        return cls(model_cfg, base_pointer(model_path, init_checkpoint, folder, params, model_cfg), params)

    def saved(self, state, meta: dict) -> tuple:
        """(what a checkpoint stores of `state`, its metadata `meta` with the base's pointer)."""
        if self.pointer is None:
            return state, meta
        return adapters_only(state, self.model_cfg), meta | {BASE_POINTER: self.pointer}

    def target(self, target):
        """The restore target for a checkpoint of this run, from the whole state's `target`."""
        return target if self.pointer is None else adapters_only(target, self.model_cfg)

    def restored(self, state, meta: dict, shardings=None):
        """The whole TrainState from a restored `state` (`target`-shaped) and its metadata."""
        if self.pointer is None:
            return state
        return with_base(state, self.base, meta[BASE_POINTER], self.model_cfg, shardings)


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


def save_peft(model: CausalLM, path: str | os.PathLike, *, base_model: str = "", overwrite: bool = False,
              local: bool = False) -> Path:
    """Writes `model`'s adapters as a PEFT folder (float32 safetensors + adapter_config.json), atomically with the
    rules of `hf.write_folder_atomically` (only a previous export is ever replaced). In a multi-host run every
    process must call this (the adapters are gathered collectively); only process 0 writes, unless `local` (every
    process writes its own copy from its own shards, as `hf.save_state`)."""

    cfg = model.config
    if not cfg.lora_rank:
        raise ValueError("the model has no LoRA adapters (model.lora.rank = 0): nothing to export as PEFT")
    entries = []
    for key, _, var, i in hf.hf_tensors(nnx.state(model, LoRAParam), cfg.num_layers):  # per layer, as HF's keys
        shape = tuple(var.get_metadata()["hf_shape"])
        fetch = (lambda v=var, i=i, s=shape: hf.to_host(hf.layer_value(v, i), local=local).reshape(s).astype(
            np.float32, copy=False))
        entries.append((_peft_key(tuple(key.split("."))), shape, np.dtype(np.float32), fetch))

    if jax.process_index() != 0 and not local:
        for e in entries:  # take part in the collective gathers, write nothing (as `hf.save_state`)
            e[3]()
        return Path(path)

    def fill(tmp: Path) -> None:
        hf.write_safetensors(tmp / ADAPTER_WEIGHTS, entries, threads=1)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, str(base_model)), indent=2))

    return hf.write_folder_atomically(path, fill, overwrite=overwrite)


def read_json(file: Path, what: str) -> dict:
    """A JSON object file; malformed: an error naming the file (json's own message names only line and column)."""
    try:
        value = json.loads(file.read_text())
    except ValueError as e:
        raise ValueError(f"{file}: not valid JSON ({e}); {what} is expected there") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: a JSON {type(value).__name__}, not an object; {what} is expected there")
    return value


def training_settings(run_config: dict) -> dict:
    """The `TRAINED_FIELDS` of a training run's config (its `config.json`, nested dicts)."""
    out = {}
    for field in TRAINED_FIELDS:
        value = run_config
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            out[field] = value
    return out


def read_training_settings(adapter: str | os.PathLike) -> dict:
    """An adapter folder's `training_settings.json` ({} when it has none)."""
    file = Path(adapter) / TRAINING_SETTINGS
    if not file.is_file():
        return {}
    settings = read_json(file, "the adapter's training settings (config field -> value)")
    unknown = sorted(set(settings) - set(TRAINED_FIELDS))
    if unknown:
        raise ValueError(f"{file}: unknown field(s) {unknown} (allowed: {', '.join(TRAINED_FIELDS)})")
    return settings


def read_peft_config(path: str | os.PathLike) -> dict:
    """A PEFT folder's LoRA settings, checked against what this module implements."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: not a PEFT adapter folder")
    d = read_json(file, "a PEFT adapter_config.json")
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
