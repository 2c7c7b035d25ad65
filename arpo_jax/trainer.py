"""The ARPO / AEPO training loop (spec section 1), plain Python that reads top to bottom.

`Trainer.__init__` is the setup and the resume (the run skeleton it shares with SFT is `skeleton.py`), `Trainer.run`
the loop (stop protocol, step, validation, metrics, checkpoints), `Trainer.train_step` one step; below the class,
the setup helpers and `GlobalBatch`, the layout of the step's batch over workers and processes.

One training step (`Trainer.train_step`), phase by phase, each timed as `time/<phase>`:
  rollout      a batch of `data.train_batch_size` prompts (seeded shuffle per epoch, drop_last); every process
               takes its own contiguous share and splits it over its rollout workers; each worker runs the tool
               rollout (ARPO branching / AEPO dynamic rollouts) with its own branching generator and sampling seed
               derived from (seed, step, worker): the run is reproducible and a single process emulating W workers
               computes what W processes compute;
  reward       rewards on the decoded responses (spec 7.2), failures and overlong responses masked (with dynamic
               sampling rollout and reward repeat per draw until every worker has informative groups);
  advantages   GRPO-family advantages per prompt group (spec 8.1), or GAE with the critic's values (spec 8.2);
  pack         per worker [K, M, B/W, T] blocks side by side form the global [K, M, B, T] batch (K optimizer steps
               of `ppo_mini_batch_size` prompts, M micro-batches, B rows = the batch-sharded devices, T =
               `actor.max_token_len_per_device` tokens per packed row); the loss weights are normalised by the
               totals of the whole mini-batch over every worker;
  old_logprob  old (and, with a KL loss, reference) log-probs with the pre-update params;
  update       `ppo_epochs` x K optimizer steps (the critic's first, with GAE);
  weight_sync  the sampler gets the new weights;
  metrics      then a checkpoint every `save_freq` steps and validation (greedy, n = 1, per data_source) every
               `test_freq` steps (`run`).
The host-side maths of reward, advantages and pack are pure functions in `experience`.

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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arpo_jax import (
    algos,
    distributed,
    experience,
    hf,
    lora,
    lora_io,
    packing,
    paths,
    rewards,
    run_guard,
    runtime,
    sharding,
    skeleton,
    tree_packing,
)
from arpo_jax import config as config_lib
from arpo_jax import critic as critic_lib
from arpo_jax import metrics as metrics_lib
from arpo_jax import train_step as ts
from arpo_jax.checkpoint import Checkpointer
from arpo_jax.components import make_sampler, make_tool_executor, rollout_config, sampling_settings, update_config
from arpo_jax.data import rl_dataset, toy
from arpo_jax.experience import Trajectories
from arpo_jax.rollout.agent_loop import RolloutOutput, RolloutState, greedy_settings, rollout

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


class Trainer:
    """The RL run: `__init__` sets it up (or resumes it), `run()` is the loop, `train_step()` one step."""

    def __init__(self, cfg, workdir: str | os.PathLike):
        # Setup: the config, the work directory (its lock, the config's history and drift), mesh, model, data.
        runtime.initialize_distributed()
        self.cfg = cfg = config_lib.validate(cfg, device_count=jax.device_count(), process_count=jax.process_count(),
                                                   command="train")
        self.workdir = paths.local_path(workdir)  # refuses gs:// (it would become $PWD/gs:/...)
        self.is_main = runtime.is_main_process()
        self.lock, resuming = run_guard.open_workdir(self.workdir, cfg, "train")
        if cfg.trainer.export_hf:
            hf.check_export_destination(self.workdir / "hf")
        self.mesh = runtime.make_mesh(cfg)
        self.workers = num_workers(cfg)
        self.local_workers = local_workers(self.workers)
        model, self.tokenizer, self.model_folder = runtime.load_policy(cfg, self.workdir, self.mesh)
        config_lib.check_tokenizer(self.tokenizer, cfg)
        self.model_cfg = model.config
        self.train_data, self.val_data = load_datasets(cfg, self.workdir, self.tokenizer)
        self.steps_per_epoch, self.total_steps = step_counts(cfg, len(self.train_data))

        # The policy update (and, with algorithm.adv_estimator = gae, the critic's), the batch layout.
        upd = update_config(cfg)
        updates = self.total_steps * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
        self.policy, params = skeleton.build_policy(
            model, upd, updates, self.mesh, lambda g, mc, opt, mesh, sh: ts.jit_train_step(g, mc, upd, opt, mesh, sh))
        self.logprob_fn = ts.jit_forward_logprobs(self.policy.graphdef, self.model_cfg, chunk=cfg.actor.logprob_chunk,
                                                  temperature=upd.temperature, mesh=self.mesh,
                                                  tree=cfg.actor.tree_training)
        self.batches = GlobalBatch(cfg, self.mesh, self.model_cfg, self.workers, self.local_workers)
        self.ref_logprobs = reference_logprobs(params, cfg, self.model_cfg, self.logprob_fn, upd.temperature, self.mesh)
        self.critic = None
        if cfg.algorithm.adv_estimator == "gae":
            self.critic = critic_lib.Critic(critic_config(cfg), self.model_cfg, self.mesh, self.policy.abstract,
                                            updates, self.workdir / "critic_checkpoints",
                                            keep=cfg.trainer.keep_checkpoints)

        # Resume, or start: the policy's and the critic's newest intact step, with the data position.
        self.checkpoints = skeleton.RunCheckpoints(
            [Checkpointer(self.workdir / "checkpoints", max_to_keep=cfg.trainer.keep_checkpoints)]
            + ([self.critic.ckpt] if self.critic else []))
        self.step, self.position = 0, rl_dataset.DataPosition(0, 0)
        # LoRA: checkpoints hold the adapters and a pointer to the frozen base (`lora_io.base_pointer`), not the base.
        lora_rl = bool(self.model_cfg.lora_rank)
        self._lora_base = params if lora_rl else None
        self.lora_base = lora_io.base_pointer(cfg, self.model_folder, params, self.model_cfg) if lora_rl else None
        latest, (self.state, critic_state) = self.checkpoints.resume_or_init(
            resuming, lambda s: (self._restore(s), self.critic.restore(s) if self.critic else None),
            lambda: (self.policy.init_state(params), self.critic.init_state(params) if self.critic else None))
        if self.critic:
            self.critic.state = critic_state
        params = model = self._lora_base = None  # the states hold their own copies: free the loaded weights

        # The rollout's components, the logger.
        self.rollout_cfg = rollout_config(cfg)
        self.executor = make_tool_executor(cfg)
        self.reward_fn = rewards.get_reward_fn(cfg.reward.name, custom_path=os.path.expandvars(cfg.reward.custom_path),
                                               custom_name=cfg.reward.custom_name)
        self.sampler = make_rollout_sampler(cfg, self.tokenizer, self.model_folder, self.workdir, self.policy,
                                            self.state.params, sync=self.step > 0 or bool(cfg.model.init_checkpoint))
        self.logger = skeleton.open_logger(cfg, self.workdir, resume_step=latest, enabled=self.is_main)
        self.timers = metrics_lib.PhaseTimer()
        f = cfg.rollout.failures
        self.failures = experience.FailureBudget(f.max_fraction, f.max_skipped_steps)  # skips steps of failures
        self.rollout_states = {w: RolloutState() for w in self.local_workers}  # B1 compat, see `_rollout`

    def run(self, stop: run_guard.StopSignals | None = None) -> dict:
        """Trains to `total_steps`: each step, then validation every `test_freq` steps, metrics, a checkpoint every
        `save_freq` steps. With `stop`, a signal ends the loop at the next step boundary: the step is saved, metrics
        are flushed and `run_guard.Stopped` is raised."""
        tr = self.cfg.trainer
        t_start = time.perf_counter()
        val, last = {}, {}
        if tr.val_before_train and self.step == 0:
            val = self.validate()
            self.logger.log(0, val)
        bar = metrics_lib.progress(self.total_steps, "train", enabled=tr.progress and self.is_main, initial=self.step)
        while not self._done():
            self.checkpoints.raise_if_failed()  # a save that failed in the background (full disk) stops the run now
            if stop is not None and stop.requested():
                bar.close()
                raise stop.stopped(self.checkpoints.save_for_stop(self.step, self.save))
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
                                   f"{self.checkpoints.save_for_stop(self.step, self.save)}") from None
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
            raise stop.stopped(self.checkpoints.save_for_stop(self.step, self.save))
        self.checkpoints.wait()
        export = None
        if tr.export_hf:
            export = str(hf.save_pretrained(nnx.merge(self.policy.graphdef, self.state.params), self.workdir / "hf",
                                            tokenizer=self.tokenizer))
        summary = {"steps": self.step, "total_steps": self.total_steps, "reward_mean": last.get("reward/mean"),
                   "val": {k: v for k, v in val.items() if k.startswith("val/")},
                   "wall_s": round(time.perf_counter() - t_start, 1), "workdir": str(self.workdir),
                   "checkpoints": str(self.checkpoints.main.directory), "metrics": str(self.workdir / "metrics.jsonl"),
                   "hf_export": export}
        if self.is_main:
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def train_step(self) -> dict:
        """One RL step, phase by phase (each timed under its name: `time/<phase>`). Returns its metrics."""
        cfg, timers = self.cfg, self.timers
        timers.reset()
        t0 = time.perf_counter()
        # rollout -> reward, per draw: dynamic sampling needs the rewards to decide whether to draw again.
        trajs, position, sampling_metrics = experience.collect(
            self._batch_examples, self._rollout_and_reward, self.position, steps_per_epoch=self.steps_per_epoch,
            need=cfg.data.train_batch_size // self.workers, dynamic=cfg.algorithm.dynamic_sampling,
            max_extra_rounds=cfg.algorithm.max_extra_rounds, agree_max=distributed.agree_max,
            gather=distributed.gather)
        failed = distributed.gather(np.concatenate([t.failed for t in trajs.values()]).astype(np.float32))
        skip = self.failures.skip(failed, self.step + 1)
        minis, pack_metrics = [], {}
        if not skip:
            with timers("advantages"):
                token_arrays = self._advantages(trajs)
            with timers("pack"):
                minis, pack_metrics = self.batches.pack(trajs, token_arrays)
            with timers("old_logprob"):
                minis = [self._old_logprobs(batch) for batch in minis]
        with timers("update"):
            step_metrics, critic_metrics = self._update(minis)
        with timers("weight_sync"):
            if minis:
                sync_weights(self.sampler, cfg, self.policy, self.state.params)
        self.step += 1
        self.position = position
        with timers("metrics"):
            out = (experience.rollout_metrics(list(trajs.values()), overlong_mask=cfg.algorithm.overlong == "mask",
                                              gather=distributed.gather)
                   | self.executor.metrics()  # tools/<tag>/<name>
                   | experience.update_metrics(step_metrics)
                   | experience.update_metrics(critic_metrics, prefix="critic/") | sampling_metrics | pack_metrics
                   | {"rollout/step_skipped": float(skip)})
            synced = getattr(self.sampler, "last_sync", {})  # vLLM: the LoRA adapters' bytes, or the full weights'
            if "export_bytes" in synced:
                out["weight_sync/export_bytes"] = float(synced["export_bytes"])
            self.executor.reset_metrics()
            if cfg.trainer.log_trajectories and self.is_main:
                self.logger.log_jsonl("trajectories", experience.trajectory_records(
                    trajs[self.local_workers[0]], cfg.trainer.log_trajectories, self.step))
        tokens = sum(len(s) for t in trajs.values() for s in t.sequences)
        elapsed = time.perf_counter() - t0
        return out | timers.as_metrics(prefix="time/") | {
            "time/step": elapsed, "perf/tokens_per_s": tokens * jax.process_count() / elapsed,
            "train/epoch": self.position.epoch, "train/lr": float(self.policy.schedule(int(self.state.step)))}

    # -- rollout and reward --------------------------------------------------------------------------------------

    def _batch_examples(self, position: rl_dataset.DataPosition | None = None) -> dict[int, list]:
        """This step's prompts (or those of the batch at `position`) per local rollout worker."""
        cfg = self.cfg
        position = position or self.position
        idx = rl_dataset.batch_indices(len(self.train_data), cfg.data.train_batch_size, position.epoch,
                                       position.step_in_epoch, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                       drop_last=cfg.data.drop_last)
        return {w: [self.train_data[int(i)] for i in rl_dataset.shard(idx, w, self.workers)]
                for w in self.local_workers}

    def _rollout_and_reward(self, examples, worker: int, extra_round: int) -> Trajectories:
        with self.timers("rollout"):
            out = self._rollout(examples, worker, extra_round=extra_round)
        with self.timers("reward"):
            return self._reward(out, examples)

    def _rollout(self, examples, worker: int, *, validation: bool = False, extra_round: int = 0) -> RolloutOutput:
        """The tool rollout of one worker's prompts, seeded by (seed, step, worker, draw)."""
        cfg = self.cfg
        val = cfg.rollout.val_kwargs
        rcfg = self.rollout_cfg.for_validation(val.n) if validation else self.rollout_cfg
        salt = "val" if validation else "train" if not extra_round else f"train/extra{extra_round}"
        seed = worker_seed(cfg.seed, self.step, worker, salt)
        settings = sampling_settings(cfg, seed)
        if validation:
            settings = (dataclasses.replace(settings, temperature=val.temperature, top_p=val.top_p, top_k=val.top_k)
                        if val.do_sample else greedy_settings(settings))
        self.sampler.reset_cache()  # cached rows of another worker's prompts must not leak into this rollout
        # The worker's RolloutState persists across calls (validation included, as in the reference): with
        # rollout.reference_compat it carries B1's stale entropy baselines from one step to the next.
        return rollout([e.prompt_ids for e in examples], self.sampler, self.executor, self.tokenizer, rcfg, settings,
                       np.random.default_rng(seed), state=self.rollout_states[worker])

    def _reward(self, out: RolloutOutput, examples, *, shape: bool = True) -> Trajectories:
        """The scored trajectories of a rollout; `shape`: with the training signal's masks and penalties."""
        traj = experience.score_rollout(out, examples, self.tokenizer, self.reward_fn)
        return experience.shape_rollout(traj, self.cfg) if shape else traj

    # -- advantages, old log-probs, update, weight sync ----------------------------------------------------------

    def _advantages(self, trajs: dict[int, Trajectories]) -> dict[int, dict[str, list[np.ndarray]]]:
        """Per worker, token-aligned `advantages` per sequence (with a critic also `returns` and `old_values`)."""
        a = self.cfg.algorithm
        if self.critic is None:
            return {w: {"advantages": experience.outcome_advantages(t, a.adv_estimator, norm_by_std=a.norm_adv_by_std)}
                    for w, t in trajs.items()}
        # The critic's values of every sequence: one forward pass over the packed global batch (GAE itself runs per
        # trajectory: a reverse scan over a packed row would cross into another trajectory).
        batch, layouts = self.batches.forward_batch(trajs, critic_lib.FORWARD_KEYS)
        values = self.batches.unpack(self.critic.values(batch), layouts)
        n_local = sum(len(t.sequences) for t in trajs.values())
        rows = slice(jax.process_index() * n_local, (jax.process_index() + 1) * n_local)
        # Whitened over every trajectory of the step (as the reference's driver does), not per process.
        g = distributed.gather
        whiten = lambda adv, mask: np.asarray(algos.masked_whiten(g(adv), g(mask)))[rows]
        out = experience.gae([trajs[w] for w in self.local_workers], [values[w] for w in self.local_workers],
                             max_response_length=self.cfg.data.max_response_length, gamma=a.gamma, lam=a.lam,
                             whiten=whiten)
        return {w: {"advantages": adv, "returns": ret, "old_values": values[w]}
                for w, (adv, ret) in zip(self.local_workers, out)}

    def _old_logprobs(self, batch: dict) -> dict:
        """The mini-batch with the pre-update policy's log-probs (and the reference policy's, with a KL loss)."""
        batch = batch | {"old_logp": self.logprob_fn(self.state.params, batch)[0]}
        if self.ref_logprobs is not None:
            batch["ref_logp"] = self.ref_logprobs(self.state.params, batch)
        return batch

    def _update(self, minis: list[dict]) -> tuple[list[dict], list[dict]]:
        """`ppo_epochs` passes over the mini-batches: the critic first (as the reference), then the policy (not
        during `critic.warmup_steps`). Returns the per-step metrics of each, on the host."""
        epochs = self.cfg.actor.ppo_epochs
        critic_metrics = self.critic.update(minis, epochs) if self.critic else []
        step_metrics = []
        for _ in range(0 if self.critic and self.step < self.cfg.critic.warmup_steps else epochs):
            for batch in minis:
                self.state, m = self.policy.step_fn(self.state, batch)
                step_metrics.append(m)
        return jax.device_get(step_metrics), jax.device_get(critic_metrics)

    # -- metrics, validation, checkpoints ------------------------------------------------------------------------

    def validate(self) -> dict:
        """Rollouts over the validation set as rollout.val_kwargs says (greedy n = 1 by default): the mean reward
        and accuracy over all samples, and the mean reward per data_source (`mean@n`)."""
        if self.val_data is None:
            return {}
        t0 = time.perf_counter()
        n, bs = self.cfg.rollout.val_kwargs.n, self.cfg.data.val_batch_size
        idx = np.array_split(np.arange(len(self.val_data)), self.workers)
        scores, sources = [], []
        for w in self.local_workers:
            exs = [self.val_data[int(i)] for i in idx[w]]
            for start in range(0, len(exs), bs or max(len(exs), 1)):
                chunk = exs[start:start + (bs or len(exs))]
                if chunk:
                    t = self._reward(self._rollout(chunk, w, validation=True), chunk, shape=False)
                    scores += list(t.scores)
                    sources += [chunk[int(p)].data_source for p in t.group]
        scores, sources = distributed.gather_ragged(np.asarray(scores, np.float32), sources,
                                                    sorted(set(self.val_data.data_sources)),
                                                    width=len(self.val_data) * n)
        out = {"val/reward/mean": float(np.mean(scores)), "val/accuracy": float(np.mean(scores > 0)),
               "val/samples": len(scores), "time/validation": time.perf_counter() - t0}
        for src in sorted(set(sources)):
            sel = np.asarray([s == src for s in sources])
            out[f"val/{src}/reward/mean@{n}"] = float(np.mean(scores[sel]))
        return out

    def _restore(self, step: int) -> ts.TrainState:
        """The policy's state at `step`; sets the step and data position the run continues from."""
        target = self.policy.restore_target()
        if self.lora_base:  # the adapters from the checkpoint, the base from its pointer (the weights loaded above)
            target = lora_io.adapters_only(target, self.model_cfg)
        restored = self.checkpoints.main.restore_state(step, target)
        self.step, self.position = int(restored.meta["step"]), restored.position
        log.info("resumed from %s step %d", self.checkpoints.main.directory, self.step)
        if self.lora_base:
            return lora_io.with_base(restored.state, self._lora_base, restored.meta[lora_io.BASE_POINTER],
                                     self.model_cfg, self.policy.shardings)
        return restored.state

    def save(self) -> None:
        meta = {"seed": self.cfg.seed, "total_steps": self.total_steps}
        state = self.state
        if self.lora_base:  # the adapters and their optimizer state, plus the base's pointer (not the frozen base)
            state, meta = lora_io.adapters_only(state, self.model_cfg), meta | {lora_io.BASE_POINTER: self.lora_base}
        self.checkpoints.main.save_state(self.step, state, config=self.model_cfg, position=self.position, meta=meta,
                                         force=True)
        if self.critic:
            self.critic.save(self.step)

    def _done(self) -> bool:
        """`total_steps` trained, or (without trainer.max_steps) `total_epochs` of data used: dynamic sampling
        draws extra batches, so an epoch can end after fewer steps."""
        tr = self.cfg.trainer
        return self.step >= self.total_steps or (not tr.max_steps and self.position.epoch >= tr.total_epochs)

    def close(self) -> None:
        try:
            self.checkpoints.close()
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


