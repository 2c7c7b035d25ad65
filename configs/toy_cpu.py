"""The built-in toy task set with a tiny random model, on CPU: the end-to-end smoke run (well under a minute a step
on 2 cores). Nothing is downloaded: `builtin:tiny` is built into the workdir, `builtin:toy` data (train and val
splits) and search corpus are generated.

  arpo-jax train --config=builtin:toy_cpu --config.trainer.max_steps=2 --workdir=runs/toy
  arpo-jax sft --config=builtin:toy_cpu --workdir=runs/toy_sft
"""

from arpo_jax.config.schema import get_config as base_config


def get_config():
    c = base_config()
    c.model.path = "builtin:tiny"
    c.model.dtype = "float32"  # CPU: no bf16 speed-up, and exact numbers for tests
    c.model.param_dtype = "float32"
    c.model.remat = "none"
    c.mesh.shape = (1, -1, 1)  # whatever devices there are (1 CPU, or 8 fake ones in tests)

    c.data.train_files = ("builtin:toy",)
    c.data.val_files = ("builtin:toy",)  # the toy val split
    c.data.max_prompt_length = 384  # the reference system prompt alone is ~270 tokens with the toy tokenizer
    c.data.max_response_length = 128
    c.data.train_batch_size = 4
    c.data.val_max_samples = 8

    c.rollout.engine = "jax"
    c.rollout.n = 4
    c.rollout.initial_rollouts = 2
    c.rollout.beam_size = 2
    c.rollout.jax.prefill_chunk = 256
    # A decode call returns when a row finishes, and at most after decode_chunk steps: the call in flight when a
    # tool result comes back delays its trajectory by up to that many steps. On 2 CPU cores (the SFT model's ARPO
    # rollout, benchmarks/loop/rollout_loop.py) 4 took 129 decode steps and 40.6 s where 16 took 155 and 44.9 s.
    c.rollout.jax.decode_chunk = 4

    c.tools.call_limit = 3
    c.tools.max_workers = 4
    c.tools.timeout_s = 30.0  # covers the Python tool's 10 s
    c.tools.python.timeout_s = 10.0
    c.tools.python.memory_mb = 1024
    c.tools.search.backend = "local"  # BM25 over the generated toy corpus; no network, no key
    c.tools.search.corpus_file = "builtin:toy"

    c.reward.name = "deep_research"
    c.actor.ppo_mini_batch_size = 2
    c.actor.lr = 1e-4  # a tiny random model has to move within a few steps
    c.actor.logprob_chunk = 128

    c.trainer.total_epochs = 1
    c.trainer.max_steps = 0  # override: --config.trainer.max_steps=N
    c.trainer.save_freq = 1
    c.trainer.test_freq = 0
    c.trainer.keep_checkpoints = 2
    c.trainer.loggers = ("console", "jsonl", "tensorboard")
    c.trainer.experiment = "toy_cpu"

    c.sft.train_files = ("builtin:toy",)
    c.sft.val_files = ()
    c.sft.cutoff_len = 640  # system prompt (~270 tokens) + question + a full tool-using solution
    c.sft.epochs = 1
    c.sft.lr = 1e-4
    c.sft.batch_size = 4
    c.sft.save_freq = 0
    c.sft.max_steps = 0
    return c
