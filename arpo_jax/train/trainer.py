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
The host-side maths of reward, advantages and pack are pure functions in `experience/`.

Off-policy rollouts (`rollout.max_staleness` = S > 0): the next step's rollout runs while this step updates, with
the weights the engine holds (`schedule.EngineSchedule`); step k trains on a rollout generated with the weights of
step k-1 (`rollout/weights_version`, `rollout/staleness`), corrected by the engine's log-probs
(`actor.rollout_correction`). S = 0 is the synchronous loop.

Randomness is a pure function of (seed, step, worker), and the data position is stored in every checkpoint, so a
run killed at any moment resumes from its newest checkpoint and ends with the parameters an uninterrupted run
would have.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arpo_jax import compile_log, distributed, knobs, paths, rewards
from arpo_jax.assemble import placement
from arpo_jax.assemble import policy as policy_lib
from arpo_jax.assemble import validate as config_lib
from arpo_jax.assemble.components import (
    initial_sync,
    make_mesh,
    make_rollout_sampler,
    make_tool_executor,
    pack_config,
    rollout_config,
    sampling_settings,
    shaping_config,
    sync_weights,
    update_config,
)
from arpo_jax.data import rl_dataset, toy
from arpo_jax.experience import advantages, collection, global_batch, reward
from arpo_jax.experience import step_metrics as step_metrics_lib
from arpo_jax.experience.collection import ScheduleConfig
from arpo_jax.experience.trajectories import Trajectories
from arpo_jax.rollout.agent_loop import RolloutState, greedy_settings, rollout
from arpo_jax.rollout.output import RolloutOutput
from arpo_jax.rollout.sampler import worker_seed
from arpo_jax.train import critic, run_guard, schedule, skeleton, warmup
from arpo_jax.train import metrics as metrics_lib
from arpo_jax.train.critic import critic_advantages, critic_config
from arpo_jax.train.schedule import EngineSchedule
from arpo_jax.update import lora, machinery
from arpo_jax.update import train_step as ts
from arpo_jax.update.accumulate import TrainState
from arpo_jax.weights import hf, lora_io

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------------------------


