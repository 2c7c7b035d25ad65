"""The ARPO / AEPO training loop (spec section 1), plain Python that reads top to bottom.

`Trainer.__init__` is the setup and the resume (the run skeleton it shares with SFT is `skeleton.py`), `Trainer.run`
the loop (stop protocol, step, validation, metrics, checkpoints), `Trainer.train_step` one step; below the class,
the setup helpers; `global_batch.GlobalBatch` is the layout of the step's batch over workers and processes.

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
  weight_sync  the sampler gets the new weights (with rollout.max_staleness > 0 after the next step's rollout, run
               ahead during this step, has ended: `rollout_wait`);
  metrics      then a checkpoint every `save_freq` steps and validation (greedy, n = 1, per data_source) every
               `test_freq` steps (`run`).
The host-side maths of reward, advantages and pack are pure functions in `experience`.

Off-policy rollouts (`rollout.max_staleness` = S > 0): as soon as a step has its batch, the next step's rollout
(and reward) starts in a background thread (`experience.RolloutAhead`) with the weights the engine holds, and runs
while this step's advantages, old log-probs and update run; the weight sync waits for it (`time/rollout_wait`), so
an engine never reloads in the middle of a rollout. Step k thus trains on a rollout generated with the weights of
step k-1 (`rollout/weights_version`, `rollout/staleness`), corrected by the engine's log-probs
(`actor.rollout_correction`). S = 0 is the synchronous loop.

Randomness is a pure function of (seed, step, worker), and the data position is stored in every checkpoint, so a
run killed at any moment resumes from its newest checkpoint and ends with the parameters an uninterrupted run
would have.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import (
    algos,
    distributed,
    experience,
    global_batch,
    hf,
    knobs,
    lora,
    lora_io,
    paths,
    rewards,
    run_guard,
    runtime,
    sharding,
    skeleton,
)
from arpo_jax import config as config_lib
from arpo_jax import critic as critic_lib
from arpo_jax import metrics as metrics_lib
from arpo_jax import train_step as ts
from arpo_jax.accumulate import TrainState
from arpo_jax.components import (
    make_sampler,
    make_tool_executor,
    process_log,
    rollout_config,
    sampling_settings,
    update_config,
)
from arpo_jax.data import rl_dataset, toy
from arpo_jax.experience import Trajectories
from arpo_jax.rollout.agent_loop import RolloutOutput, RolloutState, greedy_settings, rollout
from arpo_jax.rollout.jax_sampler import decode_weights

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


class Trainer:
    """The RL run: `__init__` sets it up (or resumes it), `run()` is the loop, `train_step()` one step. `devices`:
    the mesh's (default: all of every process'; a program embedding the trainer may give it a share of its own)."""

    def __init__(self, cfg, workdir: str | os.PathLike, devices: Sequence[jax.Device] | None = None):
        # Setup: the config, the work directory (its lock, the config's history and drift), mesh, model, data.
        runtime.initialize_distributed()
        self.cfg = cfg = config_lib.validate(cfg, device_count=len(devices) if devices else jax.device_count(),
                                             process_count=jax.process_count(), command="train")
        self.workdir = paths.local_path(workdir)  # refuses gs:// (it would become $PWD/gs:/...)
        self.is_main = runtime.is_main_process()
        self.lock, resuming = run_guard.open_workdir(self.workdir, cfg, "train")
        if cfg.trainer.export_hf:
            hf.check_export_destination(self.workdir / "hf")
        self.mesh = runtime.make_mesh(cfg, devices)
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
        self.batches = global_batch.GlobalBatch(cfg, self.mesh, self.model_cfg, self.workers, self.local_workers)
        self.ref_logprobs = reference_logprobs(params, cfg, self.model_cfg, self.logprob_fn, upd.temperature, self.mesh)
        self.critic = None if cfg.algorithm.adv_estimator != "gae" else critic_lib.Critic(
            critic_config(cfg), self.model_cfg, self.mesh, self.policy.abstract, updates,
            self.workdir / "critic_checkpoints", keep=cfg.trainer.keep_checkpoints, async_save=cfg.trainer.async_save)

        # Resume, or start: the policy's and the critic's newest intact step, with the data position.
        self.checkpoints = skeleton.RunCheckpoints(
            [skeleton.policy_checkpointer(cfg, self.workdir)] + ([self.critic.ckpt] if self.critic else []))
        self.step, self.position = 0, rl_dataset.DataPosition(0, 0)
        # LoRA: checkpoints hold the adapters and a pointer to the frozen base (`lora_io.base_pointer`), not the base.
        self.stored = lora_io.CheckpointView.for_run(cfg, self.model_folder, params, self.model_cfg)
        latest, (self.state, critic_state) = self.checkpoints.resume_or_init(
            resuming, lambda s: (self._restore(s), self.critic.restore(s) if self.critic else None),
            lambda: (self.policy.init_state(params), self.critic.init_state(params) if self.critic else None))
        if self.critic:
            self.critic.state = critic_state
        params = model = self.stored.base = None  # the states hold their own copies: free the loaded weights

        # The rollout's components, the logger.
        self.rollout_cfg = rollout_config(cfg)
        self.executor = make_tool_executor(cfg)
        self.reward_fn = rewards.get_reward_fn(cfg.reward.name, custom_path=os.path.expandvars(cfg.reward.custom_path),
                                               custom_name=cfg.reward.custom_name)
        self.sampler = make_rollout_sampler(cfg, self.tokenizer, self.model_folder, self.workdir, self.policy,
                                            self.state.params, sync=self.step > 0 or bool(cfg.model.init_checkpoint))
        self.logger = skeleton.open_logger(cfg, self.workdir, resume_step=latest, enabled=self.is_main)
        self.failures = experience.FailureBudget(cfg.rollout.failures.max_fraction,  # skips steps of failures
                                                 cfg.rollout.failures.max_skipped_steps)
        self.rollout_states = {w: RolloutState() for w in self.local_workers}  # B1 compat, see `_rollout`
        # Off-policy rollouts (rollout.max_staleness): the next step's rollout runs while this step updates.
        self.max_staleness, self.weights_version = cfg.rollout.max_staleness, self.step  # engine: step's weights
        self.ahead, self.stop = rollout_ahead(cfg, upd.rollout_correction), None  # stop: `run`'s StopSignals

    def run(self, stop: run_guard.StopSignals | None = None) -> dict:
        """Trains to `total_steps`: each step, then validation every `test_freq` steps, metrics, a checkpoint every
        `save_freq` steps. With `stop`, a signal ends the loop at the next step boundary: the step is saved, metrics
        are flushed and `run_guard.Stopped` is raised."""
        tr, self.stop = self.cfg.trainer, stop
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
            stopping = stop is not None and stop.requested()  # no validation: its engine may have had the signal too
            if tr.test_freq and (self.step % tr.test_freq == 0 or self._done()) and not stopping:
                last |= (val := self.validate())
            self.logger.log(self.step, last)
            if self._done() and self.ahead.idle():  # the engine's work is over: its memory goes back before the
                self.sampler.sleep()  # final save and export (a CPU host's RAM is shared)
            if (tr.save_freq and self.step % tr.save_freq == 0) or self._done():
                self.save()
            bar.update(1)
            bar.set_postfix(reward=f"{last.get('reward/mean', 0):.3f}")
        bar.close()
        if stop is not None and stop.requested():  # the signal came during the last step: it is saved, stop as asked
            raise stop.stopped(self.checkpoints.save_for_stop(self.step, self.save))
        self.checkpoints.wait()
        export = str(hf.save_pretrained(nnx.merge(self.policy.graphdef, self.state.params), self.workdir / "hf",
                                        tokenizer=self.tokenizer)) if tr.export_hf else None
        return run_summary(self, last, val, export, time.perf_counter() - t_start)

    def train_step(self) -> dict:
        """One RL step, phase by phase (each timed under its name: `time/<phase>`). Returns its metrics. With
        `rollout.max_staleness` > 0 the next step's rollout runs in the background from its start to the sync."""
        cfg, timers = self.cfg, metrics_lib.PhaseTimer()
        t0 = time.perf_counter()
        with timers("rollout_wait"):  # 0 when it was generated ahead and is already done
            got = self.ahead.take(self.step) or self._collect(self.step, self.position)
        if self.max_staleness and not self._done(self.step + 1, got.position):  # the next rollout, in the background
            with timers("rollout_ahead"):  # ~0 s; the JAX engine's whole rollout (it runs here, without overlap)
                self.ahead.start(self.step + 1, functools.partial(self._collect, self.step + 1, got.position))
        trajs = got.trajs
        failed = distributed.gather(np.concatenate([t.failed for t in trajs.values()]).astype(np.float32))
        skip = self.failures.skip(failed, self.step + 1)
        minis, pack_metrics = [], {}
        if not skip:
            with timers("advantages"):
                token_arrays = self._advantages(trajs)
            with timers("pack"):
                minis, pack_metrics = self.batches.pack(trajs, token_arrays)
            if minis and sync_due(self.weights_version, self.step, self.max_staleness) and self.ahead.idle():
                # The sampler gets new weights after the update: free its copy and cache meanwhile (the JAX engine's
                # rollout ahead has already run; vLLM's may still be generating: then it keeps them).
                self.sampler.sleep()
            with timers("old_logprob"):
                minis = [self._old_logprobs(batch) for batch in minis]
        with timers("update"):
            step_metrics, critic_metrics = self._update(minis)
            runtime.trim_host_memory()  # the update's freed temporaries: a CPU engine runs (or reloads) beside us
        with timers("rollout_wait"):
            self.ahead.wait()  # the next step's rollout ends before the engine's weights change
        with timers("weight_sync"):
            if not minis and self.weights_version == self.step:
                self.weights_version += 1  # no update: the engine's weights are the next step's too
            elif sync_due(self.weights_version, self.step, self.max_staleness):
                self._sync(self.step + 1)
        self.step, self.position = self.step + 1, got.position
        with timers("metrics"):
            out = (experience.rollout_metrics(list(trajs.values()), overlong_mask=cfg.algorithm.overlong == "mask",
                                              gather=distributed.gather)
                   | got.metrics  # tools/<tag>/<name>, dynamic_sampling/*
                   | experience.update_metrics(step_metrics)
                   | experience.update_metrics(critic_metrics, prefix="critic/") | pack_metrics
                   | {"rollout/step_skipped": float(skip), "rollout/weights_version": float(got.weights_version),
                      "rollout/staleness": float(self.step - 1 - got.weights_version)})
            out |= experience.weight_sync_metrics(self.sampler)
            if cfg.trainer.log_trajectories and self.is_main:
                self.logger.log_jsonl("trajectories", experience.trajectory_records(
                    trajs[self.local_workers[0]], cfg.trainer.log_trajectories, self.step))
        tokens = sum(len(s) for t in trajs.values() for s in t.sequences)
        elapsed = time.perf_counter() - t0
        timers.seconds |= got.seconds  # the rollout's phases (rollout, reward), wherever it ran
        return out | timers.as_metrics(prefix="time/") | {
            "time/step": elapsed, "perf/tokens_per_s": tokens * jax.process_count() / elapsed,
            "train/epoch": self.position.epoch, "train/lr": float(self.policy.schedule(int(self.state.step)))}

    # -- rollout and reward --------------------------------------------------------------------------------------

    def _collect(self, step: int, position: rl_dataset.DataPosition) -> experience.Collected:
        """Step `step`'s rollout -> reward from `position`, per draw (dynamic sampling needs the rewards to decide
        whether to draw again). Thread-safe against the update: it may run in the background (`RolloutAhead`)."""
        cfg, timers, version = self.cfg, metrics_lib.PhaseTimer(), self.weights_version

        def rollout_and_reward(examples, worker: int, extra_round: int) -> Trajectories:
            with timers("rollout"):
                out = self._rollout(examples, worker, step=step, extra_round=extra_round)
            with timers("reward"):
                return self._reward(out, examples)

        trajs, position, sampling_metrics = experience.collect(
            lambda pos: batch_examples(self.train_data, cfg.data, pos, self.workers, self.local_workers),
            rollout_and_reward, position, steps_per_epoch=self.steps_per_epoch,
            need=cfg.data.train_batch_size // self.workers, dynamic=cfg.algorithm.dynamic_sampling,
            max_extra_rounds=cfg.algorithm.max_extra_rounds, agree_max=distributed.agree_max,
            gather=distributed.gather)
        tools = self.executor.metrics()  # tools/<tag>/<name>: this rollout's calls
        self.executor.reset_metrics()
        return experience.Collected(trajs, position, sampling_metrics | tools, timers.seconds, version)

    def _rollout(self, examples, worker: int, *, step: int | None = None, validation: bool = False,
                 extra_round: int = 0) -> RolloutOutput:
        """The tool rollout of one worker's prompts, seeded by (seed, step (default: this one), worker, draw)."""
        cfg, val = self.cfg, self.cfg.rollout.val_kwargs
        rcfg = self.rollout_cfg.for_validation(val.n) if validation else self.rollout_cfg
        salt = "val" if validation else "train" if not extra_round else f"train/extra{extra_round}"
        seed = worker_seed(cfg.seed, self.step if step is None else step, worker, salt)
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
        return critic_advantages(trajs, self.critic, self.batches, self.cfg)

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

    def _sync(self, version: int) -> None:  # the (idle) engine gets the current weights, those of step `version`
        try:  # a stop's signal may have reached the engine too (a Ctrl-C goes to the process group): then the step
            sync_weights(self.sampler, self.cfg, self.policy, self.state.params)  # ends and is saved without a sync
            self.weights_version = version
        except Exception as e:
            if self.stop is None or not self.stop.requested():
                raise
            log.warning("weight sync skipped, the run is stopping: %s", f"{type(e).__name__}: {e}"[:300])

    # -- metrics, validation, checkpoints ------------------------------------------------------------------------

    def validate(self) -> dict:
        """Rollouts over the validation set as rollout.val_kwargs says (greedy n = 1 by default): the mean reward
        and accuracy over all samples, and the mean reward per data_source (`mean@n`)."""
        if self.val_data is None:
            return {}
        if self.weights_version < self.step:  # max_staleness >= 2 may have left the engine on older weights
            self._sync(self.step)
        t0 = time.perf_counter()
        n, bs = self.cfg.rollout.val_kwargs.n, self.cfg.data.val_batch_size
        scores, sources = [], []
        for w, chunk in validation_chunks(self.val_data, self.workers, self.local_workers, bs):
            t = self._reward(self._rollout(chunk, w, validation=True), chunk, shape=False)
            scores += list(t.scores)
            sources += [chunk[int(p)].data_source for p in t.group]
        scores, sources = distributed.gather_ragged(np.asarray(scores, np.float32), sources,
                                                    sorted(set(self.val_data.data_sources)),
                                                    width=len(self.val_data) * n)
        return experience.validation_metrics(scores, sources, n) | {"time/validation": time.perf_counter() - t0}

    def _restore(self, step: int) -> TrainState:
        """The policy's state at `step`; sets the step and data position the run continues from."""
        restored = self.checkpoints.main.restore_state(step, self.stored.target(self.policy.restore_target()))
        self.step, self.position = int(restored.meta["step"]), restored.position
        log.info("resumed from %s step %d", self.checkpoints.main.directory, self.step)
        return self.stored.restored(restored.state, restored.meta, self.policy.shardings)  # LoRA: the base put back

    def save(self) -> None:
        state, meta = self.stored.saved(self.state, {"seed": self.cfg.seed, "total_steps": self.total_steps})
        self.checkpoints.main.save_state(self.step, state, config=self.model_cfg, position=self.position, meta=meta,
                                         force=True)
        if self.critic:
            self.critic.save(self.step)

    def _done(self, step: int | None = None, position: rl_dataset.DataPosition | None = None) -> bool:
        """`total_steps` trained, or (without trainer.max_steps) `total_epochs` of data used (dynamic sampling can end
        an epoch early), at this step and position or those given."""
        step, position = self.step if step is None else step, position or self.position
        return step >= self.total_steps or (not self.cfg.trainer.max_steps and
                                            position.epoch >= self.cfg.trainer.total_epochs)

    def close(self) -> None:
        try:
            self.ahead.close()  # a rollout still in flight (the step failed) ends before its engine closes
            self.checkpoints.close()
        finally:
            self.logger.close()
            self.executor.close()
            self.sampler.close()
            self.lock.release()


