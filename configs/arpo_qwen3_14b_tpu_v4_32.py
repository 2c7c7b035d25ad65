"""ARPO, Qwen3-14B deep search (the arpo_qwen3_14b_deepsearch recipe) on a Cloud TPU v4-32 slice.

A v4-32 is 16 chips (32 GiB HBM each) on 4 hosts, so 4 JAX processes: launch with launch/tpu_pod.sh, which runs the
same command on every worker; jax.distributed.initialize() finds the slice by itself. The params and AdamW state
are sharded over all 16 chips (10.3 GiB per chip), as FSDP over 4 x tensor parallelism over 4 (Qwen3-14B's 40
query and 8 KV heads divide by 4), which splits the gathered layers and attention 4 ways. Each of the 4 processes
rolls out 16 of the 64 prompts of a step.
"""

from arpo_jax.config.experiments import experiment

arpo_config = experiment("arpo_qwen3_14b_deepsearch").get_config


def get_config():
    c = arpo_config()
    c.mesh.shape = (1, 4, 4)
    c.mesh.rules = "fsdp_tp"
    c.mesh.device = "tpu-v4"
    c.rollout.engine = "jax"
    # Memory (`arpo-jax plan`, 32 GiB a chip): one trajectory (P + R = 8192 tokens) per packed row, the update then
    # peaks at 26.5 GiB. Each host's sampler holds the whole model in bfloat16 over its 4 chips (6.9 GiB each; the
    # layers are stored stacked, so no per-call copy) beside the train state: 16 rows x 8192 slots of KV cache per
    # program (5 GiB a chip; a worker's whole call, 192 rows, would be 80) and prefill chunks of 128 tokens leave
    # 14% of a chip free (the sampler's regather is the peak program).
    c.actor.max_token_len_per_device = 8192
    c.rollout.jax.max_tokens_per_call = 16 * 8192
    c.rollout.jax.prefill_chunk = 128
    c.trainer.experiment = "arpo_qwen3_14b_tpu_v4_32"
    return c