class Trainer:
    """The RL run: `__init__` sets it up (or resumes it), `run()` is the loop, `train_step()` one step. `devices`:
    the mesh's (default: all of every process', less the vLLM engines' GPUs with `rollout.vllm.placement=split`,
    `placement.trainer_devices`; a program embedding the trainer may give it a share of its own)."""

    def __init__(self, cfg, workdir: str | os.PathLike, devices: Sequence[jax.Device] | None = None):
        # Setup: the config, the work directory (its lock, the config's history and drift), mesh, model, data.
        placement.hide_engine_gpus(cfg)  # rollout.vllm.placement=split: before JAX's backend opens any GPU
        distributed.initialize_distributed()
        devices = devices or placement.trainer_devices(cfg, jax.devices(), jax.process_index())
        self.cfg = cfg = config_lib.validate(cfg, device_count=len(devices) if devices else jax.device_count(),
                                             process_count=jax.process_count(), command="train")
        self.workdir = paths.local_path(workdir)  # refuses gs:// (it would become $PWD/gs:/...)
        self.is_main = distributed.is_main_process()
        self.lock, resuming = run_guard.open_workdir(self.workdir, cfg, "train")
        if cfg.trainer.export_hf:
            hf.check_export_destination(self.workdir / "hf")
        self.mesh = make_mesh(cfg, devices)
        self.workers = num_workers(cfg)
        self.local_workers = local_workers(self.workers)
        model, self.tokenizer, self.model_folder = policy_lib.load_policy(cfg, self.workdir, self.mesh)
        config_lib.check_tokenizer(self.tokenizer, cfg)
        self.model_cfg = model.config
        self.train_data, self.val_data = load_datasets(cfg, self.workdir, self.tokenizer)
        self.steps_per_epoch, self.total_steps = step_counts(cfg, len(self.train_data))

        # The policy update (and, with algorithm.adv_estimator = gae, the critic's), the batch layout.
        upd = update_config(cfg)
        updates = self.total_steps * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size) * cfg.actor.ppo_epochs
        self.policy, params = machinery.build_policy(
            model, upd, updates, self.mesh, lambda g, mc, opt, mesh, sh: ts.jit_train_step(g, mc, upd, opt, mesh, sh))
        self.logprob_fn = ts.jit_forward_logprobs(self.policy.graphdef, self.model_cfg, chunk=cfg.actor.logprob_chunk,
                                                  temperature=upd.temperature, mesh=self.mesh,
                                                  tree=cfg.actor.tree_training)
        self.batches = global_batch.GlobalBatch(pack_config(cfg), self.mesh, self.model_cfg, self.workers,
                                                self.local_workers)
        self.shaping = shaping_config(cfg)
        self.ref_logprobs = reference_logprobs(params, cfg, self.model_cfg, self.logprob_fn, upd.temperature, self.mesh)
        self.critic = None if cfg.algorithm.adv_estimator != "gae" else critic.Critic(
            critic_config(cfg), self.model_cfg, self.mesh, self.policy.abstract, updates,
            self.workdir / "critic_checkpoints", keep=cfg.trainer.keep_checkpoints, async_save=cfg.trainer.async_save)

        # Resume, or start: the policy's and the critic's newest intact step, with the data position.
        self.checkpoints = skeleton.RunCheckpoints(
            [skeleton.policy_checkpointer(cfg, self.workdir)] + ([self.critic.ckpt] if self.critic else []))
        self.step, self.position = 0, rl_dataset.DataPosition(0, 0)
        self.stored = lora_io.CheckpointView.for_run(  # LoRA: the adapters and the base's pointer, not the base
            cfg.model.path, cfg.model.init_checkpoint, self.model_folder, params, self.model_cfg)
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
                                            self.state.params, sync=initial_sync(cfg, self.step))
        self.logger = skeleton.open_logger(cfg, self.workdir, resume_step=latest, enabled=self.is_main)
        self.failures = collection.FailureBudget(cfg.rollout.failures.max_fraction,  # skips steps of failures
                                                 cfg.rollout.failures.max_skipped_steps)
        self.rollout_states = {w: RolloutState() for w in self.local_workers}  # B1 compat, see `_rollout`
        # Off-policy rollouts (rollout.max_staleness): the next step's rollout runs while this step updates.
        schedule_cfg = knobs.from_config(ScheduleConfig, cfg)
        schedule.describe(schedule_cfg, cfg.rollout.engine, upd.rollout_correction)
        self.engine = EngineSchedule(schedule_cfg, overlap=cfg.rollout.engine != "jax", weights_version=self.step,
                                     sleep=self.sampler.sleep, sync=self._sync)
        self.stop = None  # `run`'s StopSignals
        self.out_of_time = False  # trainer.time_limit_minutes passed: the run ends as at max_steps

    def run(self, stop: run_guard.StopSignals | None = None) -> dict:
        """Trains to `total_steps`: each step, then validation every `test_freq` steps, metrics, a checkpoint every
        `save_freq` steps. With `stop`, a signal ends the loop at the next step boundary: the step is saved, metrics
        are flushed and `run_guard.Stopped` is raised."""
        tr, self.stop = self.cfg.trainer, stop
        t_start = time.perf_counter()
        val, last = {}, {}
        # Every program compiled before the first step; then each step's compiles, its validation's included.
        compiles = warmup.warm_up(self) if not self._done() else warmup.CompileWatch()
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
                bar.close()
                raise abandoned_step(stop, e, self.checkpoints, self.step, self.save) from None
            stopping = stop is not None and stop.requested()  # no validation: its engine may have had the signal too
            self.out_of_time = not self._done() and time_limit_passed(tr.time_limit_minutes, t_start, self.step)
            if tr.test_freq and (self.step % tr.test_freq == 0 or self._done()) and not stopping:
                last |= (val := self.validate())
            last |= compiles.take()
            self.logger.log(self.step, last)
            if self._done() and self.engine.ahead.idle():  # the engine's work is over: its memory goes back before the
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
        timers, t0 = metrics_lib.PhaseTimer(compile_log.phase), time.perf_counter()
        got = self.engine.take_rollout(self.step, self.position, self._collect,
                                       lambda step, position: not self._done(step, position), timers)
        trajs = got.trajs
        failed = distributed.gather(np.concatenate([t.failed for t in trajs.values()]).astype(np.float32))
        skip = self.failures.skip(failed, self.step + 1)
        minis, pack_metrics = [], {}
        if not skip:
            with timers("advantages"):
                token_arrays = self._advantages(trajs)
            with timers("pack"):
                minis, pack_metrics = self.batches.pack(trajs, token_arrays)
            if minis:
                self.engine.before_update(self.step)
            with timers("old_logprob"):
                minis = [self._old_logprobs(batch) for batch in minis]
        with timers("update"):
            step_metrics, critic_metrics = self._update(minis)
            distributed.trim_host_memory()  # the update's freed temporaries: a CPU engine runs (or reloads) beside us
        self.engine.after_update(self.step, updated=bool(minis), timers=timers)
        self.step, self.position = self.step + 1, got.position
        with timers("metrics"):
            out = step_record(got, self.step, step_metrics, critic_metrics, pack_metrics, skip,
                              overlong_mask=self.shaping.overlong == "mask", sampler=self.sampler)
            if self.cfg.trainer.log_trajectories and self.is_main:
                records = step_metrics_lib.trajectory_records(got.trajs[self.local_workers[0]],
                                                              self.cfg.trainer.log_trajectories, self.step)
                self.logger.log_jsonl("trajectories", records)
        elapsed = time.perf_counter() - t0
        timers.seconds |= got.seconds  # the rollout's phases (rollout, reward), wherever it ran
        tokens = sum(len(s) for t in trajs.values() for s in t.sequences)
        return out | timers.as_metrics(prefix="time/") | {
            "time/step": elapsed, "perf/tokens_per_s": tokens * jax.process_count() / elapsed,
            "train/epoch": self.position.epoch, "train/lr": float(self.policy.schedule(int(self.state.step)))}

    # -- rollout and reward --------------------------------------------------------------------------------------

    def _collect(self, step: int, position: rl_dataset.DataPosition) -> collection.Collected:
        """Step `step`'s rollout -> reward from `position`, per draw (dynamic sampling needs the rewards to decide
        whether to draw again). Thread-safe against the update: it may run in the background (`RolloutAhead`)."""
        cfg, timers, version = self.cfg, metrics_lib.PhaseTimer(compile_log.phase), self.engine.weights_version

        def rollout_and_reward(examples, worker: int, extra_round: int) -> Trajectories:
            with timers("rollout"):
                out = self._rollout(examples, worker, step=step, extra_round=extra_round)
            with timers("reward"):
                return self._reward(out, examples)

        trajs, position, sampling_metrics = collection.collect(
            lambda pos: batch_examples(self.train_data, cfg.data, pos, self.workers, self.local_workers),
            rollout_and_reward, position, steps_per_epoch=self.steps_per_epoch,
            need=cfg.data.train_batch_size // self.workers, dynamic=cfg.algorithm.dynamic_sampling,
            max_extra_rounds=cfg.algorithm.max_extra_rounds, agree_max=distributed.agree_max,
            gather=distributed.gather)
        tools = self.executor.metrics()  # tools/<tag>/<name>: this rollout's calls
        self.executor.reset_metrics()
        return collection.Collected(trajs, position, sampling_metrics | tools, timers.seconds, version)

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
        traj = reward.score_rollout(out, examples, self.tokenizer, self.reward_fn)
        return reward.shape_rollout(traj, self.shaping) if shape else traj

    # -- advantages, old log-probs, update, weight sync ----------------------------------------------------------

    def _advantages(self, trajs: dict[int, Trajectories]) -> dict[int, dict[str, list[np.ndarray]]]:
        """Per worker, token-aligned `advantages` per sequence (with a critic also `returns` and `old_values`)."""
        a = self.cfg.algorithm
        if self.critic is None:
            return {w: {"advantages": advantages.outcome_advantages(t, a.adv_estimator, norm_by_std=a.norm_adv_by_std)}
                    for w, t in trajs.items()}
        return critic_advantages(trajs, self.critic, self.batches, self.cfg)

    def _old_logprobs(self, batch: dict) -> dict:
        """The mini-batch with the pre-update policy's log-probs (and the reference policy's, with a KL loss)."""
        if self.cfg.actor.recompute_old_logprob:  # else the update's own, on-policy (train_step.UpdateConfig)
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

    def _sync(self) -> bool:
        """The (idle) engine gets the current weights; False when a stop's signal reached the engine too (a Ctrl-C
        goes to the process group): then the step ends and is saved without a sync."""
        try:
            sync_weights(self.sampler, self.cfg, self.policy, self.state.params)
            return True
        except Exception as e:
            if self.stop is None or not self.stop.requested():
                raise
            log.warning("weight sync skipped, the run is stopping: %s", f"{type(e).__name__}: {e}"[:300])
            return False

    # -- metrics, validation, checkpoints ------------------------------------------------------------------------

    def validate(self) -> dict:
        """Rollouts over the validation set as rollout.val_kwargs says (greedy n = 1 by default): the mean reward
        and accuracy over all samples, and the mean reward per data_source (`mean@n`)."""
        if self.val_data is None:
            return {}
        if self.engine.weights_version < self.step:  # max_staleness >= 2 may have left the engine on older weights
            self.engine.sync_to(self.step)
        t0 = time.perf_counter()
        n, bs = self.cfg.rollout.val_kwargs.n, self.cfg.data.val_batch_size
        scores, sources = [], []
        with compile_log.phase("validation"):
            for w, chunk in validation_chunks(self.val_data, self.workers, self.local_workers, bs):
                t = self._reward(self._rollout(chunk, w, validation=True), chunk, shape=False)
                scores += list(t.scores)
                sources += [chunk[int(p)].data_source for p in t.group]
        scores, sources = distributed.gather_ragged(np.asarray(scores, np.float32), sources,
                                                    sorted(set(self.val_data.data_sources)),
                                                    width=len(self.val_data) * n)
        return step_metrics_lib.validation_metrics(scores, sources, n) | {"time/validation": time.perf_counter() - t0}

    def _restore(self, step: int) -> TrainState:
        """The policy's state at `step`; sets the step and data position the run continues from."""
        restored = self.checkpoints.main.restore_state(step, self.stored.target(self.policy.restore_target()))
        self.step, self.position = int(restored.meta["step"]), restored.position
        log.info("resumed from %s step %d", self.checkpoints.main.directory, self.step)
        return self.stored.restored(restored.state, restored.meta, self.policy.shardings)  # LoRA: the base put back

    def save(self) -> None:
        # Its own phase: orbax's first save compiles a slice per replicated array shape (replica-parallel writes).
        with compile_log.phase("checkpoint"):
            state, meta = self.stored.saved(self.state, {"seed": self.cfg.seed, "total_steps": self.total_steps})
            self.checkpoints.main.save_state(self.step, state, config=self.model_cfg, position=self.position,
                                             meta=meta, force=True)
            if self.critic:
                self.critic.save(self.step)

    def _done(self, step: int | None = None, position: rl_dataset.DataPosition | None = None) -> bool:
        """`total_steps` trained, or (without trainer.max_steps) `total_epochs` of data used (dynamic sampling can end
        an epoch early), at this step and position or those given, or the time limit passed."""
        step, position = self.step if step is None else step, position or self.position
        return self.out_of_time or step >= self.total_steps or (not self.cfg.trainer.max_steps and
                                                                position.epoch >= self.cfg.trainer.total_epochs)

    def close(self) -> None:
        try:
            self.engine.close()
            self.checkpoints.close()
        finally:
            compile_log.arm(False)  # the run is over: later compiles (another run's warm-up) are not late
            self.logger.close()
            self.executor.close()
            self.sampler.close()
            self.lock.release()


