"""RL prompt datasets in the reference parquet schema (spec 2.1-2.2) and deterministic, resumable batching.

Loading: every row becomes an `Example` whose `prompt_ids` are exactly the reference's
`encode(apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)`.
Prompt bytes are kept as stored, including the `\\x08oxed` artifact of the reference system prompt (spec 2.3).
One malformed row never stops a run: it is skipped, logged and counted in `RLDataset.skipped`.

Batching is a set of pure functions of (num_examples, epoch, step, seed): any process can compute any batch
without state, so resuming needs only a `DataPosition`, and each host takes its `shard` of the global batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from arpo_jax.data.sources import check_files, parquet_records

log = logging.getLogger(__name__)

OVERLONG_MODES = ("error", "filter")
SOURCES = ("parquet", "tfds")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: field-wise == on numpy arrays is ambiguous
class Example:
    """One RL prompt. `index` is its position in the dataset; (`source_file`, `row`) locate it on disk."""

    index: int
    source_file: str
    row: int
    data_source: str
    messages: list[dict]
    ground_truth: str | list
    prompt_ids: np.ndarray  # [prompt_len] int32, no padding
    question: str
    extra_info: dict


class RLDataset(Sequence):
    """A sequence of `Example` plus what loading dropped.

    `skipped`: (file, row, reason) of malformed rows; `filtered`: (file, row, num_tokens) of over-long prompts
    dropped with `overlong="filter"`.
    """

    def __init__(self, examples: list[Example], *, files: Sequence[str], skipped: list[tuple[str, int, str]],
                 filtered: list[tuple[str, int, int]]):
        self.examples, self.files = list(examples), tuple(files)
        self.skipped, self.filtered = list(skipped), list(filtered)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.examples[i]
        return self.examples[int(i)]  # accepts numpy integers from batch_indices

    def take(self, indices: Sequence[int] | np.ndarray) -> list[Example]:
        """The examples at `indices` (e.g. from `batch_indices` / `shard`), in that order."""
        return [self.examples[int(i)] for i in indices]

    @property
    def data_sources(self) -> tuple[str, ...]:
        """Distinct `data_source` values in order of first appearance (reward dispatch, val metric groups)."""
        return tuple(dict.fromkeys(e.data_source for e in self.examples))

    def __repr__(self) -> str:
        return (f"RLDataset({len(self)} examples from {len(self.files)} file(s), skipped={len(self.skipped)}, "
                f"filtered={len(self.filtered)}, data_sources={list(self.data_sources)})")


# ----------------------------------------------------------------------------------------------- row parsing


class MalformedRow(ValueError):
    """A row that does not fit the reference schema; the message is the reason recorded in `skipped`."""


def parse_messages(value: Any) -> list[dict]:
    """Validates a chat (list of {role: str, content: str}); returns plain dicts with the bytes unchanged."""
    if value is None or (hasattr(value, "__len__") and len(value) == 0):
        raise MalformedRow("missing or empty prompt")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise MalformedRow(f"prompt is a {type(value).__name__}, expected a list of messages")
    messages = []
    for k, m in enumerate(value):
        if not isinstance(m, dict):
            raise MalformedRow(f"message {k} is a {type(m).__name__}, expected a dict")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise MalformedRow(f"message {k} has no role")
        if not isinstance(content, str):
            raise MalformedRow(f"message {k} has no string content")
        messages.append(dict(m))
    return messages


def parse_ground_truth(reward_model: Any) -> str | list:
    """`reward_model.ground_truth`: a non-empty str or list (the reward functions accept both)."""
    if not isinstance(reward_model, dict):
        raise MalformedRow("missing reward_model")
    gt = reward_model.get("ground_truth")
    if isinstance(gt, np.ndarray):
        gt = gt.tolist()
    if isinstance(gt, (list, tuple)):
        gt = list(gt)
    elif not isinstance(gt, str):
        raise MalformedRow("missing reward_model.ground_truth")
    if len(gt) == 0:
        raise MalformedRow("empty reward_model.ground_truth")
    return gt


def question_of(messages: list[dict], extra_info: dict) -> str:
    """`extra_info.question` when present (all reference files have it), else the last user message."""
    q = extra_info.get("question")
    if isinstance(q, str) and q:
        return q
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else ""


def parse_record(record: dict, prompt_key: str) -> dict:
    """The fields of `Example` that come from the row itself; raises `MalformedRow`."""
    if not isinstance(record, dict):
        raise MalformedRow(f"row is a {type(record).__name__}, expected a dict")
    data_source = record.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise MalformedRow("missing data_source")
    messages = parse_messages(record.get(prompt_key))
    ground_truth = parse_ground_truth(record.get("reward_model"))
    extra_info = record.get("extra_info")
    extra_info = dict(extra_info) if isinstance(extra_info, dict) else {}
    return dict(data_source=data_source, messages=messages, ground_truth=ground_truth, extra_info=extra_info,
                question=question_of(messages, extra_info))


def encode_prompt(tokenizer, messages: list[dict]) -> np.ndarray:
    """Spec 2.2: chat template as text (generation prompt on), then encoded without special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)


