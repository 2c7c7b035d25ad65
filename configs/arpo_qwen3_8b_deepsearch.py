"""ARPO, Qwen3-8B, deep search: `ARPO/scripts/ARPO_8B_Deepsearch_1node.sh` with `ppo_trainer_dr.yaml` (spec 11.3).

One node of 8 GPUs. hard_search_1k (1071 prompts) at 128 a step: 8 steps an epoch, 5 epochs = 40 steps; validation
on GAIA and HLE. Longer responses (R = 10000) and up to 6 tool calls per trajectory.
"""

from arpo_jax.config.schema import get_config as base_config


def get_config():
    c = base_config()
    c.model.path = "${ARPO_MODELS}/Qwen3-8B"
    c.model.ref_on_host = True
    c.mesh.shape = (1, 8, 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "a100-80gb"

    c.data.train_files = ("${ARPO_DATA}/rl/hard_search_1k.parquet",)
    c.data.val_files = ("${ARPO_DATA}/rl/gaia_test.parquet", "${ARPO_DATA}/rl/hle_test.parquet")
    c.data.max_prompt_length = 2000
    c.data.max_response_length = 10000
    c.data.train_batch_size = 128
    c.actor.ppo_mini_batch_size = 16

    c.rollout.engine = "vllm"
    c.rollout.n = 16
    c.rollout.initial_rollouts = 8
    c.rollout.beam_size = 2
    c.rollout.branch_probability = 0.5
    c.rollout.entropy_weight = 0.2
    c.rollout.rule = "arpo"
    # Planned (`arpo-jax plan`): 12288 tokens per device and micro-batch (one 12k trajectory; the scripts' 2 (P + R)
    # = 24000 needs 43 GiB per GPU) peak at 30.2 GiB: JAX takes 0.42 of an 80 GB card and vLLM 0.45 of GPU 0
    # (up to 0.53 would leave the CUDA contexts their 0.05; the scripts: 0.6).
    c.rollout.vllm.gpu_memory_utilization = 0.45

    c.tools.call_limit = 6  # ppo_trainer_dr.yaml
    c.tools.max_workers = 64
    c.tools.retry_count = 3
    c.tools.search.backend = "brightdata"
    c.tools.search.cache_file = "${ARPO_DATA}/search/search_cache.json"

    c.reward.name = "deep_research"
    c.algorithm.adv_estimator = "grpo"
    c.actor.loss = "ppo"
    c.actor.lr = 1e-6
    c.actor.kl_coef = 0.0
    c.actor.max_token_len_per_device = 12288
    c.trainer.total_epochs = 5
    c.trainer.save_freq = 5
    c.trainer.test_freq = 5
    c.trainer.experiment = "arpo_qwen3_8b_deepsearch"
    return c
