"""LoRA: low-rank adapters on the policy's projections, the frozen base as the reference, merged and PEFT export.

A targeted Linear `y = x W` becomes `y = x W + (alpha / r) (x A) B` (Hu et al. 2021), with A `[r, in...]` and
B `[out..., r]` float32 `LoRAParam`s (an `nnx.Param` subclass: filters split them from the base) and B zero at
the start, so a fresh adapter leaves the model unchanged. The adapter settings are part of the model config
(`Config.lora_rank / lora_alpha / lora_targets`): a config with adapters builds, shards, checkpoints and restores
them like any other param. What is LoRA-specific lives here:

- `attach` (called by `CausalLM.__init__`) and `with_adapters` (adds fresh adapters to a loaded base model);
- `trainable_paths` / `freeze_base`: the update differentiates and optimises the adapters only
  (`accumulate.PartialOptimizer`: the base gets no gradient and no optimizer state);
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

import jax
import jax.numpy as jnp
from flax import nnx
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
from arpo_jax.update import accumulate


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
# Training the adapters only; the reference = the base


@functools.cache
def trainable_paths(cfg: Config) -> frozenset[tuple]:
    """Key paths (in the params' pure dict) of the adapters: the only params a LoRA update trains."""
    state = nnx.state(models.abstract_model(cfg), LoRAParam)
    return frozenset(tuple(p) for p, _ in nnx.to_flat_state(state))


def freeze_base(optimizer, cfg: Config):
    """The optimizer to use for `cfg`'s policy: with adapters, `optimizer` over the adapters only (the base gets no
    gradient and no optimizer state, see `accumulate.PartialOptimizer`); without, `optimizer` itself."""
    return accumulate.PartialOptimizer(optimizer, trainable_paths(cfg)) if cfg.lora_rank else optimizer


def base_config(cfg: Config) -> Config:
    return cfg.replace(lora_rank=0)


def base_graphdef(cfg: Config) -> nnx.GraphDef:
    """The graph of the model without adapters: with `base_params`, the reference policy."""
    return nnx.split(models.abstract_model(base_config(cfg)), nnx.Param)[0]


def base_params(params: dict, cfg: Config) -> dict:
    """The base weights of a LoRA model's params (pure dict): the same arrays, without the adapters."""
    return accumulate.partition(params, trainable_paths(cfg))[1] if cfg.lora_rank else params


def jit_reference_logprobs(cfg: Config, *, temperature: float = 1.0, chunk: int = 256, mesh: Mesh | None = None,
                           tree: bool = False):
    """`fn(params, batch) -> (logp, entropy)` of the reference policy = the base without adapters, from a LoRA
    model's params (`train_step.jit_forward_logprobs` on `base_graphdef`; the adapters are dropped before the call,
    the base arrays are shared, never copied). `tree`: for `tree_packing` batches (tree training)."""
    from arpo_jax.update import train_step as ts

    fwd = ts.jit_forward_logprobs(base_graphdef(cfg), base_config(cfg), temperature=temperature, chunk=chunk,
                                  mesh=mesh, tree=tree)
    return OnBase(fwd, cfg)


class OnBase:
    """`fn(params, batch)` of a jitted forward on the base weights of a LoRA model's params; `lower` lowers it."""

    def __init__(self, fn, cfg: Config):
        self.fn, self.cfg = fn, cfg

    def __call__(self, params, batch):
        return self.fn(base_params(params, self.cfg), batch)

    def lower(self, params, batch):
        return self.fn.lower(base_params(params, self.cfg), batch)


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
