"""What keeps a run's work directory consistent, shared by `arpo-jax train` and `arpo-jax sft`.

- `RunLock`: one run per work directory. A POSIX lock on `<workdir>/run.lock` (held by process 0; the file records
  host, pid and start time). The kernel drops the lock when its process dies, so the lock of a killed run is taken
  over by the next one; a live holder makes a second run refuse with a message naming it. Three refusals differ
  (`lock_file`): held by a run of this host; held by a run of another host (alive, or a crashed node whose lock the
  file server keeps until it evicts that client: a requeued SLURM job waits `REQUEUE_WAIT_S` for it); and a file
  system that does not lock at all (Lustre mounted without `flock`, NFS without lockd): then a warning, and the run
  goes on unlocked.
- `record_config`: the config of every start is kept. `config.json` is the run's first config and is never
  overwritten; a later start whose config differs writes `config-<n>.json` (n = 2, 3, ...). On resume, the fields
  that change what the run means (`MEANING_FIELDS`) are compared with the newest recorded config: a difference
  refuses with the list of changes unless `trainer.allow_config_change=true`.
- `StopSignals`: SIGTERM / SIGINT ask the loop to stop at the next step boundary (the loop saves a checkpoint,
  flushes metrics and raises `Stopped`: exit status 128 + signal, i.e. 143 / 130); a second signal exits at once.
  In a multi-host run the processes agree at every step boundary (any process signalled: all stop).
- `paths.local_path` (a leaf module): the work directory and checkpoint folders are POSIX paths; a URL (`gs://...`)
  is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


# Per command, the leaves (or whole sections, ending in ".") whose change makes a resumed run another experiment.
# The RL fields do not change an SFT run (the demo passes one config with its algorithm's fields to both).
_SHARED = ("seed", "model.path", "model.init_checkpoint", "model.lora.", "data.shuffle", "data.seed")
MEANING_FIELDS = {
    "train": _SHARED + ("data.train_files", "data.train_batch_size", "data.prompt_key", "data.max_prompt_length",
                        "data.max_response_length", "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.lr",
                        "actor.loss", "actor.schedule", "actor.warmup_steps", "critic.lr", "rollout.n", "algorithm.",
                        "reward.name", "reward.custom_path"),
    "sft": _SHARED + ("sft.train_files", "sft.batch_size", "sft.lr", "sft.epochs", "sft.schedule", "sft.cutoff_len",
                      "sft.warmup_ratio", "sft.mask_tool_results"),
}


class Stopped(Exception):
    """The run stopped on a signal after saving; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int, message: str):
        self.signum, self.exit_code = signum, 128 + signum
        super().__init__(message)


def agree_any(flag: bool) -> bool:
    """True on every process when `flag` is true on any (a collective: every process calls it at the same point)."""
    import jax

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.asarray(int(flag), np.int32))))


# ------------------------------------------------------------------------------------------------------------------
# One run per work directory
# ------------------------------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The errors of a lock request that another holder refuses; any other (ENOLCK, ENOSYS, EOPNOTSUPP, EINVAL...) is the
# file system refusing locks altogether.
_HELD = (errno.EAGAIN, errno.EACCES)
REQUEUE_WAIT_S = 300.0  # a requeued job (SLURM_RESTART_COUNT > 0) waits this long for another host's lock to go
_RETRY_S = 10.0


def lock_file(fd: int) -> str:
    """Tries the run lock (exclusive, non-blocking) on `fd`: "" (taken), "held" (another process holds it), or the
    name of the error with which the file system refuses locks ("ENOLCK", ...)."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # POSIX locks also hold across NFS clients
    except OSError as e:
        return "held" if e.errno in _HELD else errno.errorcode.get(e.errno, str(e.errno))
    return ""


def held_message(path: Path, holder: dict, waited: float = 0.0) -> str:
    """Why a locked work directory refuses this run, and what to do; a holder on another host may be a dead node."""
    if not holder:
        return (f"{path.parent} is in use by another process: one run per work directory; wait for it to end, stop "
                "it, or pick another --workdir")
    who = (f"{holder.get('command', 'a run')} pid {holder.get('pid')} on {holder.get('host')}, started "
           f"{holder.get('started')}")
    if holder.get("host") == socket.gethostname():
        return (f"{path.parent} is in use by {who}: one run per work directory; wait for it to end, stop it, or pick "
                "another --workdir")
    return (f"{path.parent} is locked by {who} (another host){f', still after {waited:.0f} s' if waited else ''}. If "
            "that run is alive: wait for it, stop it (scancel), or pick another --workdir. If that host crashed, the "
            "file server keeps its lock until it evicts that client (Lustre: minutes): start again later (a requeued "
            f"job, SLURM_RESTART_COUNT > 0, waits {REQUEUE_WAIT_S:.0f} s by itself), or, sure that no run uses the "
            f"folder, delete {path} (a new file has no lock)")


def unsupported_message(path: Path, error: str) -> str:
    return (f"{path}: the file system refuses POSIX locks ({error}), so one run per work directory is not enforced: "
            "make sure no other run uses this --workdir. To have the lock: Lustre, mount with -o flock; NFS, run lockd "
            "(rpc.statd); or pick a --workdir on a file system that locks")


def _requeued() -> bool:
    return os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")


class RunLock:
    """`with RunLock(workdir, command):` holds the work directory's lock (process 0 only; the others wait for its
    verdict, so every process of a refused run raises)."""

    def __init__(self, workdir: str | os.PathLike, command: str):
        self.path = Path(workdir) / LOCK_FILE
        self.command = command
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import jax

        problem = ""
        if jax.process_index() == 0:
            problem = self._try_lock()
        if agree_any(bool(problem)):
            raise ValueError(problem or f"{self.path}: the work directory is locked by another run (see process 0)")
        return self

    def _try_lock(self) -> str:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        while (refused := lock_file(fd)) == "held":
            holder = _read_holder(fd)
            waited = time.monotonic() - t0
            if not (_requeued() and holder.get("host") not in (None, socket.gethostname())):
                os.close(fd)
                return held_message(self.path, holder)
            if waited >= REQUEUE_WAIT_S:
                os.close(fd)
                return held_message(self.path, holder, waited)
            log.warning("%s: locked by pid %s on %s; this job was requeued: waiting for a crashed node's lock to go "
                        "(%.0f of %.0f s)", self.path, holder.get("pid"), holder.get("host"), waited, REQUEUE_WAIT_S)
            time.sleep(_RETRY_S)
        old = _read_holder(fd)
        if refused:  # no lock: the record of a live run of this host is all there is to go by
            pid = int(old.get("pid") or 0)
            if old.get("host") == socket.gethostname() and pid not in (0, os.getpid()) and _pid_alive(pid):
                os.close(fd)
                return held_message(self.path, old)
            log.warning("%s", unsupported_message(self.path, refused))
        elif old and old.get("pid"):
            same_host = old.get("host") == socket.gethostname()
            state = "no longer running" if same_host and not _pid_alive(int(old["pid"])) else "lock released"
            log.info("taking over %s from pid %s on %s (%s)", self.path, old.get("pid"), old.get("host"), state)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return ""

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # an empty file: nobody holds it
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------------------------------
# Config history and drift
# ------------------------------------------------------------------------------------------------------------------


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def config_files(workdir: str | os.PathLike) -> list[Path]:
    """The run's recorded configs, oldest first: config.json, config-2.json, config-3.json, ..."""
    workdir = Path(workdir)
    later = sorted((p for p in workdir.glob("config-*.json") if p.stem[7:].isdigit()), key=lambda p: int(p.stem[7:]))
    first = workdir / "config.json"
    return ([first] if first.is_file() else []) + later


