"""The cold-start SFT loop (spec 11.3: LLaMA-Factory full fine-tuning, cutoff 15000, lr 7e-6, 3 epochs, cosine,
warmup 0.1, bf16) on the same model, mesh, checkpoint and metrics machinery as the RL trainer.

One optimizer step takes `sft.batch_size` examples (all processes together; each process packs its own contiguous
shard, `rl_dataset.shard`), packed into [M, B, T] micro-batches (B = devices the batch is split over, T =
`sft.max_token_len_per_device` or `sft.cutoff_len`). The loss is the token-mean NLL over every trained token of the
step: each loss token's weight is 1 / (loss tokens in the whole step), computed on the host, so the result does
not depend on how the step is split into micro-batches, rows or processes (packing's `global_token_mean`).

Outputs in the work directory: `checkpoints/` (orbax: params, optimizer state, data position; the RL trainer starts
from it with `model.init_checkpoint`), `hf/` (an HF folder with the tokenizer, for `model.path` or vLLM) and
`metrics.jsonl` / TensorBoard. With `trainer.resume` a restarted run continues from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from arpo_jax import distributed, paths, sharding
from arpo_jax.assemble import components
from arpo_jax.assemble import policy as policy_lib
from arpo_jax.assemble import validate as config_lib
from arpo_jax.config import redaction
from arpo_jax.data import rl_dataset, sft_data
from arpo_jax.experience import packing
from arpo_jax.models.transformer import Config as ModelConfig
from arpo_jax.train import metrics as metrics_lib
from arpo_jax.train import run_guard, skeleton
from arpo_jax.update import accumulate, machinery
from arpo_jax.update import jit as jit_lib
from arpo_jax.update import train_step as ts
from arpo_jax.update.accumulate import TrainState
from arpo_jax.weights import hf

log = logging.getLogger(__name__)

Batch = dict[str, jax.Array]
BATCH_KEYS = ("input_ids", "targets", "positions", "segment_ids", "loss_weight")


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


def sft_loss(params, graphdef: nnx.GraphDef, mb: Batch, *, chunk: int = 256) -> jax.Array:
    """sum_t w_t * -log p(target_t) over one [B, T] micro-batch; with w = 1 / (loss tokens of the step) the sum over
    micro-batches is the step's token-mean NLL."""
    logp, _ = ts.token_logprobs(graphdef, params, mb, chunk=chunk)
    return -jnp.sum(mb["loss_weight"].astype(jnp.float32) * logp)


