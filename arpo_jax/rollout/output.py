"""What a rollout returns (spec 3.4): padded numpy arrays, per-trajectory metadata, branching trees and metrics.

`pad_rows` lays the finished trajectories out as the trainer's arrays; `select_rows` joins chosen rows of several
rollouts (dynamic sampling's batch). The loop that fills them is `agent_loop.rollout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arpo_jax.rollout.branching import BranchAttempt

FAILURE_CAUSES = ("tool_error", "tool_timeout", "engine_error", "wall_budget")


@dataclasses.dataclass
class TreeNode:
    slot_id: int
    parent_id: int | None  # the slot it was copied from (branches only)
    kind: str  # "root", "branch" or "refill"
    round_created: int
    branch_point: int  # response tokens inherited from the parent (0 for roots and refills)
    baseline: float | None  # H_init used for this slot's decisions (default mode; None in compat mode)
    segment_entropies: list[float]  # entropy of every segment this slot generated itself, in order


@dataclasses.dataclass
class PromptTree:
    """Branching record of one prompt: its n trajectories as nodes, and every branching attempt."""

    prompt_index: int
    initial_rollouts: int
    nodes: list[TreeNode]
    attempts: list[BranchAttempt]
    h_root: float | None = None  # AEPO pre-monitoring values (None when not run)
    h_tool_mean: float | None = None


@dataclasses.dataclass
class RolloutOutput:
    """Padded arrays (B = prompts, n per prompt, row i = prompt i // n) plus metadata. All numpy."""

    input_ids: np.ndarray  # [B*n, P+R] int32: left-padded prompt | right-padded response
    attention_mask: np.ndarray  # [B*n, P+R] int32: prompt mask | response attention
    position_ids: np.ndarray  # [B*n, P+R] int32
    responses: np.ndarray  # [B*n, R] int32
    response_mask: np.ndarray  # [B*n, R] int32: response attention (up to and including the first EOS)
    loss_mask: np.ndarray  # [B*n, R] int32: model tokens (not tool results) within the response attention
    prompt_index: np.ndarray  # [B*n] int32
    slot_id: np.ndarray  # [B*n] int32
    parent_id: np.ndarray  # [B*n] int32, -1 for roots and refills
    tool_calls: np.ndarray  # [B*n] int32: calls counted against call_limit
    rounds: np.ndarray  # [B*n] int32: generated segments in the trajectory (inherited ones included)
    response_length: np.ndarray  # [B*n] int32: kept response tokens (<= R)
    truncated: np.ndarray  # [B*n] bool: the response was longer than R and was cut
    finish_reason: np.ndarray  # [B*n] str: eos | call_limit | empty_tool_content | length | stop | engine_error |
    #                                 wall_budget
    failed: np.ndarray  # [B*n] str: "" or the first failure cause (FAILURE_CAUSES), with isolate_failures
    trees: list[PromptTree]
    metrics: dict[str, float]
    # [B*n, R] float32: the engine's log-prob of each sampled response token (`SamplingSettings.token_logprobs`);
    # NaN where it has none (tool results, an appended call-limit EOS, padding, engines that report none).
    rollout_logp: np.ndarray


Row = tuple[int, Sequence[int], Sequence[int], Sequence[float]]  # (prompt index, response ids, mask, log-probs)


def pad_rows(prompts: Sequence[Sequence[int]], rows: Sequence[Row],
             *, R: int, P: int, pad: int, eos: int, compat: bool) -> dict[str, np.ndarray]:
    """Spec 3.4: the padded arrays of `rows` = (prompt index, response ids, per-token mask, per-token log-prob).

    Prompts are left-padded to P, responses right-padded (and cut) to R. The response attention runs up to and
    including the first EOS; by default (B10) not over the padding of a response without EOS, in compat mode it
    does. The loss mask is the per-token mask (1 model, 0 tool result) within that attention.
    """
    N = len(rows)
    responses = np.full((N, R), pad, np.int32)
    mask = np.zeros((N, R), np.int32)
    rollout_logp = np.full((N, R), np.nan, np.float32)
    lengths = np.zeros(N, np.int32)
    for i, (_, resp, m, lps) in enumerate(rows):
        resp = resp[:R]
        lengths[i] = len(resp)
        responses[i, :len(resp)] = resp
        mask[i, :len(resp)] = m[:R]
        rollout_logp[i, :len(resp)] = lps[:R]
    is_eos = (responses == eos).astype(np.int32)
    attn = (np.cumsum(is_eos, axis=1) - is_eos) == 0  # up to and including the first EOS
    if not compat:
        attn &= np.arange(R)[None, :] < lengths[:, None]  # B10: padding after a no-EOS response gets 0
    attn = attn.astype(np.int32)
    prompt_ids = np.full((len(prompts), P), pad, np.int32)
    prompt_mask = np.zeros((len(prompts), P), np.int32)
    for b, p in enumerate(prompts):
        if p:
            prompt_ids[b, P - len(p):] = p
            prompt_mask[b, P - len(p):] = 1
    pidx = np.asarray([row[0] for row in rows], np.int32)
    prompt_pos = np.clip(np.cumsum(prompt_mask, axis=1) - 1, 0, None)[pidx]  # [N, P]
    resp_pos = prompt_pos[:, -1:] + 1 + np.arange(R)[None, :]  # [N, R]: the response continues the positions
    return dict(input_ids=np.concatenate([prompt_ids[pidx], responses], axis=1),
                attention_mask=np.concatenate([prompt_mask[pidx], attn], axis=1),
                position_ids=np.concatenate([prompt_pos, resp_pos], axis=1).astype(np.int32),
                responses=responses, response_mask=attn, loss_mask=mask * attn, prompt_index=pidx,
                response_length=lengths, rollout_logp=rollout_logp)


_MEAN_METRICS = ("_mean", "_fraction", "_per_trajectory")  # engine metrics that average (the rest are sums)


def select_rows(parts: Sequence[tuple[RolloutOutput, Sequence[int]]]) -> RolloutOutput:
    """Chosen rows of one or more rollout outputs as one output (dynamic sampling's batch over rollout rounds).

    Prompts are renumbered 0, 1, ... in order of first appearance and keep their trees (a chosen prompt's rows
    must all be chosen for the trees to describe them). The metrics describe all the work done: every part's
    counts and times summed, its means averaged.
    """
    per_row = [f.name for f in dataclasses.fields(RolloutOutput) if f.name not in ("trees", "metrics")]
    first: dict[tuple[int, int], int] = {}
    trees, prompt_index = [], []
    for k, (out, rows) in enumerate(parts):
        for i in rows:
            key = (k, int(out.prompt_index[i]))
            if key not in first:
                first[key] = len(first)
                trees.append(dataclasses.replace(out.trees[key[1]], prompt_index=first[key]))
            prompt_index.append(first[key])
    fields = {}
    for name in per_row:
        values = [getattr(out, name) for out, _ in parts]
        if isinstance(values[0], np.ndarray):
            fields[name] = np.concatenate([v[np.asarray(rows, np.int64)] for v, (_, rows) in zip(values, parts)])
        else:  # a list with one entry per row
            fields[name] = [v[int(i)] for v, (_, rows) in zip(values, parts) for i in rows]
    fields["prompt_index"] = np.asarray(prompt_index, np.int32)
    metrics = {}
    for key in parts[0][0].metrics:
        values = [out.metrics[key] for out, _ in parts]
        metrics[key] = float(np.mean(values) if key.endswith(_MEAN_METRICS) else np.sum(values))
    return RolloutOutput(**fields, trees=trees, metrics=metrics)
