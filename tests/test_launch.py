"""The launch scripts as SLURM and a shell run them, with stand-ins for `scontrol`, `srun` and the training command:
what they run, with which environment, from which folder (nothing is trained)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `srun` records its own arguments, then runs the task's command as SLURM would on the first node.
SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_OUT/srun_args"
while [[ "$1" != bash ]]; do shift; done
SLURM_PROCID=0 SLURM_LOCALID=0 "$@"
"""
# `scontrol`: the submitted script's path (as sbatch keeps it) and the job's hosts.
SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show job") echo "   Command=$FAKE_SCRIPT"; echo "   WorkDir=/elsewhere";;
  "show hostnames") printf 'gpu-node-1\\ngpu-node-2\\n';;
esac
"""
# The virtualenv's python: `-m arpo_jax.cli ...` (the preflight, then the training command) is recorded (the last one
# in task.json, every one's arguments in calls.jsonl), anything else (mem_fraction.py) runs for real.
PYTHON = f"""#!/bin/bash
if [[ "$1" == -m ]]; then
  {sys.executable} -c 'import json, os, sys
json.dump({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}},
          open(os.environ["FAKE_OUT"] + "/task.json", "w"))
open(os.environ["FAKE_OUT"] + "/calls.jsonl", "a").write(json.dumps(sys.argv[1:]) + "\\n")' "$@"
else
  exec {sys.executable} "$@"
fi
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir, venv, out = tmp_path / "bin", tmp_path / "venv", tmp_path / "out"
    for d in (bin_dir, venv / "bin", out):
        d.mkdir(parents=True)
    _stub(bin_dir / "srun", SRUN)
    _stub(bin_dir / "scontrol", SCONTROL)
    _stub(venv / "bin" / "python", PYTHON)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XLA_PYTHON", "NCCL_", "ARPO_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_OUT=str(out), ARPO_VENV=str(venv), HOME=str(tmp_path),
               PYTHONPATH=str(REPO), FAKE_SCRIPT=str(REPO / "launch" / "slurm_gpu.sbatch"))
    return tmp_path, env, out