def run_summary(trainer: Trainer, last: dict, val: dict, export: str | None, wall_s: float) -> dict:
    """A finished run's summary: the last step's reward, validation, where everything is; the main process also
    writes it to `summary.json`."""
    summary = {"steps": trainer.step, "total_steps": trainer.total_steps, "reward_mean": last.get("reward/mean"),
               "val": {k: v for k, v in val.items() if k.startswith("val/")}, "hf_export": export,
               "wall_s": round(wall_s, 1), "workdir": str(trainer.workdir),
               "checkpoints": str(trainer.checkpoints.main.directory),
               "metrics": str(trainer.workdir / "metrics.jsonl")}
    if trainer.is_main:
        (trainer.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def train(cfg, workdir: str | os.PathLike, devices: Sequence[jax.Device] | None = None) -> dict:
    """`arpo-jax train`: builds the trainer (on `devices`, see `Trainer`), runs it to `total_steps`, returns the
    summary (also summary.json).

    SIGTERM / SIGINT stop it at a step boundary with a checkpoint (`run_guard.Stopped`, exit 143 / 130)."""
    with run_guard.StopSignals("train") as stop:
        trainer = Trainer(cfg, workdir, devices)
        try:
            return trainer.run(stop)
        finally:
            trainer.close()


# ------------------------------------------------------------------------------------------------------------------
# Setup: data, workers, seeds, the reference policy, the critic's config
# ------------------------------------------------------------------------------------------------------------------


def rollout_ahead(cfg, correction: str) -> experience.RolloutAhead:
    """Where the next step's rollout runs (`rollout.max_staleness` > 0): a background thread for vLLM (its own
    process), before the update for the JAX engine (the same devices as the update). Says so once."""
    s = cfg.rollout.max_staleness
    if s:
        log.info("rollout.max_staleness=%d: step k trains on a rollout generated with the weights of step k-1 (at "
                 "most k-%d), %s; rollout correction: %s", s, s, "generated during the update of step k-1"
                 if cfg.rollout.engine != "jax" else "generated before the update of step k-1 (the JAX engine "
                 "shares the devices with the update: the same schedule without the overlap)", correction)
    return experience.RolloutAhead(overlap=cfg.rollout.engine != "jax")


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


def batch_examples(data: rl_dataset.RLDataset, d, position: rl_dataset.DataPosition, workers: int,
                   local: range) -> dict[int, list]:
    """The prompts of the batch at `position` (`d`: the `data` config) per local rollout worker."""
    idx = rl_dataset.batch_indices(len(data), d.train_batch_size, position.epoch, position.step_in_epoch,
                                   seed=d.seed, shuffle=d.shuffle, drop_last=d.drop_last)
    return {w: [data[int(i)] for i in rl_dataset.shard(idx, w, workers)] for w in local}


def validation_chunks(data: rl_dataset.RLDataset, workers: int, local: range, batch_size: int):
    """(worker, prompts) for each local worker's validation rollouts: its share of `data` in chunks of `batch_size`
    (0: all at once)."""
    idx = np.array_split(np.arange(len(data)), workers)
    for w in local:
        exs = [data[int(i)] for i in idx[w]]
        for start in range(0, len(exs), batch_size or max(len(exs), 1)):
            yield w, exs[start:start + (batch_size or len(exs))]


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
                                              mesh=mesh, tree=cfg.actor.tree_training)
        return lambda policy, batch: base_fn(policy, batch)[0]
    ref = jax.tree.map(jnp.copy, params)
    ref = jax.device_get(ref) if cfg.model.ref_on_host else ref
    return lambda policy, batch: logprob_fn(ref, batch)[0]


