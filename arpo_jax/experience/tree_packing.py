"""Tree packing for the policy update: the prefixes that a group's trajectories share are computed once.

ARPO's rollouts are trees: the trajectories of a prompt share the prompt, and a branch forked at a tool call shares
its parent's whole response up to there. Here each advantage group (the trajectories of one prompt within one
mini-batch) becomes a token trie, laid out in pre-order in a row of the [K, M, B, T] batch (``packing``'s shape):

  * Sorting the group's sequences lexicographically puts them in the trie's depth-first order, and the pre-order
    layout is then the first sequence followed by each next one's suffix after its longest common prefix (LCP)
    with the previous one. A token's slot is its pre-order index; ``tree_end`` is the last slot of its subtree, so
    "query t sees key s" is the interval test ``s <= t <= tree_end[s]`` (``models.transformer.TreeMask``, evaluated
    inside the attention kernel). ``positions`` are the tokens' indices in their sequences (the trie depth): RoPE
    sees exactly what it sees in the flat layout, so every token's hidden state equals the flat one.
  * A tree larger than a row is split between sequences (in sorted order) into parts that each fit: a part repeats
    the prefix it shares with the previous part (those tokens are computed twice, ``tokens_computed`` counts them).
    Parts are placed in rows first-fit decreasing, as ``packing`` places sequences.
  * The trie is keyed on token ids only, not on the loss mask: the forward of a token depends on the ids and
    positions before it, and the loss below is per trajectory, so sharing is exact whatever the masks.

Exact loss. A token shared by several trajectories is one forward computation, but the loss stays the flat one:
each trajectory's loss tokens are "entries" of its row ([K, M, B, E] arrays: ``loss_weight``, ``advantages``,
``old_logp``, ... per trajectory and token, exactly the values the flat layout places), and the train step gathers
each entry's log-prob and entropy from the tree (``entry_index``), then applies the unchanged PPO/AEPO loss, KL and
rollout correction to the entries. The forward FLOPs are the tree's; the loss, its normalisation (the same
``packing.sequence_loss_scales``) and so the gradients equal the flat layout's up to float summation order.

Log-probs are computed per "head" ([K, M, B, U]): the hidden state at a token's parent slot (``head_slot``) scored
against the token (``head_target``), once per distinct tree token that is a loss token of some trajectory. A
branch point's children each get their own head, so a token that several trajectories continue differently is
never ambiguous (the flat layout's ``targets`` would be). Heads are computed only where a loss needs them.

Everything here is host-side numpy, like ``packing``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arpo_jax.experience import packing

TREE_KEYS = ("input_ids", "positions", "tree_end")  # [K, M, B, T]
HEAD_KEYS = ("head_slot", "head_target")  # [K, M, B, U]
ENTRY_INDEX_KEYS = ("entry_index", "segment_ids")  # [K, M, B, E] int32; the float entry arrays follow


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def split_tree(sequences: Sequence[np.ndarray], row_len: int, entries: Sequence[int] | None = None,
               max_entries: int = 0) -> list[tuple[list[int], list[int]]]:
    """One group's trie in parts that fit a row: [(members in depth-first order, LCP of each with the previous
    member of its part (0 for the first))]. A part holds ``sum(len - lcp)`` tokens <= row_len and, with
    ``max_entries``, at most that many of the members' ``entries`` (their loss tokens)."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].tolist())  # lexicographic = depth-first
    entries = [0] * len(sequences) if entries is None else entries
    parts: list[tuple[list[int], list[int]]] = []
    size = held = 0
    for pos, i in enumerate(order):
        n = len(sequences[i])
        if n > row_len:
            raise ValueError(f"a sequence of {n} tokens does not fit a row of row_len={row_len}; raise row_len")
        lcp = _lcp(sequences[order[pos - 1]], sequences[i]) if pos else 0
        if parts and size + n - lcp <= row_len and (not max_entries or held + entries[i] <= max_entries):
            parts[-1][0].append(i)
            parts[-1][1].append(lcp)
            size += n - lcp
            held += entries[i]
        else:  # a new part repeats the shared prefix
            parts.append(([i], [0]))
            size, held = n, entries[i]
    return parts


