"""ARPO, Qwen3-14B, deep search: `ARPO/scripts/ARPO_14b_Deepsearch_1node.sh` (spec 11.3).

The 8B deep-search setup with a smaller batch and group: 64 prompts x 12 trajectories (6 roots), 8 prompts per
mini-batch, R = 6192. hard_search_1k gives 16 steps an epoch, 80 in all.
"""

from arpo_jax.config.experiments import experiment

deepsearch_config = experiment("arpo_qwen3_8b_deepsearch").get_config


def get_config():
    c = deepsearch_config()
    c.model.path = "${ARPO_MODELS}/Qwen3-14B"
    c.data.max_response_length = 6192
    # 14B does not fit beside vLLM on 8 x 80 GB: its update peaks at ~58 GiB per GPU (`arpo-jax plan`, with the 8B
    # config's 12288 tokens per device); H200s (141 GB) give JAX about half and vLLM 0.45.
    c.mesh.device = "h200"
    c.rollout.vllm.gpu_memory_utilization = 0.45
    c.data.train_batch_size = 64
    c.actor.ppo_mini_batch_size = 8
    c.rollout.n = 12
    c.rollout.initial_rollouts = 6
    c.trainer.experiment = "arpo_qwen3_14b_deepsearch"
    return c