def sft_step(state: TrainState, batch: Batch, *, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
             chunk: int = 256, grad_shardings=None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step over [M, B, T] arrays (`BATCH_KEYS`) with `accumulate.accumulate_and_apply` (gradients
    summed over the micro-batches, global-norm clip + AdamW, a non-finite update skipped).

    Returns:
      (new state, metrics): float32 scalars ``loss`` (token-mean NLL), ``grad_norm`` (before clipping), ``skipped``.
    """
    def micro_loss(params, mb):
        loss = sft_loss(params, graphdef, mb, chunk=chunk)
        return loss, {"loss": jax.lax.stop_gradient(loss)}

    return accumulate.accumulate_and_apply(state, batch, micro_loss, optimizer, grad_shardings)


def jit_sft_step(graphdef: nnx.GraphDef, model_cfg: ModelConfig, optimizer: optax.GradientTransformation,
                 mesh: Mesh | None = None, shardings: TrainState | None = None, *, chunk: int = 256) -> jit_lib.MeshJit:
    """`sft_step` jitted once with `jit.jit_step` (state donated, explicit shardings with a mesh)."""
    fn = lambda state, batch, grad_sh: sft_step(state, batch, graphdef=graphdef, optimizer=optimizer, chunk=chunk,
                                                grad_shardings=grad_sh)
    return jit_lib.jit_step(fn, model_cfg, mesh, shardings, name="jit_sft_step")


# --------------------------------------------------------------------------------------------------
# Host-side batches
# --------------------------------------------------------------------------------------------------


def pack_sft_batch(examples, *, row_len: int, rows: int, total_loss_tokens: int,
                   num_micro: int | None = None) -> dict[str, np.ndarray]:
    """[M, B, T] numpy arrays (`BATCH_KEYS`) of (ids, loss_mask) examples, packed; loss weights 1/total_loss_tokens.

    `total_loss_tokens` counts the whole optimizer step (all processes); `num_micro` pads M with empty micro-batches
    (weight 0) so every process sends the same shape.
    """
    seqs, masks = [ids for ids, _ in examples], [m for _, m in examples]
    # Token-mean over the whole optimizer step: the normaliser is the step's loss tokens over all processes.
    totals = np.array([[total_loss_tokens, len(seqs)]], np.float64)  # [K = 1, (tokens, sequences)]
    batch, layout = packing.pack_batch(seqs, masks, np.zeros(len(seqs), np.float32), mini_batch_size=len(seqs),
                                       row_len=row_len, rows_per_micro=rows, agg_mode="token-mean", totals=totals)
    out = {k: batch[k][0] for k in BATCH_KEYS}  # K = 1: the whole list is one optimizer step
    extra = (num_micro or 0) - layout.shape[1]
    if extra > 0:
        out = {k: np.concatenate([v, np.zeros((extra,) + v.shape[1:], v.dtype)]) for k, v in out.items()}
    return out


def micro_batches_needed(shards: list[np.ndarray], *, row_len: int, rows: int) -> int:
    """The largest micro-batch count M of any process's shard (lengths each), so all processes agree on M."""
    return max(packing.plan_layout(lengths, mini_batch_size=len(lengths), row_len=row_len,
                                   rows_per_micro=rows).shape[1] for lengths in shards)


def batch_rows(mesh: Mesh, rules_name: str) -> int:
    """B: rows per micro-batch of the global batch = devices the ``batch`` axis is split over."""
    axes = sharding.batch_spec(mesh, rules_name)[1] or ()
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding) -> Batch:
    """Global [M, B, T] arrays from each process's [M, B / processes, T] block (its rows of the batch axis)."""
    return {k: distributed.global_array(v, sharding) for k, v in local.items()}


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def export_hf(graphdef: nnx.GraphDef, params, path: Path, tokenizer) -> Path:
    """The trained params as an HF folder (every process must call this; process 0 writes)."""
    return hf.save_pretrained(nnx.merge(graphdef, params), path, tokenizer=tokenizer)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def run_sft(cfg, workdir: str | os.PathLike) -> dict:
    """Runs cold-start SFT with `cfg` (config/schema.py fields, `sft.*`) in `workdir`; returns a summary dict.

    Data order comes from `data.seed` / `data.shuffle` (a permutation per epoch; the incomplete tail batch of an
    epoch is left out). `sft.mask_tool_results` (default True; see `sft_data`) chooses whether
    `<result>` blocks inside assistant turns are trained on. SIGTERM / SIGINT stop it at a step boundary with a
    checkpoint (`run_guard.Stopped`, exit 143 / 130); one run per work directory (`run_guard`).
    """
    t_start = time.perf_counter()
    distributed.initialize_distributed()
    cfg = config_lib.validate(cfg, device_count=jax.device_count(), process_count=jax.process_count(), command="sft")
    workdir = paths.local_path(workdir)  # refuses gs:// (it would become $PWD/gs:/...)
    with run_guard.StopSignals("sft") as stop:
        lock, resuming = run_guard.open_workdir(workdir, cfg, "sft")
        try:
            hf.check_export_destination(workdir / "hf")
            if resuming and (done := finished_run(cfg, workdir)) is not None:
                log.info("SFT in %s finished at step %d with this config: its summary, nothing rebuilt", workdir,
                         done["steps"])
                return done | {"start_step": done["steps"], "wall_time_s": time.perf_counter() - t_start}
            return _run_sft(cfg, workdir, resuming, stop, t_start)
        finally:
            lock.release()