def critic_advantages(trajs: dict[int, Trajectories], critic: critic_lib.Critic, batches: global_batch.GlobalBatch,
                      cfg) -> dict[int, dict[str, list[np.ndarray]]]:
    """Per local worker, GAE's token-aligned `advantages`, `returns` and the critic's `old_values` per sequence."""
    a, local = cfg.algorithm, batches.local_workers
    # The critic's values of every sequence: one forward pass over the packed global batch (GAE itself runs per
    # trajectory: a reverse scan over a packed row would cross into another trajectory).
    batch, layouts = batches.forward_batch(trajs, critic_lib.FORWARD_KEYS)
    values = batches.unpack(critic.values(batch), layouts)
    n_local = sum(len(t.sequences) for t in trajs.values())
    rows = slice(jax.process_index() * n_local, (jax.process_index() + 1) * n_local)
    # Whitened over every trajectory of the step (as the reference's driver does), not per process.
    g = distributed.gather
    whiten = lambda adv, mask: np.asarray(algos.masked_whiten(g(adv), g(mask)))[rows]
    out = experience.gae([trajs[w] for w in local], [values[w] for w in local],
                         max_response_length=cfg.data.max_response_length, gamma=a.gamma, lam=a.lam, whiten=whiten)
    return {w: {"advantages": adv, "returns": ret, "old_values": values[w]} for w, (adv, ret) in zip(local, out)}


