"""From a rollout to a training batch: the host-side phases of the RL step as pure functions (numpy).

`Trainer.train_step` calls them in order, per rollout worker:

  reward      `score_rollout` (decode, score: spec 7.2), `shape_rollout` (failures and overlong responses masked,
              the DAPO overlong penalty), `select_groups` (dynamic sampling's pick over several draws);
  advantages  `outcome_advantages` (GRPO family, per prompt group: spec 8.1), or with a critic `gae_inputs` ->
              `gae` -> `response_to_tokens` (spec 8.2), all as token-aligned arrays per trajectory;
  pack        `layout` (where each sequence sits in [K, M, B, T]) and `worker_batch` (the worker's block of the
              global batch, loss weights from the totals of every worker: `packing.loss_weights`).

Nothing here touches a device, a model or another process: what needs them (the critic's values, totals over all
processes, whitening over the global batch) is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from arpo_jax import algos, packing, rewards, shaping
from arpo_jax.rollout.agent_loop import RolloutOutput, select_rows


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
# reward
# ------------------------------------------------------------------------------------------------------------------


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