def lay_out_part(sequences: Sequence[np.ndarray], members: list[int], lcps: list[int]):
    """The pre-order layout of one part (module docstring).

    Returns:
      (ids [S], positions [S], tree_end [S] (slots relative to the part), slot maps: for each member, the slot of
      each of its tokens [len]).
    """
    ids, positions, slot_maps, suffix_end = [], [], [], []
    cursor = 0
    for k, (i, lcp) in enumerate(zip(members, lcps)):
        seq = np.asarray(sequences[i])
        shared = slot_maps[-1][:lcp] if k else np.zeros(0, np.int64)
        slot_maps.append(np.concatenate([shared, cursor + np.arange(len(seq) - lcp)]))
        ids.append(seq[lcp:])
        positions.append(np.arange(lcp, len(seq)))
        cursor += len(seq) - lcp
        suffix_end.append(cursor - 1)  # last slot emitted so far
    ends = []
    for k, lcp in enumerate(lcps):
        depth = positions[k]
        end = np.full(len(depth), suffix_end[k])
        shared = np.inf  # LCP of member k with member j: the minimum of the adjacent LCPs between them
        for j in range(k + 1, len(members)):
            shared = min(shared, lcps[j])
            if shared <= lcp:
                break  # no token emitted by member k is shared with member j or later ones
            end[depth < shared] = suffix_end[j]  # member j's tokens lie in these tokens' subtrees
        ends.append(end)
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
    return cat(ids), cat(positions), cat(ends), slot_maps


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """Where the trees and every trajectory's loss tokens sit in the [K, M, B, *] batch.

    Per trajectory i: ``mini``, ``micro``, ``row`` [N] and ``slots[i]`` [len_i] (each token's slot in its row).
    Rows: ``input_ids``, ``positions``, ``tree_end`` [K, M, B, T]. Heads (flat arrays over all heads, each with its
    (k, m, b, u) place): ``head_at`` [H, 4], ``head_slot``, ``head_target`` [H]. Entries (one per loss token
    j >= 1 of each trajectory): ``entry_at`` [E_all, 4], ``entry_traj``, ``entry_token`` (the token index j, whose
    token-aligned values the entry carries), ``entry_head`` (u of its head in the row), ``entry_seg`` (the
    trajectory's number among those of its row with entries, 1, 2, ...).
    """

    mini: np.ndarray
    micro: np.ndarray
    row: np.ndarray
    slots: list[np.ndarray]
    lengths: np.ndarray
    rows: dict[str, np.ndarray]
    head_at: np.ndarray
    head_slot: np.ndarray
    head_target: np.ndarray
    entry_at: np.ndarray
    entry_traj: np.ndarray
    entry_token: np.ndarray
    entry_head: np.ndarray
    entry_seg: np.ndarray
    shape: tuple[int, int, int, int]  # (K, M, B, T)
    heads: int  # U
    entries: int  # E
    tokens_computed: int  # tree tokens over all parts (repeated cut prefixes included)

    @property
    def tokens_flat(self) -> int:
        """What the flat layout computes: every trajectory's every token."""
        return int(self.lengths.sum())

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(M, U, E): the sizes other workers' blocks must share (``with_sizes``)."""
        return self.shape[1], self.heads, self.entries

    def with_sizes(self, m: int, u: int, e: int) -> TreeLayout:
        """The same placement in a batch of m micro-batches, u heads and e entries per row (>= this layout's own:
        the extra ones are empty), so that every worker's block has one global shape."""
        if m < self.shape[1] or u < self.heads or e < self.entries:
            raise ValueError(f"with_sizes({m}, {u}, {e}): the layout needs {self.sizes}")
        k, m0, b, t = self.shape
        rows = {name: np.concatenate([x, np.full((k, m - m0, b, t), -1 if name == "tree_end" else 0, x.dtype)],
                                     axis=1) for name, x in self.rows.items()}  # empty micro-batches: padding
        return dataclasses.replace(self, shape=(k, m, b, t), heads=u, entries=e, rows=rows)

    def packing_layout(self) -> packing.Layout:
        """The trajectories' mini-/micro-batches as a ``packing.Layout`` (for its loss normalisation)."""
        n = len(self.lengths)
        return packing.Layout(self.mini, self.micro, self.row, np.zeros(n, np.int64), self.lengths, self.shape)