def critic_config(cfg) -> critic_lib.CriticConfig:
    return knobs.from_config(critic_lib.CriticConfig, cfg)


def sampler_mesh(mesh: Mesh) -> Mesh:
    """Rollouts are per process (each process generates for its own prompts): a mesh of its devices in `mesh`."""
    ours = set(mesh.devices.flat)
    return sharding.make_mesh((1, -1, 1), devices=[d for d in jax.local_devices() if d in ours])


def make_rollout_sampler(cfg, tokenizer, model_folder: Path, workdir: Path, policy: skeleton.Policy, params, *,
                         sync: bool):
    """The rollout engine (`rollout.engine`) with the policy's current params (`sync`: tell vLLM, which loaded
    `model_folder`, about params that differ from it: a resumed run or `model.init_checkpoint`)."""
    if cfg.rollout.engine == "jax":
        model = nnx.merge(policy.graphdef, sampler_params(params, policy))
        return make_sampler(cfg, tokenizer, model=model, mesh=sampler_mesh(policy.mesh))
    # Without rollout.vllm.export_dir, several processes share the run's folder: process 0 writes, every node reads
    # (a shared file system); one process exports to /dev/shm.
    log = process_log(workdir / "vllm.log", jax.process_index(), jax.process_count())  # vllm.p<i>.log with several
    sampler = make_sampler(cfg, tokenizer, folder=model_folder, log_file=log,
                           export_dir=workdir / "weight_sync" if jax.process_count() > 1 else None)
    if sync:  # with LoRA, model.init_checkpoint's base may differ from `model_folder`: it is sent once, in full
        sampler.update_weights(nnx.merge(policy.graphdef, params), base=bool(cfg.model.init_checkpoint))
    return sampler


