"""The Python tool: model-written code in a sandboxed interpreter process (never in the trainer).

Reference semantics (spec 6.1): the last bare expression becomes a ``print``; exit 0 returns stdout, otherwise
stderr (the traceback), both stripped. On top of the reference: Markdown fences are stripped, the process runs
with resource limits, a scrubbed environment, no network, a private uid (when the trainer runs as root), new
pid/mount namespaces, a filesystem view holding only the system and interpreter directories (read-only) and a
private size-capped tmpfs for /tmp, /var/tmp and /dev/shm, and a seccomp filter (``seccomp_filter.py``); the
output is truncated. What the kernel cannot provide is found at construction and refused with a clear message
(or, with ``allow_weaker_isolation``, logged once).

Start-up: by default sandboxes are forked from a warm *zygote* interpreter (``pool=True``) that has already
imported the common modules, and ``ready_sandboxes`` of them are kept started, waiting for a program
(``sandbox_pool.py``); every call runs in a sandbox of its own, a fresh fork of the same pristine image, so no
state leaks between calls. The child side lives in ``_sandbox_child.py``; see docs/tools.md for what holds where
the OS refuses namespaces.
"""

import ast
import dataclasses
import json
import logging
import os
import pathlib
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from arpo_jax.tools.base import Tool
from arpo_jax.tools.sandbox_pool import ReadyPool, StartedSandbox
from arpo_jax.tools.seccomp_filter import SeccompUnavailable, sandbox_filter_bpf

log = logging.getLogger(__name__)