def finished_run(cfg, workdir: Path) -> dict | None:
    """The summary (`summary.json`, written at the end) of the SFT finished in `workdir` when `cfg` would only
    repeat it: nothing that changes its meaning (`run_guard.MEANING_FIELDS`) nor its step count differs, and its
    last checkpoint and its export are in place. Rebuilding the model and the optimizer state and exporting again
    took 25 s for SmolLM2 (the demo's second algorithm), minutes for a 7B model. Single-process runs only: the other
    processes of a multi-host run might not see the same files."""
    try:
        done = json.loads((workdir / "summary.json").read_text())
        config = done.pop("config")
    except (OSError, ValueError, KeyError):
        return None
    current = json.loads(json.dumps(redaction.redact(cfg), default=str))
    if jax.process_count() > 1 or run_guard.meaning_changes(config, current, "sft") or \
            config["sft"]["max_steps"] != current["sft"]["max_steps"]:
        return None
    if not (Path(done["checkpoint_dir"]) / str(done["steps"])).is_dir() or \
            not (Path(done["hf_dir"]) / hf.EXPORT_MARKER).is_file():
        return None
    return done


def _run_sft(cfg, workdir: Path, resuming: bool, stop: run_guard.StopSignals, t_start: float) -> dict:
    is_main = distributed.is_main_process()
    mesh = components.make_mesh(cfg)
    model, tokenizer, _ = policy_lib.load_policy(cfg, workdir, mesh)
    config_lib.check_tokenizer(tokenizer, cfg)
    # Data: every process tokenises everything (M and the loss-token totals must agree) and packs its own shard.
    data = sft_data.load_sft_examples(cfg.sft.train_files, tokenizer, cutoff_len=cfg.sft.cutoff_len,
                                      mask_tool_results=cfg.sft.mask_tool_results, seed=cfg.seed)
    plan = SftPlan.of(cfg, len(data), mesh, model.config)

    # Optimizer (LLaMA-Factory: AdamW, linear warmup over warmup_ratio of the steps, then cosine to 0).
    update_cfg = ts.UpdateConfig(lr=cfg.sft.lr, schedule=cfg.sft.schedule, weight_decay=cfg.sft.weight_decay,
                                 warmup_steps=math.ceil(cfg.sft.warmup_ratio * plan.total_steps))
    jit = lambda g, mc, opt, mesh, sh: jit_sft_step(g, mc, opt, mesh, sh, chunk=cfg.actor.logprob_chunk)
    policy, params = machinery.build_policy(model, update_cfg, plan.total_steps, mesh, jit)
    del model
    batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh, policy.model_cfg.sharding_rules))

    # Resume, or start.
    ckpts = skeleton.RunCheckpoints([skeleton.policy_checkpointer(cfg, workdir)])
    latest, (state, position) = ckpts.resume_or_init(
        resuming, lambda s: ckpts.main.restore_state(s, policy.restore_target())[:2],
        lambda: (policy.init_state(params), rl_dataset.DataPosition()))
    if latest is not None:
        log.info("resumed SFT from %s step %d", ckpts.main.directory, latest)
    params = None  # the state holds its own copy
    step = start_step = latest or 0
    logger = skeleton.open_logger(cfg, workdir, resume_step=latest, enabled=is_main)
    bar = metrics_lib.progress(plan.total_steps, "sft", enabled=cfg.trainer.progress and is_main, initial=step)

    def save() -> None:
        ckpts.main.save_state(step, state, config=policy.model_cfg, position=position,
                              meta={"epoch": position.epoch, "kind": "sft"})

    loss = float("nan")
    t_last = time.perf_counter()
    try:
        while True:
            ckpts.raise_if_failed()  # a save that failed in the background (full disk) stops the run now
            # Checked after the last step too: a signal during it stops the run as asked (the step is saved).
            if stop.requested():
                bar.close()
                raise stop.stopped(ckpts.save_for_stop(step, save))
            if step >= plan.total_steps:
                break
            idx, local, num_micro = plan.batch(data, position)
            state, m = policy.step_fn(state, to_global(local, batch_sh))
            step += 1
            position = position.advance(plan.steps_per_epoch)
            loss = float(m["loss"])
            now = time.perf_counter()
            logger.log(step, {"sft/loss": loss, "sft/grad_norm": float(m["grad_norm"]),
                              "sft/skipped": float(m["skipped"]), "sft/lr": float(policy.schedule(step - 1)),
                              "sft/epoch": step / plan.steps_per_epoch,
                              "sft/loss_tokens": int(data.loss_tokens[idx].sum()),
                              "sft/tokens_per_s": float(data.lengths[idx].sum()) / max(now - t_last, 1e-9),
                              "sft/micro_batches": num_micro})
            t_last = now
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            epoch_end = cfg.sft.save_freq == 0 and position.step_in_epoch == 0
            if epoch_end or (cfg.sft.save_freq and step % cfg.sft.save_freq == 0) or step == plan.total_steps:
                save()
        bar.close()
        ckpts.wait()
        if step not in ckpts.main.all_steps():  # a resumed run that had already finished
            save()
            ckpts.wait()
        hf_dir = export_hf(policy.graphdef, state.params, workdir / "hf", tokenizer)
        distributed.barrier("sft_export")
    finally:
        ckpts.close()
        logger.close()
    summary = {"final_loss": loss, "steps": step, "start_step": start_step, "total_steps": plan.total_steps,
               "examples": len(data), "skipped": len(data.skipped), "truncated": data.truncated,
               "dropped": data.dropped, "skipped_updates": int(state.skipped),
               "wall_time_s": time.perf_counter() - t_start, "workdir": str(workdir),
               "checkpoint_dir": str(ckpts.main.directory), "hf_dir": str(hf_dir)}
    return _record_if_finished(cfg, workdir, summary, write=is_main)


