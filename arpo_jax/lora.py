"""LoRA: low-rank adapters on the policy's projections, the frozen base as the reference, merged and PEFT export.

A targeted Linear `y = x W` becomes `y = x W + (alpha / r) (x A) B` (Hu et al. 2021), with A `[r, in...]` and
B `[out..., r]` float32 `LoRAParam`s (an `nnx.Param` subclass: filters split them from the base) and B zero at
the start, so a fresh adapter leaves the model unchanged. The adapter settings are part of the model config
(`Config.lora_rank / lora_alpha / lora_targets`): a config with adapters builds, shards, checkpoints and restores
them like any other param. What is LoRA-specific lives here:

- `attach` (called by `CausalLM.__init__`) and `with_adapters` (adds fresh adapters to a loaded base model);
- `trainable_paths` / `freeze_base`: the update differentiates and optimises the adapters only
  (`train_step.PartialOptimizer`: the base gets no gradient and no optimizer state);
- `base_graphdef` / `base_params` / `jit_reference_logprobs`: the reference policy is the same params with the
  adapters left out (the base model's own graph), so no second copy of the weights exists;
- `merged_state`: `W + scale * B A` in the HF layout (`hf.save_pretrained` exports a LoRA model merged, which is
  also what the vLLM sampler's weight sync loads);
- `save_peft` / `load_peft`: a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`, keys
  `base_model.model.<module path>.lora_A.weight`) that `peft` loads onto the base in transformers, and back.

Sharding: A follows its base weight's input axes, B its output axes; the rank axis is never split (it is small,
and splitting it would turn the rank-r contractions into all-reduces).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import models, sharding
from arpo_jax.models.transformer import LORA_TARGETS, CausalLM, Config, Linear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_HF_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: a Param (saved, sharded, restored as one), told apart by its type."""


def scale(cfg: Config) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def _letters(linear: Linear) -> tuple[str, str]:
    """(input letters, output letters) of a Linear's weight, in its weight's (HF) order."""
    (xs, ws), out = linear.spec.split("->")[0].split(","), linear.spec.split("->")[1]
    return "".join(c for c in ws if c in xs[2:]), "".join(c for c in ws if c in out[2:])


def _targets(model: nnx.Module, cfg: Config):
    """(path, Linear) of every Linear the config puts an adapter on (matched by its HF module name)."""
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in cfg.lora_targets:
            yield path, module


def attach(model: CausalLM, rngs: nnx.Rngs) -> None:
    """Gives each targeted Linear of `model` its adapters (in place): A ~ U(-1/sqrt(in), 1/sqrt(in)) as PEFT's
    default (kaiming-uniform with a = sqrt(5)), B = 0."""
    cfg = model.config
    r = cfg.lora_rank
    for _, lin in list(_targets(model, cfg)):
        ins, outs = _letters(lin)
        ws, w = lin.spec.split("->")[0].split(",")[1], lin.weight
        in_shape, in_axes = tuple(w.shape[ws.index(c)] for c in ins), tuple(w.axes[ws.index(c)] for c in ins)
        out_shape, out_axes = tuple(w.shape[ws.index(c)] for c in outs), tuple(w.axes[ws.index(c)] for c in outs)
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (r, *in_shape), jnp.float32, -bound, bound)
        lin.lora_a = LoRAParam(a, axes=(None, *in_axes), hf_shape=(r, math.prod(in_shape)))
        lin.lora_b = LoRAParam(jnp.zeros((*out_shape, r), jnp.float32), axes=(*out_axes, None),
                               hf_shape=(math.prod(out_shape), r))
        lin.lora_scale = scale(cfg)


def config_with(cfg: Config, rank: int, alpha: float, targets=LORA_TARGETS) -> Config:
    """`cfg` with the given adapters (rank 0: none)."""
    return cfg.replace(lora_rank=int(rank), lora_alpha=float(alpha), lora_targets=tuple(targets))


def _adapter_state(cfg: Config, seed: int, mesh: Mesh | None) -> nnx.State:
    """Fresh adapters for `cfg`, created in their shardings. The whole model is traced but only the adapters are
    outputs: XLA drops the base's random init, so this allocates the adapters alone."""
    def init():
        return nnx.state(CausalLM(cfg, rngs=nnx.Rngs(seed)), LoRAParam)

    if mesh is None:
        return jax.jit(init)()
    abstract = nnx.state(models.abstract_model(cfg), LoRAParam)
    shardings = sharding.state_shardings(abstract, mesh, sharding.get_rules(cfg.sharding_rules))
    return jax.jit(init, out_shardings=shardings)()


