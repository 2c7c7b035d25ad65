"""From a rollout to a training batch: the host-side phases of the RL step as pure functions (numpy).

`Trainer.train_step` calls them in order, per rollout worker:

  rollout     `collect`: this step's rollouts of every local worker, with dynamic sampling's extra draws (with
              `rollout.max_staleness` > 0 collected during the previous step's update: `RolloutAhead`);
  reward      `score_rollout` (decode, score: spec 7.2), `shape_rollout` (failures and overlong responses masked,
              the DAPO overlong penalty), `select_groups` (dynamic sampling's pick over several draws);
  advantages  `outcome_advantages` (GRPO family, per prompt group: spec 8.1), or with a critic `gae_inputs` ->
              `gae` -> `response_to_tokens` (spec 8.2), all as token-aligned arrays per trajectory;
  pack        `layout` (where each sequence sits in [K, M, B, T]) and `worker_batch` (the worker's block of the
              global batch, loss weights from the totals of every worker: `packing.loss_weights`);
  metrics     `rollout_metrics`, `update_metrics`, `trajectory_records`, `validation_metrics`.

Nothing here touches a device, a model or another process: what needs them (the rollout itself, the critic's
values, totals over all processes, whitening over the global batch) is passed in.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from arpo_jax import algos, packing, rewards, shaping
from arpo_jax import metrics as metrics_lib
from arpo_jax.data.rl_dataset import DataPosition
from arpo_jax.rollout.agent_loop import FAILURE_CAUSES, RolloutOutput, select_rows

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Trajectories:
    """One worker's rollout as training data: unpadded sequences and what the metrics need."""

    sequences: list[np.ndarray]  # prompt + kept response tokens
    prompt_lengths: np.ndarray  # [N] tokens of the prompt at the start of each sequence
    loss_masks: list[np.ndarray]  # 0 over the prompt and tool results, 1 over model tokens
    scores: np.ndarray  # [N] reward
    group: np.ndarray  # [N] prompt index (GRPO group)
    responses: list[str]
    reward_infos: list[dict]
    out: RolloutOutput
    rollout_logps: list[np.ndarray]  # token-aligned engine log-probs (NaN: none), for the rollout correction

    @property
    def failed(self) -> np.ndarray:
        """[N] bool: failed trajectories (out.failed names the cause), masked out of the loss and the baselines."""
        return self.out.failed != ""


# ------------------------------------------------------------------------------------------------------------------
# rollout (and reward, per draw)
# ------------------------------------------------------------------------------------------------------------------