def meaning_changes(old: dict, new: dict, command: str) -> list[str]:
    """`field: old -> new` for every `MEANING_FIELDS[command]` leaf that differs between two config dicts."""
    a, b = _flat(old), _flat(new)
    fields = MEANING_FIELDS[command]
    keys = sorted(k for k in set(a) | set(b) if any(k == f or (f.endswith(".") and k.startswith(f)) for f in fields))
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys if a.get(k) != b.get(k)]


def record_config(workdir: str | os.PathLike, config: dict, *, command: str, resuming: bool, allow_change: bool,
                  write: bool = True) -> Path | None:
    """Checks a resumed run's config against the newest recorded one, then records `config` (a JSON-able dict,
    redacted) if it differs from it. Returns the file written, if any; `write=False` (processes other than 0)
    only checks. Raises ValueError listing the changes of meaning when resuming without `allow_change`."""
    config = json.loads(json.dumps(config, default=str))
    history = config_files(workdir)
    newest = json.loads(history[-1].read_text()) if history else None
    if resuming and newest is not None:
        changes = meaning_changes(newest, config, command)
        if changes and not allow_change:
            raise ValueError(f"{workdir} holds a run with another config ({history[-1].name}); resuming it would "
                             f"mix two experiments. Changed: {'; '.join(changes)}. Use another --workdir, or "
                             "--config.trainer.allow_config_change=true to continue anyway")
        if changes:
            log.warning("resuming with changed config (trainer.allow_config_change): %s", "; ".join(changes))
    if not write or newest == config:
        return None
    path = Path(workdir) / ("config.json" if not history else f"config-{len(history) + 1}.json")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def has_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and any(p.name.isdigit() and p.is_dir() for p in directory.iterdir())


def open_workdir(workdir: Path, cfg, command: str) -> tuple[RunLock, bool]:
    """Creates / checks the work directory, takes its lock, and checks and records the config (before any model is
    built). Returns (the held lock, whether the run resumes from a checkpoint)."""
    import jax

    from arpo_jax.config import redaction

    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir {workdir} is a file, not a folder: pick a folder for the run")
    workdir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(workdir, command).acquire()
    try:
        resuming = bool(cfg.trainer.resume) and has_checkpoints(workdir / "checkpoints")
        record_config(workdir, redaction.redact(cfg), command=command, resuming=resuming,
                      allow_change=bool(cfg.trainer.allow_config_change), write=jax.process_index() == 0)
    except BaseException:
        lock.release()
        raise
    return lock, resuming


# ------------------------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------------------------


class StopSignals:
    """`with StopSignals(name) as stop:` ... `if stop.requested():` at each step boundary (every process).

    The first SIGTERM / SIGINT prints one line and sets the flag; a second one exits at once (status 128 + signal).
    Outside the main thread (e.g. a test calling the trainer from a worker thread) nothing is installed.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, command: str):
        self.command = command
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # not the main thread
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"arpo-jax {self.command}: second {name}: exiting now, without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"arpo-jax {self.command}: {name} received: stopping after the current step with a checkpoint "
                    f"(send it again to exit at once)\n".encode())

    def requested(self) -> bool:
        """Whether to stop now; the same answer on every process (a collective in a multi-host run)."""
        stop = agree_any(self.signum is not None)
        if stop and self.signum is None:
            self.signum = signal.SIGTERM  # another process was signalled
        return stop

    def stopped(self, message: str) -> Stopped:
        return Stopped(self.signum or signal.SIGTERM, f"arpo-jax {self.command}: stopped by "
                                                       f"{signal.Signals(self.signum or signal.SIGTERM).name}: "
                                                       f"{message}")

