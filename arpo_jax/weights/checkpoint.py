"""Orbax checkpoints: sharded params, optimizer state and JSON metadata, saved per step, restored onto any mesh.

Layout of `directory/<step>/`: `params/` (the model's params as a pure dict of arrays), `opt_state/` (optional,
any pytree of arrays), `meta/` (JSON: the model config, so a checkpoint can be exported without its run's config,
plus whatever the caller stores). Items are separate so that exporting or evaluating a checkpoint restores the params
alone. A training state (the update's `accumulate.TrainState`, a NamedTuple (params, opt_state, step, skipped): the
policy's, the critic's or SFT's) is saved and restored with
`save_state` / `restore_state`, which own its metadata: `counters` (optimizer updates and skipped updates) and, for
a run that reads data, `data_position`.

Restore takes abstract targets (`jax.ShapeDtypeStruct` with a sharding) and orbax reads each device's slices
directly, so a checkpoint saved on one mesh shape restores onto another (e.g. (1, 8, 1) -> (2, 2, 2)).
Saves are asynchronous; an interrupted save leaves a temporary folder that orbax never lists as a step.

Layer layout: the decoder layers are stored stacked (`model.layers.<weight>` [L, ...]). Checkpoints written before
that hold them per layer (`model.layers.<i>.<weight>`); `restore` reads the saved tree's metadata, restores such a
step into per-layer targets and stacks each weight onto its target sharding (`_per_layer_target`, `_stack_layers`),
params and optimizer state alike. The stacking holds a weight's per-layer and stacked copies at once: a transient
of one stacked weight on top of the restored state.

Integrity: once a step's files are complete, process 0 records their sizes and CRC-32s in `<step>/integrity.json`
(in a background thread: hashing a 7B model's state takes seconds). Restore checks them first and refuses
non-finite params, raising `CorruptCheckpointError` (one line: the step, the file, what is wrong) instead of
restoring silent garbage; `restore_newest_intact` then falls back to the newest intact step. Retention (keep-N) is
done here, not by orbax: it counts only steps whose integrity record is written, so a newer step that is still being
written or hashed never causes an older intact one to be deleted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from arpo_jax import distributed, models, sharding
from arpo_jax.data.rl_dataset import DataPosition
from arpo_jax.models.transformer import Config, RopeScaling
from arpo_jax.paths import local_path

log = logging.getLogger(__name__)


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax logs a failed background save (e.g. a full disk) from several threads, each with a traceback and a
    TensorStore spec: hundreds of lines. The error is raised here as one line; its log records keep their first
    line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in record.pathname and record.levelno >= logging.ERROR:
            record.msg, record.args = _short_text(record.getMessage()), ()
            record.exc_info = record.exc_text = None
        return True


def _short_text(text: str, limit: int = 600) -> str:
    """The first line, without TensorStore's spec dump (the OS error just before it is what matters)."""
    text = text.strip().splitlines()[0] if text.strip() else ""
    text = re.sub(r"\s*\[(tensorstore_spec|source_locations)=.*$", "", text)
    return text if len(text) <= limit else text[:limit] + " ..."


logging.getLogger("absl").addFilter(_OneLineOrbaxErrors())
INTEGRITY_FILE = "integrity.json"  # {relative path: [size, crc32]} of every file of the step
_CHUNK = 8 << 20


class CorruptCheckpointError(ValueError):
    """A checkpoint step that must not be restored: a file missing, of the wrong size or checksum, unreadable by
    orbax, or params that are not finite. The message is one line naming the step and the file."""

    def __init__(self, directory: Path, step: int, what: str, reason: str):
        self.directory, self.step, self.what, self.reason = directory, step, what, reason
        super().__init__(f"checkpoint {directory / str(step)} could not be restored: step {step}, {what}: {reason}")


