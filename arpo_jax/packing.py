"""Host-side batching for the policy update: mini-batches, token-budget micro-batches, sequence packing.

A rollout batch of N variable-length trajectories (prompt + response + tool results, no padding) becomes
arrays of shape [K, M, B, T]: K optimizer steps (``ppo_mini_batch_size`` sequences each, in order, no shuffle:
spec 9), M micro-batches per step (gradient accumulation), B rows per micro-batch, T tokens per row. A
micro-batch therefore holds at most ``B * T`` tokens: that is the token budget (verl's
``ppo_max_token_len_per_gpu``, here per micro-batch of the whole mesh).

Packing puts several sequences into one row (first-fit decreasing), each with its own segment id (1, 2, ...;
0 = padding) and positions restarting at 0; the model's attention mask keeps segments apart, so a packed
row computes exactly what separate padded rows would. ``pack=False`` gives one sequence per row (the padded
layout, used to test that equivalence).

Alignment: slot ``t`` of a row holds token ``x_j`` as input and is where the model predicts ``x_{j+1}``.
So every per-token array in the batch (``targets``, ``loss_weight``, ``advantages``, ``old_logp``,
``ref_logp``) describes the *next* token; ``place`` and ``unpack`` convert from/to token-aligned arrays
(value ``j`` belongs to token ``j``, as the rollout records it).

Loss normalisation is data: ``loss_weight`` holds the weight of each token's loss so that the train step
only computes ``sum(w * loss)`` and is correct for any aggregation mode and any micro-batch split:
  * ``global_token_mean`` (default): the weights make the sum over micro-batches equal ``agg_loss`` over the
    whole mini-batch (token-mean: ``w = 1 / tokens in the mini-batch``), so the update does not depend on
    how the mini-batch is split or packed.
  * ``reference``: verl's dynamic-batch weighting (spec 9): ``agg_loss`` per micro-batch, scaled by
    ``sequences in the micro-batch / sequences in the mini-batch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MICRO_NORMS = ("global_token_mean", "reference")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each of the N sequences sits in the [K, M, B, T] batch: mini-batch, micro-batch, row, start."""

    mini: np.ndarray  # [N] int
    micro: np.ndarray  # [N] int
    row: np.ndarray  # [N] int
    start: np.ndarray  # [N] int, first slot in the row
    lengths: np.ndarray  # [N] int, tokens
    shape: tuple[int, int, int, int]  # (K, M, B, T)

    def slots(self, i: int) -> tuple[int, int, int, slice]:
        """Index of sequence i's tokens in a [K, M, B, T] array."""
        return self.mini[i], self.micro[i], self.row[i], slice(self.start[i], self.start[i] + self.lengths[i])


def _fill_rows(lengths: np.ndarray, row_len: int, pack: bool) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing into rows of ``row_len`` tokens, or one per row."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep rollout order
        for r, f in enumerate(free):
            if lengths[i] <= f:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return [sorted(r) for r in rows]


