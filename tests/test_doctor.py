"""`arpo-jax doctor` on this CPU machine: it passes where nothing is wrong, and names each problem planted for real
(a file system that refuses locks, a vLLM of another release, a port in use, a tiny /dev/shm, a GPU node's
nvidia-smi report), with what to do, exit status 1 on a failure."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_jax.config import args
from arpo_jax.plan import doctor

REPO = Path(__file__).resolve().parents[1]
NO_LOCKS = str(REPO / "tests" / "no_locks.py")  # runs a command as on a file system that refuses locks


def _rows(out: str) -> dict[str, list[str]]:
    """check name -> its lines in the table (the row and its `->` line)."""
    rows: dict[str, list[str]] = {}
    last = ""
    for line in out.splitlines():
        if line.startswith(" ") and last:
            rows[last].append(line.strip())
        elif "  " in line and not line.startswith(("check", "---", "arpo-jax", "{")):
            last = line.split("  ")[0]
            rows.setdefault(last, []).append(line)
    return rows


def _standin_vllm(folder: Path, version: str) -> Path:
    """A `vllm` package of `version` first on the path: what the engine's worker would import and judge."""
    (folder / "vllm").mkdir(parents=True)
    (folder / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return folder


def _doctor(*argv: str, env: dict, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*wrapper, "-m", "arpo_jax.cli", "doctor", *argv], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # subprocess runs of the command (jax imported, the plan)
def test_doctor_passes_here_and_names_each_planted_problem_with_what_to_do(tmp_path):
    """The toy config on this machine: every check ok, exit 0. Then the same command with the vLLM engine, on a file
    system without locks (a seccomp filter answers every lock request ENOLCK), a vLLM 0.31 first on the path and
    the coordinator's port taken: those rows, with their fixes, and exit 1."""
    env = os.environ | {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    workdir = tmp_path / "run"
    ok = _doctor("--config=builtin:toy_cpu", f"--workdir={workdir}", env=env, wrapper=(sys.executable,))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = _rows(ok.stdout)
    for check in ("config / paths", "jax", "flax", "transformers", "GPUs", "memory plan", "host memory", "/dev/shm",
                  "work dir lock", "ports", "environment"):
        assert check in rows, (check, ok.stdout)
    assert "arpo-jax doctor: all checks pass" in ok.stdout and "FAIL" not in ok.stdout
    assert json.loads(ok.stdout.strip().splitlines()[-1]) == {"failed": [], "warnings": []}

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bad = env | {"PYTHONPATH": f"{_standin_vllm(tmp_path / 'old', '0.31.2')}:{REPO}",
                     "ARPO_COORDINATOR": f"127.0.0.1:{port}", "ARPO_PROCESS_ID": "0"}
        proc = _doctor("--config=builtin:toy_cpu", "--config.rollout.engine=vllm", f"--workdir={workdir}", env=bad,
                       wrapper=(sys.executable, NO_LOCKS))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert "warn" in rows["work dir lock"][0] and "lockf ENOLCK" in rows["work dir lock"][0]
    assert "mount with -o flock" in rows["work dir lock"][1]
    assert "FAIL" in rows["vllm"][0] and "0.31.2" in rows["vllm"][0]
    assert "Install the tested one (pip install -e '.[gpu]'" in rows["vllm"][1]
    assert "FAIL" in rows["coordinator port"][0] and f"127.0.0.1:{port}: Address already in use" in \
        rows["coordinator port"][0] and f"sport = :{port}" in rows["coordinator port"][1]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])["failed"]
    assert [f.split(":")[0] for f in failed] == ["vllm", "coordinator port"]


@pytest.mark.slow  # a subprocess in a user namespace
def test_doctor_names_a_tiny_dev_shm(tmp_path):
    """A 1 MiB tmpfs (mounted in a user namespace of its own) as the shared-memory folder of a vLLM run: one weight
    export does not fit, the row says where the sync goes instead and what to do."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no user namespaces here (unshare -rm) to mount a tmpfs in")
    shm = tmp_path / "shm"
    shm.mkdir()
    env = os.environ | {"PYTHONPATH": f"{_standin_vllm(tmp_path / 'ok', '0.32.0')}:{REPO}", "JAX_PLATFORMS": "cpu"}
    script = (f'mount -t tmpfs -o size=1m tmpfs "{shm}" && exec "{sys.executable}" -m arpo_jax.cli doctor '
              f'--config=builtin:toy_cpu --config.rollout.engine=vllm --workdir="{tmp_path / "run"}" --shm="{shm}"')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a warning: the sync falls back to the disk
    row = _rows(proc.stdout)["/dev/shm"]
    assert "warn" in row[0] and f"{shm}: 0.00 GiB free; one weight export needs" in row[0]
    assert "falls back to the temporary folder" in row[1] and "a larger /dev/shm" in row[1]


# nvidia-smi of a node of 8 GPUs in the EXCLUSIVE_PROCESS compute mode, one of them 30 GiB in use by another job.
NVIDIA_SMI = """#!/bin/sh
for i in 0 1 2 3 4 5 6 7; do
  used=0; [ $i = 3 ] && used=30720
  echo "$i, GPU-$i, NVIDIA H200, 580.159.04, Exclusive_Process, 143771, $used"