class CheckpointMismatchError(ValueError):
    """An intact checkpoint step (its files match their integrity record) that does not fit what it is restored into:
    another model, LoRA or optimizer config. Not damage: it is never moved aside, and older steps are not tried."""

    def __init__(self, directory: Path, step: int, reason: str):
        super().__init__(f"checkpoint {directory / str(step)} does not fit this run: its files are intact (checked "
                         f"against {INTEGRITY_FILE}), but {reason}. Was it saved with another model, model.lora or "
                         "optimizer config? Use that config, or another --workdir")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers: hashing overlaps training
    return crc


def file_digests(step_dir: Path) -> dict[str, list[int]]:
    """{path relative to `step_dir`: [size, crc32]} of every file under it (the integrity record excluded)."""
    out = {}
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = Path(root) / name
            rel = str(path.relative_to(step_dir))
            if rel != INTEGRITY_FILE:
                out[rel] = [path.stat().st_size, _crc32(path)]
    return dict(sorted(out.items()))


def _short(e: BaseException, limit: int = 600) -> str:
    """The first line of an error (orbax / TensorStore errors run to dozens of lines of context)."""
    return _short_text(f"{type(e).__name__}: {str(e).strip()}", limit)


def _first_non_finite(tree) -> str | None:
    """The key path of the first float leaf of `tree` holding a NaN or an infinity (every process must call this
    in a multi-host run: the reduction over a sharded array is a collective)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            continue
        ok = jnp.all(jnp.isfinite(x))
        if not bool(np.asarray(ok.addressable_data(0) if isinstance(ok, jax.Array) else ok)):
            return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return None


_agree = distributed.agree


def config_to_json(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> Config:
    d = dict(d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = tuple(d["eos_token_id"])
    return Config(**d)


def abstract_params(cfg: Config, mesh: Mesh | None = None) -> dict:
    """Pure-dict tree of ShapeDtypeStruct for the model's params, with target shardings when `mesh` is given."""
    state = nnx.state(models.abstract_model(cfg), nnx.Param)
    if mesh is not None:
        state = sharding.state_shardings(state, mesh, sharding.get_rules(cfg.sharding_rules), abstract=True)
        return nnx.to_pure_dict(state)
    # No mesh: the first local device, whatever topology saved it (e.g. a multi-host run's checkpoint on a laptop).
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), nnx.to_pure_dict(state))


def _is_decoder(x) -> bool:
    """A `Decoder`'s pure dict (params, or any param-shaped tree such as Adam's moments)."""
    return isinstance(x, dict) and "embed_tokens" in x and "layers" in x


def _map_decoders(fn, tree, *rest):
    """`tree` with every decoder dict d replaced by fn(d, *the matching subtrees of `rest`)."""
    return jax.tree.map(lambda d, *r: fn(d, *r) if _is_decoder(d) else (r[0] if r else d), tree, *rest,
                        is_leaf=_is_decoder)


def _layer_sds(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """One layer's abstract array of a stacked one (its sharding without the unsplit layer axis)."""
    s = getattr(x, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding):
        s = jax.sharding.NamedSharding(s.mesh, jax.P(*tuple(s.spec)[1:]))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)


def _per_layer_target(target):
    """The abstract tree of `target` (stacked layers) in the per-layer layout of older checkpoints."""
    def one(d):
        n = jax.tree.leaves(d["layers"])[0].shape[0]
        return {**d, "layers": {i: jax.tree.map(_layer_sds, d["layers"]) for i in range(n)}}

    return _map_decoders(one, target)


def _stack_layers(restored, target):
    """Per-layer restored trees -> the stacked layout of `target`, each weight stacked onto its target sharding
    (and its per-layer arrays freed as soon as it is)."""
    def one(t, r):
        n = len(r["layers"])

        def stack(ts, *xs):
            out = sharding.stack_onto(xs, getattr(ts, "sharding", None))
            for x in xs:
                x.delete()
            return out

        return {**r, "layers": jax.tree.map(stack, t["layers"], *(r["layers"][i] for i in range(n)))}

    return _map_decoders(one, target, restored)


