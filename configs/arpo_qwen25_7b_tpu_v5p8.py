"""ARPO, Qwen2.5-7B-Instruct reasoning (the arpo_qwen25_7b_reasoning recipe) on a Cloud TPU v5p-8 slice.

A v5p-8 is one host with 4 chips (the "8" counts TensorCores; each chip is one JAX device with 95 GB HBM): FSDP over
the 4 chips, and the JAX KV-cache sampler instead of vLLM (no co-located vLLM on TPU). Every other value is the
reference script's. Launch with launch/tpu_pod.sh (a single host also works with launch/local.sh on the VM).
"""

from arpo_jax.config.experiments import experiment

arpo_config = experiment("arpo_qwen25_7b_reasoning").get_config


def get_config():
    c = arpo_config()
    c.mesh.shape = (1, 4, 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "tpu-v5p"
    c.rollout.engine = "jax"
    # Memory (`arpo-jax plan`): the JAX sampler runs a call's trajectories in chunks of 256 rows x 6144 cache slots
    # (21 GiB of KV cache per chip; one worker's whole call, 2048 rows, would be 168 GiB) and prefills in chunks of
    # 128 tokens (float32 scores [B, N, chunk, S]). Its peak (the regather, old and new cache side by side) leaves
    # 24% of a chip free, the update 40%.
    c.rollout.jax.max_tokens_per_call = 256 * 6144
    c.rollout.jax.prefill_chunk = 128
    c.trainer.experiment = "arpo_qwen25_7b_tpu_v5p8"
    return c