# ------------------------------------------------------------------------------------------------------------------
# Setup: data, workers, seeds, the reference policy, the critic's config
# ------------------------------------------------------------------------------------------------------------------


def resolve_files(files, workdir: Path, split: str, seed: int) -> list[str]:
    """Data file list with `builtin:toy` replaced by the generated toy parquet of `split` (train or val)."""
    if runtime.is_main_process():
        toy.resolve_files(files, str(workdir / "toy_data"), split=split, seed=seed)  # writes them once
    runtime.barrier("toy_data")
    return [os.path.expandvars(f) for f in toy.resolve_files(files, str(workdir / "toy_data"), split=split, seed=seed)]


def load_datasets(cfg, workdir: Path, tokenizer) -> tuple[rl_dataset.RLDataset, rl_dataset.RLDataset | None]:
    """The training prompts and the validation prompts (None without `data.val_files`)."""
    d = cfg.data
    load = lambda files, split, **kw: rl_dataset.load_rl_dataset(
        resolve_files(files, workdir, split, cfg.seed), tokenizer, prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length, overlong=d.overlong_prompts, source=d.source, **kw)
    return load(d.train_files, "train"), (load(d.val_files, "val", max_samples=d.val_max_samples)
                                          if d.val_files else None)


def step_counts(cfg, prompts: int) -> tuple[int, int]:
    """(steps per epoch, total steps) of a run over `prompts` training prompts."""
    per_epoch = rl_dataset.steps_per_epoch(prompts, cfg.data.train_batch_size, cfg.data.drop_last)
    if per_epoch == 0:
        raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the training set "
                         f"({prompts} prompts) with data.drop_last=True")
    return per_epoch, cfg.trainer.max_steps or cfg.trainer.total_epochs * per_epoch