def sync_due(weights_version: int, step: int, max_staleness: int) -> bool:
    """Whether the engine, holding the weights of step `weights_version`, needs those of step + 1 after step `step`'s
    update: the next rollout it generates (step + 2's with one generated ahead, else step + 1's) may be at most
    `max_staleness` steps stale. Every step for 0 and 1; every other step for 2 (k syncs out of k for k+1 ...)."""
    next_rollout = step + 1 + (1 if max_staleness else 0)
    return weights_version < next_rollout - max_staleness


def sync_weights(sampler, cfg, policy: skeleton.Policy, params) -> float:
    """The weight-sync phase: the sampler gets `params` (the JAX sampler a copy of its own, vLLM the model to
    export). Returns the seconds it took."""
    if cfg.rollout.engine == "jax":
        return sampler.update_weights(sampler_params(params, policy))
    return sampler.update_weights(nnx.merge(policy.graphdef, params))


def sampler_params(params, policy: skeleton.Policy):
    """A copy of the policy's params for the JAX sampler (the train step donates its own) in the compute dtype
    (`jax_sampler.decode_weights`: cast before any gather), on local devices: with several processes every one gets
    the whole model (it samples alone)."""
    params = decode_weights(params, policy.model_cfg.compute_dtype)
    if jax.process_count() > 1:
        return distributed.replicate_on_local_devices(params, ts.param_shardings(policy.model_cfg,
                                                                                 sampler_mesh(policy.mesh)))
    return params
