"""Observability for the RL and SFT loops: metrics.jsonl, TensorBoard, optional W&B, console lines, phase timers, bars.

One ``MetricsLogger`` per run writes every step's scalar metrics to each selected sink:
  * ``jsonl``: ``<workdir>/metrics.jsonl``, one ``{"step", "time", **metrics}`` object per line, flushed at
    every call (a killed run loses nothing); non-finite floats are written as ``null`` (strict JSON).
  * ``tensorboard``: scalars through tensorboardX into ``<workdir>/tensorboard`` (no TensorFlow needed).
  * ``wandb``: Weights & Biases (optional extra ``arpo-jax[wandb]``); the run id lives in ``<workdir>/wandb_id``
    so a resumed training run continues the same W&B run.
  * ``console``: one compact line of the important keys per step, through ``tqdm.write`` so progress bars
    are not torn.

Resume (``resume_step=k``, the step of the checkpoint a killed run restarts from): steps after ``k`` are logged
again, so lines with ``step > k`` are dropped from every jsonl file written here and TensorBoard is told to
purge them (``purge_step=k + 1``); curves never hold two values for one step.

Multi-host: only process 0 logs; pass ``enabled=False`` elsewhere and every call is a no-op that writes nothing.
This module imports no JAX: jax/numpy scalars are converted through their ``item()``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm

from arpo_jax.config import redaction
from arpo_jax.paths import local_path

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# Shown on the console, in this order, when present (patterns allowed); everything stays in the files.
CONSOLE_KEYS = ("reward/mean", "val/*", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "critic/vf_loss", "sft/loss", "response/length/mean",
                "tools/calls_per_trajectory/mean", "rollout/branches_per_prompt", "rollout/decode_steps",
                "train/lr", "sft/lr", "perf/tokens_per_s", "sft/tokens_per_s", "time/rollout", "time/step")
CONSOLE_MAX_FALLBACK = 8  # keys shown when none of CONSOLE_KEYS is present
REDACTED = redaction.REDACTED  # what config_lib.redact (the one redaction) puts in place of a secret
WANDB_ID_FILE = "wandb_id"


# --------------------------------------------------------------------------------------------------
# Value conversion
# --------------------------------------------------------------------------------------------------


def to_jsonable(x: Any) -> Any:
    """Plain JSON types for numpy / jax values (recursively); non-finite floats become None."""
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, (str, bool)) or x is None:
        return x
    if hasattr(x, "tolist") and not isinstance(x, (int, float)):  # numpy / jax arrays and scalars
        return to_jsonable(np.asarray(x).tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, int):
        return x
    return str(x)  # paths, enums, dataclass reprs: readable rather than a crash mid-run


def _scalar(x: Any) -> float | int | None:
    """A python number for a metric value; None for values that are not numeric scalars."""
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, (int, float)):
        return x
    try:
        arr = np.asarray(x)
    except Exception:  # noqa: BLE001 - any non-array object is simply not a scalar
        return None
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        return None
    return arr.reshape(()).item()


# --------------------------------------------------------------------------------------------------
# jsonl files
# --------------------------------------------------------------------------------------------------


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> int:
    """Drops lines whose ``step`` is > ``max_step`` (and unreadable lines, e.g. half-written by a kill).

    The file is rewritten to a temporary file and swapped in with ``os.replace``, so a crash here leaves either the
    old or the new file, never a mix. Returns the number of lines dropped.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, (int, float)) and step > max_step:
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All records of a jsonl file (for tests and notebooks). A live run's file may end in a line still being
    written: a last line without its newline that does not parse yet is left out."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(line) for line in lines]


# --------------------------------------------------------------------------------------------------
# The logger
# --------------------------------------------------------------------------------------------------


