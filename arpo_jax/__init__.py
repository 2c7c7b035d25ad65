"""arpo_jax: ARPO / AEPO reinforcement learning for tool-using LLM agents, in JAX."""

from arpo_jax.hf import from_pretrained, save_pretrained
from arpo_jax.models import CausalLM, Config, KVCache, init_model
from arpo_jax.sharding import make_mesh

__version__ = "0.1.0"
__all__ = ["CausalLM", "Config", "KVCache", "from_pretrained", "init_model", "make_mesh", "save_pretrained"]
