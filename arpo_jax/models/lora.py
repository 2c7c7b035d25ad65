"""LoRA on the model: low-rank adapters on the policy's projections, the base without them, and the merge.

A targeted Linear `y = x W` becomes `y = x W + (alpha / r) (x A) B` (Hu et al. 2021), with A `[r, in...]` and
B `[out..., r]` float32 `LoRAParam`s (an `nnx.Param` subclass: filters split them from the base) and B zero at
the start, so a fresh adapter leaves the model unchanged. The adapter settings are part of the model config
(`Config.lora_rank / lora_alpha / lora_targets`): a config with adapters builds, shards, checkpoints and restores
them like any other param. Here (the adapters as parameters of the model):

- `attach` (in transformer.py, called by `CausalLM.__init__`) and `with_adapters` (adds fresh adapters to a loaded
  base model);
- `trainable_paths` / `partition` / `combine`: the adapters' key paths in the params' pure dict, and a params tree
  split there and joined back (a LoRA update trains them alone, `update/lora.py`; a LoRA checkpoint saves them alone,
  `weights/lora_io.py`);
- `base_config` / `base_graphdef` / `base_params` / `base_state` / `base_model`: the same params with the adapters
  left out (the base model's own graph): the reference policy, and the base a vLLM engine serves under them;
- `merged_state` / `merged_export` / `jit_engine_weights`: `W + scale * B A` (`hf.save_pretrained` exports a LoRA
  model merged, which is also what the vLLM sampler's full weight sync loads; the JAX engine samples with it).

The PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) is `weights/lora_io.py`; the update's side
(the optimizer over the adapters alone, the reference's jitted log-probs) is `update/lora.py`.

Sharding: A follows its base weight's input axes, B its output axes; the rank axis is never split (it is small,
and splitting it would turn the rank-r contractions into all-reduces).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax.sharding import Mesh

from arpo_jax import models, sharding
from arpo_jax.models.transformer import (
    LORA_TARGETS,
    CausalLM,
    Config,
    Linear,
    LoRAParam,
    lora_letters,
    lora_linears,
    split_layer_key,
)


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


# --------------------------------------------------------------------------------------------------
# The adapters' params and the base's


@functools.cache
def trainable_paths(cfg: Config) -> frozenset[tuple]:
    """Key paths (in the params' pure dict) of the adapters: the only params a LoRA update trains."""
    state = nnx.state(models.abstract_model(cfg), LoRAParam)
    return frozenset(tuple(p) for p, _ in nnx.to_flat_state(state))


def partition(tree, trainable: frozenset | None) -> tuple[Any, Any]:
    """(the leaves at the key paths ``trainable``, the rest) of a params-shaped pure dict; ``trainable`` None:
    (everything, {}). ``combine`` puts them back together."""
    if trainable is None:
        return tree, {}
    flat = traverse_util.flatten_dict(tree)
    train = {k: v for k, v in flat.items() if k in trainable}
    frozen = {k: v for k, v in flat.items() if k not in trainable}
    return traverse_util.unflatten_dict(train), traverse_util.unflatten_dict(frozen)


def combine(train, frozen):
    """The inverse of ``partition``."""
    if not frozen:
        return train
    return traverse_util.unflatten_dict(traverse_util.flatten_dict(train) | traverse_util.flatten_dict(frozen))


def base_config(cfg: Config) -> Config:
    return cfg.replace(lora_rank=0)


def base_graphdef(cfg: Config) -> nnx.GraphDef:
    """The graph of the model without adapters: with `base_params`, the reference policy."""
    return nnx.split(models.abstract_model(base_config(cfg)), nnx.Param)[0]


def base_params(params: dict, cfg: Config) -> dict:
    """The base weights of a LoRA model's params (pure dict): the same arrays, without the adapters."""
    return partition(params, trainable_paths(cfg))[1] if cfg.lora_rank else params


# --------------------------------------------------------------------------------------------------
# Merged export


def _param_key(path) -> str:
    return ".".join(str(p) for p in path)


def _delta(lin: Linear, i: int | None = None) -> jax.Array:
    """scale * B A in the weight's own layout and shape (float32): of layer i of a stacked Linear, or of all its
    layers (i None; a per-layer Linear's own)."""
    ins, outs = lora_letters(lin)
    ws = lin.spec.split("->")[0].split(",")[1]
    r, n = [c for c in "zyxwvu" if c not in lin.spec][:2]
    a, b = lin.lora_a[...].astype(jnp.float32), lin.lora_b[...].astype(jnp.float32)
    if i is not None:
        a, b = a[i], b[i]
    lead = n if a.ndim == len(ins) + 2 else ""  # the stacked layers' axis
    d = jnp.einsum(f"{lead}{outs}{r},{lead}{r}{ins}->{lead}{ws}", b, a, precision=jax.lax.Precision.HIGHEST)
    return lin.lora_scale * d


def base_state(model: CausalLM) -> nnx.State:
    """The params of `model` without its adapters (the same arrays)."""
    return nnx.split(model, LoRAParam, nnx.Param)[2]


def base_model(model: CausalLM) -> CausalLM:
    """`model` without its adapters (the same weight arrays): the base that a vLLM engine serves under them."""
    return nnx.merge(nnx.split(models.abstract_model(base_config(model.config)), nnx.Param)[0], base_state(model))


def _merged(w: jax.Array, lin: Linear, i: int | None = None) -> jax.Array:
    """W + scale * B A (see `_delta`), in W's dtype (the sum in float32)."""
    return (w.astype(jnp.float32) + _delta(lin, i)).astype(w.dtype)


def _adapted(model: CausalLM) -> dict[str, Linear]:
    """{state key of the weight (dotted path): its Linear} of every adapted Linear."""
    return {_param_key((*path, "weight")): lin for path, lin in lora_linears(model, model.config)}


@functools.lru_cache(maxsize=4)
def jit_engine_weights(graphdef: nnx.GraphDef, dtype: str):
    """jitted `params -> the JAX engine's weights` of a LoRA policy (`graphdef`: its `jit.split_model` graphdef;
    params: its pure dict): every adapted weight merged (`_merged`'s W + scale * B A, summed in float32), the adapters
    dropped (the base config's structure, `base_graphdef`), each float leaf in `dtype` (the compute dtype, as
    `jax_decode.decode_weights`). One program per weight sync, reading every weight once.

    The engine samples with these rather than the adapters: unmerged, every adapted projection of a decode step is
    three matmuls instead of one (x W, x A, (x A) B), 28 more dot kernels per layer and step (the base's 19 dots of the
    tiny test model's decode became 47), which made the `--lora` demo's RL phase 2.2x the full one's on an H200
    (issue 60). The update keeps the adapters (only they are trained); the trainer computes the old log-probs itself,
    so the engine's merged rounding never enters the loss."""
    dt = jnp.dtype(dtype)

    def weights(params):
        model = nnx.merge(graphdef, params)
        adapted = _adapted(model)
        flat = []
        for path, v in nnx.to_flat_state(base_state(model)):
            x = v[...]
            if _param_key(path) in adapted:
                x = x.astype(jnp.float32) + _delta(adapted[_param_key(path)])
            flat.append((path, v.replace(x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x)))
        return nnx.to_pure_dict(nnx.from_flat_state(flat))

    return jax.jit(weights)


def merged_export(model: CausalLM):
    """(the base params of `model`, the config without adapters, a `transform(HF key, array)` that merges each adapted
    weight as `hf.save_state` writes it): the merged HF export, one merged tensor (one layer) in memory at a time."""
    adapted = _adapted(model)

    def transform(key, w):
        state_key, i = split_layer_key(key)
        return _merged(w, adapted[state_key], i) if state_key in adapted else w

    return base_state(model), base_config(model.config), transform


def merged_state(model: CausalLM) -> tuple[nnx.State, Config]:
    """(the params of `model` with each adapter merged into its weight, all at once; the config without adapters).
    Exports use `merged_export`, which merges a tensor at a time."""
    adapted = _adapted(model)
    flat = [(p, v.replace(_merged(v[...], adapted[_param_key(p)]) if _param_key(p) in adapted else v[...]))
            for p, v in nnx.to_flat_state(base_state(model))]
    return nnx.from_flat_state(flat), base_config(model.config)