done
"""


def test_doctor_reads_a_gpu_node_from_nvidia_smi(tmp_path, monkeypatch):
    """On a GPU config, nvidia-smi's report decides: a compute mode that allows one CUDA context per GPU with JAX
    and vLLM sharing each GPU, a GPU another process holds memory on, mesh.device naming another GPU than the
    node's; each row says what to do."""
    (tmp_path / "bin").mkdir()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cfg = args.load_config(["--config=builtin:arpo_qwen25_7b_reasoning"])  # colocated vLLM, mesh.device=a100-80gb
    env = os.environ | {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
                        "PYTHONPATH": f"{_standin_vllm(tmp_path / 'ok', '0.32.0')}:{REPO}"}
    rows = {}
    for r in doctor.run(cfg, tmp_path / "run", env=env):
        rows.setdefault(r.check, r)
    assert rows["compute mode"].status == doctor.FAIL and rows["compute mode"].found == "Exclusive_Process"
    assert "placement=split" in rows["compute mode"].todo
    assert rows["GPU memory"].status == doctor.FAIL and "GPU 3: 30.0 GiB in use" in rows["GPU memory"].found
    assert "GPU 2" not in rows["GPU memory"].found and "--query-compute-apps" in rows["GPU memory"].todo
    assert rows["mesh.device"].status == doctor.WARN and "these have 140.4" in rows["mesh.device"].found
    assert "--config.mesh.device=" in rows["mesh.device"].todo and "h200" in rows["mesh.device"].todo
    assert rows["vLLM engines"].status == doctor.OK and "8 engine(s)" in rows["vLLM engines"].found
    assert rows["vllm"].status == doctor.OK


@pytest.mark.slow  # a subprocess run of the command
def test_doctor_without_arguments_checks_the_node_and_its_data(tmp_path):
    """No --config, no --workdir: the node's checks (devices or the CPU, pins, vLLM, /dev/shm, the current folder's
    locks) and $ARPO_DATA's files, a missing one a warning with the fetch command; nothing left in the folder."""
    data = tmp_path / "data"
    (data / "rl").mkdir(parents=True)
    shared = REPO.parent / "shared" / "data" / "rl" / "valid.parquet"
    if not shared.is_file():
        shared = Path("/work/shared/data/rl/valid.parquet")
    if shared.is_file():
        shutil.copy(shared, data / "rl" / "valid.parquet")
    env = os.environ | {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "ARPO_DATA": str(data)}
    proc = subprocess.run([sys.executable, "-m", "arpo_jax.cli", "doctor"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert ("CPU" in rows) != ("GPUs" in rows), proc.stdout
    for check in ("jax", "flax", "transformers", "vllm", "host memory", "/dev/shm", "work dir lock", "environment"):
        assert check in rows, (check, proc.stdout)
    assert f"{tmp_path}: lockf and flock work" in rows["work dir lock"][0]
    assert "warn" in rows["data"][0] and "rl/train_10k.parquet (missing)" in rows["data"][0]
    assert ("rl/valid.parquet" in rows["data"][0]) != shared.is_file()  # a present, checked file is not listed
    assert rows["data"][1].startswith("-> arpo-jax data fetch --only ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no lock or probe file left


def test_a_configs_missing_data_files_fail_with_the_fetch_command(tmp_path, monkeypatch):
    """With a config, its data files that the manifest names: FAIL with the fetch command; `train` refuses the
    same config at validation, naming the same command."""
    from arpo_jax.assemble import validate

    monkeypatch.setenv("ARPO_DATA", str(tmp_path))
    cfg = args.load_config(["--config=builtin:arpo_qwen25_7b_reasoning"])
    node = doctor.Node(cfg, tmp_path / "run", "train", Path("/dev/shm"), dict(os.environ))
    rows = {r.check: r for r in doctor.data_files(node)}
    assert rows["data rl/train_10k.parquet"].status == doctor.FAIL
    assert rows["data rl/train_10k.parquet"].todo == "arpo-jax data fetch --only train_10k"
    assert rows["data search/search_cache.json"].todo == "arpo-jax data fetch --only search"
    with pytest.raises(validate.ConfigError) as e:
        validate.validate(cfg, command="train", check_files=True)
    assert f"data.train_files: file '{tmp_path}/rl/train_10k.parquet' does not exist (allowed: arpo-jax data " \
           "fetch --only train_10k writes it" in str(e.value)