@pytest.mark.slow  # subprocess runs of the scripts and the plan
def test_sbatch_script_runs_from_anywhere_with_its_cpus_and_planned_memory(fake_slurm):
    """Submitted from another folder and run as SLURM's spooled copy: the script finds its checkout through
    scontrol, runs the venv's python, gives srun --cpus-per-task (SLURM >= 22.05 does not pass it on), and the task
    gets the plan's JAX memory fraction, NVLS off, NCCL's warnings on, the coordinator and its process id, without
    SLURM_LOCALID; srun labels each output line with its task."""
    tmp, env, out = fake_slurm
    spool = tmp / "spool" / "job42"
    spool.mkdir(parents=True)
    shutil.copy(REPO / "launch" / "slurm_gpu.sbatch", spool / "slurm_script")
    env.update(SLURM_JOB_ID="1234567", SLURM_JOB_NODELIST="gpu-node-[1-2]", SLURM_NNODES="2",
               SLURM_CPUS_PER_TASK="64", SLURM_SUBMIT_DIR=str(tmp))
    overrides = ["--config.mesh.shape=(2,8,1)", "--config.mesh.device=h100-80gb"]
    p = subprocess.run(["bash", str(spool / "slurm_script"), "builtin:arpo_qwen25_7b_reasoning", "/shared/runs/7b",
                        *overrides], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    srun = (out / "srun_args").read_text().splitlines()
    # --label: every output line names its node's task (one slurm-*.out for all nodes).
    assert srun[:5] == ["--label", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    task = json.loads((out / "task.json").read_text())
    assert task["argv"] == ["-m", "arpo_jax.cli", "train", "--config=builtin:arpo_qwen25_7b_reasoning",
                            "--workdir=/shared/runs/7b", *overrides]
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls == [["-m", "arpo_jax.cli", "doctor", "--mode=train", *task["argv"][3:]], task["argv"]]  # preflight
    assert task["cwd"] == str(REPO)
    e = task["env"]
    # The plan's 7B update peak, 27.63 GiB per GPU, with 10% headroom, of an H100's 79.6 GiB: 0.3857, up to 0.39.
    assert e["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.39"
    assert e["NCCL_NVLS_ENABLE"] == "0" and e["ARPO_PROCESS_ID"] == "0" and "SLURM_LOCALID" not in e
    # The coordinator's port: above the engines' (< 20000) and below the ephemeral ports (>= 32768).
    assert e["ARPO_COORDINATOR"] == f"gpu-node-1:{20000 + 1234567 % 12000}" and e["ARPO_NUM_PROCESSES"] == "2"
    assert e["NCCL_DEBUG"] == "WARN"
    assert f"repo {REPO}, python {tmp / 'venv' / 'bin' / 'python'}" in p.stdout


@pytest.mark.slow  # subprocess runs of the scripts and the plan
def test_local_script_runs_from_anywhere_and_keeps_a_given_memory_fraction(fake_slurm):
    tmp, env, out = fake_slurm
    env.update(XLA_PYTHON_CLIENT_MEM_FRACTION="0.33", NCCL_NVLS_ENABLE="1", ARPO_COMMAND="sft")
    p = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), "builtin:sft_qwen25_7b", "runs/sft"], cwd=tmp,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    task = json.loads((out / "task.json").read_text())
    assert task["argv"] == ["-m", "arpo_jax.cli", "sft", "--config=builtin:sft_qwen25_7b", "--workdir=runs/sft"]
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls == [["-m", "arpo_jax.cli", "doctor", "--mode=sft", *task["argv"][3:]], task["argv"]]  # preflight
    assert task["cwd"] == str(REPO)
    assert task["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.33" and task["env"]["NCCL_NVLS_ENABLE"] == "1"


@pytest.mark.slow  # subprocess runs of the scripts and the plan
def test_signal_margin_covers_a_step_and_a_save():
    """The lead time SLURM's SIGTERM needs: 1.5 x (the step model's step + the checkpoint at 1 GB/s per node) + 60 s;
    two nodes halve both (half the batch each, each writes its half)."""
    def lead(*overrides):
        p = subprocess.run([sys.executable, str(REPO / "launch" / "signal_margin.py"),
                            "--config=builtin:arpo_qwen25_7b_reasoning", *overrides, "--workdir=ignored"],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return int(p.stdout.strip().splitlines()[-1]), p.stderr

    one, words = lead()
    assert "step ~494 s + save ~91 s on 1 node(s)" in words  # RESULTS.md's 7B step; 7.6B x 12 bytes at 1 GB/s
    assert one == 938  # ceil(1.5 x (494 + 91.3...) + 60)
    two, words = lead("--config.mesh.shape=(2,8,1)")
    assert "save ~46 s on 2 node(s)" in words and two < one
    assert lead("--write-gbps=0.25")[0] > one
    # The script's default lead covers the one-node case.
    sbatch = (REPO / "launch" / "slurm_gpu.sbatch").read_text()
    assert int(sbatch.split("#SBATCH --signal=TERM@")[1].split()[0]) >= one


def test_launch_scripts_parse():
    for script in ("slurm_gpu.sbatch", "local.sh", "tpu_pod.sh"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)


@pytest.mark.slow  # subprocess runs of the scripts and the plan
def test_mem_fraction_prints_the_three_way_split_and_warns_when_it_overflows():
    def run(*overrides, nvls="0"):
        p = subprocess.run([sys.executable, str(REPO / "launch" / "mem_fraction.py"),
                            "--config=builtin:arpo_qwen25_7b_reasoning", "--config.mesh.device=h100-80gb", *overrides],
                           env=dict(os.environ, PYTHONPATH=str(REPO), NCCL_NVLS_ENABLE=nvls), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return float(p.stdout.strip().splitlines()[-1]), p.stderr

    fraction, split = run()
    assert fraction == 0.39  # the 7B update's 27.66 GiB peak / 0.9 / 79.6 GiB = 0.3861, up to a hundredth
    # 4.5 GiB of CUDA contexts and NCCL + 1.015 GiB of the engine's reload transient (Qwen2.5-7B's bf16 embedding)
    assert (f"h100-80gb (79.6 GiB): JAX {fraction} + vLLM 0.5 + 5.515 GiB outside both (CUDA contexts, NCCL) = "
            f"{fraction + 0.5 + 5.515 / 79.6:.2f} of each GPU") in split and "warning" not in split
    _, split = run("--config.rollout.vllm.gpu_memory_utilization=0.56", nvls="1")
    assert "+ 8.515 GiB outside both (CUDA contexts, NCCL, NVLS)" in split and "do not fit one GPU" in split


@pytest.mark.slow  # a subprocess run of the plan
def test_mem_fraction_of_a_split_placement_counts_jax_and_the_engines_on_their_own_gpus():
    """rollout.vllm.placement=split: JAX's fraction of each of its 5 GPUs plus its CUDA context and NCCL buffers,
    and vLLM's 0.9 of each of the engines' 3 GPUs plus the engine's context and reload transient; no three-way sum
    of one GPU. Without a model config to plan from: the whole GPU less the reserves, and a warning that says so
    (it was 1 - gpu_memory_utilization - 0.05 = 0.05, silently: review 2026-11-28 finding 11)."""
    def run(*overrides):
        p = subprocess.run([sys.executable, str(REPO / "launch" / "mem_fraction.py"),
                            f"--config={REPO / 'configs' / 'arpo_qwen3_14b_deepsearch_8x80gb.py'}",
                            "--config.mesh.device=h100-80gb", "--workdir=ignored", *overrides],
                           env=dict(os.environ, PYTHONPATH=str(REPO), NCCL_NVLS_ENABLE="0"), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return float(p.stdout.strip().splitlines()[-1]), p.stderr

    fraction, stderr = run()
    # ceil(67.02 GiB / 0.9 / 79.6 GiB) = 0.94 asked for; at most 1 - 3.75 / 79.6 - 0.02 (the margin): 0.93.
    assert fraction == 0.93
    line = (f"h100-80gb (79.6 GiB), split: JAX 0.93 + 3.75 GiB outside it (CUDA context, NCCL) = "
            f"{0.93 + 3.75 / 79.6:.2f} of each of its 5 GPUs; vLLM 0.9 + 2.199 GiB of each of the engines' 3")
    assert line in stderr and "warning" not in stderr
    fraction, stderr = run("--config.model.path=/nonexistent/my-sft-14b")
    assert fraction == round(1 - 3.75 / 79.6 - 0.05, 2) == 0.9
    assert "mem_fraction.py: warning: no plan (model.path='/nonexistent/my-sft-14b': no config.json" in stderr
    assert "split placement: the whole GPU less reserves" in stderr


@pytest.mark.slow  # subprocess runs of the plan
def test_signal_margin_of_a_split_placement_counts_its_nodes_and_engines():
    """With split placement a node's mesh has 5 GPUs: (2, 5, 1) is two nodes (each saves half), not 10 // 8 = 1."""
    def lead(*overrides):
        p = subprocess.run([sys.executable, str(REPO / "launch" / "signal_margin.py"),
                            f"--config={REPO / 'configs' / 'arpo_qwen3_14b_deepsearch_8x80gb.py'}", *overrides],
                           env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return int(p.stdout.strip().splitlines()[-1]), p.stderr

    one, words = lead()
    assert "on 1 node(s)" in words
    two, words = lead("--config.mesh.shape=(2,5,1)")
    assert "on 2 node(s)" in words and two < one