# ----------------------------------------------------------------------------------------------- loading


MAX_ROW_WARNINGS = 5  # malformed rows logged one by one; the rest are counted


def _overlong_error(f: str, row: int, n: int, max_prompt_length: int) -> ValueError:
    return ValueError(
        f"{f} row {row}: the prompt is {n} tokens after the chat template, longer than data.max_prompt_length="
        f"{max_prompt_length}. Raise data.max_prompt_length, or set data.overlong_prompts='filter' to drop such "
        f"prompts (allowed: {'|'.join(OVERLONG_MODES)}).")


def load_rl_dataset(files: str | Sequence[str], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int,
                    overlong: str = "error", max_samples: int = 0, source: str = "parquet",
                    tfds_data_dir: str = "") -> RLDataset:
    """Loads reference-schema RL files into an `RLDataset` (files concatenated in order).

    Args:
      files: parquet path(s) in the reference schema (spec 2.1).
      tokenizer: an HF tokenizer with a chat template.
      prompt_key: column holding the chat messages (`data.prompt_key`).
      max_prompt_length: P; prompts longer than this (in tokens) are over-long.
      overlong: "error" raises on the first over-long prompt (the reference's truncation=error); "filter" drops
        them and records them in `RLDataset.filtered`.
      max_samples: keep only the first this-many valid examples; 0 = all.
      source: "parquet" (pyarrow) or "tfds" (converted once to array_record, read with `tfds.data_source`).
      tfds_data_dir: where the tfds route keeps its prepared datasets ("" = $TFDS_DATA_DIR or a user cache).

    Raises:
      FileNotFoundError: a file does not exist. ValueError: bad arguments, an over-long prompt in "error" mode, or
      no valid row at all.
    """
    if overlong not in OVERLONG_MODES:
        raise ValueError(f"data.overlong_prompts={overlong!r}; allowed: {'|'.join(OVERLONG_MODES)}")
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r}; allowed: {'|'.join(SOURCES)}")
    if max_prompt_length <= 0:
        raise ValueError(f"data.max_prompt_length must be positive, got {max_prompt_length}")
    files = check_files(files)
    if source == "tfds":
        from arpo_jax.data import tfds_builders

        records = tfds_builders.tfds_records(files, data_dir=tfds_data_dir)
    else:
        records = parquet_records(files)

    examples, skipped, filtered = [], [], []
    for f, row, record in records:
        if max_samples and len(examples) >= max_samples:
            break
        try:
            fields = parse_record(record, prompt_key)
        except MalformedRow as e:
            if len(skipped) < MAX_ROW_WARNINGS:
                log.warning("skipping %s row %d: %s", f, row, e)
            skipped.append((f, row, str(e)))
            continue
        ids = encode_prompt(tokenizer, fields["messages"])
        if len(ids) > max_prompt_length:
            if overlong == "error":
                raise _overlong_error(f, row, len(ids), max_prompt_length)
            filtered.append((f, row, len(ids)))
            continue
        examples.append(Example(index=len(examples), source_file=f, row=row, prompt_ids=ids, **fields))

    if len(skipped) > MAX_ROW_WARNINGS:
        log.warning("skipped %d malformed row(s) in all (the first %d are shown above)", len(skipped),
                    MAX_ROW_WARNINGS)
    if filtered:
        log.warning("dropped %d prompt(s) longer than data.max_prompt_length=%d (data.overlong_prompts=filter)",
                    len(filtered), max_prompt_length)
    if not examples:
        raise ValueError(f"no valid examples in {files} ({len(skipped)} malformed row(s) skipped, "
                         f"{len(filtered)} over-long prompt(s) filtered)")
    return RLDataset(examples, files=files, skipped=skipped, filtered=filtered)