def bucket(n: int, quantum: int) -> int:
    """n rounded up to a multiple of quantum (>= quantum): fewer distinct shapes, fewer recompilations."""
    return max(quantum, -(-n // quantum) * quantum)


def max_tree_rows(trajectories: int, row_len: int, max_len: int) -> int:
    """The most rows `plan_tree_layout` can need for `trajectories` of at most `max_len` tokens each with
    `max_entries` = `max_entries_per_row(row_len)` (cf. `packing.max_rows`). With k = row_len // max_len, first fit
    leaves at most one row with at most half its tokens and half its entries: a part that fits such a row would
    have gone into the first of two of them. A row more than half full in tokens holds more than k / 2
    trajectories (each adds at most max_len tokens to its part); one more than half full in entries (>= row_len
    entries) more than k (each has fewer than max_len loss tokens). So every row but one holds k // 2 + 1 or more:
    half the trajectories at the default row of 2 (P + R), as the flat layout."""
    k = max(1, row_len // max_len)
    return 1 + max(0, trajectories - 1) // (k // 2 + 1)


def max_heads_per_row(row_len: int) -> int:
    """The heads a row can need (``TreeLayout.heads``): one per distinct loss slot, at most ``row_len``, bucketed."""
    return bucket(row_len, max(1, row_len // 4))


ENTRIES_PER_TOKEN = 8


def max_entries_per_row(row_len: int) -> int:
    """The loss entries a tree row may hold (``plan_tree_layout``'s ``max_entries``): ``ENTRIES_PER_TOKEN`` x its
    tokens. A row's trajectories share prefixes, so their loss tokens (entries) outnumber its tokens wherever they
    share responses: after the demo's SFT most of a group's 8 trajectories are identical (entropy 0.02-0.07 nats a
    token), ~8 x 150 loss tokens over ~250 tree tokens, so three groups in a 768-token row hold ~3,600 entries, 4.7x
    its tokens. Entries cost little (per entry a gather and the elementwise loss, ~9 int32/float32 values in the
    batch), so the cap leaves that room; a row past it starts a new part of the tree (its shared prefix computed
    again). Any cap of at least 2 x row_len keeps `max_tree_rows`."""
    return ENTRIES_PER_TOKEN * row_len


def plan_tree_layout(sequences: Sequence[np.ndarray], groups: Sequence[int], loss_masks: Sequence[np.ndarray], *,
                     mini_batch_size: int, row_len: int, rows_per_micro: int, max_entries: int = 0) -> TreeLayout:
    """Builds each (mini-batch, group)'s tree, packs the parts into rows and lists the heads and entries.

    Args:
      sequences: N int arrays, each trajectory's full token sequence (no padding).
      groups: [N] advantage group (prompt index) of each; a tree never spans two groups or two mini-batches.
      loss_masks: N token-aligned 0/1 arrays (which tokens get entries).
      mini_batch_size: trajectories per optimizer step, consecutive in order (as ``packing.plan_layout``).
      row_len, rows_per_micro: T and B.
      max_entries: loss entries a row may hold (0: any number); a trajectory has fewer than row_len.
    """
    sequences = [np.asarray(s) for s in sequences]
    groups = np.asarray(groups)
    n = len(sequences)
    if n == 0 or min(len(s) for s in sequences) < 1:
        raise ValueError("need at least one sequence, each with at least one token")
    loss_tokens = [int((np.asarray(m)[1:] > 0).sum()) for m in loss_masks]  # token 0 is never predicted
    mini, micro, row = (np.zeros(n, np.int64) for _ in range(3))
    slots: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    placed = []  # (k, r, offset, ids, positions, ends)
    num_micro, computed = 1, 0
    for k, lo in enumerate(range(0, n, mini_batch_size)):
        idx = np.arange(lo, min(lo + mini_batch_size, n))
        parts = []
        for g in dict.fromkeys(groups[idx].tolist()):  # groups in order of first appearance
            members = idx[groups[idx] == g]
            for local, lcps in split_tree([sequences[i] for i in members], row_len,
                                          [loss_tokens[i] for i in members], max_entries):
                parts.append(([int(members[j]) for j in local], lcps))
        laid = [lay_out_part(sequences, m, lcps) for m, lcps in parts]
        rows = packing.fill_rows(np.array([len(p[0]) for p in laid]), row_len, pack=True,
                                 entries=np.array([sum(loss_tokens[i] for i in m) for m, _ in parts]),
                                 max_entries=max_entries)
        num_micro = max(num_micro, -(-len(rows) // rows_per_micro))
        for r, in_row in enumerate(rows):
            offset = 0
            for p in in_row:
                ids, pos, ends, maps = laid[p]
                for i, sm in zip(parts[p][0], maps):
                    mini[i], micro[i], row[i], slots[i] = k, r // rows_per_micro, r % rows_per_micro, sm + offset
                placed.append((k, r, offset, ids, pos, ends + offset))
                offset += len(ids)
                computed += len(ids)
    shape = (int(mini.max()) + 1, num_micro, rows_per_micro, row_len)
    rows_arr = {"input_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
                "tree_end": np.full(shape, -1, np.int32)}
    for k, r, offset, ids, pos, ends in placed:
        at = (k, r // rows_per_micro, r % rows_per_micro, slice(offset, offset + len(ids)))
        rows_arr["input_ids"][at], rows_arr["positions"][at], rows_arr["tree_end"][at] = ids, pos, ends
    heads, entries = _heads_and_entries(mini, micro, row, slots, loss_masks, rows_arr["input_ids"])
    return TreeLayout(mini, micro, row, slots, np.array([len(s) for s in sequences]), rows_arr, *heads, *entries,
                      shape=shape, heads=bucket(int(heads[0][:, 3].max(initial=-1)) + 1, max(1, row_len // 4)),
                      entries=bucket(int(entries[0][:, 3].max(initial=-1)) + 1, row_len),
                      tokens_computed=computed)


def _heads_and_entries(mini, micro, row, slots, loss_masks, input_ids):
    """Per row: the distinct loss tokens' heads (sorted by slot) and every trajectory's entries (in trajectory then
    token order), as flat arrays with their (k, m, b, index) places."""
    heads = ([], [], [])  # at, slot, target
    entries = ([], [], [], [], [])  # at, traj, token, head, seg
    for place in sorted(set(zip(mini.tolist(), micro.tolist(), row.tolist()))):
        members = [i for i in np.flatnonzero((mini == place[0]) & (micro == place[1]) & (row == place[2]))]
        toks = [np.flatnonzero(np.asarray(loss_masks[i])[1:] > 0) + 1 for i in members]  # token 0: not predicted
        child = [slots[i][j] for i, j in zip(members, toks)]
        uniq = np.unique(np.concatenate(child)) if child else np.zeros(0, np.int64)
        parent = {}  # child slot -> parent slot (one parent in a tree)
        for i, j in zip(members, toks):
            parent.update(zip(slots[i][j].tolist(), slots[i][j - 1].tolist()))
        heads[0].append(np.array([[*place, u] for u in range(len(uniq))], np.int64).reshape(-1, 4))
        heads[1].append(np.array([parent[c] for c in uniq.tolist()], np.int64))
        heads[2].append(input_ids[place][uniq] if len(uniq) else np.zeros(0, np.int32))
        e, seg = 0, 0
        for i, j, c in zip(members, toks, child):
            if not len(j):
                continue  # no loss tokens (a failed trajectory): no entries, no segment
            seg += 1
            entries[0].append(np.array([[*place, e + x] for x in range(len(j))], np.int64))
            entries[1].append(np.full(len(j), i))
            entries[2].append(j)
            entries[3].append(np.searchsorted(uniq, c))
            entries[4].append(np.full(len(j), seg))
            e += len(j)
    cat = lambda xs, shape=(0,): np.concatenate(xs) if xs else np.zeros(shape, np.int64)
    return ((cat(heads[0], (0, 4)), cat(heads[1]), cat(heads[2])),
            (cat(entries[0], (0, 4)), *(cat(x) for x in entries[1:])))


def place_entries(layout: TreeLayout, values: Sequence[np.ndarray], dtype=np.float32) -> np.ndarray:
    """Token-aligned per-trajectory values -> [K, M, B, E]: each entry gets its trajectory's value at its token
    (the value ``packing.place`` puts in the flat slot that predicts that token)."""
    k, m, b, _ = layout.shape
    out = np.zeros((k, m, b, layout.entries), dtype)
    if len(layout.entry_traj):
        vals = np.array([np.asarray(values[i])[j] for i, j in zip(layout.entry_traj, layout.entry_token)])
        out[tuple(layout.entry_at.T)] = vals
    return out


def unpack_entries(layout: TreeLayout, arr: np.ndarray) -> list[np.ndarray]:
    """Inverse of ``place_entries``: [K, M, B, E] -> token-aligned values per trajectory (0 where no entry)."""
    arr = np.asarray(arr)
    out = [np.zeros(n, arr.dtype) for n in layout.lengths]
    for (k, m, b, e), i, j in zip(layout.entry_at, layout.entry_traj, layout.entry_token):
        out[i][j] = arr[k, m, b, e]
    return out


def assemble_tree(layout: TreeLayout, loss_masks: Sequence[np.ndarray], advantages, *, agg_mode: str = "token-mean",
                  micro_norm: str = "global_token_mean", norm_len: int | None = None, totals: np.ndarray | None = None,
                  workers: int = 1, extra: dict[str, Sequence[np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """The train-step batch of a tree layout (``packing.assemble``'s counterpart; same arguments).

    Returns:
      [K, M, B, T]: ``input_ids``, ``positions``, ``tree_end``; [K, M, B, U]: ``head_slot``, ``head_target``;
      [K, M, B, E]: ``entry_index``, ``segment_ids`` (int32) and ``loss_weight``, ``advantages`` (+ ``extra``)
      (float32). The loss weights are ``packing.sequence_loss_scales`` of the trajectories, so every aggregation
      mode normalises exactly as the flat layout with the same mini-/micro-batch membership.
    """
    k, m, b, _ = layout.shape
    batch = {name: x.copy() for name, x in layout.rows.items()}
    for name, values, shape in (("head_slot", layout.head_slot, layout.heads),
                                ("head_target", layout.head_target, layout.heads),
                                ("entry_index", layout.entry_head, layout.entries),
                                ("segment_ids", layout.entry_seg, layout.entries)):
        at = layout.head_at if name.startswith("head") else layout.entry_at
        batch[name] = np.zeros((k, m, b, shape), np.int32)
        batch[name][tuple(at.T)] = values
    scale = packing.sequence_loss_scales(layout.packing_layout(), loss_masks, agg_mode=agg_mode,
                                         micro_norm=micro_norm, norm_len=norm_len, totals=totals, workers=workers)
    batch["loss_weight"] = place_entries(layout, [np.full(n, s) for n, s in zip(layout.lengths, scale)])
    adv = [np.broadcast_to(np.asarray(a, np.float32), (n,)) for n, a in zip(layout.lengths, advantages)]
    batch["advantages"] = place_entries(layout, adv)
    for name, values in (extra or {}).items():
        batch[name] = place_entries(layout, values)
    return batch


def loss_totals(layout: TreeLayout, loss_masks: Sequence[np.ndarray]) -> np.ndarray:
    """[K, 2] loss tokens and sequences per mini-batch (``packing.loss_totals``; sum them over the workers)."""
    return packing.loss_totals(layout.packing_layout(), loss_masks)


def tree_metrics(layouts: Sequence[TreeLayout]) -> dict[str, float]:
    """``perf/tree_tokens_computed`` and ``perf/tree_tokens_flat`` over some workers' layouts (the ratio is the
    saving of every forward over the batch: the update's and the log-prob forward's)."""
    return {"perf/tree_tokens_computed": float(sum(x.tokens_computed for x in layouts)),
            "perf/tree_tokens_flat": float(sum(x.tokens_flat for x in layouts))}


# ------------------------------------------------------------------------------------------------------------------
# The rollout loop's entry points (the tree variants of global_batch.layout / global_batch.worker_batch)
# ------------------------------------------------------------------------------------------------------------------


def worker_tree_layout(traj, pack, *, mini_prompts: int, rows: int, row_len: int) -> TreeLayout:
    """``global_batch.layout`` for tree training: the worker's trajectories (``experience.Trajectories``: sequences,
    group, loss_masks) as trees in its [K, M, rows, row_len] block, at most ``max_entries_per_row`` entries a row."""
    return plan_tree_layout(traj.sequences, traj.group, traj.loss_masks, mini_batch_size=mini_prompts * pack.group_size,
                            row_len=row_len, rows_per_micro=rows, max_entries=max_entries_per_row(row_len))


def worker_tree_batch(traj, token_arrays: dict[str, list[np.ndarray]], layout: TreeLayout, pack, *,
                      totals: np.ndarray | None = None, workers: int = 1) -> dict[str, np.ndarray]:
    """``global_batch.worker_batch`` for tree training: one worker's [K, M, rows, *] block (numpy). ``layout`` comes
    from ``worker_tree_layout(...).with_sizes(*global sizes)``; ``totals`` is the sum over workers of
    ``loss_totals``."""
    extra = {"rollout_logp": traj.rollout_logps} | {k: v for k, v in token_arrays.items() if k != "advantages"}
    return assemble_tree(layout, traj.loss_masks, token_arrays["advantages"], agg_mode=pack.agg_mode,
                         micro_norm=pack.micro_norm, norm_len=pack.norm_len, totals=totals,
                         workers=workers, extra=extra)
