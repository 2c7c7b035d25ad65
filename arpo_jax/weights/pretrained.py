"""`from_pretrained`: a model by folder, GGUF file or name, above the I/O layers it dispatches to.

The layers, bottom up: `hf` (safetensors folders <-> params), `gguf_import` (GGUF -> params or an HF folder),
`named_models` (names -> a cached HF folder, converting a GGUF download), then this module.
"""

from __future__ import annotations

import os

from flax import nnx
from jax.sharding import Mesh

from arpo_jax.models.transformer import CausalLM
from arpo_jax.weights import hf, named_models


def from_pretrained(path: str | os.PathLike, *, dtype: str = "float32", mesh: Mesh | None = None,
                    param_dtype: str | None = None, **runtime) -> CausalLM:
    """Loads a model (Qwen2/2.5, Qwen3, Llama 3.x) as a CausalLM.

    Args:
      path: an HF folder (config.json and safetensors, single file or sharded with an index), a `.gguf` file
        (dequantized straight into params), or a model name (`named_models.NAMED`, e.g. "smollm2-135m-instruct").
      dtype: compute dtype; also the param dtype unless `param_dtype` is given.
      mesh: shard params over this ('data', 'fsdp', 'tensor') mesh; None = the first device.
      **runtime: remat, attention_impl, sharding_rules (see models.Config).
    """
    if named_models.is_gguf(path) and not named_models.is_named(path):
        from arpo_jax.weights import gguf_import  # the gguf package is optional

        return gguf_import.load(path, dtype=dtype, mesh=mesh, param_dtype=param_dtype, **runtime)
    path = named_models.model_folder(path)
    cfg, _ = hf.read_config(path, dtype=dtype, param_dtype=param_dtype or dtype, **runtime)
    graphdef, state = hf.load_state(path, cfg, mesh)
    return nnx.merge(graphdef, state)
