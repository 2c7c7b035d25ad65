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

Loss normalisation is data, and this module is its one owner: ``loss_weight`` holds the weight of each token's
loss so that the train step only computes ``sum(w * per-token loss)`` (policy, KL, entropy and value losses alike)
and is correct for any aggregation mode (``AGG_MODES``: verl's ``agg_loss`` modes, spec 8.3) and any micro-batch
split (``MICRO_NORMS``):
  * ``global_token_mean`` (default): the weights make the sum over micro-batches equal verl's ``agg_loss`` over
    the whole mini-batch (token-mean: ``w = 1 / tokens in the mini-batch``), so the update does not depend on
    how the mini-batch is split or packed. With several rollout workers, each packing its share of every
    mini-batch, the counts are those of the whole mini-batch (``loss_totals`` summed over the workers).
  * ``reference``: verl's dynamic-batch weighting (spec 9): ``agg_loss`` per micro-batch, scaled by
    ``sequences in the micro-batch / sequences in the mini-batch``, and the workers (verl's ranks) averaged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arpo_jax import knobs

# How a loss aggregates over tokens and sequences (verl's `agg_loss` modes, spec 8.3) and is normalised over
# micro-batches: the loss weights below implement them (`loss_weights`); the update's config names them too.
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MICRO_NORMS = ("global_token_mean", "reference")


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """How a step's trajectories become the update's batches (the knobs: config/schema.py)."""

    group_size: int = knobs.knob("rollout.n", knobs.POSITIVE)  # trajectories per prompt
    mini_batch_prompts: int = knobs.knob("actor.ppo_mini_batch_size", knobs.POSITIVE)  # prompts per optimizer step
    pack: bool = knobs.knob("actor.pack")  # several sequences per row
    tree: bool = knobs.knob("actor.tree_training")  # shared prefixes once (`tree_packing`)
    agg_mode: str = knobs.knob("actor.agg_mode", knobs.one_of(AGG_MODES))
    micro_norm: str = knobs.knob("actor.micro_norm", knobs.one_of(MICRO_NORMS))
    norm_len: int = knobs.knob("data.max_response_length", knobs.POSITIVE)  # seq-mean-token-sum-norm's divisor
    row_len: int = knobs.knob("actor.max_token_len_per_device", knobs.NONNEG)  # tokens per row; 0: 2 x (P + R)
    max_len: int = 0  # the longest trajectory, P + R (it fixes the batch's micro-batch count); 0: row_len

    def __post_init__(self):
        knobs.validate(self)


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

    def with_micro_batches(self, m: int) -> Layout:
        """The same placement in a batch of m >= M micro-batches (the extra ones empty: segment 0, weight 0), so
        that workers whose layouts need fewer micro-batches form blocks of one global shape."""
        if m < self.shape[1]:
            raise ValueError(f"with_micro_batches({m}): the layout needs {self.shape[1]}")
        return dataclasses.replace(self, shape=(self.shape[0], m, *self.shape[2:]))


def fill_rows(lengths: np.ndarray, row_len: int, pack: bool, *, entries: np.ndarray | None = None,
              max_entries: int = 0) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing into rows of ``row_len`` tokens, or one per row. With
    ``entries`` (per item) and ``max_entries``, a row also holds at most that many entries (tree training's loss
    entries: ``tree_packing``)."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    entries = np.zeros(len(lengths), np.int64) if entries is None else np.asarray(entries)
    cap = max_entries or int(entries.sum())
    rows: list[list[int]] = []
    free: list[list[int]] = []  # per row: [tokens, entries] left
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep rollout order
        for r, f in enumerate(free):
            if lengths[i] <= f[0] and entries[i] <= f[1]:
                rows[r].append(i)
                f[0] -= lengths[i]
                f[1] -= entries[i]
                break
        else:
            rows.append([i])
            free.append([row_len - lengths[i], cap - entries[i]])
    return [sorted(r) for r in rows]


def max_rows(sequences: int, row_len: int, max_len: int) -> int:
    """The most rows ``fill_rows`` can need for ``sequences`` sequences of at most ``max_len`` tokens each: with
    k = row_len // max_len, every row but the last holds at least k of them (first fit opens a row only when the
    sequence fits no open row, so each open row has less than max_len tokens free: more than (k - 1) max_len
    tokens placed, hence k sequences). The default row (2 (P + R)) gives half the sequences; any layout of that many
    rows fits the batch shape the config fixes (``global_batch.GlobalBatch``)."""
    return -(-sequences // max(1, row_len // max_len))


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
        rows = fill_rows(lengths[idx], row_len, pack)
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


def loss_totals(layout: Layout, loss_masks: Sequence[np.ndarray]) -> np.ndarray:
    """[K, 2] per mini-batch: loss tokens and sequences with at least one loss token (token 0 is never predicted).

    Several rollout workers each pack their share of every mini-batch; the sum of their totals is what
    ``loss_weights`` normalises by (``totals``), so the blocks side by side form the global mini-batch's loss.
    """
    totals = np.zeros((layout.shape[0], 2), np.float64)
    for k, m in zip(layout.mini, loss_masks):
        n = float((np.asarray(m)[1:] > 0).sum())
        totals[k] += (n, float(n > 0))
    return totals


def loss_weights(layout: Layout, loss_masks: Sequence[np.ndarray], **kwargs) -> np.ndarray:
    """Per-token loss weights [K, M, B, T] implementing ``agg_mode`` under ``micro_norm`` (module docstring):
    each sequence's 0/1 loss mask times its ``sequence_loss_scales`` (keyword arguments: see there)."""
    scale = sequence_loss_scales(layout, loss_masks, **kwargs)
    return place(layout, [(np.asarray(m) > 0) * s for m, s in zip(loss_masks, scale)], np.float32)


def sequence_loss_scales(layout: Layout, loss_masks: Sequence[np.ndarray], *, agg_mode: str = "token-mean",
                         micro_norm: str = "global_token_mean", norm_len: int | None = None,
                         totals: np.ndarray | None = None, workers: int = 1) -> np.ndarray:
    """[N] float64: the loss weight of each loss token of each sequence (``loss_weights``; prefix trees,
    ``arpo_jax.experience.tree_packing``, give the same weight to every trajectory's own tokens).

    The one owner of loss normalisation: the train step computes ``sum(w * per-token loss)`` and nothing else.
    Per sequence ``i`` with ``n_i`` loss tokens, ``N`` loss tokens and ``S`` sequences (with loss tokens) in the
    normalisation group (the global mini-batch for ``global_token_mean``: ``totals``; the micro-batch for
    ``reference``, whose result is then scaled by ``S_micro / S_mini``):
      token-mean ``1/N``; seq-mean-token-sum ``1/S``; seq-mean-token-mean ``1/(S n_i)``;
      seq-mean-token-sum-norm ``1/norm_len``. The reference divides by its padded response length, i.e. the
      configured ``data.max_response_length``, a constant: pass that (the trainer does). The default, the
      longest span from a sequence's first loss token to its end, is only a fallback for direct use: it is
      shorter than the reference's whenever no response of the batch reaches the maximum, and changes from
      batch to batch.

    Args:
      layout, loss_masks: the packed sequences and their token-aligned 0/1 loss masks.
      agg_mode: ``AGG_MODES``; micro_norm: ``MICRO_NORMS``; norm_len: see above.
      totals: [K, 2] loss tokens and sequences per mini-batch summed over every worker (``loss_totals``);
        None: this layout's own (one worker).
      workers: rollout workers whose blocks form the global batch. Where the normaliser is not a global count
        (``reference``, whose ranks each normalise their own micro-batches, and the constant of
        ``seq-mean-token-sum-norm``) their losses are averaged as verl's ranks' gradients are: ``1 / workers``.
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
    if micro_norm == "global_token_mean":
        group = layout.mini
        totals = loss_totals(layout, masks) if totals is None else np.asarray(totals, np.float64)
        tok_in, seq_in = totals[:, 0], totals[:, 1]
    else:  # the micro-batch, this worker's own
        group = layout.mini * layout.shape[1] + layout.micro
        tok_in, seq_in = (np.bincount(group, x.astype(np.float64), minlength=layout.shape[0] * layout.shape[1])
                          for x in (n_tok, has))
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
        if micro_norm == "reference" or agg_mode == "seq-mean-token-sum-norm":
            scale[i] /= workers
    return scale


def assemble(layout: Layout, sequences: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray], advantages, *,
             agg_mode: str = "token-mean", micro_norm: str = "global_token_mean", norm_len: int | None = None,
             totals: np.ndarray | None = None, workers: int = 1,
             extra: dict[str, Sequence[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """The train-step batch of sequences placed by ``layout``, as numpy arrays of shape [K, M, B, T].

    Args:
      layout: from ``plan_layout`` (its M may be raised to match other workers: the extra micro-batches are
        empty, segment 0 and weight 0).
      sequences: N int arrays, the full token sequence of each trajectory (no padding).
      loss_masks: N 0/1 arrays, token-aligned (1 = model-generated token that is trained on).
      advantages: [N] per-sequence advantages (broadcast to tokens) or N token-aligned arrays.
      agg_mode, micro_norm, norm_len, totals, workers: loss normalisation, see ``loss_weights``.
      extra: more token-aligned per-sequence arrays to place (e.g. ``rollout_logp``, ``returns``).

    Returns:
      ``input_ids``, ``targets``, ``positions``, ``segment_ids`` (int32) and ``loss_weight``, ``advantages``
      (+ ``extra``) (float32), all [K, M, B, T].
    """
    sequences = [np.asarray(s) for s in sequences]
    ids, targets, positions, segments = (np.zeros(layout.shape, np.int32) for _ in range(4))
    for i, s in enumerate(sequences):
        k, m, b, sl = layout.slots(i)
        ids[k, m, b, sl] = s
        targets[k, m, b, sl.start:sl.stop - 1] = s[1:]
        positions[k, m, b, sl] = np.arange(len(s))
        segments[k, m, b, sl] = segments[k, m, b].max() + 1  # 1, 2, ... in order of placement within the row
    adv = [np.broadcast_to(np.asarray(a, np.float32), (len(s),)) for s, a in zip(sequences, advantages)]
    batch = {"input_ids": ids, "targets": targets, "positions": positions, "segment_ids": segments,
             "loss_weight": loss_weights(layout, loss_masks, agg_mode=agg_mode, micro_norm=micro_norm,
                                         norm_len=norm_len, totals=totals, workers=workers),
             "advantages": place(layout, adv)}
    for name, values in (extra or {}).items():
        batch[name] = place(layout, values)
    return batch


def pack_batch(sequences: Sequence[np.ndarray], loss_masks: Sequence[np.ndarray], advantages, *,
               mini_batch_size: int, row_len: int, rows_per_micro: int, pack: bool = True,
               **kwargs) -> tuple[dict[str, np.ndarray], Layout]:
    """``plan_layout`` then ``assemble`` (its keyword arguments): the batch of one worker, and its layout."""
    layout = plan_layout([len(s) for s in sequences], mini_batch_size=mini_batch_size, row_len=row_len,
                         rows_per_micro=rows_per_micro, pack=pack)
    return assemble(layout, sequences, loss_masks, advantages, **kwargs), layout
