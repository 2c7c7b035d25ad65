"""ARPO, Qwen2.5-7B-Instruct, reasoning + search mix: `ARPO/scripts/ARPO_7B_Reasoning_1node.sh` (spec 11.3).

One node of 8 A100/H100 (80 GB): FSDP over the 8 GPUs, a co-located vLLM engine samples. 128 prompts x 16
trajectories per step, 8 optimizer steps of 16 prompts each; train_10k gives 78 steps an epoch, 156 in all.
The reference starts RL from the cold-start SFT model: pass `--config.model.init_checkpoint=<sft workdir>/checkpoints`
(see sft_qwen25_7b.py) or point model.path at an exported SFT folder.
"""

from arpo_jax.config.schema import get_config as base_config


def get_config():
    c = base_config()
    c.model.path = "${ARPO_MODELS}/Qwen2.5-7B-Instruct"
    c.model.ref_on_host = True  # scripts: ref param offload on (only loaded when actor.kl_coef > 0)
    c.mesh.shape = (1, 8, 1)  # 8 GPUs, FSDP (scripts: FSDP, rollout TP 1)
    c.mesh.rules = "fsdp"
    c.mesh.device = "a100-80gb"  # the smaller of the two 80 GB cards the reference ran on

    c.data.train_files = ("${ARPO_DATA}/rl/train_10k.parquet",)
    c.data.val_files = ("${ARPO_DATA}/rl/valid.parquet",)
    c.data.max_prompt_length = 1536  # P
    c.data.max_response_length = 4096  # R
    c.data.train_batch_size = 128
    c.actor.ppo_mini_batch_size = 16

    c.rollout.engine = "vllm"
    c.rollout.n = 16
    c.rollout.initial_rollouts = 8  # m
    c.rollout.beam_size = 2
    c.rollout.branch_probability = 0.5  # p
    c.rollout.entropy_weight = 0.2  # w
    c.rollout.rule = "arpo"
    # vLLM beside JAX on each GPU: the update peaks at 27.7 GiB per GPU (`arpo-jax plan`, benchmarks/RESULTS.md), so
    # JAX needs 0.39 of an 80 GB card and vLLM gets 0.5 (the scripts' 0.7 would leave JAX 18 GiB).
    c.rollout.vllm.gpu_memory_utilization = 0.5

    c.tools.call_limit = 3  # ARPO ppo_trainer.yaml (spec 6.3)
    c.tools.max_workers = 64
    c.tools.retry_count = 3
    c.tools.search.backend = "brightdata"  # key from $BRIGHTDATA_API_KEY, never from this file
    c.tools.search.cache_file = "${ARPO_DATA}/search/search_cache.json"  # read and appended (reference format)

    c.reward.name = "deep_research"
    c.algorithm.adv_estimator = "grpo"
    c.actor.loss = "ppo"
    c.actor.lr = 1e-6
    c.actor.kl_coef = 0.0  # scripts: use_kl_loss=True with kl_loss_coef=0.0, i.e. no KL term
    c.actor.max_token_len_per_device = 0  # = 2 (P + R), as the scripts
    c.trainer.total_epochs = 2
    c.trainer.save_freq = 5
    c.trainer.test_freq = 5
    c.trainer.experiment = "arpo_qwen25_7b_reasoning"
    return c
