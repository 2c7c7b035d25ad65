"""The ARPO / AEPO training loop (spec section 1), plain Python that reads top to bottom.

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
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arpo_jax import algos, experience, hf, lora, packing, rewards, run_guard, runtime, shaping, sharding
from arpo_jax import config as config_lib
from arpo_jax import critic as critic_lib
from arpo_jax import metrics as metrics_lib
from arpo_jax import train_step as ts
from arpo_jax.checkpoint import Checkpointer
from arpo_jax.components import make_sampler, make_tool_executor, rollout_config, sampling_settings, update_config
from arpo_jax.data import rl_dataset, toy
from arpo_jax.experience import Trajectories
from arpo_jax.rollout.agent_loop import (
    FAILURE_CAUSES,
    RolloutOutput,
    RolloutState,
    greedy_settings,
    rollout,
)

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------------------------
# Files, workers, seeds
# ------------------------------------------------------------------------------------------------------------------


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
        self.optimizer = lora.freeze_base(self.optimizer, self.model_cfg)  # LoRA: the adapters only (else as is)
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
        self.ref_fn = None  # LoRA: the reference = the policy's own base with the adapters off (no weight copy)
        if cfg.actor.kl_coef and self.model_cfg.lora_rank:
            self.ref_fn = lora.jit_reference_logprobs(self.model_cfg, temperature=self.update_cfg.temperature,
                                                      chunk=cfg.actor.logprob_chunk, mesh=self.mesh)
        elif cfg.actor.kl_coef:
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
        self.rollout_states = {w: RolloutState() for w in self.local_workers}  # B1 compat, see `_rollout`

    # -- setup helpers -------------------------------------------------------------------------------------------

    def _checkpoint_steps(self) -> list[int]:
        """The steps with every checkpoint of the run (a kill may land between the policy's and critic's)."""
        steps = set(self.ckpt.all_steps())
        if self.critic_ckpt is not None:
            steps &= set(self.critic_ckpt.all_steps())
        return sorted(steps)

    def _restore_critic(self, step: int) -> ts.TrainState:
        target = ts.abstract_train_state(self.critic_optimizer, self.critic_abstract, self.critic_sh)
        return self.critic_ckpt.restore_state(step, target).state

    def _restore(self, step: int, abstract) -> ts.TrainState:
        """The policy's state at `step`; sets the step and data position the run continues from."""
        restored = self.ckpt.restore_state(step, ts.abstract_train_state(self.optimizer, abstract, self.state_sh))
        self.step, self.position = int(restored.meta["step"]), restored.position
        log.info("resumed from %s step %d", self.ckpt.directory, self.step)
        return restored.state

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

    def train_step(self) -> dict:
        """One RL step, phase by phase (each timed under its name: `time/<phase>`). Returns its metrics."""
        timers = self.timers
        timers.reset()
        t0 = time.perf_counter()
        # rollout -> reward, per draw: dynamic sampling needs the rewards to decide whether to draw again.
        trajs, position, sampling_metrics = self._collect_rollouts()
        skip = self._too_many_failures(trajs)
        minis = []
        if not skip:
            with timers("advantages"):
                token_arrays = self._advantages(trajs)
            with timers("pack"):
                minis = self._pack(trajs, token_arrays)
            with timers("old_logprob"):
                minis = [self._old_logprobs(batch) for batch in minis]
        with timers("update"):
            step_metrics, critic_metrics = self._update(minis)
        with timers("weight_sync"):
            if minis:
                self._sync_weights()
        self.step += 1
        self.position = position
        with timers("metrics"):
            out = (self._rollout_metrics(trajs) | self._update_metrics(step_metrics)
                   | self._update_metrics(critic_metrics, prefix="critic/") | sampling_metrics
                   | {"rollout/step_skipped": float(skip)})
            self._log_trajectories(trajs)
        tokens = sum(len(s) for t in trajs.values() for s in t.sequences)
        elapsed = time.perf_counter() - t0
        out |= timers.as_metrics(prefix="time/") | {
            "time/step": elapsed, "perf/tokens_per_s": tokens * jax.process_count() / elapsed,
            "train/epoch": self.position.epoch, "train/lr": float(self.schedule(int(self.state.step)))}
        return out

    # rollout

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

    # reward

    def _reward(self, out: RolloutOutput, examples, *, shape: bool = True) -> Trajectories:
        """The scored trajectories of a rollout; `shape`: with the training signal's masks and penalties."""
        traj = experience.score_rollout(out, examples, self.tokenizer, self.reward_fn)
        return experience.shape_rollout(traj, self.cfg) if shape else traj

    def _collect_rollouts(self) -> tuple[dict[int, Trajectories], rl_dataset.DataPosition, dict]:
        """The rollout and reward phases: this step's shaped rollouts per local worker, the data position after
        them, and dynamic-sampling metrics.

        With `algorithm.dynamic_sampling`, groups whose rewards are all equal are dropped and the next batches of
        the data stream are rolled out (up to `algorithm.max_extra_rounds` more) until every worker has its share
        of informative groups; a worker still short is topped up with dropped groups (`shaping.pick_groups`).
        """
        cfg, a, timers = self.cfg, self.cfg.algorithm, self.timers
        position = self.position
        draws: dict[int, list[Trajectories]] = {w: [] for w in self.local_workers}
        informative: dict[int, list[np.ndarray]] = {w: [] for w in self.local_workers}
        need = cfg.data.train_batch_size // self.workers
        extra = 0
        while True:
            for w, ex in self._batch_examples(position).items():
                if extra and sum(int(i.sum()) for i in informative[w]) >= need:
                    continue  # this worker is full; others draw on
                with timers("rollout"):
                    out = self._rollout(ex, w, extra_round=extra)
                with timers("reward"):
                    t = self._reward(out, ex)
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
            trajs[w] = experience.select_groups([(t, [k for r, k in picks if r == j])
                                                 for j, t in enumerate(draws[w])])
            counts += (sum(int(i.sum()) for i in informative[w]), sum(len(i) for i in informative[w]),
                       sum(not informative[w][r][k] for r, k in picks))
        counts = self._gather(counts[None]).sum(0)
        return trajs, position, {"dynamic_sampling/kept_fraction": float(counts[0] / max(counts[1], 1)),
                                 "dynamic_sampling/extra_rounds": float(extra),
                                 "dynamic_sampling/filled_groups": float(counts[2])}

    def _batch_examples(self, position: rl_dataset.DataPosition | None = None) -> dict[int, list]:
        """This step's prompts (or those of the batch at `position`) per local rollout worker."""
        cfg = self.cfg
        position = position or self.position
        idx = rl_dataset.batch_indices(len(self.train_data), cfg.data.train_batch_size, position.epoch,
                                       position.step_in_epoch, seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                       drop_last=cfg.data.drop_last)
        return {w: [self.train_data[int(i)] for i in rl_dataset.shard(idx, w, self.workers)]
                for w in self.local_workers}

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

    # advantages

    def _advantages(self, trajs: dict[int, Trajectories]) -> dict[int, dict[str, list[np.ndarray]]]:
        """Per worker, token-aligned `advantages` per sequence (with a critic also `returns` and `old_values`)."""
        a = self.cfg.algorithm
        if not self.use_critic:
            return {w: {"advantages": experience.outcome_advantages(t, a.adv_estimator, norm_by_std=a.norm_adv_by_std)}
                    for w, t in trajs.items()}
        values = self._old_values(trajs)
        n_local = sum(len(t.sequences) for t in trajs.values())
        rows = slice(jax.process_index() * n_local, (jax.process_index() + 1) * n_local)
        # Whitened over every trajectory of the step (as the reference's driver does), not per process.
        whiten = lambda adv, mask: np.asarray(algos.masked_whiten(self._gather(adv), self._gather(mask)))[rows]
        out = experience.gae([trajs[w] for w in self.local_workers], [values[w] for w in self.local_workers],
                             max_response_length=self.cfg.data.max_response_length, gamma=a.gamma, lam=a.lam,
                             whiten=whiten)
        return {w: {"advantages": adv, "returns": ret, "old_values": values[w]}
                for w, (adv, ret) in zip(self.local_workers, out)}

    def _old_values(self, trajs: dict[int, Trajectories]) -> dict[int, list[np.ndarray]]:
        """The critic's token-aligned values of every sequence: one forward pass over the packed global batch (GAE
        itself runs per trajectory: a reverse scan over a packed row would cross into another trajectory)."""
        layouts = self._layouts(trajs)
        zeros = {w: [np.zeros(len(s), np.float32) for s in t.sequences] for w, t in trajs.items()}
        blocks = [packing.assemble(layouts[w], trajs[w].sequences, trajs[w].loss_masks, zeros[w])
                  for w in self.local_workers]
        local = {k: np.concatenate([b[k] for b in blocks], axis=2) for k in critic_lib.FORWARD_KEYS}
        values = self._host_local(self.value_fn(self.critic_state.params,
                                                {k: self._global(v, lead=1) for k, v in local.items()}))
        per_worker = np.split(values, len(self.local_workers), axis=2)
        return {w: packing.unpack(layouts[w], v) for w, v in zip(self.local_workers, per_worker)}

    # pack

    def _layouts(self, trajs: dict[int, Trajectories]) -> dict[int, packing.Layout]:
        """Each worker's layout, with the micro-batch count of the largest one over every process."""
        mini_prompts = self.cfg.actor.ppo_mini_batch_size // self.workers
        layouts = {w: experience.layout(t, self.cfg, mini_prompts=mini_prompts, rows=self.rows_per_worker,
                                        row_len=self.row_len) for w, t in trajs.items()}
        m = max(layouts[w].shape[1] for w in self.local_workers)
        if jax.process_count() > 1:
            m = int(multihost_utils.process_allgather(np.asarray(m)).max())
        return {w: lay.with_micro_batches(m) for w, lay in layouts.items()}

    def _pack(self, trajs: dict[int, Trajectories], token_arrays: dict[int, dict]) -> list[dict]:
        """K mini-batches of global [M, B, T] arrays, in optimizer-step order. The loss weights are normalised by
        the loss tokens and sequences of each whole mini-batch, summed over every worker of every process."""
        layouts = self._layouts(trajs)
        totals = self._gather(np.stack([packing.loss_totals(layouts[w], trajs[w].loss_masks)
                                        for w in self.local_workers])).sum(0)  # [K, 2]
        blocks = [experience.worker_batch(trajs[w], token_arrays[w], layouts[w], self.cfg, totals=totals,
                                          workers=self.workers) for w in self.local_workers]
        local = {k: np.concatenate([b[k] for b in blocks], axis=2) for k in blocks[0]}  # [K, M, B_local, T]
        return [{name: self._global(v[k]) for name, v in local.items()} for k in range(local["input_ids"].shape[0])]

    def _global(self, local: np.ndarray, lead: int = 0) -> jax.Array:
        """The global [M, B, T] array (with `lead` = 1: [K, M, B, T]) from this process's rows (its workers' blocks
        along B)."""
        b = local.ndim - 2
        global_shape = local.shape[:b] + (local.shape[b] * jax.process_count(),) + local.shape[b + 1:]
        return jax.make_array_from_process_local_data(self.batch_sh4 if lead else self.batch_sh, local, global_shape)

    def _host_local(self, x: jax.Array) -> np.ndarray:
        """This process's rows of a global [K, M, B, T] array (inverse of `_global(..., lead=1)`)."""
        if jax.process_count() == 1:
            return np.asarray(x)
        return np.asarray(multihost_utils.global_array_to_host_local_array(x, self.mesh, self.batch_sh4.spec))

    # old / ref log-probs

    def _old_logprobs(self, batch: dict) -> dict:
        """The mini-batch with the pre-update policy's log-probs (and the reference policy's, with a KL loss)."""
        batch = batch | {"old_logp": self.logprob_fn(self.state.params, batch)[0]}
        if self.ref_params is not None:
            batch["ref_logp"] = self.logprob_fn(self.ref_params, batch)[0]
        if self.ref_fn is not None:  # LoRA
            batch["ref_logp"] = self.ref_fn(self.state.params, batch)[0]
        return batch

    # update

    def _update(self, minis: list[dict]) -> tuple[list[dict], list[dict]]:
        """`ppo_epochs` passes over the mini-batches: the critic first (as the reference), then the policy (not
        during `critic.warmup_steps`). Returns the per-step metrics of each, on the host."""
        cfg = self.cfg
        step_metrics, critic_metrics = [], []
        if self.use_critic:
            for _ in range(cfg.actor.ppo_epochs):
                for batch in minis:
                    self.critic_state, m = self.value_step_fn(self.critic_state, batch)
                    critic_metrics.append(m)
        update_policy = not (self.use_critic and self.step < cfg.critic.warmup_steps)
        for _ in range(cfg.actor.ppo_epochs if update_policy else 0):
            for batch in minis:
                self.state, m = self.step_fn(self.state, batch)
                step_metrics.append(m)
        return jax.device_get(step_metrics), jax.device_get(critic_metrics)

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
                    t = self._reward(self._rollout(chunk, w, validation=True), chunk, shape=False)
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
        self.ckpt.save_state(self.step, self.state, config=self.model_cfg, position=self.position,
                             meta={"seed": self.cfg.seed, "total_steps": self.total_steps}, force=True)
        if self.critic_ckpt is not None:
            self.critic_ckpt.save_state(self.step, self.critic_state, config=self.model_cfg, force=True)

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
