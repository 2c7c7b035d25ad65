"""LoRA in the update: the optimizer over the adapters alone, the reference policy = the base.

The adapters themselves (their params, the base without them, the merge) are `models/lora.py`; here:

- `freeze_base`: the update differentiates and optimises the adapters only (`accumulate.PartialOptimizer`: the
  base gets no gradient and no optimizer state);
- `jit_reference_logprobs`: the reference policy is the same params with the adapters left out (the base model's
  own graph, `models.lora.base_graphdef`), so no second copy of the weights exists.
"""

from __future__ import annotations

from jax.sharding import Mesh

from arpo_jax.models.lora import base_config, base_graphdef, base_params, trainable_paths
from arpo_jax.models.transformer import Config
from arpo_jax.update import accumulate


def freeze_base(optimizer, cfg: Config):
    """The optimizer to use for `cfg`'s policy: with adapters, `optimizer` over the adapters only (the base gets no
    gradient and no optimizer state, see `accumulate.PartialOptimizer`); without, `optimizer` itself."""
    return accumulate.PartialOptimizer(optimizer, trainable_paths(cfg)) if cfg.lora_rank else optimizer


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