def plan_layout(lengths: Sequence[int], *, mini_batch_size: int, row_len: int, rows_per_micro: int,
                pack: bool = True) -> Layout:
    """Assigns sequences to mini-batches (consecutive, in order), rows and micro-batches.

    Args:
      lengths: [N] token count of each sequence.
      mini_batch_size: sequences per optimizer step (the last mini-batch may be smaller).
      row_len: T, tokens per row; every sequence must fit in one row.
      rows_per_micro: B, rows per micro-batch (a multiple of the mesh's batch sharding).
      pack: several sequences per row (True) or one (False).

    Returns:
      The Layout; M is the largest micro-batch count of any mini-batch (the others get empty micro-batches,
      which carry zero weight), so every optimizer step has the same shapes and compiles once.
    """
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) == 0 or lengths.min() < 1:
        raise ValueError("need at least one sequence, each with at least one token")
    if lengths.max() > row_len:
        raise ValueError(f"a sequence of {lengths.max()} tokens does not fit a row of row_len={row_len}; "
                         f"raise row_len (the token budget is rows_per_micro * row_len)")
    n = len(lengths)
    mini, micro, row, start = (np.zeros(n, np.int64) for _ in range(4))
    num_micro = 1
    for k, lo in enumerate(range(0, n, mini_batch_size)):
        idx = np.arange(lo, min(lo + mini_batch_size, n))
        rows = _fill_rows(lengths[idx], row_len, pack)
        num_micro = max(num_micro, -(-len(rows) // rows_per_micro))
        for r, members in enumerate(rows):
            offset = 0
            for local in members:
                i = idx[local]
                mini[i], micro[i], row[i], start[i] = k, r // rows_per_micro, r % rows_per_micro, offset
                offset += lengths[i]
    shape = (int(mini.max()) + 1, num_micro, rows_per_micro, row_len)
    return Layout(mini, micro, row, start, lengths, shape)


def place(layout: Layout, values: Sequence[np.ndarray], dtype=np.float32) -> np.ndarray:
    """Token-aligned per-sequence values -> [K, M, B, T], shifted so slot j holds the value of token j+1."""
    out = np.zeros(layout.shape, dtype)
    for i, v in enumerate(values):
        k, m, b, sl = layout.slots(i)
        out[k, m, b, sl.start:sl.stop - 1] = np.asarray(v)[1:]
    return out


def unpack(layout: Layout, arr: np.ndarray) -> list[np.ndarray]:
    """Inverse of ``place``: [K, M, B, T] -> token-aligned values per sequence (token 0 has none: 0)."""
    arr = np.asarray(arr)
    out = []
    for i in range(len(layout.lengths)):
        k, m, b, sl = layout.slots(i)
        out.append(np.concatenate([np.zeros(1, arr.dtype), arr[k, m, b, sl.start:sl.stop - 1]]))
    return out


def loss_weights(layout: Layout, loss_masks: Sequence[np.ndarray], *, agg_mode: str = "token-mean",
                 micro_norm: str = "global_token_mean", norm_len: int | None = None) -> np.ndarray:
    """Per-token loss weights [K, M, B, T] implementing ``agg_mode`` under ``micro_norm`` (module docstring).

    Per sequence ``i`` with ``n_i`` loss tokens, ``N`` loss tokens and ``S`` sequences (with loss tokens) in the
    normalisation group (the mini-batch for ``global_token_mean``; the micro-batch for ``reference``, whose
    result is then scaled by ``S_micro / S_mini``):
      token-mean ``1/N``; seq-mean-token-sum ``1/S``; seq-mean-token-mean ``1/(S n_i)``;
      seq-mean-token-sum-norm ``1/norm_len``. The reference divides by its padded response length, i.e. the
      configured ``data.max_response_length``, a constant: pass that (the trainer does). The default, the
      longest span from a sequence's first loss token to its end, is only a fallback for direct use: it is
      shorter than the reference's whenever no response of the batch reaches the maximum, and changes from
      batch to batch.
    """
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; choose from {AGG_MODES}")
    if micro_norm not in MICRO_NORMS:
        raise ValueError(f"unknown micro_norm {micro_norm!r}; choose from {MICRO_NORMS}")
    masks = [(np.asarray(m) > 0).astype(np.float64) for m in loss_masks]
    n_tok = np.array([m[1:].sum() for m in masks])  # token 0 is never predicted
    if norm_len is None:
        norm_len = max(len(m) - int(np.argmax(m)) for m in masks if m[1:].any()) if n_tok.any() else 1
    has = n_tok > 0
    # Group key: the mini-batch (global) or the micro-batch (reference).
    group = layout.mini if micro_norm == "global_token_mean" else layout.mini * layout.shape[1] + layout.micro
    tok_in = {g: n_tok[group == g].sum() for g in np.unique(group)}
    seq_in = {g: has[group == g].sum() for g in np.unique(group)}
    scale = np.ones(len(masks))
    for i in range(len(masks)):
        g = group[i]
        if agg_mode == "token-mean":
            scale[i] = 1.0 / max(tok_in[g], 1)
        elif agg_mode == "seq-mean-token-sum":
            scale[i] = 1.0 / max(seq_in[g], 1)
        elif agg_mode == "seq-mean-token-mean":
            scale[i] = 1.0 / (max(seq_in[g], 1) * max(n_tok[i], 1))
        else:
            scale[i] = 1.0 / norm_len
        if micro_norm == "reference":
            # verl: loss * (rows in this micro-batch / per-GPU mini-batch size).
            scale[i] *= (layout.micro == layout.micro[i])[layout.mini == layout.mini[i]].sum() / max(
                (layout.mini == layout.mini[i]).sum(), 1)
    return place(layout, [m * s for m, s in zip(masks, scale)], np.float32)


def pack_batch(sequences: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray], advantages, *,
               mini_batch_size: int, row_len: int, rows_per_micro: int, pack: bool = True,
               agg_mode: str = "token-mean", micro_norm: str = "global_token_mean", norm_len: int | None = None,
               extra: dict[str, Sequence[np.ndarray]] | None = None) -> tuple[dict[str, np.ndarray], Layout]:
    """Builds the train-step batch for a rollout, as numpy arrays of shape [K, M, B, T].

    Args:
      sequences: N int arrays, the full token sequence of each trajectory (no padding).
      loss_masks: N 0/1 arrays, token-aligned (1 = model-generated token that is trained on).
      advantages: [N] per-sequence advantages (broadcast to tokens) or N token-aligned arrays.
      mini_batch_size, row_len, rows_per_micro, pack: see ``plan_layout``.
      agg_mode, micro_norm, norm_len: loss normalisation, see ``loss_weights``.
      extra: more token-aligned per-sequence arrays to place (e.g. ``old_logp``, ``ref_logp`` from a rollout).

    Returns:
      (batch, layout): batch holds ``input_ids``, ``targets``, ``positions``, ``segment_ids`` (int32) and
      ``loss_weight``, ``advantages`` (+ ``extra``) (float32), all [K, M, B, T].
    """
    sequences = [np.asarray(s) for s in sequences]
    layout = plan_layout([len(s) for s in sequences], mini_batch_size=mini_batch_size, row_len=row_len,
                         rows_per_micro=rows_per_micro, pack=pack)
    ids, targets, positions, segments = (np.zeros(layout.shape, np.int32) for _ in range(4))
    for i, s in enumerate(sequences):
        k, m, b, sl = layout.slots(i)
        ids[k, m, b, sl] = s
        targets[k, m, b, sl.start:sl.stop - 1] = s[1:]
        positions[k, m, b, sl] = np.arange(len(s))
        segments[k, m, b, sl] = segments[k, m, b].max() + 1  # 1, 2, ... in order of placement within the row
    adv = advantages
    if np.ndim(advantages) == 1 and len(advantages) == len(sequences) and np.isscalar(advantages[0]):
        adv = [np.full(len(s), a, np.float32) for s, a in zip(sequences, advantages)]
    batch = {"input_ids": ids, "targets": targets, "positions": positions, "segment_ids": segments,
             "loss_weight": loss_weights(layout, loss_masks, agg_mode=agg_mode, micro_norm=micro_norm,
                                         norm_len=norm_len),
             "advantages": place(layout, adv)}
    for name, values in (extra or {}).items():
        batch[name] = place(layout, values)
    return batch, layout