_CHILD_SOURCE = (pathlib.Path(__file__).parent / "_sandbox_child.py").read_text()
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Threads count against RLIMIT_NPROC and a 64-thread BLAS pool per call would starve the node.
_BASE_ENV = {"LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
             "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
_SETUP_FAILED = 125  # exit status of a call whose sandbox could not be set up (_sandbox_child.user_process)
_REFERENCE_TIMEOUT_TEXT = "Execution timeout (超过 120 秒）"
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class PythonSandboxConfig:
    """Settings of the Python tool. Limits are per call; ``None`` leaves a limit unset."""

    python_path: str = sys.executable  # the reference runs <conda>/envs/<env>/bin/python
    timeout_s: float = 120.0  # wall clock, enforced by killing the whole process tree
    cpu_time_s: int | None = 120  # RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)
    memory_mb: int | None = 4096  # RLIMIT_AS (address space; numpy+BLAS need a few hundred MB)
    max_processes: int | None = 64  # RLIMIT_NPROC (processes *and threads* of the sandbox uid)
    max_file_size_mb: int | None = 64  # RLIMIT_FSIZE
    max_open_files: int | None = 256  # RLIMIT_NOFILE
    max_output_chars: int = 16384  # per returned text; the rest is replaced by a note
    isolate_network: bool = True  # new network namespace: no interface but a downed loopback
    isolate_processes: bool = True  # new pid + mount namespace: every descendant dies with the call
    drop_privileges: bool = True  # when running as root, run the code under a private per-slot uid
    uid_base: int = 100000  # private uids are uid_base + (pid % 1000) * 1000 + slot
    pool: bool = True  # fork calls from a warm zygote instead of starting an interpreter per call
    # Sandboxes kept started (namespaces, view, limits, seccomp in place) waiting for a program, each used for one
    # call and discarded: start-up (~11 of ~14 ms a call on 2 cores) leaves the call's latency. 0 = on demand.
    ready_sandboxes: int = 4
    start_timeout_s: float = 10.0  # a sandbox not ready (or not taking its program) by then is killed and replaced
    preload_modules: tuple[str, ...] = ("math", "json", "re", "random", "itertools", "collections", "fractions",
                                        "decimal", "datetime", "statistics", "numpy", "sympy")
    tmp_root: str | None = None  # parent of the working directories without isolate_filesystem (default: /tmp)
    # A fresh root per call: system and interpreter directories read-only, a private tmpfs of tmp_size_mb behind
    # /tmp, /var/tmp and /dev/shm (the working directory lives there too), nothing else (data, project, homes).
    isolate_filesystem: bool = True
    tmp_size_mb: int = 128  # RAM: at most max_workers * tmp_size_mb in use at once
    expose_paths: tuple[str, ...] = ()  # extra read-only paths for the code (e.g. a corpus it should read)
    hide_paths: tuple[str, ...] = ()  # covered even inside exposed directories (added to default_hidden_paths())
    seccomp: bool = True  # deny namespaces, mounts, ptrace, bpf, keyrings... (seccomp_filter.py)
    allow_weaker_isolation: bool = False  # run (with a warning) where the kernel refuses a protection asked for
    extra_env: tuple[tuple[str, str], ...] = ()  # explicit additions to the environment allow-list
    strip_fences: bool = True  # take the code out of ```python fences (the reference does not)
    reference_compat: bool = False  # reference timeout text and no truncation


@dataclasses.dataclass
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    signal: int | None
    timed_out: bool
    truncated: bool
    elapsed_s: float
    namespaces: tuple[str, ...] = ()
    error: str | None = None  # the sandbox itself failed (not the user code)


def strip_code_fences(text: str) -> str:
    """Returns the code inside Markdown fences (all fenced blocks joined), or the text unchanged if none."""
    blocks = _FENCE.findall(text)
    return "\n".join(b for b in blocks) if blocks else text


def preprocess_code(code: str, strip_fences: bool = True) -> str:
    """Reference preprocessing: a last bare expression that is not a ``print(...)`` call gets printed."""
    if strip_fences:
        code = strip_code_fences(code)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return code  # keep it unchanged: the interpreter reports the error to the model
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    expr = tree.body[-1].value
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "print":
        return code
    tree.body[-1] = ast.Expr(ast.Call(ast.Name("print", ast.Load()), [expr], []))
    return ast.unparse(ast.fix_missing_locations(tree))


def sandbox_env(workdir: str, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """The whole environment of the code: an allow-list, nothing inherited (no keys, tokens or proxies)."""
    return {"PATH": _DEFAULT_PATH, "HOME": workdir, "TMPDIR": workdir, **_BASE_ENV, **dict(extra)}


def default_hidden_paths() -> tuple[str, ...]:
    """Never shown to the code even inside an exposed directory: the project tree, data, caches, home."""
    paths = [os.path.expanduser("~"), os.path.expanduser("~/.cache")]
    paths += [os.environ[v] for v in ("ARPO_DATA", "ARPO_CACHE", "HF_HOME", "XDG_CACHE_HOME") if os.environ.get(v)]
    project = pathlib.Path(__file__).resolve().parents[2]
    if (project / "pyproject.toml").exists():  # a source checkout, not an installed wheel
        paths.append(str(project))
    return tuple(sorted({os.path.realpath(p) for p in paths} - {"/"}))


# What the kernel refused, per set of protections asked for: probed once per process (see PythonSandbox._probe).
_PROBED: dict[tuple, tuple[str, str] | None] = {}
_PROBE_LOCK = threading.Lock()


def process_uid_range(uid_base: int) -> range:
    """The private uids this process's sandboxes run under (`_UidSlots` hands them out)."""
    start = uid_base + (os.getpid() % 1000) * 1000
    return range(start, start + 1000)


def sandbox_pids(uid_base: int) -> list[int]:
    """The processes running under this process's sandbox uids (none once every sandbox is gone)."""
    uids, found = process_uid_range(uid_base), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if uid in uids:
            found.append(int(pid))
    return found


class _UidSlots:
    """Hands out private uids so concurrent calls never share RLIMIT_NPROC accounting or files."""

    def __init__(self, base: int):
        self._base = process_uid_range(base).start
        self._free: list[int] = []
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._base + self._next - 1

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


class _Zygote:
    """A warm interpreter that forks one monitor per call (see _sandbox_child.zygote)."""

    def __init__(self, python_path: str, preload: tuple[str, ...], start_timeout_s: float = 120.0):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [python_path, "-I", "-c", _CHILD_SOURCE, "zygote", str(child.fileno()), ",".join(preload)],
            pass_fds=[child.fileno()], env=sandbox_env(tempfile.gettempdir()), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
        child.close()
        self.sock = parent
        self.lock = threading.Lock()
        self.sock.settimeout(start_timeout_s)
        ready = self.sock.recv(1)
        self.sock.settimeout(None)
        if ready != b"R":
            self.close()
            raise RuntimeError(f"zygote failed to start with {python_path}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def submit(self, req: dict, fds: list[int]) -> None:
        payload = json.dumps(req).encode()
        with self.lock:
            socket.send_fds(self.sock, [struct.pack("!I", len(payload))], fds)
            self.sock.sendall(payload)

    def close(self) -> None:
        self.sock.close()  # the zygote sees EOF and exits; running calls finish on their own
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _check_traversable(path: str) -> None:
    """The private uid must reach its working directory by absolute path (HOME, TMPDIR, tempfile)."""
    parts = pathlib.Path(path).resolve().parts
    for i in range(2, len(parts) + 1):
        ancestor = pathlib.Path(*parts[:i])
        if not ancestor.stat().st_mode & 0o001:
            raise ValueError(f"tmp_root {path!r}: {ancestor} is not traversable by other users (mode o+x), so the "
                             "sandbox's private uid could not reach its working directory; pick another tmp_root")


class PythonSandbox:
    """Runs code strings in sandboxed processes; thread-safe (one call per thread at a time)."""

    def __init__(self, config: PythonSandboxConfig = PythonSandboxConfig()):
        self.config = config
        self._as_root = os.geteuid() == 0
        self._uids = _UidSlots(config.uid_base)
        if self._as_root and config.drop_privileges:
            _check_traversable(config.tmp_root or tempfile.gettempdir())
        if config.isolate_filesystem and not config.isolate_processes:
            raise ValueError("isolate_filesystem needs isolate_processes: without a pid namespace of its own the code "
                             "would reach the host's files through /proc/<pid>/root")
        if isinstance(config.ready_sandboxes, bool) or not isinstance(config.ready_sandboxes, int) \
                or config.ready_sandboxes < 0:
            raise ValueError(f"ready_sandboxes must be an int >= 0 (sandboxes kept started for the next calls; 0 "
                             f"starts each on demand), got {config.ready_sandboxes!r}")
        if config.isolate_filesystem and config.tmp_size_mb < 1:
            raise ValueError(f"tmp_size_mb must be >= 1 (MB of the private /tmp), got {config.tmp_size_mb}")
        self._hide = tuple(sorted({*default_hidden_paths(), *(os.path.realpath(p) for p in config.hide_paths)}))
        self._expose = tuple(os.path.realpath(p) for p in config.expose_paths)
        self._view = config.isolate_filesystem
        self._bpf: str | None = None
        self.weakened: list[str] = []  # protections asked for that this machine refused (allow_weaker_isolation)
        if config.seccomp:
            try:
                self._bpf = sandbox_filter_bpf().hex()
            except SeccompUnavailable as e:
                self._refuse("seccomp", str(e), "or set seccomp=False")
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._ready = ReadyPool(config.ready_sandboxes, self._start, config.start_timeout_s)
        self._probe()
        shared = not (self._as_root and config.drop_privileges) and (not config.isolate_processes
                                                                     or "namespaces" in self.weakened)
        if shared and config.ready_sandboxes:
            # No pid namespace and no private uid: a program could reach a sandbox waiting for the *next* call
            # (signal it, or write its memory through /proc/<pid>/mem as the same uid), so none waits.
            log.warning("python sandbox: ready_sandboxes=%d ignored: without a pid namespace or private uids a "
                        "program could reach the sandboxes waiting for the next calls", config.ready_sandboxes)
            self._ready = ReadyPool(0, self._start, config.start_timeout_s)

    def _refuse(self, layer: str, reason: str, remedy: str) -> None:
        """A protection asked for is unavailable: refuse, or (allow_weaker_isolation) drop it with a warning."""
        if not self.config.allow_weaker_isolation:
            raise RuntimeError(f"python sandbox: {reason}; {remedy}, or set allow_weaker_isolation=True to run the "
                               "model's code without it")
        log.warning("python sandbox runs WITHOUT %s: %s", layer, reason)
        self.weakened.append(layer)
        if layer == "seccomp":
            self._bpf = None
        elif layer == "filesystem view":
            self._view = False

    def _probe(self) -> None:
        """Runs one trivial call with every protection asked for and refuses (or degrades) on what fails."""
        c = self.config
        key = (c.isolate_network, c.isolate_processes, self._view, self._bpf is not None,
               self._as_root and c.drop_privileges, self._expose, self._hide)
        with _PROBE_LOCK:
            if key not in _PROBED:
                r = self.run("pass", python_path=sys.executable)
                _PROBED[key] = _probe_failure(r, self._wanted_namespaces(), self._view)
        if _PROBED[key] is None:
            return
        layer, reason = _PROBED[key]
        remedy = ("run the trainer as root (e.g. in a container) or enable unprivileged user namespaces "
                  "(sysctl kernel.unprivileged_userns_clone=1; Ubuntu >= 23.10 also "
                  "kernel.apparmor_restrict_unprivileged_userns=0)")
        if layer == "sandbox":  # nothing to leave out: the machinery itself does not work here
            raise RuntimeError(f"python sandbox: {reason}")
        self._refuse(layer, reason, remedy)
        if layer != "namespaces":
            self._probe()  # again without it: what is left must work

    def _wanted_namespaces(self) -> set[str]:
        c = self.config
        return ({"net"} if c.isolate_network else set()) | ({"pid", "mnt", "ipc"} if c.isolate_processes else set())

    def __repr__(self) -> str:
        return f"PythonSandbox({self.config!r})"

    def start(self) -> None:
        """Starts the warm zygote and fills the pool of ready sandboxes now (otherwise the first call does)."""
        if self.config.pool:
            self._get_zygote()
        self._ready.start()

    def close(self) -> None:
        """Kills the ready sandboxes and stops the zygote; calls running finish. A later call starts them again."""
        self._ready.close()
        with self._zygote_lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None

    def _get_zygote(self) -> _Zygote:
        with self._zygote_lock:
            if self._zygote is None or not self._zygote.alive():
                self._zygote = _Zygote(self.config.python_path, self.config.preload_modules)
            return self._zygote

    def _limits(self) -> dict[str, int | None]:
        c, mb = self.config, 1 << 20
        return {"RLIMIT_CPU": c.cpu_time_s, "RLIMIT_AS": c.memory_mb and c.memory_mb * mb,
                "RLIMIT_NPROC": c.max_processes, "RLIMIT_FSIZE": c.max_file_size_mb and c.max_file_size_mb * mb,
                "RLIMIT_NOFILE": c.max_open_files, "RLIMIT_CORE": 0}

    def run(self, code: str, python_path: str | None = None) -> RunResult:
        """Runs ``code`` (no preprocessing) in a sandbox of its own; never raises for user-code failures.

        The sandbox is a ready one from the pool, else one started now; either way it runs this program only.
        ``python_path`` (cold start only, never pooled) overrides the configured interpreter, for the start-up probe.
        """
        start, timeout = time.monotonic(), self.config.start_timeout_s
        for _ in range(3):  # a sandbox that dies or hangs before it has taken the program is replaced
            sb = self._ready.take() if python_path is None else None
            pooled = sb is not None
            if sb is None:
                try:
                    sb = self._start(python_path)
                except Exception as e:  # the machinery failed (no interpreter, full tmp_root...): tell the model
                    return RunResult("", "", None, None, False, False, time.monotonic() - start, error=repr(e))
                state = sb.wait_ready(timeout)
                if state == "hung":
                    sb.close()
                    return RunResult("", "", None, None, False, False, time.monotonic() - start,
                                     error=f"the sandbox did not start within {timeout:g} s")
                if state == "dead":  # e.g. its filesystem view could not be built: its status says why
                    return self._finish(sb, start, start)
            try:
                go = time.monotonic()
                if sb.go(code, timeout):
                    return self._finish(sb, start, go)
                log.warning("python sandbox: a sandbox did not take its program; replaced")
                sb.close()
            finally:
                if pooled:
                    self._ready.done()
        return RunResult("", "", None, None, False, False, time.monotonic() - start,
                         error="three sandboxes in a row did not take the program")

    def _finish(self, sb: StartedSandbox, start: float, go: float) -> RunResult:
        try:
            return _collect(sb, start, go, self.config)
        except Exception as e:  # the sandbox machinery failed; report it instead of raising into the rollout
            return RunResult("", "", None, None, False, False, time.monotonic() - start, error=repr(e))
        finally:
            sb.close()

    def _start(self, python_path: str | None = None) -> StartedSandbox:
        """Starts a sandbox that waits for its program (``_sandbox_child.py``); raises if it cannot be started."""
        uid = self._uids.acquire() if self._as_root and self.config.drop_privileges else None
        host_dir = None

        def cleanup() -> None:
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)
            if uid is not None:
                self._uids.release(uid)

        ends, child_ends = [], []  # the caller's (closed if the start fails) and the sandbox's (closed once sent)
        close = lambda end: end.close() if isinstance(end, socket.socket) else os.close(end)  # noqa: E731
        try:
            if self._view:  # the working directory is created inside the call's private /tmp: nothing on the host
                workdir = f"/tmp/arpo_py_{secrets.token_hex(6)}"
            else:
                workdir = host_dir = tempfile.mkdtemp(prefix="arpo_py_", dir=self.config.tmp_root)
                if uid is not None:
                    os.chown(workdir, uid, uid)
                os.chmod(workdir, 0o700)
            c = self.config
            req = {"cwd": workdir, "env": sandbox_env(workdir, c.extra_env), "limits": self._limits(),
                   "uid": uid, "gid": uid, "timeout_s": c.timeout_s, "isolate_network": c.isolate_network,
                   "isolate_processes": c.isolate_processes, "isolate_filesystem": self._view,
                   "tmp_size_mb": c.tmp_size_mb, "expose": self._expose, "hide": self._hide,
                   "seccomp_bpf": self._bpf}
            for make in (os.pipe, os.pipe, socket.socketpair, socket.socketpair):  # stdout, stderr, status, code
                parent, child = make()  # (socketpair: AF_UNIX, SOCK_STREAM)
                ends.append(parent)
                child_ends.append(child)
            child_fds = [e if isinstance(e, int) else e.fileno() for e in child_ends]
            if self.config.pool and python_path is None:
                self._submit_to_zygote(req, child_fds)
                bootstrap = None
            else:
                bootstrap = self._start_cold(req, child_fds, python_path or self.config.python_path)
        except BaseException:
            for end in ends:
                close(end)
            cleanup()
            raise
        finally:
            for end in child_ends:
                close(end)
        return StartedSandbox(*ends, bootstrap, cleanup)

    def _submit_to_zygote(self, req: dict, fds: list[int]) -> None:
        try:
            self._get_zygote().submit(req, fds)
        except OSError:  # the zygote died (e.g. OOM-killed): start a new one and try once more
            with self._zygote_lock:
                self._zygote = None
            self._get_zygote().submit(req, fds)

    def _start_cold(self, req: dict, fds: list[int], python_path: str) -> subprocess.Popen:
        proc = subprocess.Popen(  # cwd "/": the working directory may exist only inside the call's view
            [python_path, "-I", "-c", _CHILD_SOURCE, "once"], pass_fds=fds, stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=req["env"], cwd="/", start_new_session=True)
        proc.stdin.write(json.dumps({**req, "fds": fds}).encode())
        proc.stdin.close()
        return proc


def _collect(sb: StartedSandbox, start: float, go: float, cfg: PythonSandboxConfig) -> RunResult:
    """Reads stdout/stderr and the monitor's status lines until the call is over (``start``: the call's start).

    The monitor enforces the timeout from ``go``; this loop only adds a backstop (timeout + 5 s) in case the monitor
    itself hangs, and asks the monitor to kill the code once the output exceeds the cap (no need to read 100 MB).
    """
    cap = 4 * cfg.max_output_chars + 4096 if not cfg.reference_compat else None  # bytes; UTF-8 is <= 4 B/char
    out_r, err_r, status = sb.out_r, sb.err_r, sb.status
    bufs = {out_r: bytearray(), err_r: bytearray()}
    open_fds, status_buf, msgs = {out_r, err_r}, sb.status_buf, sb.msgs  # what came while it started (pids)
    truncated, killed, drain_until = False, False, None
    backstop = go + cfg.timeout_s + 5.0
    while True:
        final = next((m for m in msgs if "status" in m or "error" in m), None)
        now = time.monotonic()
        if final is not None and (not open_fds or (drain_until is not None and now > drain_until)):
            break
        if final is not None and drain_until is None:
            drain_until = now + 0.5  # a daemonised grandchild (no pid namespace) may hold the pipes open
        if now > backstop:
            raise TimeoutError("sandbox monitor did not report back")
        watch = list(open_fds) + ([status] if final is None else [])
        ready, _, _ = select.select(watch, [], [], 0.1)
        for fd in ready:
            if fd is status:
                chunk = status.recv(65536)
                if not chunk:
                    if final is None:
                        raise RuntimeError("sandbox monitor exited without a status")
                    continue
                status_buf += chunk
                *lines, status_buf = status_buf.split(b"\n")
                msgs.extend(json.loads(line) for line in lines if line)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.discard(fd)
            elif cap is None or len(bufs[fd]) < cap:
                bufs[fd] += chunk
            if cap is not None and len(bufs[out_r]) + len(bufs[err_r]) >= cap and not killed:
                truncated, killed = True, True
                try:
                    status.send(b"K")
                except OSError:
                    pass  # the monitor is already gone: the code has exited
    final = next(m for m in msgs if "status" in m or "error" in m)
    namespaces = tuple(next((m["namespaces"] for m in msgs if "namespaces" in m), ()))
    elapsed = time.monotonic() - start
    if "error" in final:
        return RunResult("", "", None, None, False, False, elapsed, namespaces, error=final["error"])
    raw = final["status"]
    exit_code = os.WEXITSTATUS(raw) if os.WIFEXITED(raw) else None
    sig = os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else None
    decode = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    stdout, stderr = decode(bufs[out_r]), decode(bufs[err_r])
    if exit_code == _SETUP_FAILED and stderr.startswith("sandbox setup failed"):  # not the code: the sandbox
        return RunResult(stdout, stderr, exit_code, sig, False, truncated, elapsed, namespaces, error=stderr)
    return RunResult(stdout, stderr, exit_code, sig, final["reason"] == "timeout", truncated, elapsed, namespaces)


def _probe_failure(r: RunResult, wanted: set[str], view: bool) -> tuple[str, str] | None:
    """Which protection (and why) a trivial call did not get: None if it ran with all of them."""
    if r.error is not None:
        lines = r.error.strip().splitlines()
        detail = lines[-1] if lines else "no detail"
        layer = "seccomp" if "seccomp" in detail else "filesystem view" if view else "sandbox"
        return layer, f"the sandbox could not be set up on this machine ({detail})"
    missing = sorted(wanted - set(r.namespaces))
    if missing:
        return "namespaces", f"the kernel refused the {', '.join(missing)} namespace(s)"
    if r.exit_code != 0:
        return "sandbox", f"a trivial call failed: {(r.stderr.strip().splitlines() or ['no output'])[-1]}"
    return None


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [output truncated: more than {limit} characters]"


def _kill_note(sig: int) -> str:
    why = {signal.SIGXCPU: " (CPU time limit exceeded)", signal.SIGKILL: " (killed: memory, CPU or process limit)"}
    return f"Process killed by signal {signal.Signals(sig).name}{why.get(sig, '')}."


def format_result(r: RunResult, cfg: PythonSandboxConfig) -> str:
    """The text the model sees (reference: stdout on success, the traceback otherwise)."""
    if r.error is not None:
        lines = r.error.strip().splitlines()
        return f"Execution exception: {lines[-1] if lines else 'sandbox failure'}"
    if r.timed_out:
        if cfg.reference_compat:
            return _REFERENCE_TIMEOUT_TEXT
        before = _truncate((r.stdout.strip() + "\n" + r.stderr.strip()).strip(), cfg.max_output_chars)
        return (before + "\n" if before else "") + f"Execution timed out after {cfg.timeout_s:g} s."
    if r.truncated:  # the code was stopped for flooding the output: show the beginning of both streams
        return _truncate((r.stdout.strip() + "\n" + r.stderr.strip()).strip(), cfg.max_output_chars)
    text = r.stdout.strip() if r.exit_code == 0 else r.stderr.strip()
    if cfg.reference_compat:
        return text
    if r.signal is not None and not text:
        text = (r.stdout.strip() + "\n" + _kill_note(r.signal)).strip()
    elif r.exit_code not in (0, None) and not text:
        text = (r.stdout.strip() + f"\nProcess exited with status {r.exit_code}.").strip()
    return _truncate(text, cfg.max_output_chars)


class PythonTool(Tool):
    """``<python>`` tool: preprocess, run in the sandbox, format (spec 6.1 plus the sandbox)."""

    tag = "python"

    def __init__(self, config: PythonSandboxConfig | None = None, **params):
        self.config = config or PythonSandboxConfig(**params)
        self.sandbox = PythonSandbox(self.config)

    def __repr__(self) -> str:
        return f"PythonTool({self.config!r})"

    def execute(self, content: str) -> str:
        code = preprocess_code(content, self.config.strip_fences)
        return format_result(self.sandbox.run(code), self.config)

    def close(self) -> None:
        self.sandbox.close()