def _record_if_finished(cfg, workdir: Path, summary: dict, *, write: bool) -> dict:
    """`summary` (returned); a finished run's is written to `summary.json` with the config it finished under
    (`finished_run` reads both) by the process that `write`s."""
    if write and summary["steps"] == summary["total_steps"]:
        tmp = workdir / f".summary.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(summary | {"config": redaction.redact(cfg)}, indent=2, default=str))
        os.replace(tmp, workdir / "summary.json")
    return summary


@dataclasses.dataclass(frozen=True)
class SftPlan:
    """The run's shape: steps, and how each step's examples are packed over the processes."""

    batch_size: int  # examples per optimizer step, all processes together
    steps_per_epoch: int
    total_steps: int
    row_len: int  # T
    rows: int  # B: rows per micro-batch of the global batch
    seed: int  # data.seed
    shuffle: bool  # data.shuffle

    @classmethod
    def of(cls, cfg, examples: int, mesh: Mesh, model_cfg: ModelConfig) -> SftPlan:
        bs = cfg.sft.batch_size
        steps_per_epoch = examples // bs  # drop_last: the tail of each (shuffled) epoch waits for the next order
        if steps_per_epoch == 0:
            raise ValueError(f"sft.batch_size={bs} is larger than the SFT set ({examples} examples)")
        rows, procs = batch_rows(mesh, model_cfg.sharding_rules), jax.process_count()
        if rows % procs:
            raise ValueError(f"the batch is split over {rows} devices, not a multiple of {procs} processes "
                             "(mesh.shape)")
        return cls(bs, steps_per_epoch, cfg.sft.max_steps or cfg.sft.epochs * steps_per_epoch,
                   cfg.sft.max_token_len_per_device or cfg.sft.cutoff_len, rows, cfg.data.seed, cfg.data.shuffle)

    def batch(self, data, position: rl_dataset.DataPosition) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """The step's example indices, this process's packed [M, B / processes, T] block and M (agreed)."""
        # A seeded permutation per epoch; each process packs its contiguous shard of the batch.
        idx = rl_dataset.batch_indices(len(data), self.batch_size, position.epoch, position.step_in_epoch,
                                       seed=self.seed, shuffle=self.shuffle, drop_last=True)
        procs = jax.process_count()
        shards = [rl_dataset.shard(idx, p, procs) for p in range(procs)]
        rows = self.rows // procs
        num_micro = micro_batches_needed([data.lengths[s] for s in shards], row_len=self.row_len, rows=rows)
        local = pack_sft_batch([data[i] for i in shards[jax.process_index()]], row_len=self.row_len, rows=rows,
                               total_loss_tokens=int(data.loss_tokens[idx].sum()), num_micro=num_micro)
        return idx, local, num_micro
