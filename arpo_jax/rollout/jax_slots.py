"""Host bookkeeping of the JAX engine's persistent KV cache: which trajectory each row holds, and its tokens.

The rows are the engine's fixed decode slots. Between requests a row keeps the tokens of the trajectory (a request's
`slot_id`) it last ran, so that the trajectory's next request prefills only what is new (a tool result), and an ARPO
branch (`parent_id`) starts from a copy of its parent's row, until the stream's caller releases the trajectory
(`forget_slot`) or another request needs the row. The table is exact: `held[row]` is what the row holds
in its slots 0 .. len - 1 (whatever the device wrote past that is cut when the row is next admitted).
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, np.int32)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class SlotTable:
    """Rows of the cache: the trajectory each holds (`slot`), its tokens (`held`), and whether a request of the
    current call runs in it (`busy`)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.clear()

    def clear(self) -> None:
        """Forgets every row (new weights, a reset, or a failed call)."""
        self.slot: list[int | None] = [None] * self.rows
        self.held: list[np.ndarray] = [_EMPTY] * self.rows
        self.busy = [False] * self.rows
        self.used = [0] * self.rows  # when each row was last taken: free rows are reused least recently used first
        self._row: dict[int, int] = {}
        self._clock = 0

    def begin(self, named: set[int]) -> None:
        """A new call, which names the trajectories `named` (as slot or parent): the other rows are forgotten."""
        for r in range(self.rows):
            self.busy[r] = False
            if self.slot[r] is not None and self.slot[r] not in named:
                self._forget(r)

    def lookup(self, slot_id: int | None, exclude: set[int] = frozenset()) -> int | None:
        """The row holding trajectory `slot_id`, unless it is in `exclude`."""
        row = self._row.get(slot_id) if slot_id is not None else None
        return None if row is None or row in exclude else row

    def free_row(self, protect: set[int], empty_only: bool = False) -> int | None:
        """A row no request runs in: an empty one, else (unless `empty_only`) one whose trajectory is not in
        `protect` (the ones waiting requests continue or branch from), else any; least recently used first. None:
        all busy."""
        idle = [r for r in range(self.rows) if not self.busy[r]]
        picks = [lambda r: self.slot[r] is None]
        if not empty_only:
            picks += [lambda r: self.slot[r] not in protect, lambda r: True]
        for pick in picks:
            rows = [r for r in idle if pick(r)]
            if rows:
                return min(rows, key=self.used.__getitem__)
        return None

    def take(self, row: int, slot_id: int | None) -> None:
        """A request of trajectory `slot_id` runs in `row` from now on (the row's previous trajectory is forgotten)."""
        if self.slot[row] != slot_id:
            self._forget(row)
            if slot_id is not None:
                old = self._row.pop(slot_id, None)
                if old is not None:  # the trajectory moves: its old row no longer counts as its
                    self.slot[old] = None
                self.slot[row], self._row[slot_id] = slot_id, row
        self.busy[row] = True
        self._clock += 1
        self.used[row] = self._clock

    def append(self, row: int, tokens: np.ndarray) -> None:
        self.held[row] = np.concatenate([self.held[row], np.asarray(tokens, np.int32)])

    def release(self, row: int) -> None:
        """The row's request has finished; the row keeps its tokens for the trajectory's next request."""
        self.busy[row] = False

    def forget_slot(self, slot_id: int) -> None:
        """Trajectory `slot_id` needs its row no more (the streaming rollout's `release`): the row is empty again,
        unless a request runs in it."""
        row = self._row.get(slot_id)
        if row is not None and not self.busy[row]:
            self._forget(row)

    def forget(self, row: int) -> None:
        self._forget(row)

    def _forget(self, row: int) -> None:
        if self.slot[row] is not None:
            self._row.pop(self.slot[row], None)
        self.slot[row], self.held[row] = None, _EMPTY