class MetricsLogger:
    """Writes step metrics to console / metrics.jsonl / TensorBoard / W&B (module docstring); a context manager.

    Args:
      workdir: run directory; created if missing.
      loggers: subset of ``LOGGERS`` (``trainer.loggers``).
      config: the run's config as a plain dict, given to W&B (redacted again here).
      project: W&B project; experiment: W&B run name ("" = the workdir's name).
      resume_step: the checkpoint step a resumed run restarts from; later logged steps are dropped.
      enabled: False on non-zero processes of a multi-host run: nothing is written anywhere.
    """

    def __init__(self, workdir: str | os.PathLike, *, loggers: Iterable[str] = ("console", "jsonl", "tensorboard"),
                 config: dict | None = None, project: str = "arpo-jax", experiment: str = "",
                 resume_step: int | None = None, enabled: bool = True):
        loggers = tuple(loggers)
        unknown = [name for name in loggers if name not in LOGGERS]
        if unknown:
            raise ValueError(f"trainer.loggers: unknown logger(s) {unknown}; allowed: {LOGGERS}")
        self.workdir = local_path(workdir)
        self.loggers = loggers
        self.enabled = enabled
        self.resume_step = resume_step
        self._files: dict[str, Any] = {}  # jsonl name -> open file
        self._tb = self._wandb = None
        if not enabled:
            return
        if "wandb" in loggers:
            wandb = _import_wandb()  # fail before any file is created
        self.workdir.mkdir(parents=True, exist_ok=True)
        if "tensorboard" in loggers:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard hides events at steps >= k + 1 written before the restart.
            purge = None if resume_step is None else resume_step + 1
            # The suffix keeps two writers started in the same second (a quick restart) from sharing a file name:
            # tensorboardX opens with "wb" and would erase the first; nanoseconds also keep name order = time order.
            self._tb = SummaryWriter(str(self.workdir / "tensorboard"), purge_step=purge, flush_secs=30,
                                     filename_suffix=f".{time.time_ns()}")
        if "wandb" in loggers:
            self._wandb = _init_wandb(wandb, self.workdir, project, experiment or self.workdir.resolve().name,
                                      redaction.redact(to_jsonable(config or {})))

    # ---------------------------------------------------------------- writing

    def _jsonl(self, name: str):
        """The open jsonl file ``<workdir>/<name>.jsonl``; on first use after a resume, later steps are dropped."""
        f = self._files.get(name)
        if f is None:
            path = self.workdir / f"{name}.jsonl"
            if self.resume_step is not None:
                truncate_jsonl(path, self.resume_step)
            f = self._files[name] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        return f

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs one step's scalar metrics to every sink (non-scalar values are skipped, except in jsonl)."""
        if not self.enabled:
            return
        step = int(step)
        scalars = {k: _scalar(v) for k, v in metrics.items()}
        if "jsonl" in self.loggers:
            rec = {"step": step, "time": time.time(), **to_jsonable(dict(metrics))}
            f = self._jsonl("metrics")
            f.write(json.dumps(rec, allow_nan=False) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in scalars.items():
                if v is not None:
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in scalars.items() if v is not None}, step=step)
        if "console" in self.loggers:
            tqdm.tqdm.write(console_line(step, scalars))

    def log_jsonl(self, name: str, records: Iterable[Mapping[str, Any]]) -> None:
        """Appends records (e.g. trajectories, with a ``step`` field so resume can trim them) to ``<name>.jsonl``."""
        if not self.enabled:
            return
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"log_jsonl: name {name!r} must be a plain file stem")
        f = self._jsonl(name)
        for rec in records:
            f.write(json.dumps(to_jsonable(dict(rec)), allow_nan=False) + "\n")
        f.flush()

    def write_config(self, cfg: Mapping[str, Any]) -> None:
        """Writes ``<workdir>/config.json`` (secret-looking values redacted once more, defensively)."""
        if not self.enabled:
            return
        path = self.workdir / "config.json"
        tmp = path.with_name(f"config.json.tmp{os.getpid()}")
        text = json.dumps(redaction.redact(to_jsonable(dict(cfg))), indent=2, sort_keys=True) + "\n"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def console_line(step: int, scalars: Mapping[str, float | int | None]) -> str:
    """``step 12 | reward/mean 0.4531 | ... | time/step 12.3``: CONSOLE_KEYS in order, else the first few keys."""
    keys = [k for pat in CONSOLE_KEYS for k in sorted(fnmatch.filter(scalars, pat)) if scalars[k] is not None]
    keys = list(dict.fromkeys(keys))  # a key matched by two patterns is shown once
    if not keys:
        keys = [k for k, v in scalars.items() if v is not None][:CONSOLE_MAX_FALLBACK]
    parts = [f"step {step}"] + [f"{k} {_fmt(scalars[k])}" for k in keys]
    return " | ".join(parts)


def _fmt(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.4g}"


# --------------------------------------------------------------------------------------------------
# W&B (optional)
# --------------------------------------------------------------------------------------------------


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise ValueError("trainer.loggers includes 'wandb' but wandb is not installed: "
                         "pip install arpo-jax[wandb] (or drop 'wandb' from trainer.loggers)") from e
    return wandb


def _init_wandb(wandb, workdir: Path, project: str, name: str, config: dict):
    """``wandb.init`` with a run id kept in ``<workdir>/wandb_id``: a resumed run continues the same W&B run."""
    id_file = workdir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text(encoding="utf-8").strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        id_file.write_text(run_id + "\n", encoding="utf-8")
    return wandb.init(project=project, name=name, config=config, dir=str(workdir), id=run_id, resume="allow")


# --------------------------------------------------------------------------------------------------
# Summaries, timers, progress bars
# --------------------------------------------------------------------------------------------------


class PhaseTimer:
    """Seconds per named phase, accumulated across ``with timers("rollout"): ...`` blocks until ``reset()``.

    ``scope``: a context manager factory entered with each phase's name around its block (the trainer passes
    ``compile_log.phase``, so the programs a phase compiles are counted under its name)."""

    def __init__(self, scope=None):
        self.seconds: dict[str, float] = {}
        self.scope = scope

    def __call__(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def as_metrics(self, prefix: str = "time/") -> dict[str, float]:
        return {prefix + k: v for k, v in self.seconds.items()}

    def reset(self) -> None:
        """Call once per step, after the step's metrics were taken."""
        self.seconds = {}


class _Phase:
    def __init__(self, timers: PhaseTimer, phase: str):
        self.timers, self.phase = timers, phase

    def __enter__(self) -> _Phase:
        self._scope = self.timers.scope(self.phase) if self.timers.scope else None
        if self._scope is not None:
            self._scope.__enter__()
        # A profiler trace shows the phase as `phase/<name>` (benchmarks/trace_summary.py splits the device's busy
        # time by it); ~1 us when no trace is recording.
        self._annotation = jax.profiler.TraceAnnotation(f"phase/{self.phase}")
        self._annotation.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        # Counted even when the block raises: a failing phase still cost its time.
        self.timers.add(self.phase, time.perf_counter() - self._start)
        self._annotation.__exit__(*exc)
        if self._scope is not None:
            self._scope.__exit__(*exc)
        return False


class _NoBar:
    """Stands in for a tqdm bar where progress is off (non-zero processes, ``trainer.progress=False``)."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc) -> bool:
        return False


def progress(total: int | None, desc: str = "", *, enabled: bool = True, unit: str = "step", initial: int = 0):
    """A tqdm bar (tqdm also behaves on non-TTY output such as SLURM logs), or a no-op bar when disabled."""
    if not enabled:
        bar = _NoBar()
        bar.n = initial
        return bar
    return tqdm.tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)