def abandoned_step(stop: run_guard.StopSignals, error: Exception, checkpoints: skeleton.RunCheckpoints, step: int,
                   save) -> Exception:
    """The stop for a step that failed before any update because the signal also reached a helper process (the vLLM
    engines block it, `engine_signals.keep_stop_signals_out`; a tool's process may not): the step is abandoned and
    the last one saved (`step`, if not yet). With several processes nothing is saved: a save is a collective, and
    the others may be elsewhere in the step (waiting in its gathers: the two would meet in mismatched collectives
    and hang until SIGKILL); the run resumes from its last periodic checkpoint."""
    first_line = str(error).splitlines()[0][:200] if str(error) else ""
    if jax.process_count() == 1:
        saved = checkpoints.save_for_stop(step, save)
    else:
        saved = (f"not saved on {jax.process_count()} processes (a save is a collective the others may not reach); "
                 f"the same command resumes from step {max(checkpoints.steps(), default=0)}")
    return stop.stopped(f"the step in progress was abandoned ({type(error).__name__}: {first_line}); {saved}")


def step_record(got: collection.Collected, step: int, step_metrics: list[dict], critic_metrics: list[dict],
                pack_metrics: dict, skip: bool, *, overlong_mask: bool, sampler) -> dict:
    """The metrics of the step that trained on `got` and ended at `step`: its rollout, update, packing and weight
    sync."""
    out = step_metrics_lib.rollout_metrics(list(got.trajs.values()), overlong_mask=overlong_mask,
                                           gather=distributed.gather)
    out |= got.metrics  # tools/<tag>/<name>, dynamic_sampling/*
    out |= step_metrics_lib.update_metrics(step_metrics)
    out |= step_metrics_lib.update_metrics(critic_metrics, prefix="critic/")
    out |= pack_metrics
    out["rollout/step_skipped"] = float(skip)
    out["rollout/weights_version"] = float(got.weights_version)
    out["rollout/staleness"] = float(step - 1 - got.weights_version)
    out |= step_metrics_lib.weight_sync_metrics(sampler)
    return out


