"""arpo_jax: ARPO / AEPO reinforcement learning for tool-using LLM agents, in JAX."""

import os as _os


def _tune_xla_cpu() -> None:
    """Keeps XLA:CPU from sending reductions and elementwise fusions to YNNPACK (jaxlib 0.10-0.11).

    Those YNNPACK fusions are a known CPU regression (jax-ml/jax#37465): the column reduction of a norm's weight
    gradient took 9 ms instead of 0.3 ms, and the policy-update benchmark ran 1.4x faster with matmuls alone on
    YNNPACK (benchmarks/RESULTS.md). Only the CPU backend reads the flag; it must be set before JAX starts its
    backends, hence here. A value the user already put in XLA_FLAGS wins; other jaxlib versions are left alone,
    since XLA aborts on flags it does not know.
    """
    from importlib import metadata

    flags = _os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" in flags:
        return
    try:
        major_minor = tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return
    if (0, 10) <= major_minor < (0, 12):
        _os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_experimental_ynn_fusion_type=dot".strip()


_tune_xla_cpu()


from arpo_jax.models import CausalLM, Config, KVCache, init_model
from arpo_jax.sharding import make_mesh
from arpo_jax.weights.hf import save_pretrained
from arpo_jax.weights.pretrained import from_pretrained

__version__ = "0.1.0"
__all__ = ["CausalLM", "Config", "KVCache", "from_pretrained", "init_model", "make_mesh", "save_pretrained"]
