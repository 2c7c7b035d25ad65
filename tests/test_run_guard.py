"""One run per work directory, config drift on resume, and the signal handler (run_guard), with real processes.

The full SIGTERM / SIGINT path of `arpo-jax train` (stop, save, resume, same params) is in test_trainer.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arpo_jax import cli, paths
from arpo_jax.assemble import validate as config_lib
from arpo_jax.config import args, redaction
from arpo_jax.train import run_guard

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")

# Takes the lock of argv[1]; argv[2], if given, is written as the holder's host (a run of another node).
HOLD_LOCK = """
import json, os, sys, time
from arpo_jax.train.run_guard import RunLock
lock = RunLock(sys.argv[1], "train").acquire()
if len(sys.argv) > 2:
    record = json.loads(os.pread(lock._fd, 4096, 0)) | {"host": sys.argv[2]}
    os.ftruncate(lock._fd, 0)
    os.pwrite(lock._fd, json.dumps(record).encode(), 0)
print("locked", flush=True)
time.sleep(600)
"""
NO_LOCKS = str(REPO / "tests" / "no_locks.py")  # runs a command as on a file system that refuses locks


def _holder(workdir: Path, *host: str, wrapper: tuple[str, ...] = ()) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, *wrapper, "-c", HOLD_LOCK, str(workdir), *host], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(tmp_path, capsys, caplog):
    workdir = tmp_path / "run"
    workdir.mkdir()
    holder = _holder(workdir)
    try:
        code = cli.main(["train", f"--config={TOY}", f"--workdir={workdir}"])
        err = capsys.readouterr().err
        assert code == 2
        assert f"in use by train pid {holder.pid} on {socket.gethostname()}" in err and "one run per" in err
        assert not (workdir / "checkpoints").exists() and not (workdir / "config.json").exists()
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; the kernel drops its lock
        holder.wait()
    with caplog.at_level("INFO", logger="arpo_jax.train.run_guard"), run_guard.RunLock(workdir, "sft"):
        record = json.loads((workdir / run_guard.LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["command"] == "sft"
    assert any(f"pid {holder.pid}" in r.getMessage() and "no longer running" in r.getMessage()
               for r in caplog.records)


def test_a_lock_of_another_host_says_it_may_be_a_dead_node_and_a_requeued_job_waits_for_it(tmp_path, monkeypatch):
    """A lock whose holder is recorded on another host: that host may have crashed with its lock still on the file
    server (Lustre keeps it until it evicts the client), so the message says what to do then; a requeued job
    (SLURM_RESTART_COUNT > 0) waits for such a lock to go before refusing."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    holder = _holder(workdir, "node-17")
    try:
        with pytest.raises(ValueError) as refused:
            run_guard.RunLock(workdir, "train").acquire()
        msg = str(refused.value)
        assert f"locked by train pid {holder.pid} on node-17, started" in msg and "(another host)" in msg
        assert "If that host crashed" in msg
        assert f"delete {workdir / run_guard.LOCK_FILE}" in msg and "still after" not in msg
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        monkeypatch.setattr(run_guard, "_RETRY_S", 0.1)
        monkeypatch.setattr(run_guard, "REQUEUE_WAIT_S", 1.0)
        with pytest.raises(ValueError, match="another host.*still after 1 s"):
            run_guard.RunLock(workdir, "train").acquire()
        monkeypatch.setattr(run_guard, "REQUEUE_WAIT_S", 60.0)
        threading.Timer(1.0, holder.kill).start()  # the dead node's client is evicted: its lock goes
        t0 = time.monotonic()
        with run_guard.RunLock(workdir, "train"):
            assert time.monotonic() - t0 >= 0.9
    finally:
        holder.kill()
        holder.wait()


