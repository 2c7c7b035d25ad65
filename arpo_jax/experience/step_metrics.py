"""The metrics of one RL step, computed from its trajectories and updates: rollout, update, validation and
weight-sync metrics, per-trajectory records, and `summarize` (mean / max / min of one series)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.rollout.output import FAILURE_CAUSES


def weight_sync_metrics(sampler) -> dict[str, float]:
    """`weight_sync/export_bytes`: what the last weight sync wrote for the engine (vLLM: the LoRA adapters' bytes,
    or the full weights'); nothing for an engine that syncs in memory. `weight_sync/released_bytes`: what a CPU
    vLLM engine gave back while the update ran (`VllmSampler.sleep`)."""
    synced, slept = getattr(sampler, "last_sync", {}), getattr(sampler, "last_sleep", {})
    out = {"weight_sync/export_bytes": float(synced["export_bytes"])} if "export_bytes" in synced else {}
    return out | ({"weight_sync/released_bytes": float(sum(slept.values()))} if slept else {})


def validation_metrics(scores: np.ndarray, sources: list[str], n: int) -> dict[str, float]:
    """Validation's [N] scores (every process's) -> the mean reward and accuracy (score > 0) over all samples, and
    the mean reward per data source (`mean@n`: n samples per prompt)."""
    out = {"val/reward/mean": float(np.mean(scores)), "val/accuracy": float(np.mean(scores > 0)),
           "val/samples": len(scores)}
    for src in sorted(set(sources)):
        sel = np.asarray([s == src for s in sources])
        out[f"val/{src}/reward/mean@{n}"] = float(np.mean(scores[sel]))
    return out


def rollout_metrics(trajs: list[Trajectories], *, overlong_mask: bool = False,
                    gather: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> dict[str, float]:
    """Rewards, tool calls, lengths, turns, branches and failures of the step's rollouts (per-trajectory values of
    every process through `gather`), and the rollouts' own engine counters (this process's workers averaged)."""
    cat = lambda f: gather(np.concatenate([f(t) for t in trajs]).astype(np.float32))
    scores = gather(np.concatenate([t.scores for t in trajs]))
    branches = gather(np.asarray([float((t.out.parent_id >= 0).sum()) / max(len(t.out.trees), 1) for t in trajs],
                                 np.float32))
    out = {}
    out |= summarize("reward", scores)
    out |= summarize("tools/calls_per_trajectory", cat(lambda t: t.out.tool_calls))
    out |= summarize("response/length", cat(lambda t: t.out.response_length))
    out |= summarize("response/turns", cat(lambda t: t.out.rounds))
    out["reward/accuracy"] = float(np.mean(scores > 0)) if scores.size else 0.0
    out["rollout/branches_per_prompt"] = float(np.mean(branches))
    out["reward/format_error_fraction"] = float(np.mean(scores < 0)) if scores.size else 0.0
    causes = ("", *FAILURE_CAUSES)  # gathered as codes (0 = not failed)
    failed = gather(np.asarray([causes.index(c) for t in trajs for c in t.out.failed], np.int32))
    out["rollout/failed"] = float(np.sum(failed > 0))
    out["rollout/failed_fraction"] = float(np.mean(failed > 0)) if failed.size else 0.0
    out |= {f"rollout/failed/{c}": float(np.sum(failed == k)) for k, c in enumerate(causes) if c}
    if overlong_mask:
        out["response/overlong_masked_fraction"] = float(np.mean(cat(lambda t: t.out.finish_reason == "length")))
    for key in trajs[0].out.metrics:
        out[key] = float(np.mean([t.out.metrics[key] for t in trajs]))
    return out


def update_metrics(step_metrics: list[dict], prefix: str = "actor/") -> dict[str, float]:
    """The update's per-optimizer-step metrics as one record: means, except `*_max` (the max over the steps);
    `rollout_corr/*` keep their own prefix."""
    if not step_metrics:
        return {}
    name = lambda k: k if k.startswith("rollout_corr/") else f"{prefix}{k}"
    agg = lambda k: np.max if k.endswith("_max") else np.mean
    return {name(k): float(agg(k)([np.asarray(m[k]) for m in step_metrics])) for k in step_metrics[0]}


def trajectory_records(traj: Trajectories, n: int, step: int) -> list[dict]:
    """The first `n` trajectories of a rollout as JSON records (`trajectories.jsonl`): text, reward, tree."""
    records = []
    for i in range(min(n, len(traj.responses))):
        tree = traj.out.trees[int(traj.out.prompt_index[i])]
        records.append({"step": step, "prompt_index": int(traj.out.prompt_index[i]),
                        "score": float(traj.scores[i]), "reward": traj.reward_infos[i], "response": traj.responses[i],
                        "tool_calls": int(traj.out.tool_calls[i]), "finish_reason": str(traj.out.finish_reason[i]),
                        "failed": str(traj.out.failed[i]),
                        "tree": {"initial_rollouts": tree.initial_rollouts,
                                 "nodes": [dataclasses.asdict(nd) for nd in tree.nodes]}})
    return records


def summarize(prefix: str, values) -> dict[str, float]:
    """``{prefix/mean, prefix/std, prefix/min, prefix/max}`` of an array of any shape; {} when it is empty."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        return {}
    return {f"{prefix}/mean": float(arr.mean()), f"{prefix}/std": float(arr.std()),
            f"{prefix}/min": float(arr.min()), f"{prefix}/max": float(arr.max())}