def num_workers(cfg) -> int:
    return cfg.rollout.workers or jax.process_count()


def local_workers(workers: int) -> range:
    """This process's rollout workers: a contiguous share of them."""
    p, n = jax.process_index(), jax.process_count()
    return range(p * workers // n, (p + 1) * workers // n)


def worker_seed(seed: int, step: int, worker: int, salt: str = "") -> int:
    """A 31-bit seed that depends only on (seed, step, worker, salt): the same in every process layout."""
    return zlib.crc32(f"{seed}/{step}/{worker}/{salt}".encode()) & 0x7FFFFFFF


def reference_logprobs(params, cfg, model_cfg, logprob_fn, temperature: float, mesh: Mesh):
    """With a KL loss, the reference policy's log-probs as a function of (policy params, batch): the starting
    policy (a copy, on host memory when asked: the reference's param_offload), or with LoRA the policy's own base
    with the adapters off (no weight copy); None without a KL loss."""
    if not cfg.actor.kl_coef:
        return None
    if model_cfg.lora_rank:
        base_fn = lora.jit_reference_logprobs(model_cfg, temperature=temperature, chunk=cfg.actor.logprob_chunk,
                                              mesh=mesh)
        return lambda policy, batch: base_fn(policy, batch)[0]
    ref = jax.tree.map(jnp.copy, params)
    ref = jax.device_get(ref) if cfg.model.ref_on_host else ref
    return lambda policy, batch: logprob_fn(ref, batch)[0]


def critic_config(cfg) -> critic_lib.CriticConfig:
    return critic_lib.CriticConfig(cliprange_value=cfg.critic.cliprange_value, lr=cfg.critic.lr,
                                   max_grad_norm=cfg.actor.max_grad_norm, weight_decay=cfg.actor.weight_decay,
                                   reference_compat=cfg.critic.reference_compat)


def sampler_mesh() -> Mesh:
    """Rollouts are per process (each process generates for its own prompts): a mesh of its local devices."""
    return sharding.make_mesh((1, -1, 1), devices=jax.local_devices())


def make_rollout_sampler(cfg, tokenizer, model_folder: Path, workdir: Path, policy: skeleton.Policy, params, *,
                         sync: bool):
    """The rollout engine (`rollout.engine`) with the policy's current params (`sync`: tell vLLM, which loaded
    `model_folder`, about params that differ from it: a resumed run or `model.init_checkpoint`)."""
    if cfg.rollout.engine == "jax":
        model = nnx.merge(policy.graphdef, sampler_params(params, policy.model_cfg))
        return make_sampler(cfg, tokenizer, model=model, mesh=sampler_mesh())
    # Without rollout.vllm.export_dir, several processes share the run's folder: process 0 writes, every node reads
    # (a shared file system); one process exports to /dev/shm.
    sampler = make_sampler(cfg, tokenizer, folder=model_folder, log_file=workdir / "vllm.log",
                           export_dir=workdir / "weight_sync" if jax.process_count() > 1 else None)
    if sync:  # with LoRA, model.init_checkpoint's base may differ from `model_folder`: it is sent once, in full
        sampler.update_weights(nnx.merge(policy.graphdef, params), base=bool(cfg.model.init_checkpoint))
    return sampler


def sync_weights(sampler, cfg, policy: skeleton.Policy, params) -> float:
    """The weight-sync phase: the sampler gets `params` (the JAX sampler a copy of its own, vLLM the model to
    export). Returns the seconds it took."""
    if cfg.rollout.engine == "jax":
        return sampler.update_weights(sampler_params(params, policy.model_cfg))
    return sampler.update_weights(nnx.merge(policy.graphdef, params))


def sampler_params(params, model_cfg):
    """A copy of the policy's params for the JAX sampler (the train step donates its own), on local devices: with
    several processes every one gets the whole model (it samples alone)."""
    if jax.process_count() > 1:
        return distributed.replicate_on_local_devices(params, ts.param_shardings(model_cfg, sampler_mesh()))
    return jax.tree.map(jnp.copy, params)


# ------------------------------------------------------------------------------------------------------------------
# The global batch
# ------------------------------------------------------------------------------------------------------------------


# (plan a worker's layout, its loss totals, its block of the batch): flat, or (tree training) prefix trees
_LAYOUTS = {False: (experience.layout, packing.loss_totals, experience.worker_batch),
            True: (tree_packing.worker_tree_layout, tree_packing.loss_totals, tree_packing.worker_tree_batch)}


class GlobalBatch:
    """How the step's trajectories become global [K, M, B, *] arrays: each local rollout worker packs its block of
    `rows_per_worker` rows of `row_len` tokens; the blocks of every worker of every process sit side by side along
    B, the batch-sharded axis.

    Two layouts, chosen here once by `actor.tree_training`: flat (`experience.layout` / `experience.worker_batch`:
    [K, M, B, T] arrays) or prefix trees (`tree_packing.worker_tree_layout` / `worker_tree_batch`: tokens
    [K, M, B, T], heads [K, M, B, U], loss entries [K, M, B, E]). The rest of the step does not care which:
    the log-prob forward and the train step recognise a tree batch by its `tree_end`."""

    def __init__(self, cfg, mesh: Mesh, model_cfg, workers: int, local: range):
        self.cfg, self.mesh, self.workers, self.local_workers = cfg, mesh, workers, local
        self.sharding = NamedSharding(mesh, ts.batch_spec(mesh, model_cfg.sharding_rules))  # [M, B, T]
        self.sharding4 = NamedSharding(mesh, PartitionSpec(None, *self.sharding.spec))  # [K, M, B, T]
        rules = sharding.get_rules(model_cfg.sharding_rules)
        self.rows_per_worker = max(1, math.prod(mesh.shape[a] for a in rules["batch"]) // workers)
        self.row_len = cfg.actor.max_token_len_per_device or 2 * (cfg.data.max_prompt_length +
                                                                  cfg.data.max_response_length)
        self.tree = bool(cfg.actor.tree_training)

    def layouts(self, trajs: dict[int, Trajectories], tree: bool | None = None) -> dict:
        """Each worker's layout (`packing.Layout`, or with `tree` (default: `actor.tree_training`) a
        `tree_packing.TreeLayout`), with the sizes of the largest one over every process (micro-batches; for trees
        also heads and entries per row), so that every worker's block has one global shape."""
        tree = self.tree if tree is None else tree
        plan = _LAYOUTS[tree][0]
        mini_prompts = self.cfg.actor.ppo_mini_batch_size // self.workers
        layouts = {w: plan(t, self.cfg, mini_prompts=mini_prompts, rows=self.rows_per_worker, row_len=self.row_len)
                   for w, t in trajs.items()}
        if tree:
            sizes = distributed.gather(np.array([layouts[w].sizes for w in self.local_workers])).max(0)  # (M, U, E)
            return {w: lay.with_sizes(*map(int, sizes)) for w, lay in layouts.items()}
        m = distributed.agree_max(max(layouts[w].shape[1] for w in self.local_workers))
        return {w: lay.with_micro_batches(m) for w, lay in layouts.items()}

    def pack(self, trajs: dict[int, Trajectories], token_arrays: dict[int, dict]) -> tuple[list[dict], dict]:
        """K mini-batches of global [M, B, *] arrays, in optimizer-step order, and the layout's metrics (tree
        training: `perf/tree_tokens_computed` and `perf/tree_tokens_flat` over every process). The loss weights are
        normalised by the loss tokens and sequences of each whole mini-batch, summed over every worker of every
        process."""
        _, loss_totals, worker_batch = _LAYOUTS[self.tree]
        layouts = self.layouts(trajs)
        totals = distributed.gather(np.stack([loss_totals(layouts[w], trajs[w].loss_masks)
                                              for w in self.local_workers])).sum(0)  # [K, 2]
        blocks = [worker_batch(trajs[w], token_arrays[w], layouts[w], self.cfg, totals=totals, workers=self.workers)
                  for w in self.local_workers]
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