def collect(batch_at: Callable[[DataPosition], dict[int, list]], roll: Callable[[list, int, int], Trajectories],
            position: DataPosition, *, steps_per_epoch: int, need: int, dynamic: bool = False,
            max_extra_rounds: int = 0, agree_max: Callable[[int], int] = int,
            gather: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> tuple[dict[int, Trajectories],
                                                                               DataPosition, dict]:
    """The rollout and reward phases: this step's shaped rollouts per local worker, the data position after them,
    and dynamic-sampling metrics.

    Args:
      batch_at: position -> the prompts of the batch there, per local worker.
      roll: (prompts, worker, draw) -> the worker's scored, shaped rollout (draw 0: the step's batch).
      position: where this step's batch starts.
      need: prompt groups per worker (`data.train_batch_size` / workers).
      dynamic, max_extra_rounds: `algorithm.dynamic_sampling`: groups whose rewards are all equal are dropped and
        the next batches of the data stream are rolled out (up to `max_extra_rounds` more) until every worker of
        every process has `need` informative groups; a worker still short is topped up with dropped groups
        (`shaping.pick_groups`).
      agree_max, gather: the largest int over every process, and every process's rows of an array (for counts).
    """
    draws: dict[int, list[Trajectories]] = {}
    informative: dict[int, list[np.ndarray]] = {}
    have = lambda w: sum(int(i.sum()) for i in informative[w])
    extra = 0
    while True:
        for w, ex in batch_at(position).items():
            if extra and have(w) >= need:
                continue  # this worker is full; others draw on
            t = roll(ex, w, extra)
            draws.setdefault(w, []).append(t)
            informative.setdefault(w, []).append(shaping.informative_groups(t.scores, t.group, ~t.failed)[1])
        position = position.advance(steps_per_epoch)
        if not dynamic:
            return {w: d[0] for w, d in draws.items()}, position, {}
        short = agree_max(max(need - have(w) for w in draws))
        if extra >= max_extra_rounds or max(short, 0) == 0:
            break
        extra += 1
    trajs, counts = {}, np.zeros(3)  # informative groups drawn, groups drawn, uninformative groups kept
    for w in draws:
        picks = shaping.pick_groups(informative[w], need)
        trajs[w] = select_groups([(t, [k for r, k in picks if r == j]) for j, t in enumerate(draws[w])])
        counts += (have(w), sum(len(i) for i in informative[w]), sum(not informative[w][r][k] for r, k in picks))
    counts = gather(counts[None]).sum(0)
    return trajs, position, {"dynamic_sampling/kept_fraction": float(counts[0] / max(counts[1], 1)),
                             "dynamic_sampling/extra_rounds": float(extra),
                             "dynamic_sampling/filled_groups": float(counts[2])}


@dataclasses.dataclass
class Collected:
    """One step's rollout and reward (`collect`), with what its step logs about it."""

    trajs: dict[int, Trajectories]  # per local rollout worker
    position: DataPosition  # the data position after its batches
    metrics: dict  # dynamic sampling's and the tools' metrics of this rollout
    seconds: dict[str, float]  # its phases' times (rollout, reward), wherever it ran
    weights_version: int  # the policy step whose weights the engine generated it with


class RolloutAhead:
    """`rollout.max_staleness` > 0: the next step's rollout, started while this step updates and taken by the next.

    `overlap`: in a background thread (an engine in another process: vLLM; the thread waits on it, and JAX releases
    the GIL while the update runs); without it the rollout runs at `start`, before the update (the JAX engine shares
    the devices with the update: the same schedule and results, without the overlap). At most one is in flight."""

    def __init__(self, overlap: bool):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if overlap else None
        self._step, self._future = None, None

    def start(self, step: int, run: Callable[[], Collected]) -> None:
        assert self._future is None, "one rollout in flight at most"
        self._step = step
        if self._pool is not None:
            self._future = self._pool.submit(run)
            return
        self._future = Future()
        try:
            self._future.set_result(run())
        except Exception as e:  # raised by `take`, where the step that needs it runs
            self._future.set_exception(e)

    def wait(self) -> None:
        """Until the rollout in flight (if any) has ended: the engine is idle and its weights may change."""
        if self._future is not None:
            wait([self._future])

    def idle(self) -> bool:
        """Whether no rollout is running now (none started, or the one started has ended)."""
        return self._future is None or self._future.done()

    def take(self, step: int) -> Collected | None:
        """Step `step`'s rollout if it was started ahead (its error, if it failed), else None."""
        future, started = self._future, self._step
        self._step = self._future = None
        return future.result() if future is not None and started == step else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------------------------------------------
# reward
# ------------------------------------------------------------------------------------------------------------------


def weight_sync_metrics(sampler) -> dict[str, float]:
    """`weight_sync/export_bytes`: what the last weight sync wrote for the engine (vLLM: the LoRA adapters' bytes,
    or the full weights'); nothing for an engine that syncs in memory. `weight_sync/released_bytes`: what a CPU
    vLLM engine gave back while the update ran (`VllmSampler.sleep`)."""
    synced, slept = getattr(sampler, "last_sync", {}), getattr(sampler, "last_sleep", {})
    out = {"weight_sync/export_bytes": float(synced["export_bytes"])} if "export_bytes" in synced else {}
    return out | ({"weight_sync/released_bytes": float(sum(slept.values()))} if slept else {})


def score_rollout(out: RolloutOutput, examples, tokenizer, reward_fn) -> Trajectories:
    """Decodes each valid response (spec 7.2: up to its response mask, special tokens skipped) and scores it."""
    seqs, masks, texts, prompt_lengths, rollout_logps = [], [], [], [], []
    for i in range(len(out.responses)):
        n_resp = int(out.response_mask[i].sum())
        prompt = out.input_ids[i, :-out.responses.shape[1]][out.attention_mask[i, :-out.responses.shape[1]] > 0]
        resp = out.responses[i, :n_resp]
        seqs.append(np.concatenate([prompt, resp]).astype(np.int32))
        prompt_lengths.append(len(prompt))
        masks.append(np.concatenate([np.zeros(len(prompt), np.int32), out.loss_mask[i, :n_resp]]))
        no_logp = np.full(len(prompt), np.nan, np.float32)  # the prompt was not sampled
        rollout_logps.append(np.concatenate([no_logp, out.rollout_logp[i, :n_resp]]))
        texts.append(tokenizer.decode(resp, skip_special_tokens=True))
    ex = [examples[int(p)] for p in out.prompt_index]
    infos = rewards.score_responses(reward_fn, [e.data_source for e in ex], texts, [e.ground_truth for e in ex],
                                    [e.extra_info for e in ex])
    scores = np.asarray([float(r["score"]) for r in infos], np.float32)
    return Trajectories(seqs, np.asarray(prompt_lengths), masks, scores, np.asarray(out.prompt_index), texts, infos,
                        out, rollout_logps)


def shape_rollout(traj: Trajectories, cfg) -> Trajectories:
    """The training signal of a scored rollout: failed trajectories (and with `algorithm.overlong = mask` the
    truncated ones) masked out of the loss, the DAPO overlong penalty added to the scores (`shaping`)."""
    a = cfg.algorithm
    scores = traj.scores
    if a.overlong == "penalty":
        scores = scores + shaping.overlong_penalty(traj.out.response_length, max_length=cfg.data.max_response_length,
                                                   buffer_length=a.overlong_buffer_len,
                                                   factor=a.overlong_penalty_factor)
    drop = traj.failed | ((traj.out.finish_reason == "length") if a.overlong == "mask" else False)
    masks = [np.zeros_like(m) if d else m for m, d in zip(traj.loss_masks, drop)]
    return dataclasses.replace(traj, scores=np.asarray(scores, np.float32), loss_masks=masks)


class FailureBudget:
    """`rollout.failures`: a step where more than `max_fraction` of the trajectories failed skips its update;
    `max_skipped_steps` such steps in a row (0: no limit) stop the run."""

    def __init__(self, max_fraction: float, max_skipped_steps: int):
        self.max_fraction, self.max_skipped_steps = max_fraction, max_skipped_steps
        self.skipped_in_a_row = 0

    def skip(self, failed: np.ndarray, step: int) -> bool:
        """True (with a warning) when the step's share of `failed` (bool per trajectory of every process) is over
        the budget; raises at the `max_skipped_steps`-th such step in a row."""
        share = float(failed.mean()) if failed.size else 0.0
        if share <= self.max_fraction:
            self.skipped_in_a_row = 0
            return False
        self.skipped_in_a_row += 1
        log.warning("step %d: %.0f%% of the trajectories failed (> rollout.failures.max_fraction = %g): the update "
                    "is skipped (%d step(s) in a row)", step, 100 * share, self.max_fraction, self.skipped_in_a_row)
        if self.max_skipped_steps and self.skipped_in_a_row >= self.max_skipped_steps:
            raise RuntimeError(f"{self.skipped_in_a_row} steps in a row had more than rollout.failures.max_fraction="
                               f"{self.max_fraction:g} of failed trajectories (see the rollout/failed/* metrics): "
                               "the engine or a tool is broken")
        return True


def select_groups(parts: list[tuple[Trajectories, list[int]]]) -> Trajectories:
    """The rows of the chosen groups (prompt indices) of one or more rollouts, as one rollout (dynamic sampling)."""
    picks = [(t, np.concatenate([np.flatnonzero(t.group == g) for g in groups]).astype(np.int64))
             for t, groups in parts if groups]
    out = select_rows([(t.out, rows) for t, rows in picks])
    fields = {"out": out, "group": out.prompt_index}
    for f in dataclasses.fields(Trajectories):  # every other field holds one entry per row
        if f.name not in fields:
            rows = [getattr(t, f.name)[i] for t, idx in picks for i in idx]
            fields[f.name] = np.asarray(rows) if isinstance(getattr(picks[0][0], f.name), np.ndarray) else rows
    return Trajectories(**fields)


# ------------------------------------------------------------------------------------------------------------------
# advantages
# ------------------------------------------------------------------------------------------------------------------


def outcome_advantages(traj: Trajectories, estimator: str, *, norm_by_std: bool = True) -> list[np.ndarray]:
    """GRPO-family advantages per prompt group (spec 8.1), as token-aligned arrays (the sequence's value on every
    token; the loss weights select the trained ones). A failed trajectory is its own group: its score must not move
    the baseline of the others (it has no loss)."""
    group = np.where(traj.failed, -1 - np.arange(len(traj.group)), traj.group)
    kwargs = {"norm_by_std": norm_by_std} if estimator == "grpo" else {}
    adv = np.asarray(algos.compute_advantages(estimator, traj.scores, group, **kwargs))
    return [np.full(len(s), a, np.float32) for s, a in zip(traj.sequences, adv)]


def gae_inputs(traj: Trajectories, values: list[np.ndarray], max_response_length: int):
    """Per-trajectory response slices for `algos.gae_advantages`, padded to [N, max_response_length].

    Returns (rewards, values, mask): the score sits on the last response token (spec 7.2), values are the critic's
    token-aligned old values over the whole response (tool results are states too), 0 past its end, and the mask
    is the loss mask (model tokens), over which the advantages are whitened and the losses taken.
    """
    n = len(traj.sequences)
    rew, val, mask = (np.zeros((n, max_response_length), np.float32) for _ in range(3))
    for i, (seq, v, m) in enumerate(zip(traj.sequences, values, traj.loss_masks)):
        p = int(traj.prompt_lengths[i])
        r = len(seq) - p
        if r:
            rew[i, r - 1] = traj.scores[i]
            val[i, :r] = v[p:]
            mask[i, :r] = m[p:]
    return rew, val, mask


def gae(trajs: list[Trajectories], values: list[list[np.ndarray]], *, max_response_length: int, gamma: float,
        lam: float, whiten: Callable[[np.ndarray, np.ndarray], np.ndarray] = algos.masked_whiten
        ) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """PPO with a critic (spec 8.2): GAE per trajectory on its response, advantages whitened over the batch.

    Args:
      trajs: the rollouts of this process's workers.
      values: per rollout, the critic's token-aligned old values of each sequence.
      max_response_length: the response budget (`data.max_response_length`), the width of the GAE arrays.
      gamma, lam: GAE's discount and lambda.
      whiten: (advantages [N, R], mask [N, R]) -> whitened advantages [N, R]; the trainer's whitens over every
        process's trajectories, as the reference's driver does.

    Returns:
      Per rollout: (advantages, returns), each a token-aligned array per sequence (0 over the prompt).
    """
    inputs = [gae_inputs(t, v, max_response_length) for t, v in zip(trajs, values)]
    rew, val, mask = (np.concatenate(x) for x in zip(*inputs))
    _, returns = algos.gae_advantages(rew, val, mask, gamma=gamma, lam=lam)
    returns = np.asarray(returns)
    adv = np.asarray(whiten(returns - val, mask))  # GAE's unwhitened advantages are returns - values
    out, start = [], 0
    for t in trajs:
        sl = slice(start, start + len(t.sequences))
        start = sl.stop
        out.append((response_to_tokens(t, adv[sl]), response_to_tokens(t, returns[sl])))
    return out


def response_to_tokens(traj: Trajectories, per_response: np.ndarray) -> list[np.ndarray]:
    """[N, R] values over each response -> token-aligned arrays over each whole sequence (0 over the prompt)."""
    out = []
    for i, seq in enumerate(traj.sequences):
        p = int(traj.prompt_lengths[i])
        full = np.zeros(len(seq), np.float32)
        full[p:] = per_response[i, :len(seq) - p]
        out.append(full)
    return out


# ------------------------------------------------------------------------------------------------------------------
# pack
# ------------------------------------------------------------------------------------------------------------------


def layout(traj: Trajectories, cfg, *, mini_prompts: int, rows: int, row_len: int) -> packing.Layout:
    """Where the worker's sequences sit in its [K, M, rows, row_len] block: `mini_prompts` prompts (x n rows) per
    optimizer step, `rows` rows per micro-batch."""
    return packing.plan_layout([len(s) for s in traj.sequences], mini_batch_size=mini_prompts * cfg.rollout.n,
                               row_len=row_len, rows_per_micro=rows, pack=cfg.actor.pack)


def worker_batch(traj: Trajectories, token_arrays: dict[str, list[np.ndarray]], placed: packing.Layout, cfg, *,
                 totals: np.ndarray | None = None, workers: int = 1) -> dict[str, np.ndarray]:
    """One worker's [K, M, rows, T] block of the global batch (numpy).

    Args:
      traj: the worker's rollout.
      token_arrays: token-aligned arrays per sequence: `advantages` and any others to place (`returns`,
        `old_values` with a critic).
      placed: its layout (`layout`, with the micro-batch count of the largest worker).
      cfg: the run's config (`actor.agg_mode`, `actor.micro_norm`, `data.max_response_length`).
      totals, workers: loss tokens and sequences per mini-batch over every worker, and the worker count
        (`packing.loss_weights`); defaults: this worker alone.
    """
    extra = {"rollout_logp": traj.rollout_logps} | {k: v for k, v in token_arrays.items() if k != "advantages"}
    return packing.assemble(placed, traj.sequences, traj.loss_masks, token_arrays["advantages"],
                            agg_mode=cfg.actor.agg_mode, micro_norm=cfg.actor.micro_norm,
                            norm_len=cfg.data.max_response_length,  # seq-mean-token-sum-norm's divisor
                            totals=totals, workers=workers, extra=extra)


# ------------------------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------------------------


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
    out |= metrics_lib.summarize("reward", scores)
    out |= metrics_lib.summarize("tools/calls_per_trajectory", cat(lambda t: t.out.tool_calls))
    out |= metrics_lib.summarize("response/length", cat(lambda t: t.out.response_length))
    out |= metrics_lib.summarize("response/turns", cat(lambda t: t.out.rounds))
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
