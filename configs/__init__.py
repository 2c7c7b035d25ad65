"""Experiment configs, shipped with the package: one ``get_config()`` per file, each built on ``base.py`` (every
field documented there).

Use them by name, from any directory and without a checkout:
``arpo-jax train --config=builtin:toy_cpu --config.trainer.max_steps=2 --workdir=runs/toy``; or copy one, edit it
and pass its path (``--config=my_exp.py``: ``from arpo_jax.config.schema import get_config`` works anywhere).

Paths use environment references expanded by ``arpo_jax.assemble.validate``:
  ARPO_DATA    the data folder, laid out like the reference release: rl/train_10k.parquet, rl/valid.parquet,
               rl/hard_search_1k.parquet, rl/gaia_test.parquet, rl/hle_test.parquet, search/search_cache.json,
               sft/ (cold-start conversations)
  ARPO_MODELS  a folder of HuggingFace model folders (Qwen2.5-7B-Instruct, Qwen3-8B, Qwen3-14B, ...)
"""
