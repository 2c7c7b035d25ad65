"""ARPO, Qwen2.5-7B-Instruct reasoning (the arpo_qwen25_7b_reasoning recipe) on a Cloud TPU v5p-8 slice.

A v5p-8 is one host with 4 chips (the "8" counts TensorCores; each chip is one JAX device with 95 GB HBM): FSDP over
the 4 chips, and the JAX KV-cache sampler instead of vLLM (no co-located vLLM on TPU). Every other value is the
reference script's. Launch with launch/tpu_pod.sh (a single host also works with launch/local.sh on the VM).
"""

from arpo_jax.configs.arpo_qwen25_7b_reasoning import get_config as arpo_config


def get_config():
    c = arpo_config()
    c.mesh.shape = (1, 4, 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "tpu-v5p"
    c.rollout.engine = "jax"
    # Memory (`arpo-jax plan`): the JAX sampler puts a worker's trajectories in one dense cache and keeps it between
    # calls, so 16 rollout workers of 8 prompts (128 rows, 10.5 GiB of cache per chip instead of 168) and prefill
    # chunks of 128 (float32 scores [B, N, chunk, S]); one trajectory per packed row (4 rows per chip).
    c.rollout.workers = 16
    c.rollout.jax.prefill_chunk = 128
    c.actor.max_token_len_per_device = 5632
    c.trainer.experiment = "arpo_qwen25_7b_tpu_v5p8"
    return c