def test_a_file_system_without_locks_warns_and_runs_unless_a_live_run_is_recorded(tmp_path):
    """On a file system that refuses POSIX locks (ENOLCK, planted with a seccomp filter: tests/no_locks.py) the run
    is not refused as "in use": it warns that one run per work directory is not enforced, names the fix, and
    runs; the record of a live run of this host still refuses a second one."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    env = os.environ | {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    take = ("import logging, sys; logging.basicConfig(); from arpo_jax.train.run_guard import RunLock\n"
            "with RunLock(sys.argv[1], 'sft'): print('running')")
    proc = subprocess.run([sys.executable, NO_LOCKS, "-c", take, str(workdir)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "running", proc.stderr[-2000:]
    assert "the file system refuses POSIX locks (ENOLCK)" in proc.stderr and "mount with -o flock" in proc.stderr
    assert "in use by" not in proc.stderr
    holder = _holder(workdir, wrapper=(NO_LOCKS,))
    try:
        proc = subprocess.run([sys.executable, NO_LOCKS, "-c", take, str(workdir)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0 and f"in use by train pid {holder.pid} on {socket.gethostname()}" in proc.stderr
    finally:
        holder.kill()
        holder.wait()


def _toy_config(*overrides: str) -> dict:
    cfg = args.load_config([f"--config={TOY}", *overrides])
    return redaction.redact(config_lib.validate(cfg, check_files=False))


def test_resuming_with_another_meaning_is_refused_and_every_config_is_kept(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    first = _toy_config()
    record = lambda cfg, **kw: run_guard.record_config(workdir, cfg, **({"command": "train", "resuming": True,
                                                                          "allow_change": False} | kw))
    assert record(first, resuming=False).name == "config.json"
    (workdir / "checkpoints" / "2").mkdir(parents=True)  # a step to resume from
    original = (workdir / "config.json").read_text()

    # Through the real command: refused before any model is built, with the list of changes.
    code = cli.main(["train", f"--config={TOY}", f"--workdir={workdir}", "--config.data.train_batch_size=8",
                     "--config.actor.lr=0.5", "--config.trainer.save_freq=7"])
    err = capsys.readouterr().err
    assert code == 2
    assert "data.train_batch_size: 4 -> 8" in err and "actor.lr:" in err and "-> 0.5" in err
    assert "save_freq" not in err and "allow_config_change=true" in err  # a harmless change is not listed
    assert (workdir / "config.json").read_text() == original and not (workdir / "config-2.json").exists()

    # A harmless change is recorded as the next config; config.json is never overwritten.
    path = record(_toy_config("--config.trainer.save_freq=7"))
    assert path.name == "config-2.json" and (workdir / "config.json").read_text() == original
    # The same config again writes nothing; an allowed change of meaning is recorded (config-3.json).
    assert record(_toy_config("--config.trainer.save_freq=7")) is None
    changed = _toy_config("--config.trainer.save_freq=7", "--config.seed=5")
    with pytest.raises(ValueError, match=r"seed: 0 -> 5"):
        record(changed)
    assert record(changed, allow_change=True).name == "config-3.json"
    assert [p.name for p in run_guard.config_files(workdir)] == ["config.json", "config-2.json", "config-3.json"]
    # What changes a run's meaning depends on the command: the RL loss is not part of an SFT run.
    rl_change = _toy_config("--config.trainer.save_freq=7", "--config.seed=5", "--config.actor.loss=aepo")
    with pytest.raises(ValueError, match=r"actor.loss: 'ppo' -> 'aepo'"):
        record(rl_change)
    assert record(rl_change, command="sft").name == "config-4.json"
    with pytest.raises(ValueError, match=r"sft.lr: "):
        record(_toy_config("--config.trainer.save_freq=7", "--config.seed=5", "--config.sft.lr=0.5"), command="sft")
    # LoRA changes what a checkpoint holds (adapters and a pointer to the base): either command's meaning.
    for command in ("train", "sft"):
        with pytest.raises(ValueError, match=r"model.lora.rank: 0 -> 16"):
            record(_toy_config("--config.trainer.save_freq=7", "--config.seed=5", "--config.model.lora.rank=16"),
                   command=command)


def test_workdir_naming_a_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert cli.main(["train", f"--config={TOY}", f"--workdir={tmp_path / 'f'}"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "x"


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_url_workdir_is_refused_not_made_a_local_folder(tmp_path, capsys, monkeypatch, command):
    """`gs://b/run` used to become `$PWD/gs:/b/run` on every host (checkpoints on local disks, lost with the VMs)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, f"--config={TOY}", "--workdir=gs://bucket/runs/x"]) == 2
    err = capsys.readouterr().err
    assert "'gs://bucket/runs/x' is a URL" in err and "gcsfuse" in err and "shared file system" in err
    assert list(tmp_path.iterdir()) == []  # no ./gs: folder
    from arpo_jax.train.metrics import MetricsLogger
    from arpo_jax.weights.checkpoint import Checkpointer

    for make in (Checkpointer, MetricsLogger):  # the init checkpoint and the loggers refuse it too
        with pytest.raises(ValueError, match="is a URL"):
            make("s3://bucket/x")
    assert paths.local_path("rel/dir") == tmp_path / "rel" / "dir"


SIGNALLED = """
import time
from arpo_jax.train.run_guard import StopSignals
with StopSignals("train") as stop:
    print("ready", flush=True)
    while stop.signum is None:
        time.sleep(0.01)
    print("asked to stop", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_asks_to_stop_second_exits_at_once(sig):
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    assert proc.stdout.readline().strip() == "asked to stop"  # the first one did not kill it
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    name = signal.Signals(sig).name
    assert err.splitlines() == [f"arpo-jax train: {name} received: stopping after the current step with a "
                                "checkpoint (send it again to exit at once)",
                                f"arpo-jax train: second {name}: exiting now, without a checkpoint"]
