"""Prints the XLA_PYTHON_CLIENT_MEM_FRACTION a config needs: `python launch/mem_fraction.py --config=... [overrides]`.

With the co-located vLLM engine each GPU is shared: JAX gets its planned peak plus 10% headroom (`arpo-jax plan`'s
itemised model, no compile, on the device `mesh.device` names), vLLM takes `rollout.vllm.gpu_memory_utilization` of
the rest (`arpo_jax.plan.jax_mem_fraction`). The JAX engine gets JAX's usual 0.9. Unknown arguments (--workdir,
...) are ignored, so a launch script can pass its whole argument list.
"""

import os
import sys

if __name__ == "__main__":
    # The plan is arithmetic: keep this short-lived process off the GPUs (JAX would preallocate them).
    os.environ["JAX_PLATFORMS"] = "cpu"
    from arpo_jax.config import args
    from arpo_jax.plan import plan

    cfg, _ = args.parse_config_args(sys.argv[1:])
    print(plan.jax_mem_fraction(cfg))