def with_adapters(model: CausalLM, rank: int, alpha: float, targets=LORA_TARGETS, *, seed: int = 0,
                  mesh: Mesh | None = None) -> CausalLM:
    """`model` (a base without adapters) with fresh adapters: its own weight arrays (not copied) plus A, B."""
    if model.config.lora_rank:
        raise ValueError("the model already has LoRA adapters")
    cfg = config_with(model.config, rank, alpha, targets)
    graphdef, _ = nnx.split(models.abstract_model(cfg))
    return nnx.merge(graphdef, nnx.state(model), _adapter_state(cfg, seed, mesh))


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
# Training the adapters only; the reference = the base


@functools.cache
def trainable_paths(cfg: Config) -> frozenset[tuple]:
    """Key paths (in the params' pure dict) of the adapters: the only params a LoRA update trains."""
    state = nnx.state(models.abstract_model(cfg), LoRAParam)
    return frozenset(tuple(p) for p, _ in nnx.to_flat_state(state))


def freeze_base(optimizer, cfg: Config):
    """The optimizer to use for `cfg`'s policy: with adapters, `optimizer` over the adapters only (the base gets no
    gradient and no optimizer state, see `train_step.PartialOptimizer`); without, `optimizer` itself."""
    from arpo_jax import train_step as ts

    return ts.PartialOptimizer(optimizer, trainable_paths(cfg)) if cfg.lora_rank else optimizer


def base_config(cfg: Config) -> Config:
    return cfg.replace(lora_rank=0)


def base_graphdef(cfg: Config) -> nnx.GraphDef:
    """The graph of the model without adapters: with `base_params`, the reference policy."""
    return nnx.split(models.abstract_model(base_config(cfg)), nnx.Param)[0]


def base_params(params: dict, cfg: Config) -> dict:
    """The base weights of a LoRA model's params (pure dict): the same arrays, without the adapters."""
    from arpo_jax import train_step as ts

    return ts.partition(params, trainable_paths(cfg))[1] if cfg.lora_rank else params


def jit_reference_logprobs(cfg: Config, *, temperature: float = 1.0, chunk: int = 256, mesh: Mesh | None = None):
    """`fn(params, batch) -> (logp, entropy)` of the reference policy = the base without adapters, from a LoRA
    model's params (`train_step.jit_forward_logprobs` on `base_graphdef`; the adapters are dropped before the call,
    the base arrays are shared, never copied)."""
    from arpo_jax import train_step as ts

    fwd = ts.jit_forward_logprobs(base_graphdef(cfg), base_config(cfg), temperature=temperature, chunk=chunk,
                                  mesh=mesh)
    return lambda params, batch: fwd(base_params(params, cfg), batch)


# --------------------------------------------------------------------------------------------------
# Merged export


def _param_key(path) -> str:
    return ".".join(str(p) for p in path)