def time_limit_passed(limit_minutes: float, t_start: float, step: int) -> bool:
    """Whether `limit_minutes` (trainer.time_limit_minutes; 0: no limit) have passed since `t_start`: the same answer
    on every process (each reads its own clock; a collective when there are several)."""
    passed = bool(limit_minutes) and run_guard.agree_any(time.perf_counter() - t_start > limit_minutes * 60)
    if passed:
        log.info("trainer.time_limit_minutes=%g passed: the run ends after step %d", limit_minutes, step)
    return passed


def run_summary(trainer: Trainer, last: dict, val: dict, export: str | None, wall_s: float) -> dict:
    """A finished run's summary: the last step's reward, validation, where everything is; the main process also
    writes it to `summary.json`."""
    summary = {"steps": trainer.step, "total_steps": trainer.total_steps, "time_limit_reached": trainer.out_of_time,
               "reward_mean": last.get("reward/mean"),
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


def resolve_files(files, workdir: Path, split: str, seed: int) -> list[str]:
    """Data file list with `builtin:toy` replaced by the generated toy parquet of `split` (train or val)."""
    if distributed.is_main_process():
        toy.resolve_files(files, str(workdir / "toy_data"), split=split, seed=seed)  # writes them once
    distributed.barrier("toy_data")
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


def reference_logprobs(params, cfg, model_cfg, logprob_fn, temperature: float, mesh: Mesh):
    """With a KL loss, the reference policy's log-probs as a function of (policy params, batch): the starting
    policy (a copy, on host memory when asked: the reference's param_offload), or with LoRA the policy's own base
    with the adapters off (no weight copy); None without a KL loss."""
    if not cfg.actor.kl_coef:
        return None
    if model_cfg.lora_rank:
        base_fn = lora.jit_reference_logprobs(model_cfg, temperature=temperature, chunk=cfg.actor.logprob_chunk,
                                              mesh=mesh, tree=cfg.actor.tree_training)
        return ReferenceLogprobs(base_fn)
    if cfg.model.ref_on_host:
        return ReferenceLogprobs(logprob_fn, *offload(params))
    return ReferenceLogprobs(logprob_fn, jax.tree.map(jnp.copy, params))


class ReferenceLogprobs:
    """`(policy params, batch) -> reference log-probs`: `fn` (a jitted log-prob forward) on the reference's own
    params `ref` (on the devices, or in pinned host memory with `on_device` their device shardings, put back for
    each call), or with `ref` None (LoRA) on the policy's, whose base it reads with the adapters off. `lower` lowers
    the program a call runs (the warm-up compiles it)."""

    def __init__(self, fn, ref=None, on_device=None):
        self.fn, self.ref, self.on_device = fn, ref, on_device

    def __call__(self, policy, batch):
        return self.fn(self._params(policy), batch)[0]

    def lower(self, policy, batch):
        if self.on_device is None:
            return self.fn.lower(self._params(policy), batch)
        spec = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return self.fn.lower(jax.tree.map(spec, self.ref, self.on_device), batch)

    def _params(self, policy):
        if self.ref is None:
            return policy
        if self.on_device is None:
            return self.ref
        return jax.device_put(self.ref, self.on_device)


def offload(params):
    """(a copy of `params` in pinned host memory with their shardings, those shardings): the reference's
    param_offload. Each process keeps its own shards (several processes, FSDP over the hosts: no gather) and each
    log-prob pass puts them back on their devices for that pass only (`jax.device_put(host, on_device)`), so the
    devices hold the reference only while it is used. A host numpy copy, as before, was uploaded whole and
    unsharded at every call and could not be made at all from arrays spread over several processes."""
    on_device = jax.tree.map(lambda x: x.sharding, params)
    return jax.device_put(params, jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), on_device)), on_device


