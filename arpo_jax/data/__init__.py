"""Data: RL prompt datasets in the reference parquet schema, deterministic batching, the built-in toy tasks.

`tfds_builders` (the optional tensorflow-datasets route) is imported only when `data.source = "tfds"`.
"""

from arpo_jax.data import toy
from arpo_jax.data.rl_dataset import (
           DataPosition,
           Example,
           RLDataset,
           batch_indices,
           encode_prompt,
           epoch_order,
           load_rl_dataset,
           shard,
           steps_per_epoch,
)

__all__ = ["DataPosition", "Example", "RLDataset", "batch_indices", "encode_prompt", "epoch_order",
           "load_rl_dataset", "shard", "steps_per_epoch", "toy"]
