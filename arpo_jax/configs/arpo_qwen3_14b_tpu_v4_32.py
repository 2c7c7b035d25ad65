"""ARPO, Qwen3-14B deep search (the arpo_qwen3_14b_deepsearch recipe) on a Cloud TPU v4-32 slice.

A v4-32 is 16 chips (32 GiB HBM each) on 4 hosts, so 4 JAX processes: launch with launch/tpu_pod.sh, which runs the
same command on every worker; jax.distributed.initialize() finds the slice by itself. FSDP over all 16 chips keeps
about 15 GiB of fp32 params + AdamW state per chip. If activations or the sampler's KV cache do not fit, trade FSDP
for tensor parallelism: `--config.mesh.shape="(1, 8, 2)" --config.mesh.rules=fsdp_tp` (Qwen3-14B's 40 query and
8 KV heads divide by 2). Each of the 4 processes rolls out 16 of the 64 prompts of a step.
"""

from arpo_jax.configs.arpo_qwen3_14b_deepsearch import get_config as arpo_config


def get_config():
    c = arpo_config()
    c.mesh.shape = (1, 16, 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "tpu-v4"
    c.rollout.engine = "jax"
    # `arpo-jax plan` says this does not fit yet: each host's sampler holds the whole model in float32 over its 4
    # chips (13.8 GiB each) and a dense KV cache of a worker's trajectories (40 GiB at 8 prompts x 12); it needs the
    # bounded TPU sampler of issue 31 item 7 (bf16 weights, a token budget per call).
    c.trainer.experiment = "arpo_qwen3_14b_tpu_v4_32"
    return c
