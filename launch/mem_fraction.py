"""Prints the XLA_PYTHON_CLIENT_MEM_FRACTION a config needs: `python launch/mem_fraction.py --config=... [overrides]`.

With the co-located vLLM engine each GPU is shared: vLLM takes `rollout.vllm.gpu_memory_utilization` of it, JAX
must stay below the rest (`arpo_jax.config.jax_mem_fraction`). The JAX engine gets JAX's usual 0.9. Unknown arguments
(--workdir, ...) are ignored, so a launch script can pass its whole argument list.
"""

import sys

from arpo_jax import config

if __name__ == "__main__":
    cfg, _ = config.parse_config_args(sys.argv[1:])
    print(config.jax_mem_fraction(cfg))