# ----------------------------------------------------------------------------------------------- batching


def epoch_order(num_examples: int, epoch: int, *, seed: int, shuffle: bool) -> np.ndarray:
    """The order of the dataset in `epoch`: a permutation seeded by (seed, epoch), or the identity."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    # A fresh generator per (seed, epoch): epoch k's order needs no replay of epochs 0..k-1, so resuming is free.
    return np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)


def steps_per_epoch(num_examples: int, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch; drop_last drops the incomplete tail batch (torch DataLoader semantics)."""
    if batch_size <= 0:
        raise ValueError(f"data.train_batch_size must be positive, got {batch_size}")
    return num_examples // batch_size if drop_last else math.ceil(num_examples / batch_size)


def batch_indices(num_examples: int, batch_size: int, epoch: int, step_in_epoch: int, *, seed: int, shuffle: bool,
                  drop_last: bool) -> np.ndarray:
    """Global dataset indices of batch `step_in_epoch` of `epoch` ([batch_size], the last may be shorter)."""
    n_steps = steps_per_epoch(num_examples, batch_size, drop_last)
    if not 0 <= step_in_epoch < n_steps:
        raise IndexError(f"step_in_epoch={step_in_epoch} outside [0, {n_steps}) for {num_examples} examples at "
                         f"data.train_batch_size={batch_size} (drop_last={drop_last})")
    order = epoch_order(num_examples, epoch, seed=seed, shuffle=shuffle)
    return order[step_in_epoch * batch_size:(step_in_epoch + 1) * batch_size]


def shard(indices: np.ndarray, shard_index: int, num_shards: int) -> np.ndarray:
    """The `shard_index`-th of `num_shards` equal contiguous slices of a batch (one per host / rollout worker)."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index={shard_index} outside [0, {num_shards})")
    if len(indices) % num_shards:
        raise ValueError(f"a batch of {len(indices)} prompts does not split evenly over {num_shards} shards; make "
                         f"data.train_batch_size a multiple of {num_shards}")
    size = len(indices) // num_shards
    return indices[shard_index * size:(shard_index + 1) * size]


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where the next batch comes from; saved with checkpoints so a resumed run continues the same order."""

    epoch: int = 0
    step_in_epoch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": int(self.epoch), "step_in_epoch": int(self.step_in_epoch)}

    @classmethod
    def from_dict(cls, d: dict) -> DataPosition:
        return cls(epoch=int(d["epoch"]), step_in_epoch=int(d["step_in_epoch"]))

    def advance(self, steps_per_epoch: int) -> DataPosition:
        """The position after one more batch, rolling over into the next epoch."""
        if steps_per_epoch <= 0:
            raise ValueError(f"steps_per_epoch must be positive, got {steps_per_epoch} (dataset smaller than "
                             "data.train_batch_size with data.drop_last=True?)")
        step = self.step_in_epoch + 1
        return DataPosition(self.epoch + 1, 0) if step >= steps_per_epoch else DataPosition(self.epoch, step)
