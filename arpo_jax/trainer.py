"""The ARPO / AEPO training loop (spec section 1), plain Python that reads top to bottom.

One training step:
  1. a batch of `data.train_batch_size` prompts (seeded shuffle per epoch, drop_last); every process takes its own
     contiguous share, and splits it over its rollout workers;
  2. each rollout worker runs the tool rollout (ARPO branching / AEPO dynamic rollouts) on its prompts, with its
     own branching generator and sampling seed derived from (seed, step, worker): the run is reproducible and a
     single process emulating W workers computes what W processes compute;
  3. rewards on the decoded responses (spec 7.2), GRPO-family advantages per prompt group (spec 8.1);
  4. the trajectories are packed per worker into [K, M, B/W, T] and the workers' blocks side by side form the
     global [K, M, B, T] batch (K optimizer steps of `ppo_mini_batch_size` prompts, M micro-batches, B rows =
     the batch-sharded devices, T = `actor.max_token_len_per_device` tokens per packed row);
  5. old (and, with a KL loss, reference) log-probs with the pre-update params; then `ppo_epochs` x K optimizer
     steps (`train_step`);
  6. the sampler gets the new weights; metrics; a checkpoint every `save_freq` steps; validation (greedy, n = 1,
     per data_source) every `test_freq` steps.

Randomness is a pure function of (seed, step, worker), and the data position is stored in every checkpoint, so a
run killed at any moment resumes from its newest checkpoint and ends with the parameters an uninterrupted run
would have.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arpo_jax import algos, hf, packing, rewards, run_guard, runtime, shaping, sharding
from arpo_jax import config as config_lib
from arpo_jax import critic as critic_lib
from arpo_jax import metrics as metrics_lib
from arpo_jax import train_step as ts
from arpo_jax.checkpoint import Checkpointer
from arpo_jax.components import make_sampler, make_tool_executor, rollout_config, sampling_settings
from arpo_jax.data import rl_dataset, toy
from arpo_jax.rollout.agent_loop import (
    FAILURE_CAUSES,
    RolloutOutput,
    greedy_settings,
    rollout,
    select_rows,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------------
# Config -> components
# ------------------------------------------------------------------------------------------------------------------


def rollout_correction_mode(cfg) -> str:
    """`actor.rollout_correction.mode` with "auto" resolved: truncate (TIS) for vLLM, off for the JAX engine (the
    trainer's own model code) and for vLLM at a temperature other than 1 (its log-probs are temperature 1's)."""
    mode = cfg.actor.rollout_correction.mode
    if mode == "auto":
        return "truncate" if cfg.rollout.engine == "vllm" and cfg.rollout.temperature == 1 else "off"
    return mode


def update_config(cfg) -> ts.UpdateConfig:
    a = cfg.actor
    return ts.UpdateConfig(
        rollout_correction=rollout_correction_mode(cfg), rollout_correction_level=a.rollout_correction.level,
        rollout_correction_threshold=a.rollout_correction.threshold,
        loss=a.loss, clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c, agg_mode=a.agg_mode,
        micro_norm=a.micro_norm, kl_coef=a.kl_coef, kl_kind=a.kl_kind, entropy_coef=a.entropy_coef,
        entropy_adv=a.entropy_adv, entropy_adv_alpha=a.entropy_adv_alpha, reference_compat=a.reference_compat,
        temperature=cfg.rollout.temperature or 1.0, logprob_chunk=a.logprob_chunk, max_grad_norm=a.max_grad_norm,
        lr=a.lr, schedule=a.schedule, warmup_steps=a.warmup_steps, min_lr_ratio=a.min_lr_ratio,
        weight_decay=a.weight_decay)


def resolve_files(files, workdir: Path, split: str, seed: int) -> list[str]:
    """Data file list with `builtin:toy` replaced by the generated toy parquet of `split` (train or val)."""
    if runtime.is_main_process():
        toy.resolve_files(files, str(workdir / "toy_data"), split=split, seed=seed)  # writes them once
    runtime.barrier("toy_data")
    return [os.path.expandvars(f) for f in toy.resolve_files(files, str(workdir / "toy_data"), split=split, seed=seed)]


def num_workers(cfg) -> int:
    return cfg.rollout.workers or jax.process_count()


def worker_seed(seed: int, step: int, worker: int, salt: str = "") -> int:
    """A 31-bit seed that depends only on (seed, step, worker, salt): the same in every process layout."""
    return zlib.crc32(f"{seed}/{step}/{worker}/{salt}".encode()) & 0x7FFFFFFF


# ------------------------------------------------------------------------------------------------------------------
# Rollout -> training sequences
# ------------------------------------------------------------------------------------------------------------------


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


def worker_batch(traj: Trajectories, cfg, *, mini_prompts: int, rows: int,
                 row_len: int) -> tuple[dict, np.ndarray, packing.Layout]:
    """One worker's [K, M, rows, T] batch (numpy), its loss-token counts per mini-batch [K, 2] and its layout.

    With `gae` the advantages are zeros here: they need the critic's values on this very batch (`Trainer._add_gae`).
    """
    estimator = cfg.algorithm.adv_estimator
    # A failed trajectory is its own group: its score must not move the baseline of the others (it has no loss).
    group = np.where(traj.failed, -1 - np.arange(len(traj.group)), traj.group)
    if estimator == "gae":
        adv = np.zeros(len(traj.sequences), np.float32)
    else:
        adv = np.asarray(algos.compute_advantages(estimator, traj.scores, group,
                                                  **({"norm_by_std": cfg.algorithm.norm_adv_by_std}
                                                     if estimator == "grpo" else {})))
    batch, layout = packing.pack_batch(traj.sequences, traj.loss_masks, adv,
                                       mini_batch_size=mini_prompts * cfg.rollout.n, row_len=row_len,
                                       rows_per_micro=rows, pack=cfg.actor.pack, agg_mode=cfg.actor.agg_mode,
                                       micro_norm=cfg.actor.micro_norm,
                                       norm_len=cfg.data.max_response_length,  # seq-mean-token-sum-norm's divisor
                                       extra={"rollout_logp": traj.rollout_logps})
    counts = np.zeros((layout.shape[0], 2), np.float64)  # per mini-batch: loss tokens, sequences with loss tokens
    for i, m in enumerate(traj.loss_masks):
        n = float(m[1:].sum())
        counts[layout.mini[i]] += (n, float(n > 0))
    return batch, counts, layout


def gae_inputs(traj: Trajectories, values: list[np.ndarray], response_length: int):
    """Per-trajectory response slices for `algos.gae_advantages`, padded to [N, response_length].

    Returns (rewards, values, mask): the score sits on the last response token (spec 7.2), values are the critic's
    token-aligned old values over the whole response (tool results are states too), 0 past its end, and the mask
    is the loss mask (model tokens), over which the advantages are whitened and the losses taken.
    """
    n = len(traj.sequences)
    rew, val, mask = (np.zeros((n, response_length), np.float32) for _ in range(3))
    for i, (seq, v, m) in enumerate(zip(traj.sequences, values, traj.loss_masks)):
        p = int(traj.prompt_lengths[i])
        r = len(seq) - p
        if r:
            rew[i, r - 1] = traj.scores[i]
            val[i, :r] = v[p:]
            mask[i, :r] = m[p:]
    return rew, val, mask


def response_to_tokens(traj: Trajectories, per_response: np.ndarray) -> list[np.ndarray]:
    """[N, R] values over each response -> token-aligned arrays over each whole sequence (0 over the prompt)."""
    out = []
    for i, seq in enumerate(traj.sequences):
        p = int(traj.prompt_lengths[i])
        full = np.zeros(len(seq), np.float32)
        full[p:] = per_response[i, :len(seq) - p]
        out.append(full)
    return out


def pad_micro(batch: dict, m: int) -> dict:
    """Pads the micro-batch axis (1) to m with empty micro-batches (segment 0, weight 0: no loss, no gradient)."""
    return {k: pad_axis1(v, m) for k, v in batch.items()}


def pad_axis1(x: np.ndarray, m: int) -> np.ndarray:
    """[K, M, ...] -> [K, m, ...] with zeros."""
    extra = m - x.shape[1]
    return x if extra == 0 else np.concatenate([x, np.zeros(x.shape[:1] + (extra,) + x.shape[2:], x.dtype)], axis=1)


def rescale_weights(batch: dict, counts: np.ndarray, totals: np.ndarray, cfg, workers: int) -> dict:
    """Per-worker loss weights -> weights of the global mini-batch (the workers' blocks are summed by the step).

    A worker normalised its weights over its own share of a mini-batch; the global mean needs the global count:
    token-mean scales by the worker's share of loss tokens, the sequence means by its share of sequences. verl's
    per-GPU weighting (`micro_norm = reference`) averages the ranks' losses: 1 / workers.
    """
    if cfg.actor.micro_norm == "reference" or cfg.actor.agg_mode == "seq-mean-token-sum-norm":
        scale = np.full(len(counts), 1.0 / workers)
    else:
        col = 0 if cfg.actor.agg_mode == "token-mean" else 1
        scale = counts[:, col] / np.maximum(totals[:, col], 1.0)
    return batch | {"loss_weight": (batch["loss_weight"] * scale[:, None, None, None]).astype(np.float32)}


# ------------------------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------------------------


class Trainer:
    """Holds the run's components; `run()` is the loop. Built from a validated config and a work directory."""

    def __init__(self, cfg, workdir: str | os.PathLike):
        runtime.initialize_distributed()
        self.cfg = cfg = config_lib.validate(cfg, device_count=jax.device_count(), process_count=jax.process_count(),
                                                   command="train")
        self.workdir = Path(workdir).absolute()
        self.is_main = runtime.is_main_process()
        # Before anything heavy: the work directory's lock, the config's history and drift, the export folder.
        self.lock, resuming = run_guard.open_workdir(self.workdir, cfg, "train")
        if cfg.trainer.export_hf:
            hf.check_export_destination(self.workdir / "hf")
        self.mesh = runtime.make_mesh(cfg)
        self.workers = num_workers(cfg)
        self.local_workers = range(jax.process_index() * self.workers // jax.process_count(),
                                   (jax.process_index() + 1) * self.workers // jax.process_count())

        model, self.tokenizer, self.model_folder = runtime.load_policy(cfg, self.workdir, self.mesh)
        config_lib.check_tokenizer(self.tokenizer, cfg)
        self.model_cfg = model.config
        self.train_data = rl_dataset.load_rl_dataset(
            resolve_files(cfg.data.train_files, self.workdir, "train", cfg.seed), self.tokenizer,
            prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
            overlong=cfg.data.overlong_prompts, source=cfg.data.source)
        self.val_data = None
        if cfg.data.val_files:
            self.val_data = rl_dataset.load_rl_dataset(
                resolve_files(cfg.data.val_files, self.workdir, "val", cfg.seed), self.tokenizer,
                prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                overlong=cfg.data.overlong_prompts, max_samples=cfg.data.val_max_samples, source=cfg.data.source)
        self.steps_per_epoch = rl_dataset.steps_per_epoch(len(self.train_data), cfg.data.train_batch_size,
                                                          cfg.data.drop_last)
        if self.steps_per_epoch == 0:
            raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the training set "
                             f"({len(self.train_data)} prompts) with data.drop_last=True")
        self.total_steps = cfg.trainer.max_steps or cfg.trainer.total_epochs * self.steps_per_epoch

        # The policy update.
        self.update_cfg = update_config(cfg)
        self.mini_batches = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
        optimizer_steps = self.total_steps * self.mini_batches * cfg.actor.ppo_epochs
        self.optimizer = ts.make_optimizer(self.update_cfg, optimizer_steps)
        self.schedule = ts.make_schedule(self.update_cfg, optimizer_steps)
        self.graphdef, params = ts.split_model(model)
        p_sh = ts.param_shardings(self.model_cfg, self.mesh)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.state_sh = ts.state_shardings(self.optimizer, p_sh, abstract, self.mesh)
        self.step_fn = ts.jit_train_step(self.graphdef, self.model_cfg, self.update_cfg, self.optimizer, self.mesh,
                                         self.state_sh)
        self.logprob_fn = ts.jit_forward_logprobs(self.graphdef, self.model_cfg,
                                                  temperature=self.update_cfg.temperature,
                                                  chunk=cfg.actor.logprob_chunk, mesh=self.mesh)
        self.batch_sh = NamedSharding(self.mesh, ts.batch_spec(self.mesh, self.model_cfg.sharding_rules))
        self.batch_sh4 = NamedSharding(self.mesh, PartitionSpec(None, *self.batch_sh.spec))  # [K, M, B, T]
        rules = sharding.get_rules(self.model_cfg.sharding_rules)
        self.batch_devices = math.prod(self.mesh.shape[a] for a in rules["batch"])
        self.rows_per_worker = max(1, self.batch_devices // self.workers)
        self.row_len = cfg.actor.max_token_len_per_device or 2 * (cfg.data.max_prompt_length +
                                                                  cfg.data.max_response_length)
        self.ref_params = None
        if cfg.actor.kl_coef:
            # The reference policy is the starting policy; on host memory when asked (reference: param_offload).
            self.ref_params = jax.tree.map(jnp.copy, params)
            if cfg.model.ref_on_host:
                self.ref_params = jax.device_get(self.ref_params)

        # PPO with a critic (algorithm.adv_estimator = gae): a value model initialised from the policy.
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        critic_params = None
        if self.use_critic:
            critic_cfg = critic_lib.CriticConfig(cliprange_value=cfg.critic.cliprange_value, lr=cfg.critic.lr,
                                                 max_grad_norm=cfg.actor.max_grad_norm,
                                                 weight_decay=cfg.actor.weight_decay,
                                                 reference_compat=cfg.critic.reference_compat)
            self.critic_optimizer = critic_lib.make_optimizer(critic_cfg, optimizer_steps)
            value_graphdef = critic_lib.value_graphdef(self.model_cfg)
            v_sh = critic_lib.value_param_shardings(self.model_cfg, self.mesh)
            critic_params = critic_lib.value_params_from_policy(params)
            critic_params["value_head"] = jax.tree.map(jax.device_put, critic_params["value_head"],
                                                       v_sh["value_head"])
            self.critic_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), critic_params)
            self.critic_sh = ts.state_shardings(self.critic_optimizer, v_sh, self.critic_abstract, self.mesh)
            self.value_step_fn = critic_lib.jit_value_step(value_graphdef, self.model_cfg, critic_cfg,
                                                           self.critic_optimizer, self.mesh, self.critic_sh)
            self.value_fn = critic_lib.jit_value_forward(value_graphdef, self.model_cfg, self.mesh)

        # Resume, or start.
        self.ckpt = Checkpointer(self.workdir / "checkpoints", max_to_keep=cfg.trainer.keep_checkpoints)
        self.critic_ckpt = (Checkpointer(self.workdir / "critic_checkpoints", max_to_keep=cfg.trainer.keep_checkpoints)
                            if self.use_critic else None)
        self.step, self.position = 0, rl_dataset.DataPosition(0, 0)
        latest = restored = None
        if resuming and self._checkpoint_steps():
            # The newest step whose files and params are intact; a damaged newer one is moved aside (logged).
            latest, restored = self.ckpt.restore_newest_intact(
                lambda s: (self._restore(s, abstract), self._restore_critic(s) if self.use_critic else None),
                steps=self._checkpoint_steps(), also=[c for c in (self.critic_ckpt,) if c is not None])
        self.state = restored[0] if restored else ts.init_train_state(params, self.optimizer, self.state_sh)
        if self.use_critic:
            self.critic_state = (restored[1] if restored else
                                 ts.init_train_state(critic_params, self.critic_optimizer, self.critic_sh))
        del params, model, critic_params

        self.rollout_cfg = rollout_config(cfg)
        self.executor = make_tool_executor(cfg)
        self.reward_fn = rewards.get_reward_fn(cfg.reward.name, custom_path=os.path.expandvars(cfg.reward.custom_path),
                                               custom_name=cfg.reward.custom_name)
        self.sampler = self._make_sampler()
        redacted = config_lib.redact(cfg)
        self.logger = metrics_lib.MetricsLogger(
            self.workdir, loggers=tuple(cfg.trainer.loggers), config=redacted,
            project=cfg.trainer.project, experiment=cfg.trainer.experiment or self.workdir.name,
            resume_step=self.step if latest is not None else None, enabled=self.is_main)
        self.timers = metrics_lib.PhaseTimer()
        self.skipped_in_a_row = 0  # steps skipped for failures (rollout.failures), in a row

    # -- setup helpers -------------------------------------------------------------------------------------------

    def _checkpoint_steps(self) -> list[int]:
        """The steps with every checkpoint of the run (a kill may land between the policy's and critic's)."""
        steps = set(self.ckpt.all_steps())
        if self.critic_ckpt is not None:
            steps &= set(self.critic_ckpt.all_steps())
        return sorted(steps)

    def _restore_critic(self, step: int) -> ts.TrainState:
        with_sh = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                                tree, sh)
        target = with_sh(jax.eval_shape(lambda p: ts.init_train_state(p, self.critic_optimizer), self.critic_abstract),
                         self.critic_sh)
        params, opt_state, meta = self.critic_ckpt.restore(step, config=self.model_cfg, mesh=self.mesh,
                                                           params_target=target.params,
                                                           opt_state_target=target.opt_state)
        counters = meta.get("counters", {})
        return ts.TrainState(params, opt_state, jnp.asarray(counters.get("updates", 0), jnp.int32),
                             jnp.asarray(counters.get("skipped", 0), jnp.int32))

    def _restore(self, step: int, abstract) -> ts.TrainState:
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              jax.eval_shape(lambda p: ts.init_train_state(p, self.optimizer), abstract),
                              self.state_sh)
        params, opt_state, meta = self.ckpt.restore(step, config=self.model_cfg, mesh=self.mesh,
                                                    opt_state_target=target.opt_state)
        params = jax.tree.map(lambda x, s: jax.device_put(x, s), params, self.state_sh.params)
        self.step = int(meta["step"])
        self.position = rl_dataset.DataPosition.from_dict(meta["data_position"])
        counters = meta.get("counters", {})
        log.info("resumed from %s step %d", self.ckpt.directory, self.step)
        return ts.TrainState(params, opt_state, jnp.asarray(counters.get("updates", 0), jnp.int32),
                             jnp.asarray(counters.get("skipped", 0), jnp.int32))

    def _sampler_mesh(self) -> Mesh:
        """Rollouts are per process (each process generates for its own prompts): a mesh of its local devices."""
        return sharding.make_mesh((1, -1, 1), devices=jax.local_devices())

    def _make_sampler(self):
        cfg = self.cfg
        if cfg.rollout.engine == "jax":
            model = nnx.merge(self.graphdef, self._sampler_params())
            return make_sampler(cfg, self.tokenizer, model=model, mesh=self._sampler_mesh())
        # Without rollout.vllm.export_dir, several processes share the run's folder: process 0 writes, every node
        # reads (a shared file system); one process exports to /dev/shm.
        sampler = make_sampler(cfg, self.tokenizer, folder=self.model_folder, log_file=self.workdir / "vllm.log",
                               export_dir=self.workdir / "weight_sync" if jax.process_count() > 1 else None)
        if self.step > 0 or cfg.model.init_checkpoint:
            self._sync_weights(sampler)
        return sampler

    def _sampler_params(self):
        """A copy of the current params for the JAX sampler (the train step donates its own), on local devices."""
        params = self.state.params
        if jax.process_count() > 1:
            # Every process gets the whole model on its own devices: it samples alone.
            params = multihost_utils.process_allgather(params, tiled=True)
            local = ts.param_shardings(self.model_cfg, self._sampler_mesh())
            return jax.tree.map(lambda x, s: jax.device_put(x, s), params, local)
        return jax.tree.map(jnp.copy, params)

    def _sync_weights(self, sampler=None) -> float:
        sampler = sampler or self.sampler
        if self.cfg.rollout.engine == "jax":
            return sampler.update_weights(self._sampler_params())
        model = nnx.merge(self.graphdef, self.state.params)
        return sampler.update_weights(model)

    # -- one step ------------------------------------------------------------------------------------------------

    def _rollout(self, examples, worker: int, *, validation: bool = False, extra_round: int = 0) -> Trajectories:
        cfg = self.cfg
        val = cfg.rollout.val_kwargs
        rcfg = self.rollout_cfg.for_validation(val.n) if validation else self.rollout_cfg
        salt = "val" if validation else "train" if not extra_round else f"train/extra{extra_round}"
        seed = worker_seed(cfg.seed, self.step, worker, salt)
        settings = sampling_settings(cfg, self.executor.stop_strings, seed)
        if validation:
            settings = (dataclasses.replace(settings, temperature=val.temperature, top_p=val.top_p, top_k=val.top_k)
                        if val.do_sample else greedy_settings(settings))
        if hasattr(self.sampler, "reset_cache"):
            self.sampler.reset_cache()  # cached rows of another worker's prompts must not leak into this rollout
        out = rollout([e.prompt_ids for e in examples], self.sampler, self.executor, self.tokenizer, rcfg, settings,
                      np.random.default_rng(seed))
        return score_rollout(out, examples, self.tokenizer, self.reward_fn)

    def _batch_examples(self, position: rl_dataset.DataPosition | None = None) -> dict[int, list]:
        """This step's prompts (or those of the batch at `position`) per local rollout worker."""
        cfg = self.cfg
        position = position or self.position
        idx = rl_dataset.batch_indices(len(self.train_data), cfg.data.train_batch_size, position.epoch,
                                       position.step_in_epoch, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                       drop_last=cfg.data.drop_last)
        return {w: [self.train_data[int(i)] for i in rl_dataset.shard(idx, w, self.workers)]
                for w in self.local_workers}

    def _global(self, local: np.ndarray, lead: int = 0) -> jax.Array:
        """The global [M, B, T] array (with `lead` = 1: [K, M, B, T]) from this process's rows (its workers' blocks
        along B)."""
        b = local.ndim - 2
        global_shape = local.shape[:b] + (local.shape[b] * jax.process_count(),) + local.shape[b + 1:]
        return jax.make_array_from_process_local_data(self.batch_sh4 if lead else self.batch_sh, local, global_shape)

    def _collect_rollouts(self) -> tuple[dict[int, Trajectories], rl_dataset.DataPosition, dict]:
        """This step's shaped rollouts per local worker, the data position after them, and dynamic-sampling metrics.

        With `algorithm.dynamic_sampling`, groups whose rewards are all equal are dropped and the next batches of
        the data stream are rolled out (up to `algorithm.max_extra_rounds` more) until every worker has its share
        of informative groups; a worker still short is topped up with dropped groups (`shaping.pick_groups`).
        """
        cfg, a = self.cfg, self.cfg.algorithm
        position = self.position
        draws: dict[int, list[Trajectories]] = {w: [] for w in self.local_workers}
        informative: dict[int, list[np.ndarray]] = {w: [] for w in self.local_workers}
        need = cfg.data.train_batch_size // self.workers
        extra = 0
        while True:
            for w, ex in self._batch_examples(position).items():
                if extra and sum(int(i.sum()) for i in informative[w]) >= need:
                    continue  # this worker is full; others draw on
                t = shape_rollout(self._rollout(ex, w, extra_round=extra), cfg)
                draws[w].append(t)
                informative[w].append(shaping.informative_groups(t.scores, t.group, ~t.failed)[1])
            position = position.advance(self.steps_per_epoch)
            if not a.dynamic_sampling:
                return {w: d[0] for w, d in draws.items()}, position, {}
            short = max(need - sum(int(i.sum()) for i in informative[w]) for w in self.local_workers)
            if jax.process_count() > 1:
                short = int(multihost_utils.process_allgather(np.asarray(short)).max())
            if extra >= a.max_extra_rounds or max(short, 0) == 0:
                break
            extra += 1
        trajs, counts = {}, np.zeros(3)  # informative groups drawn, groups drawn, uninformative groups kept
        for w in self.local_workers:
            picks = shaping.pick_groups(informative[w], need)
            trajs[w] = select_groups([(t, [k for r, k in picks if r == j]) for j, t in enumerate(draws[w])])
            counts += (sum(int(i.sum()) for i in informative[w]), sum(len(i) for i in informative[w]),
                       sum(not informative[w][r][k] for r, k in picks))
        counts = self._gather(counts[None]).sum(0)
        return trajs, position, {"dynamic_sampling/kept_fraction": float(counts[0] / max(counts[1], 1)),
                                 "dynamic_sampling/extra_rounds": float(extra),
                                 "dynamic_sampling/filled_groups": float(counts[2])}

    def _too_many_failures(self, trajs: dict[int, Trajectories]) -> bool:
        """True (with a warning) when more than `rollout.failures.max_fraction` of the step's trajectories failed;
        raises after `max_skipped_steps` such steps in a row (0: never)."""
        f = self.cfg.rollout.failures
        failed = self._gather(np.concatenate([t.failed for t in trajs.values()]).astype(np.float32))
        share = float(failed.mean()) if failed.size else 0.0
        if share <= f.max_fraction:
            self.skipped_in_a_row = 0
            return False
        self.skipped_in_a_row += 1
        log.warning("step %d: %.0f%% of the trajectories failed (> rollout.failures.max_fraction = %g): the update "
                    "is skipped (%d step(s) in a row)", self.step + 1, 100 * share, f.max_fraction,
                    self.skipped_in_a_row)
        if f.max_skipped_steps and self.skipped_in_a_row >= f.max_skipped_steps:
            raise RuntimeError(f"{self.skipped_in_a_row} steps in a row had more than rollout.failures.max_fraction="
                               f"{f.max_fraction:g} of failed trajectories (see the rollout/failed/* metrics): "
                               "the engine or a tool is broken")
        return True

    def _build_batch(self, trajs: dict[int, Trajectories]) -> list[dict]:
        """K mini-batches of global arrays (old and reference log-probs included), in optimizer-step order."""
        cfg = self.cfg
        mini_prompts = cfg.actor.ppo_mini_batch_size // self.workers
        parts = {w: worker_batch(t, cfg, mini_prompts=mini_prompts, rows=self.rows_per_worker, row_len=self.row_len)
                 for w, t in trajs.items()}  # w -> (batch, counts, layout)
        local_counts = np.stack([parts[w][1] for w in self.local_workers])  # [W_local, K, 2]
        local_m = max(parts[w][0]["input_ids"].shape[1] for w in self.local_workers)
        if jax.process_count() > 1:
            all_counts = multihost_utils.process_allgather(local_counts)  # [P, W_local, K, 2]
            totals = all_counts.reshape(-1, *local_counts.shape[1:]).sum(0)
            m = int(multihost_utils.process_allgather(np.asarray(local_m)).max())
        else:
            totals, m = local_counts.sum(0), local_m
        padded = {w: pad_micro(parts[w][0], m) for w in self.local_workers}
        if self.use_critic:
            self._add_gae(padded, {w: parts[w][2] for w in self.local_workers}, trajs)
        blocks = [rescale_weights(padded[w], parts[w][1], totals, cfg, self.workers) for w in self.local_workers]
        local = {k: np.concatenate([b[k] for b in blocks], axis=2) for k in blocks[0]}  # [K, M, B_local, T]
        minis = []
        for k in range(local["input_ids"].shape[0]):
            batch = {name: self._global(v[k]) for name, v in local.items()}
            batch["old_logp"], _ = self.logprob_fn(self.state.params, batch)
            if self.ref_params is not None:
                batch["ref_logp"], _ = self.logprob_fn(self.ref_params, batch)
            minis.append(batch)
        return minis

    def _add_gae(self, padded: dict[int, dict], layouts: dict[int, packing.Layout],
                 trajs: dict[int, Trajectories]) -> None:
        """PPO with a critic (spec 8.2): the rollout's old values, GAE per trajectory, whitening over the global batch.

        Fills `advantages`, `returns` and `old_values` of each worker's padded [K, M, rows, T] block in place.
        The values come from one forward pass over the packed global batch; GAE itself runs per trajectory on its
        response (a reverse scan over a packed row would cross from one trajectory into another).
        """
        cfg = self.cfg
        local = {k: np.concatenate([padded[w][k] for w in self.local_workers], axis=2) for k in critic_lib.FORWARD_KEYS}
        values = self._host_local(self.value_fn(self.critic_state.params,
                                                {k: self._global(v, lead=1) for k, v in local.items()}))
        per_worker = dict(zip(self.local_workers, np.split(values, len(self.local_workers), axis=2)))
        tok_values = {w: packing.unpack(layouts[w], per_worker[w]) for w in self.local_workers}
        inputs = [gae_inputs(trajs[w], tok_values[w], cfg.data.max_response_length) for w in self.local_workers]
        rew, val, mask = (np.concatenate(x) for x in zip(*inputs))
        _, returns = algos.gae_advantages(rew, val, mask, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
        returns = np.asarray(returns)
        # Whitened over every trajectory of the step (as the reference's driver does), not per process.
        n_local = len(rew)
        adv = np.asarray(algos.masked_whiten(self._gather(returns - val), self._gather(mask)))
        adv = adv[jax.process_index() * n_local:(jax.process_index() + 1) * n_local]
        start = 0
        for w in self.local_workers:
            t, layout, block = trajs[w], layouts[w], padded[w]
            sl = slice(start, start + len(t.sequences))
            start = sl.stop
            m = block["input_ids"].shape[1]
            block["advantages"] = pad_axis1(packing.place(layout, response_to_tokens(t, adv[sl])), m)
            block["returns"] = pad_axis1(packing.place(layout, response_to_tokens(t, returns[sl])), m)
            block["old_values"] = pad_axis1(packing.place(layout, tok_values[w]), m)

    def _host_local(self, x: jax.Array) -> np.ndarray:
        """This process's rows of a global [K, M, B, T] array (inverse of `_global(..., lead=1)`)."""
        if jax.process_count() == 1:
            return np.asarray(x)
        return np.asarray(multihost_utils.global_array_to_host_local_array(x, self.mesh, self.batch_sh4.spec))

    def train_step(self) -> dict:
        """One training step: rollout, rewards, advantages, update, weight sync. Returns its metrics."""
        cfg, timers = self.cfg, self.timers
        timers.reset()
        t0 = time.perf_counter()
        with timers("rollout"):
            trajs, position, sampling_metrics = self._collect_rollouts()
        skip = self._too_many_failures(trajs)
        with timers("old_logprob"):
            minis = [] if skip else self._build_batch(trajs)
        update_policy = not (self.use_critic and self.step < cfg.critic.warmup_steps)
        step_metrics, critic_metrics = [], []
        if self.use_critic:
            with timers("critic_update"):  # the reference updates the critic first, on the same mini-batches
                for _ in range(cfg.actor.ppo_epochs):
                    for batch in minis:
                        self.critic_state, m = self.value_step_fn(self.critic_state, batch)
                        critic_metrics.append(m)
                critic_metrics = jax.device_get(critic_metrics)
        with timers("update"):
            for _ in range(cfg.actor.ppo_epochs if update_policy else 0):
                for batch in minis:
                    self.state, m = self.step_fn(self.state, batch)
                    step_metrics.append(m)
            step_metrics = jax.device_get(step_metrics)
        with timers("weight_sync"):
            if minis:
                self._sync_weights()
        self.step += 1
        self.position = position
        out = (self._rollout_metrics(trajs) | self._update_metrics(step_metrics) | timers.as_metrics(prefix="time/")
               | self._update_metrics(critic_metrics, prefix="critic/") | sampling_metrics
               | {"rollout/step_skipped": float(skip)})
        tokens = sum(len(s) for t in trajs.values() for s in t.sequences)
        elapsed = time.perf_counter() - t0
        out |= {"time/step": elapsed, "perf/tokens_per_s": tokens * jax.process_count() / elapsed,
                "train/epoch": self.position.epoch, "train/lr": float(self.schedule(int(self.state.step)))}
        self._log_trajectories(trajs)
        return out

    # -- metrics -------------------------------------------------------------------------------------------------

    def _gather(self, values: np.ndarray) -> np.ndarray:
        """Per-trajectory values of every process (equal counts per process), for metrics."""
        if jax.process_count() == 1:
            return values
        return np.asarray(multihost_utils.process_allgather(values)).reshape(-1, *values.shape[1:])

    def _rollout_metrics(self, trajs: dict[int, Trajectories]) -> dict:
        ts_ = list(trajs.values())
        scores = self._gather(np.concatenate([t.scores for t in ts_]))
        calls = self._gather(np.concatenate([t.out.tool_calls for t in ts_]).astype(np.float32))
        lengths = self._gather(np.concatenate([t.out.response_length for t in ts_]).astype(np.float32))
        rounds = self._gather(np.concatenate([t.out.rounds for t in ts_]).astype(np.float32))
        branches = self._gather(np.asarray([float((t.out.parent_id >= 0).sum()) / max(len(t.out.trees), 1)
                                            for t in ts_], np.float32))
        out = {}
        out |= metrics_lib.summarize("reward", scores)
        out |= metrics_lib.summarize("tools/calls_per_trajectory", calls)
        out |= metrics_lib.summarize("response/length", lengths)
        out |= metrics_lib.summarize("response/turns", rounds)
        out["reward/accuracy"] = float(np.mean(scores > 0)) if scores.size else 0.0
        out["rollout/branches_per_prompt"] = float(np.mean(branches))
        out["reward/format_error_fraction"] = float(np.mean(scores < 0)) if scores.size else 0.0
        causes = ("", *FAILURE_CAUSES)  # gathered as codes (0 = not failed)
        failed = self._gather(np.asarray([causes.index(c) for t in ts_ for c in t.out.failed], np.int32))
        out["rollout/failed"] = float(np.sum(failed > 0))
        out["rollout/failed_fraction"] = float(np.mean(failed > 0)) if failed.size else 0.0
        out |= {f"rollout/failed/{c}": float(np.sum(failed == k)) for k, c in enumerate(causes) if c}
        if self.cfg.algorithm.overlong == "mask":
            cut = self._gather(np.concatenate([t.out.finish_reason == "length" for t in ts_]).astype(np.float32))
            out["response/overlong_masked_fraction"] = float(np.mean(cut))
        # Engine / tool counters of this process (the rollout's own metrics, per worker averaged).
        for key in ts_[0].out.metrics:
            out[key] = float(np.mean([t.out.metrics[key] for t in ts_]))
        out |= self.executor.metrics()  # tools/<tag>/<name>
        self.executor.reset_metrics()
        return out

    def _update_metrics(self, step_metrics: list[dict], prefix: str = "actor/") -> dict:
        if not step_metrics:
            return {}
        keys = step_metrics[0].keys()
        # rollout_corr/* keep their own prefix; maxima stay maxima over the mini-batches.
        name = lambda k: k if k.startswith("rollout_corr/") else f"{prefix}{k}"
        agg = lambda k: np.max if k.endswith("_max") else np.mean
        return {name(k): float(agg(k)([np.asarray(m[k]) for m in step_metrics])) for k in keys}

    def _log_trajectories(self, trajs: dict[int, Trajectories]) -> None:
        n = self.cfg.trainer.log_trajectories
        if not n or not self.is_main:
            return
        t = trajs[self.local_workers[0]]
        records = []
        for i in range(min(n, len(t.responses))):
            tree = t.out.trees[int(t.out.prompt_index[i])]
            records.append({"step": self.step, "prompt_index": int(t.out.prompt_index[i]),
                            "score": float(t.scores[i]), "reward": t.reward_infos[i], "response": t.responses[i],
                            "tool_calls": int(t.out.tool_calls[i]), "finish_reason": str(t.out.finish_reason[i]),
                            "failed": str(t.out.failed[i]),
                            "tree": {"initial_rollouts": tree.initial_rollouts,
                                     "nodes": [dataclasses.asdict(nd) for nd in tree.nodes]}})
        self.logger.log_jsonl("trajectories", records)

    # -- validation and checkpoints ------------------------------------------------------------------------------

    def validate(self) -> dict:
        """Rollouts over the validation set as rollout.val_kwargs says (greedy n = 1 by default): the mean reward
        and accuracy over all samples, and the mean reward per data_source (`mean@n`)."""
        if self.val_data is None:
            return {}
        t0 = time.perf_counter()
        n = self.cfg.rollout.val_kwargs.n
        idx = np.array_split(np.arange(len(self.val_data)), self.workers)
        per_worker = {w: [self.val_data[int(i)] for i in idx[w]] for w in self.local_workers}
        bs = self.cfg.data.val_batch_size
        scores, sources = [], []
        for w, exs in per_worker.items():
            for start in range(0, len(exs), bs or max(len(exs), 1)):
                chunk = exs[start:start + (bs or len(exs))]
                if chunk:
                    t = self._rollout(chunk, w, validation=True)
                    scores += list(t.scores)
                    sources += [chunk[int(p)].data_source for p in t.group]
        scores, sources = self._gather_ragged(np.asarray(scores, np.float32), sources, width=len(self.val_data) * n)
        out = {"val/reward/mean": float(np.mean(scores)), "val/accuracy": float(np.mean(scores > 0)),
               "val/samples": len(scores), "time/validation": time.perf_counter() - t0}
        for src in sorted(set(sources)):
            sel = np.asarray([s == src for s in sources])
            out[f"val/{src}/reward/mean@{n}"] = float(np.mean(scores[sel]))
        return out

    def _gather_ragged(self, scores: np.ndarray, sources: list[str], *, width: int) -> tuple[np.ndarray, list[str]]:
        """All processes' `scores` and `sources` (at most `width` each)."""
        if jax.process_count() == 1:
            return scores, sources
        names = sorted(set(self.val_data.data_sources))
        codes = np.asarray([names.index(s) for s in sources], np.int32)
        pad = lambda x, v: np.concatenate([x, np.full(width - len(x), v, x.dtype)])
        all_s = np.asarray(multihost_utils.process_allgather(pad(scores, np.nan))).reshape(-1)
        all_c = np.asarray(multihost_utils.process_allgather(pad(codes, -1))).reshape(-1)
        keep = all_c >= 0
        return all_s[keep], [names[c] for c in all_c[keep]]

    def save(self) -> None:
        meta = {"data_position": self.position.to_dict(), "seed": self.cfg.seed, "total_steps": self.total_steps,
                "counters": {"updates": int(self.state.step), "skipped": int(self.state.skipped)}}
        self.ckpt.save(self.step, self.state.params, config=self.model_cfg, opt_state=self.state.opt_state,
                       meta=meta, force=True)
        if self.critic_ckpt is not None:
            counters = {"updates": int(self.critic_state.step), "skipped": int(self.critic_state.skipped)}
            self.critic_ckpt.save(self.step, self.critic_state.params, config=self.model_cfg,
                                  opt_state=self.critic_state.opt_state, meta={"counters": counters}, force=True)

    # -- the loop ------------------------------------------------------------------------------------------------

    def run(self, stop: run_guard.StopSignals | None = None) -> dict:
        """Trains to `total_steps`. With `stop`, a signal ends the loop at the next step boundary: the step is
        saved, metrics are flushed and `run_guard.Stopped` is raised."""
        tr = self.cfg.trainer
        t_start = time.perf_counter()
        val = {}
        if tr.val_before_train and self.step == 0:
            val = self.validate()
            self.logger.log(0, val)
        bar = metrics_lib.progress(self.total_steps, "train", enabled=tr.progress and self.is_main,
                                   initial=self.step)
        last = {}
        while not self._done():
            for ckpt in (self.ckpt, self.critic_ckpt):
                if ckpt is not None:
                    ckpt.raise_if_failed()  # a save that failed in the background (full disk) stops the run now
            if stop is not None and stop.requested():
                bar.close()
                raise stop.stopped(self._save_for_stop())
            updates = int(self.state.step)
            try:
                last = self.train_step()
            except Exception as e:
                if stop is None or stop.signum is None or int(self.state.step) != updates:
                    raise
                # The signal also reached this step's helper processes (a Ctrl-C goes to the whole process group,
                # e.g. the vLLM engine) and the step failed before any update: abandon it, keep the last step.
                bar.close()
                raise stop.stopped(f"the step in progress was abandoned ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''}); "
                                   f"{self._save_for_stop()}") from None
            if tr.test_freq and (self.step % tr.test_freq == 0 or self._done()):
                val = self.validate()
                last |= val
            self.logger.log(self.step, last)
            if (tr.save_freq and self.step % tr.save_freq == 0) or self._done():
                self.save()
            bar.update(1)
            bar.set_postfix(reward=f"{last.get('reward/mean', 0):.3f}")
        bar.close()
        if stop is not None and stop.requested():  # the signal came during the last step: it is saved, stop as asked
            raise stop.stopped(self._save_for_stop())
        for ckpt in (self.ckpt, self.critic_ckpt):
            if ckpt is not None:
                ckpt.wait()
        export = None
        if tr.export_hf:
            export = str(hf.save_pretrained(nnx.merge(self.graphdef, self.state.params), self.workdir / "hf",
                                            tokenizer=self.tokenizer))
        summary = {"steps": self.step, "total_steps": self.total_steps, "reward_mean": last.get("reward/mean"),
                   "val": {k: v for k, v in val.items() if k.startswith("val/")},
                   "wall_s": round(time.perf_counter() - t_start, 1), "workdir": str(self.workdir),
                   "checkpoints": str(self.ckpt.directory), "metrics": str(self.workdir / "metrics.jsonl"),
                   "hf_export": export}
        if self.is_main:
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _done(self) -> bool:
        """`total_steps` trained, or (without trainer.max_steps) `total_epochs` of data used: dynamic sampling
        draws extra batches, so an epoch can end after fewer steps."""
        tr = self.cfg.trainer
        return self.step >= self.total_steps or (not tr.max_steps and self.position.epoch >= tr.total_epochs)

    def _save_for_stop(self) -> str:
        """Saves the current step unless it is saved already; waits for the saves. Returns what happened."""
        if self.step > 0 and self.step not in self._checkpoint_steps():
            self.save()
        for ckpt in (self.ckpt, self.critic_ckpt):
            if ckpt is not None:
                ckpt.wait()
        if self.step == 0:
            return "no step was trained, nothing to save"
        return f"step {self.step} is saved in {self.ckpt.directory}; the same command resumes it"

    def close(self) -> None:
        try:
            for ckpt in (self.ckpt, self.critic_ckpt):
                if ckpt is not None:
                    ckpt.wait()
                    ckpt.close()
        finally:
            self.logger.close()
            self.executor.close()
            self.sampler.close()
            self.lock.release()


def train(cfg, workdir: str | os.PathLike) -> dict:
    """`arpo-jax train`: builds the trainer, runs it to `total_steps`, returns the summary (also summary.json).

    SIGTERM / SIGINT stop it at a step boundary with a checkpoint (`run_guard.Stopped`, exit 143 / 130)."""
    with run_guard.StopSignals("train") as stop:
        trainer = Trainer(cfg, workdir)
        try:
            return trainer.run(stop)
        finally:
            trainer.close()