def saved_per_layer(step_dir: Path) -> bool:
    """Whether a step's params were saved with the layers per layer (`model.layers.<i>`: before stacked storage)."""
    try:
        tree = ocp.StandardCheckpointHandler().metadata(step_dir / "params").tree
    except Exception:  # unreadable metadata: the restore itself reports the damage
        return False
    found = []
    _map_decoders(lambda d: found.append(all(str(k).isdigit() for k in d["layers"])), tree)
    return any(found)


def _counter(value: int, target) -> jax.Array:
    """An int32 scalar of the train state in `target`'s sharding: a counter left on the default device would make
    the first update after a resume compile again (its argument's sharding is part of the program's key)."""
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return jnp.asarray(value, jnp.int32)
    return jax.make_array_from_callback((), sharding, lambda _: np.asarray(value, np.int32))


class RestoredState(NamedTuple):
    """What `Checkpointer.restore_state` returns."""

    state: Any  # the restored training state, the target's type (the update's `accumulate.TrainState`)
    position: DataPosition | None  # where the run's data continues; None for a state saved without one (the critic)
    meta: dict  # the whole metadata, e.g. `step` and what the caller stored


class Checkpointer:
    """Keep-N, asynchronous, resumable, checksummed checkpoints of (params, optimizer state, metadata) per step.

    `create=False` opens an existing directory only (a read-only user such as an export: a missing directory is a
    FileNotFoundError, never created).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True,
                 create: bool = True):
        self.directory = local_path(directory, "checkpoint directory")
        if not create and not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory}: no such checkpoint directory")
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"{self.directory} is a file, not a checkpoint directory")
        self.max_to_keep = max_to_keep
        # Retention is ours (`_retain`): orbax's would count steps whose integrity is not recorded yet.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=create,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("params", "opt_state", "meta"))
        self._sealing: threading.Thread | None = None
        self._seal_error: BaseException | None = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, params, *, config: Config, opt_state=None, meta: dict | None = None,
             force: bool = False) -> bool:
        """Starts saving step `step` (asynchronously); `params` is an nnx.State or a pure dict of arrays.

        The previous save is finished first (its integrity record written, then old steps beyond `max_to_keep`
        deleted); a failed previous save raises here with a one-line message.
        """
        self._finish()
        items = {
            "params": ocp.args.StandardSave(_pure(params)),
            "meta": ocp.args.JsonSave({"step": int(step), "model_config": config_to_json(config), **(meta or {})}),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        try:
            saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        except Exception as e:
            raise OSError(f"checkpoint step {step} could not be saved in {self.directory}: {_short(e)}") from e
        if saved:
            self._sealing = threading.Thread(target=self._seal, args=(step,), name=f"seal-{step}", daemon=True)
            self._sealing.start()
        return saved

    def save_state(self, step: int, state: Any, *, config: Config, position: DataPosition | None = None,
                   meta: dict | None = None, force: bool = False) -> bool:
        """Starts saving a training state at `step` (`save`): its params and optimizer state, and in the metadata its
        `counters` (updates, skipped), the `data_position` when given, and the caller's `meta`."""
        meta = {**(meta or {}), "counters": {"updates": int(state.step), "skipped": int(state.skipped)}}
        if position is not None:
            meta["data_position"] = position.to_dict()
        return self.save(step, state.params, config=config, opt_state=state.opt_state, meta=meta, force=force)

    def _seal(self, step: int) -> None:
        """Background: waits for the step's files, then (process 0) writes its integrity record atomically."""
        try:
            self._manager.wait_until_finished()
            if jax.process_index() == 0:
                step_dir = self.step_dir(step)
                record = {"step": step, "algorithm": "crc32", "files": file_digests(step_dir)}
                tmp = step_dir / f".{INTEGRITY_FILE}.tmp"
                tmp.write_text(json.dumps(record))
                os.replace(tmp, step_dir / INTEGRITY_FILE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread by _finish
            self._seal_error = e

    def _finish(self) -> None:
        """Joins the pending save's sealing, raises its error, and applies retention."""
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None
        if self._seal_error is not None:
            e, self._seal_error = self._seal_error, None
            raise OSError(f"a checkpoint save in {self.directory} failed: {_short(e)}") from e
        self._retain()

    def is_sealed(self, step: int) -> bool:
        return (self.step_dir(step) / INTEGRITY_FILE).is_file()

    def _retain(self) -> None:
        """Deletes steps that have `max_to_keep` newer sealed (integrity-recorded) steps; process 0 decides."""
        steps = sorted(self.all_steps())
        if not self.max_to_keep or not steps:
            return
        doomed = np.zeros(len(steps), np.int32)  # every process lists the same steps (saves are collective)
        if jax.process_index() == 0:
            sealed = [s for s in steps if self.is_sealed(s)]
            doomed[:] = [sum(1 for t in sealed if t > s) >= self.max_to_keep for s in steps]
        for s, gone in zip(steps, _agree(doomed)):
            if gone:
                self._manager.delete(s)

    def verify(self, step: int) -> None:
        """Checks the files of `step` against its integrity record (process 0 reads them; every process gets the
        verdict). Raises CorruptCheckpointError. A step saved before integrity records existed passes (logged)."""
        problem = ""
        if jax.process_index() == 0:
            problem = self._check_files(step)
        if _agree(int(bool(problem))):
            raise CorruptCheckpointError(self.directory, step, *(problem.split("|", 1) if problem else
                                                                 ("files", "failed the check on process 0")))

    def _check_files(self, step: int) -> str:
        """'' if the files match the record, else 'file|reason'."""
        step_dir = self.step_dir(step)
        record_file = step_dir / INTEGRITY_FILE
        if not record_file.is_file():
            log.warning("checkpoint step %d in %s has no %s (saved before integrity records, or the save did not "
                        "finish hashing): restored unverified", step, self.directory, INTEGRITY_FILE)
            return ""
        try:
            files = json.loads(record_file.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{INTEGRITY_FILE}|unreadable ({_short(e)})"
        for rel, (size, crc) in files.items():
            path = step_dir / rel
            if not path.is_file():
                return f"{rel}|missing"
            actual = path.stat().st_size
            if actual != size:
                return f"{rel}|{actual} bytes, {size} when saved (truncated or replaced)"
            if _crc32(path) != crc:
                return f"{rel}|checksum mismatch (contents changed since the save)"
        return ""

    def quarantine(self, step: int) -> Path:
        """Moves a damaged step aside (`<step>.damaged-<time>`, never deleted: nothing is lost) so that the run can
        save that step again; every process must call this."""
        dest = self.directory / f"{step}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        self._finish_sealing_only()
        if jax.process_index() == 0:
            os.rename(self.step_dir(step), dest)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint_quarantine_{step}")
        self._manager.reload()
        return dest

    def _finish_sealing_only(self) -> None:
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None

    def read_meta(self, step: int | None = None) -> dict:
        step = self._resolve(step)
        return self._restore(step, meta=ocp.args.JsonRestore())["meta"]

    def restore(self, step: int | None = None, *, config: Config | None = None, mesh: Mesh | None = None,
                opt_state_target: Any = None, params_target: Any = None) -> tuple[dict, Any, dict]:
        """Restores (params pure dict, opt_state or None, meta) of `step` onto `mesh`, after checking its files.

        `step=None` takes the newest intact step (a damaged newer one is logged and skipped, not moved). A damaged
        `step` (files, or non-finite params) raises CorruptCheckpointError. `config` defaults to the one stored in
        the checkpoint (its runtime fields, e.g. param_dtype, may be overridden by passing a config).
        `opt_state_target` is an abstract tree (ShapeDtypeStruct with shardings); None skips the optimizer state.
        `params_target` replaces the model's abstract params for trees that are not a CausalLM's (e.g. the critic's
        value model).
        """
        if step is None:
            return self.restore_newest_intact(
                lambda s: self.restore(s, config=config, mesh=mesh, opt_state_target=opt_state_target,
                                       params_target=params_target), move_damaged=False)[1]
        step = self._resolve(step)
        self.verify(step)
        meta = self.read_meta(step)
        config = config or config_from_json(meta["model_config"])
        if params_target is None:
            params_target = abstract_params(config, mesh)
        per_layer = saved_per_layer(self.step_dir(step))  # an old checkpoint: restore per layer, then stack
        adapt = _per_layer_target if per_layer else (lambda t: t)
        items = {"params": ocp.args.StandardRestore(adapt(params_target))}
        if opt_state_target is not None:
            items["opt_state"] = ocp.args.StandardRestore(adapt(opt_state_target))
        try:
            out = dict(self._restore(step, **items))
        except CorruptCheckpointError as e:  # files verified against their record: not damage, another tree
            if not self.is_sealed(step):
                raise
            raise CheckpointMismatchError(self.directory, step, e.reason) from e.__cause__
        if per_layer:
            out["params"] = _stack_layers(out["params"], params_target)
            if opt_state_target is not None:
                out["opt_state"] = _stack_layers(out["opt_state"], opt_state_target)
        bad = _first_non_finite(out["params"])
        if bad is not None:
            raise CorruptCheckpointError(self.directory, step, f"params/{bad}", "holds NaN or infinite values")
        return out["params"], out.get("opt_state"), meta

    def restore_state(self, step: int, target: Any) -> RestoredState:
        """The training state that `save_state` saved at `step`, restored into `target`'s shapes, dtypes and shardings
        (`jit.abstract_train_state`), after the checks of `restore`.

        SFT checkpoints written before `save_state` existed store no `counters`: their skip count is
        `skipped_updates` and their update count the step (SFT makes one update per step).
        """
        params, opt_state, meta = self.restore(step, params_target=target.params, opt_state_target=target.opt_state)
        counters = meta.get("counters") or {"updates": meta["step"], "skipped": meta.get("skipped_updates", 0)}
        state = target._replace(params=params, opt_state=opt_state, step=_counter(counters["updates"], target.step),
                                skipped=_counter(counters["skipped"], target.skipped))
        position = meta.get("data_position")
        return RestoredState(state, None if position is None else DataPosition.from_dict(position), meta)

    def restore_newest_intact(self, restore: Callable[[int], Any], *, steps: Sequence[int] | None = None,
                              move_damaged: bool = True, also: Sequence[Checkpointer] = ()) -> tuple[int, Any]:
        """(step, restore(step)) for the newest of `steps` (default: all) whose restore raises no
        CorruptCheckpointError. Each damaged step is logged in one line and, with `move_damaged` (a run that will
        save again), moved aside here and in the checkpointers `also` (e.g. the critic's, saved in step with this
        one). Raises FileNotFoundError when there is no step, ValueError when none is intact."""
        candidates = sorted(self.all_steps() if steps is None else steps, reverse=True)
        if not candidates:
            raise FileNotFoundError(f"{self.directory}: no checkpoint found")
        damaged, first = [], None
        for step in candidates:
            try:
                return step, restore(step)
            except CorruptCheckpointError as e:
                first = first or e
                damaged.append(step)
                moved = ""
                if move_damaged:
                    for ckpt in (self, *also):
                        if step in ckpt.all_steps():
                            moved = f"; moved to {ckpt.quarantine(step).name}"
                log.warning("%s%s; falling back to an older step", e, moved)
        raise ValueError(f"{first} (no older intact step in {self.directory}; damaged: {damaged})")

    def restore_model(self, step: int | None = None, *, mesh: Mesh | None = None, **runtime) -> models.CausalLM:
        """A CausalLM from a checkpoint's params and stored config (runtime fields overridable); `step=None` takes
        the newest intact step."""
        if step is None:
            return self.restore_newest_intact(lambda s: self.restore_model(s, mesh=mesh, **runtime),
                                              move_damaged=False)[1]
        step = self._resolve(step)
        meta = self.read_meta(step)
        config = config_from_json(meta["model_config"]).replace(**runtime)
        if "lora_base" in meta:  # a LoRA RL checkpoint: the adapters here, the base where its pointer says
            return _restore_lora_model(self, step, meta, config, mesh)
        params, _, _ = self.restore(step, config=config, mesh=mesh)
        graphdef, state = nnx.split(models.abstract_model(config))
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def wait(self) -> None:
        """Waits for the pending save, its integrity record and retention; raises if the save failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._finish_sealing_only()
            self._seal_error = None
            raise OSError(f"a checkpoint save in {self.directory} failed: {_short(e)}") from e
        self._finish()

    def raise_if_failed(self) -> None:
        """Raises (one line) if the pending background save has already failed, e.g. on a full disk: called at each
        step boundary so that a failed save stops the run at once instead of at the next save."""
        if self._sealing is not None and not self._sealing.is_alive() and self._seal_error is not None:
            self._finish()

    def close(self) -> None:
        try:
            self._finish_sealing_only()
        finally:
            self._manager.close()

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"{self.directory}: no checkpoint found")
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"{self.directory}: no checkpoint for step {step}; available: {sorted(steps)}")
        return step

    def _restore(self, step: int, **items):
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax/tensorstore errors do not say which checkpoint failed, in dozens of lines
            raise CorruptCheckpointError(self.directory, step, f"items {sorted(items)}",
                                         f"could not be restored ({_short(e)})") from e

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.wait()
        finally:
            self.close()


def _pure(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def _load_lora_base(pointer: dict, cfg, mesh: Mesh | None = None) -> models.CausalLM:
    """The base model a pointer names (`base_pointer`), loaded in `cfg`'s dtypes; checked against its hash by
    `_restore_lora_model` (a trainer resuming checks it in `lora_io.with_base`)."""
    from arpo_jax.models import lora
    from arpo_jax.weights import pretrained

    opts = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "sharding_rules": cfg.sharding_rules}
    if pointer["init_checkpoint"]:
        with Checkpointer(pointer["init_checkpoint"], async_save=False, create=False) as ckpt:
            model = ckpt.restore_model(ckpt.latest_step(), mesh=mesh, **opts)
        return lora.base_model(model) if model.config.lora_rank else model
    return pretrained.from_pretrained(pointer["folder"], mesh=mesh, **opts)


def _restore_lora_model(ckpt: Checkpointer, step: int, meta: dict, config, mesh: Mesh | None = None
                        ) -> models.CausalLM:
    """A LoRA RL checkpoint (`Checkpointer.restore_model` calls this for one with a base pointer) as a model: its
    adapters over the base its pointer names, loaded and checked against the hash."""
    from arpo_jax.models import lora
    from arpo_jax.weights import lora_io

    pointer = meta[lora_io.BASE_POINTER]
    base = _load_lora_base(pointer, config, mesh)
    adapters, _, _ = ckpt.restore(step, config=config, mesh=mesh,
                                  params_target=lora_io.adapters_only(abstract_params(config, mesh), config))
    base_params = nnx.to_pure_dict(nnx.state(base, nnx.Param))
    got = lora_io.base_fingerprint(base_params, lora.base_config(config))
    if got != pointer["hash"]:
        where = pointer["init_checkpoint"] or pointer["folder"]
        raise ValueError(f"{ckpt.directory} step {step}: its LoRA base ({where}) has hash {pointer['hash']}, the "
                         f"weights there now {got}: the base changed since the checkpoint was written")
    graphdef, state = nnx.split(models.abstract_model(config))
    flat = traverse_util.flatten_dict(adapters) | traverse_util.flatten_dict(base_params)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    return nnx.merge(graphdef, state)
