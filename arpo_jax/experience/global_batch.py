"""The layout of an RL step's batch over rollout workers and processes (`GlobalBatch`, used by `trainer.Trainer`)."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arpo_jax import distributed, sharding
from arpo_jax.experience import packing, tree_packing
from arpo_jax.experience.trajectories import Trajectories


class GlobalBatch:
    """How the step's trajectories become global [K, M, B, *] arrays: each local rollout worker packs its block of
    `rows_per_worker` rows of `row_len` tokens; the blocks of every worker of every process sit side by side along
    B, the batch-sharded axis.

    Two layouts, chosen here once by `actor.tree_training`: flat (`global_batch.layout` / `global_batch.worker_batch`:
    [K, M, B, T] arrays) or prefix trees (`tree_packing.worker_tree_layout` / `worker_tree_batch`: tokens
    [K, M, B, T], heads [K, M, B, U], loss entries [K, M, B, E]). The rest of the step does not care which:
    the log-prob forward and the train step recognise a tree batch by its `tree_end`."""

    def __init__(self, pack: packing.PackConfig, mesh: Mesh, model_cfg, workers: int, local: range):
        self.pack_config, self.mesh, self.workers, self.local_workers = pack, mesh, workers, local
        self.sharding = NamedSharding(mesh, sharding.batch_spec(mesh, model_cfg.sharding_rules))  # [M, B, T]
        self.sharding4 = NamedSharding(mesh, PartitionSpec(None, *self.sharding.spec))  # [K, M, B, T]
        rules = sharding.get_rules(model_cfg.sharding_rules)
        self.rows_per_worker = max(1, math.prod(mesh.shape[a] for a in rules["batch"]) // workers)
        self.row_len = pack.row_len
        self.tree = bool(pack.tree)
        # The batch's shapes, from the config alone: every step's programs are the first step's (issue 54).
        self.micro_batches = {t: micro_batches(pack, workers, self.rows_per_worker, tree=t) for t in (False, True)}
        self.tree_sizes = (self.micro_batches[True], tree_packing.max_heads_per_row(self.row_len),
                           tree_packing.max_entries_per_row(self.row_len))  # (M, U, E)

    def layouts(self, trajs: dict[int, Trajectories], tree: bool | None = None) -> dict:
        """Each worker's layout (`packing.Layout`, or with `tree` (default: `actor.tree_training`) a
        `tree_packing.TreeLayout`) in the batch shape the config fixes (micro-batches; for trees also heads and
        entries per row), so that every worker's block, and every step's batch, has the same shape."""
        tree = self.tree if tree is None else tree
        plan = _LAYOUTS[tree][0]
        mini_prompts = self.pack_config.mini_batch_prompts // self.workers
        longest, limit = max(len(s) for t in trajs.values() for s in t.sequences), self.pack_config.max_len
        if limit and longest > limit:
            raise ValueError(f"a trajectory of {longest} tokens: longer than data.max_prompt_length + "
                             f"data.max_response_length = {limit}, which fix the batch's shapes")
        layouts = {w: plan(t, self.pack_config, mini_prompts=mini_prompts, rows=self.rows_per_worker,
                           row_len=self.row_len) for w, t in trajs.items()}
        if tree:
            return {w: lay.with_sizes(*self.tree_sizes) for w, lay in layouts.items()}
        return {w: lay.with_micro_batches(self.micro_batches[False]) for w, lay in layouts.items()}

    def pack(self, trajs: dict[int, Trajectories], token_arrays: dict[int, dict]) -> tuple[list[dict], dict]:
        """K mini-batches of global [M, B, *] arrays, in optimizer-step order, and the layout's metrics (tree
        training: `perf/tree_tokens_computed` and `perf/tree_tokens_flat` over every process). The loss weights are
        normalised by the loss tokens and sequences of each whole mini-batch, summed over every worker of every
        process."""
        _, loss_totals, worker_batch = _LAYOUTS[self.tree]
        layouts = self.layouts(trajs)
        totals = distributed.gather(np.stack([loss_totals(layouts[w], trajs[w].loss_masks)
                                              for w in self.local_workers])).sum(0)  # [K, 2]
        blocks = [worker_batch(trajs[w], token_arrays[w], layouts[w], self.pack_config, totals=totals,
                               workers=self.workers) for w in self.local_workers]
        local = self._side_by_side(blocks, blocks[0])  # [K, M, B_local, *]
        minis = [{name: distributed.global_array(v[k], self.sharding) for name, v in local.items()}
                 for k in range(local["input_ids"].shape[0])]
        metrics = {}
        if self.tree:
            tm = tree_packing.tree_metrics([layouts[w] for w in self.local_workers])
            summed = distributed.gather(np.array([list(tm.values())], np.float64)).sum(0)
            metrics = {k: float(v) for k, v in zip(tm, summed)}
        return minis, metrics

    def forward_batch(self, trajs: dict[int, Trajectories], keys) -> tuple[dict, dict[int, packing.Layout]]:
        """The packed sequences as one global [K, M, B, T] batch of `keys` (for a forward pass), and the layouts
        (flat: the critic's values are per token of every sequence)."""
        layouts = self.layouts(trajs, tree=False)
        zeros = {w: [np.zeros(len(s), np.float32) for s in t.sequences] for w, t in trajs.items()}
        blocks = [packing.assemble(layouts[w], trajs[w].sequences, trajs[w].loss_masks, zeros[w])
                  for w in self.local_workers]
        local = self._side_by_side(blocks, keys)
        return {k: distributed.global_array(v, self.sharding4) for k, v in local.items()}, layouts

    def unpack(self, values: jax.Array, layouts: dict[int, packing.Layout]) -> dict[int, list[np.ndarray]]:
        """Per local worker, the token-aligned values of each sequence from a global [K, M, B, T] array."""
        per_worker = np.split(distributed.host_local(values, self.mesh, self.sharding4), len(self.local_workers),
                              axis=2)
        return {w: packing.unpack(layouts[w], v) for w, v in zip(self.local_workers, per_worker)}

    @staticmethod
    def _side_by_side(blocks: list[dict], keys) -> dict[str, np.ndarray]:
        return {k: np.concatenate([b[k] for b in blocks], axis=-2) for k in keys}


def micro_batches(pack: packing.PackConfig, workers: int, rows: int, *, tree: bool) -> int:
    """M, the micro-batches of every mini-batch, from the config alone: enough for the most rows a worker's share of
    a mini-batch can need (ppo_mini_batch_size / workers prompts x n trajectories of at most P + R tokens:
    `packing.max_rows`, `tree_packing.max_tree_rows`), `rows` rows each. The update and the forward passes skip an
    empty micro-batch (no tokens, no loss weight), so the room for the worst case costs its batch arrays only,
    where buckets would cost a program each (benchmarks/RESULTS.md, "Fixed update programs")."""
    n = pack.mini_batch_prompts // workers * pack.group_size
    max_len = pack.max_len or pack.row_len
    if tree:
        need = tree_packing.max_tree_rows(n, pack.row_len, max_len)
    else:
        need = packing.max_rows(n, pack.row_len, max_len) if pack.pack else n
    return max(1, -(-need // rows))


def layout(traj: Trajectories, pack: packing.PackConfig, *, mini_prompts: int, rows: int,
           row_len: int) -> packing.Layout:
    """Where the worker's sequences sit in its [K, M, rows, row_len] block: `mini_prompts` prompts (x n rows) per
    optimizer step, `rows` rows per micro-batch."""
    return packing.plan_layout([len(s) for s in traj.sequences], mini_batch_size=mini_prompts * pack.group_size,
                               row_len=row_len, rows_per_micro=rows, pack=pack.pack)


def worker_batch(traj: Trajectories, token_arrays: dict[str, list[np.ndarray]], placed: packing.Layout,
                 pack: packing.PackConfig, *, totals: np.ndarray | None = None,
                 workers: int = 1) -> dict[str, np.ndarray]:
    """One worker's [K, M, rows, T] block of the global batch (numpy).

    Args:
      traj: the worker's rollout.
      token_arrays: token-aligned arrays per sequence: `advantages` and any others to place (`returns`,
        `old_values` with a critic).
      placed: its layout (`layout`, with the micro-batch count of the largest worker).
      pack: the aggregation mode, micro-batch normalisation and normalising length.
      totals, workers: loss tokens and sequences per mini-batch over every worker, and the worker count
        (`packing.loss_weights`); defaults: this worker alone.
    """
    extra = {"rollout_logp": traj.rollout_logps} | {k: v for k, v in token_arrays.items() if k != "advantages"}
    return packing.assemble(placed, traj.sequences, traj.loss_masks, token_arrays["advantages"],
                            agg_mode=pack.agg_mode, micro_norm=pack.micro_norm, norm_len=pack.norm_len,
                            totals=totals, workers=workers, extra=extra)


# (plan a worker's layout, its loss totals, its block of the batch): flat, or (tree training) prefix trees
_LAYOUTS = {False: (layout, packing.loss_totals, worker_batch),
            True: (tree_packing.worker_tree_layout, tree_packing.loss_totals, tree_packing.worker_tree_batch)}