def _delta(lin: Linear) -> jax.Array:
    """scale * B A in the weight's own layout and shape (float32)."""
    ins, outs = _letters(lin)
    ws = lin.spec.split("->")[0].split(",")[1]
    r = next(c for c in "zyxwvu" if c not in lin.spec)
    d = jnp.einsum(f"{outs}{r},{r}{ins}->{ws}", lin.lora_b[...].astype(jnp.float32),
                   lin.lora_a[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return lin.lora_scale * d


def _base_state(model: CausalLM) -> nnx.State:
    """The params of `model` without its adapters (the same arrays)."""
    return nnx.split(model, LoRAParam, nnx.Param)[2]


def _merged_weight(lin: Linear) -> jax.Array:
    """W + scale * B A of one adapted Linear, in W's dtype (the sum in float32)."""
    w = lin.weight[...]
    return (w.astype(jnp.float32) + _delta(lin)).astype(w.dtype)


def merged_export(model: CausalLM):
    """(the base params of `model`, the config without adapters, a `transform(key, array)` that merges each adapted
    weight as `hf.save_state` writes it): the merged HF export, one merged tensor in memory at a time."""
    merged = {_param_key((*path, "weight")): lin for path, lin in _targets(model, model.config)}
    transform = lambda key, w: _merged_weight(merged[key]) if key in merged else w
    return _base_state(model), base_config(model.config), transform


def merged_state(model: CausalLM) -> tuple[nnx.State, Config]:
    """(the params of `model` with each adapter merged into its weight, all at once; the config without adapters).
    Exports use `merged_export`, which merges a tensor at a time."""
    state, cfg, transform = merged_export(model)
    flat = [(p, v.replace(transform(_param_key(p), v[...]))) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat), cfg


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
    from arpo_jax import hf

    cfg = model.config
    if not cfg.lora_rank:
        raise ValueError("the model has no LoRA adapters (model.lora.rank = 0): nothing to export as PEFT")
    entries = []
    for p, var in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        shape = tuple(var.get_metadata()["hf_shape"])
        fetch = (lambda v=var, s=shape: hf._to_host(v[...]).reshape(s).astype(np.float32, copy=False))
        entries.append((_peft_key(p), shape, np.dtype(np.float32), fetch))

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
    from arpo_jax import hf

    path = Path(path)
    lc = read_peft_config(path)
    cfg = config_with(model.config, lc["rank"], lc["alpha"], lc["targets"])
    abstract = nnx.state(models.abstract_model(cfg), LoRAParam)
    tensors = hf.folder_tensors(path) if (path / ADAPTER_WEIGHTS).is_file() else {}
    if not tensors:
        raise FileNotFoundError(f"{path / ADAPTER_WEIGHTS} not found")
    expected = {_peft_key(p): (p, v) for p, v in nnx.to_flat_state(abstract)}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ValueError(f"{path}: adapter tensors do not match the model and {ADAPTER_CONFIG}: "
                         f"unexpected {unknown[:3]}, missing {missing[:3]}")
    rules = sharding.get_rules(cfg.sharding_rules)
    flat = []
    for key, (p, var) in expected.items():
        src = tensors[key]
        if tuple(src.shape) != tuple(var.get_metadata()["hf_shape"]):
            raise ValueError(f"{path}: tensor {key!r} has shape {tuple(src.shape)}, expected "
                             f"{tuple(var.get_metadata()['hf_shape'])}")
        host = np.asarray(src.read(), np.float32).reshape(var.shape)
        target = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None
                  else sharding.param_sharding(var.get_metadata()["axes"], var.shape, mesh, rules))
        flat.append((p, var.replace(jax.device_put(host, target))))
    graphdef, _ = nnx.split(models.abstract_model(cfg))
    return nnx.merge(graphdef, _base_state(model), nnx.from_flat_state(flat))


# --------------------------------------------------------------------------------------------------
# `arpo-jax export`

EXPORT_FORMATS = ("merged", "peft")


def export(out: str | os.PathLike, *, fmt: str = "merged", ckpt: str | os.PathLike | None = None,
           step: int | None = None, adapter: str | os.PathLike | None = None, base: str | os.PathLike | None = None,
           dtype: str | None = None, overwrite: bool = False) -> dict:
    """Writes a LoRA model as a merged HF folder (`fmt="merged"`) or a PEFT adapter folder (`"peft"`).

    The model: the newest (or `step`) of an orbax checkpoint directory `ckpt` of a LoRA run, or the PEFT folder
    `adapter` on the HF folder `base`. `base` is also what the PEFT folder's `base_model_name_or_path` names.
    """
    from arpo_jax import checkpoint, convert, hf

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"--format {fmt!r}; allowed: {EXPORT_FORMATS}")
    if (ckpt is None) == (adapter is None):
        raise ValueError("export needs exactly one source: --ckpt RUN/checkpoints, or --adapter PEFT_FOLDER --base HF")
    if adapter is not None and base is None:
        raise ValueError("--adapter needs --base: the HF folder the adapter was trained on")
    hf.check_export_destination(out, overwrite=overwrite)
    tokenizer = None
    if ckpt is not None:
        ckpt = Path(ckpt)
        model = checkpoint.Checkpointer(ckpt, create=False).restore_model(step)
        if (ckpt / convert.TOKENIZER_SUBDIR).is_dir():
            tokenizer = ckpt / convert.TOKENIZER_SUBDIR
    else:
        model = load_peft(hf.from_pretrained(base, dtype=dtype or hf.checkpoint_dtype(base)), adapter)
        tokenizer = base if any((Path(base) / f).is_file() for f in hf.TOKENIZER_FILES) else None
    if not model.config.lora_rank:
        raise ValueError(f"{ckpt}: the checkpoint holds no LoRA adapters (use `arpo-jax convert orbax-to-hf`)")
    if fmt == "peft":
        written = save_peft(model, out, base_model=str(base or ""), overwrite=overwrite)
    else:
        written = hf.save_pretrained(model, out, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)
    return {"out": str(written), "format": fmt, "rank": model.config.lora_rank, "alpha": model.config.lora_alpha,
            "targets": list(model.config.lora_targets)}
