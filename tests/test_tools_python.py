"""The sandboxed Python tool: reference preprocessing/formatting, isolation, and a hostile-program suite."""

import concurrent.futures as cf
import json
import os
import pathlib
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from arpo_jax.tools import make_tool, seccomp_filter
from arpo_jax.tools.python_sandbox import (
    PythonSandbox,
    PythonSandboxConfig,
    PythonTool,
    default_hidden_paths,
    preprocess_code,
    sandbox_env,
    strip_code_fences,
)

SECRET = "planted-secret-7c1d9e0b5a"
AS_ROOT = os.geteuid() == 0
MARK = f"arpo_left_{secrets.token_hex(4)}"  # names of the files hostile programs drop: found on the host = leaked
HOST_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


@pytest.fixture(scope="module")
def root():
    # Not under pytest's tmp dir: that one is mode 0700, and the sandbox's private uid must reach its workdir.
    path = tempfile.mkdtemp(prefix="arpo_tools_test_")
    os.chmod(path, 0o755)
    os.makedirs(os.path.join(path, "outside"), mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", params=["pool", "cold"])
def tool(request, root):
    # "pool": forked from the zygote, with ready sandboxes waiting (the default); "cold": an interpreter started
    # for each call when it comes (ready_sandboxes=0). Both run the hostile suite.
    # Planted before the sandbox starts: the code must not see it, nor proxies picked up from the caller.
    os.environ["ARPO_PLANTED_SECRET"] = SECRET
    os.environ["HTTPS_PROXY"] = "http://proxy.invalid:3128"
    cfg = PythonSandboxConfig(timeout_s=2.0, cpu_time_s=30, memory_mb=512, max_processes=32, max_output_chars=2000,
                              tmp_root=os.path.join(root, "work"), pool=request.param == "pool",
                              ready_sandboxes=PythonSandboxConfig.ready_sandboxes if request.param == "pool" else 0,
                              preload_modules=("math", "json"))
    os.makedirs(cfg.tmp_root, mode=0o755, exist_ok=True)
    t = PythonTool(cfg)
    yield t
    t.close()
    del os.environ["ARPO_PLANTED_SECRET"], os.environ["HTTPS_PROXY"]


def _mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return set(f.read().splitlines())


def _sysv_ipc() -> set[str]:
    """System V shared memory, semaphores, message queues: they outlive their creator unless removed."""
    found = set()
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            found |= {f"{kind} " + " ".join(line.split()[:2]) for line in f.read().splitlines()[1:]}  # key, id
    return found


HOST_MOUNTS = _mounts()  # the code's mounts live in its own namespace: the host's table never changes
HOST_IPC = _sysv_ipc()


def leftovers(root: str, uid_base: int) -> list[int]:
    """Processes whose working directory is under ``root``, or that run as one of this process's sandbox uids."""
    uids = range(uid_base + (os.getpid() % 1000) * 1000, uid_base + (os.getpid() % 1000 + 1) * 1000)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
            if os.readlink(f"/proc/{pid}/cwd").startswith(root) or (AS_ROOT and uid in uids):
                found.append(int(pid))
        except (OSError, StopIteration):
            continue
    return found


def leaked_files() -> list[str]:
    return [os.path.join(d, n) for d in HOST_TMP_DIRS if os.path.isdir(d) for n in os.listdir(d) if MARK in n]


def assert_clean(tool: PythonTool) -> None:
    """Nothing left behind: no process, no working directory, no file in the host's temp dirs, no mount."""
    tool.close()  # the ready sandboxes run as sandbox uids too; the next call starts the pool and the zygote again
    root, uid_base = tool.config.tmp_root, tool.config.uid_base
    deadline = time.monotonic() + 5.0  # a pid namespace is torn down asynchronously after its init dies
    while leftovers(root, uid_base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(root, uid_base) == [], "processes left running"
    assert os.listdir(root) == [], "working directories left behind"
    assert leaked_files() == [], "files left in the host's /tmp, /var/tmp or /dev/shm"
    assert _mounts() - HOST_MOUNTS == set(), "mounts left behind"
    assert _sysv_ipc() - HOST_IPC == set(), "System V IPC objects left behind"


def namespaces(tool: PythonTool) -> tuple[str, ...]:
    return tool.sandbox.run("pass").namespaces


# ---------------------------------------------------------------------------------------- reference behaviour
def test_preprocess_last_expression_becomes_print():
    assert preprocess_code("x = 2\nx * 3") == "x = 2\nprint(x * 3)"
    assert preprocess_code("print(1)") == "print(1)"
    assert preprocess_code("x = 1") == "x = 1"
    assert preprocess_code("def f(:\n  1") == "def f(:\n  1"  # a syntax error is left for the interpreter
    assert preprocess_code("import math\n# c\nmath.pi  # why") == "import math\nprint(math.pi)"


def test_code_fences_are_stripped():
    assert strip_code_fences("```python\nprint(1)\n```") == "print(1)"
    assert strip_code_fences("Here:\n```py\na = 1\n```\nand\n```\nprint(a)\n```") == "a = 1\nprint(a)"
    assert strip_code_fences("```python\nprint(1)") == "print(1)"  # unterminated (stopped at </python>)
    assert strip_code_fences("print('```')") == "print('```')"
    assert preprocess_code("```python\n1 + 1\n```") == "print(1 + 1)"
    assert preprocess_code("```python\n1 + 1\n```", strip_fences=False).startswith("```")


def test_results_follow_the_reference(tool):
    assert tool.execute("print('  hi  ')\n") == "hi"  # stdout, stripped
    assert tool.execute("x = 6\nx * 7") == "42"
    err = tool.execute("1 / 0")
    assert err.startswith("Traceback (most recent call last):") and 'File "<string>", line 1' in err
    assert err.endswith("ZeroDivisionError: division by zero") and "_sandbox_child" not in err
    assert "SyntaxError" in tool.execute("def f(:\n  pass")
    assert tool.execute("import sys\nprint('out')\nsys.exit(3)") == "out\nProcess exited with status 3."
    assert tool.execute("import sys; sys.exit('bye')") == "bye"
    assert tool.execute("x = 1") == ""  # empty output is the executor's business
    assert tool.execute("print('北京 ✓')") == "北京 ✓"
    assert tool.execute("import sys; print(sys.argv, '' in sys.path[:1])") == "['-c'] True"


def test_environment_is_the_allow_list(tool):
    out = tool.execute("import os; print(sorted(os.environ))")
    assert eval(out) == sorted(sandbox_env("x"))


def test_no_state_leaks_between_calls(tool):
    first = tool.execute("import json, builtins, os\njson.LEAK = 1\nbuiltins.LEAK = 2\n"
                         "open('f.txt', 'w').write('x')\nprint(os.getcwd())")
    second = tool.execute("import json, builtins, os\nprint(hasattr(json, 'LEAK'), hasattr(builtins, 'LEAK'), "
                          "os.path.exists('f.txt'), os.getcwd())")
    assert second.startswith("False False False ") and not second.endswith(first)
    draws = {tool.execute("import random; print(random.random())") for _ in range(3)}
    assert len(draws) == 3


def test_concurrent_calls(tool):
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(tool.execute, [f"{i} ** 2" for i in range(16)]))
    assert outs == [str(i * i) for i in range(16)]
    assert_clean(tool)


def test_reference_compat_timeout_text(root):
    cfg = PythonSandboxConfig(timeout_s=0.5, pool=False, reference_compat=True, tmp_root=os.path.join(root, "rc"))
    os.makedirs(cfg.tmp_root, mode=0o755, exist_ok=True)
    assert PythonTool(cfg).execute("while True: pass") == "Execution timeout (超过 120 秒）"


def test_interpreter_path_is_configurable(root):
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other is None:
        pytest.skip("no system python3 to switch to")
    for pool in (False, True):
        t = make_tool("python", python_path=other, pool=pool, timeout_s=10, tmp_root=root, preload_modules=())
        assert t.execute("import sys; sys.executable") == other
        t.close()


@pytest.mark.parametrize("pool", [True, False])
def test_broken_interpreter_gives_a_clear_text(root, pool):
    t = PythonTool(PythonSandboxConfig(python_path="/nonexistent/bin/python", pool=pool, tmp_root=root))
    assert t.execute("print(1)").startswith("Execution exception: FileNotFoundError")
    t.close()
    assert not [name for name in os.listdir(root) if name.startswith("arpo_py_")]


def test_zygote_death_is_survived(root):
    t = PythonTool(PythonSandboxConfig(pool=True, timeout_s=5, tmp_root=root, preload_modules=()))
    assert t.execute("1") == "1"
    t.sandbox._zygote.proc.kill()
    t.sandbox._zygote.proc.wait()
    assert t.execute("2") == "2"
    t.close()


def test_unreachable_tmp_root_is_refused(tmp_path):
    if not AS_ROOT:
        pytest.skip("the check applies when privileges are dropped (running as root)")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.chmod(locked, 0o700)
    with pytest.raises(ValueError, match="not traversable"):
        PythonSandbox(PythonSandboxConfig(tmp_root=str(locked)))


# ---------------------------------------------------------------------------------------- hostile programs
@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"],
                         ids=["infinite_loop", "sleep_past_timeout"])
def test_hostile_timeouts(tool, code):
    assert tool.execute(code) == "Execution timed out after 2 s."
    assert_clean(tool)


def test_hostile_fork_bomb(tool):
    out = tool.execute("import os\nwhile True:\n    os.fork()")
    assert "BlockingIOError" in out or "Resource temporarily unavailable" in out or "timed out" in out, out
    assert_clean(tool)
    assert tool.execute("6 * 7") == "42"


def test_hostile_memory_bomb(tool):
    out = tool.execute("blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))")
    assert "MemoryError" in out, out
    assert_clean(tool)


def test_hostile_huge_output(tool):
    out = tool.execute("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1000000)")
    assert out.startswith("xxxx") and out.endswith("[output truncated: more than 2000 characters]")
    assert len(out) < 2100
    assert_clean(tool)


def test_hostile_reads_secrets(tool):
    code = ("import os\nparts = [repr(dict(os.environ))]\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    for name in ('environ', 'cmdline'):\n"
            "        try:\n"
            "            parts.append(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace'))\n"
            "        except OSError:\n"
            "            pass\n"
            "print('\\n'.join(parts))")
    out = tool.execute(code)
    assert "PATH" in out
    assert SECRET not in out and "ARPO_PLANTED_SECRET" not in out and "proxy.invalid" not in out
    assert_clean(tool)


def test_hostile_writes_outside_its_directory(tool, root):
    if not AS_ROOT:
        pytest.skip("without root the code runs as the caller's uid and may write where the caller may")
    target = os.path.join(root, "outside", "pwned.txt")
    out = tool.execute(f"open({target!r}, 'w').write('pwned')")
    # The filesystem view has no such directory (it had PermissionError before the view existed).
    assert ("PermissionError" in out or "FileNotFoundError" in out) and not os.path.exists(target)
    for exposed in (sys.prefix, "/usr/lib", "/etc"):  # read-only in the view (and not the private uid's)
        target = os.path.join(exposed, MARK)
        out = tool.execute(f"open({target!r}, 'w').write('pwned')")
        assert ("Read-only file system" in out or "PermissionError" in out) and not os.path.exists(target), out
    assert_clean(tool)


def test_hostile_network(tool):
    if "net" not in namespaces(tool):
        pytest.skip("this OS refused a network namespace (see docs/tools.md)")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        out = tool.execute(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                           "print('connected')")
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "connected" not in out and "Error" in out
    assert_clean(tool)


def test_hostile_signals_its_parent(tool):
    if not AS_ROOT and "pid" not in namespaces(tool):
        pytest.skip("without a private uid or pid namespace the code could signal the caller")
    code = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, 1):\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as e:\n        print(type(e).__name__)\nprint('done')")
    out = tool.execute(code)
    assert "done" in out
    assert tool.execute("6 * 7") == "42"  # the caller (this process) and the sandbox machinery survived
    assert_clean(tool)


def test_hostile_daemonised_child(tool):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
            "    os._exit(0)\nprint('parent exits')")
    assert tool.execute(code) == "parent exits"
    assert_clean(tool)


def test_hostile_closes_and_floods_stderr(tool):
    out = tool.execute("import os, sys\nos.close(1)\nsys.stderr.write('e' * 10**7)\nraise SystemExit(1)")
    assert out.startswith("eee") and "truncated" in out
    assert_clean(tool)


def test_caller_is_unharmed(tool):
    assert os.getpid() > 0 and signal.getsignal(signal.SIGTERM) is not None
    assert tool.execute("print('still working')") == "still working"
    assert pathlib.Path(tool.config.tmp_root).is_dir()


# ---------------------------------------------------------------------------------------- escapes (issue 22)
# Syscall numbers the escape programs call directly (no Python wrapper); the filter itself uses libseccomp's table.
SYSCALLS = {"x86_64": {"clone": 56, "clone3": 435, "bpf": 321, "keyctl": 250, "add_key": 248,
                       "process_vm_readv": 310, "chroot": 161},
            "aarch64": {"clone": 220, "clone3": 435, "bpf": 280, "keyctl": 219, "add_key": 217,
                        "process_vm_readv": 270, "chroot": 51}}
ESCAPE_PRELUDE = f"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {SYSCALLS.get(platform.machine(), {})!r}
def err(ret):
    return 'ok' if ret >= 0 else errno.errorcode[ctypes.get_errno()]
def sys_(name, *args):
    return err(libc.syscall(NR[name], *[ctypes.c_long(a) for a in args]))
"""
needs_syscall_table = pytest.mark.skipif(platform.machine() not in SYSCALLS, reason="x86_64 / aarch64 only")


def run_escape(tool: PythonTool, body: str) -> dict:
    out = tool.execute(ESCAPE_PRELUDE + textwrap.dedent(body))
    try:
        return json.loads(out.splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise AssertionError(out) from None


def test_tmp_dirs_are_private_and_vanish(tool):
    write = (f"import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n"
             f"    open(os.path.join(d, '{MARK}'), 'w').write('x')\n"
             f"print(sorted(os.path.exists(os.path.join(d, '{MARK}')) for d in ('/tmp', '/var/tmp', '/dev/shm')))")
    assert tool.execute(write) == "[True, True, True]"
    assert leaked_files() == []  # not on the host
    assert tool.execute(f"import os\nprint([os.path.exists(os.path.join(d, '{MARK}')) "
                        "for d in ('/tmp', '/var/tmp', '/dev/shm')])") == "[False, False, False]"
    assert_clean(tool)


def test_tmp_size_is_capped(root):
    cfg = PythonSandboxConfig(tmp_size_mb=4, timeout_s=10, tmp_root=root, preload_modules=())
    t = PythonTool(cfg)
    # One 4 MB tmpfs behind all three directories: 3 MB in /tmp leaves no room for 3 MB in /dev/shm.
    out = t.execute("import os\nchunk = b'x' * (3 << 20)\nfor d in ('/tmp', '/dev/shm'):\n"
                    "    try:\n        open(d + '/big', 'wb').write(chunk)\n        print(d, 'ok')\n"
                    "    except OSError as e:\n        print(d, os.strerror(e.errno))")
    assert out == "/tmp ok\n/dev/shm No space left on device", out
    out = t.execute("import os\ntry:\n    [open(f'/tmp/f{i}', 'w').close() for i in range(100000)]\n"
                    "except OSError as e:\n    print(os.strerror(e.errno), len(os.listdir('/tmp')))")
    assert out.startswith("No space left on device"), out  # inodes are capped too (256 per MB)
    t.close()


def test_bad_isolation_settings_are_refused(root):
    with pytest.raises(ValueError, match="tmp_size_mb"):
        PythonSandbox(PythonSandboxConfig(tmp_size_mb=0, tmp_root=root))
    with pytest.raises(ValueError, match="isolate_filesystem needs isolate_processes"):
        PythonSandbox(PythonSandboxConfig(isolate_processes=False, tmp_root=root))
    # Without the view, the old layout holds: a host working directory under tmp_root, removed afterwards. Those
    # left while the tool is open are the ready sandboxes' (empty, waiting for the next calls); close removes them.
    t = PythonTool(PythonSandboxConfig(isolate_filesystem=False, tmp_root=root, preload_modules=()))
    out = t.execute("import os; open('f', 'w'); print(os.getcwd())")
    assert out.startswith(os.path.join(root, "arpo_py_")) and not os.path.exists(out)
    left = [n for n in os.listdir(root) if n.startswith("arpo_py_")]
    assert len(left) <= t.config.ready_sandboxes and all(os.listdir(os.path.join(root, n)) == [] for n in left)
    t.close()
    assert [n for n in os.listdir(root) if n.startswith("arpo_py_")] == []


@needs_syscall_table
def test_no_new_namespaces_or_mounts(tool):
    got = run_escape(tool, """
        import json
        CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x20000, 17
        res = {'unshare_user': err(libc.unshare(CLONE_NEWUSER)),
               'unshare_user_mount': err(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))}
        pid = libc.syscall(NR['clone'], ctypes.c_long(CLONE_NEWUSER | SIGCHLD), 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        res['clone_user'] = err(pid)
        if pid > 0:
            os.waitpid(pid, 0)
        res['clone3'] = sys_('clone3', 0, 0)
        res['mount'] = err(libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None))
        res['chroot'] = sys_('chroot', 0)
        res['setns'] = err(libc.setns(0, 0))
        print(json.dumps(res))""")
    assert got == {"unshare_user": "EPERM", "unshare_user_mount": "EPERM", "clone_user": "EPERM",
                   "clone3": "ENOSYS", "mount": "EPERM", "chroot": "EPERM", "setns": "EPERM"}
    assert_clean(tool)


@needs_syscall_table
def test_no_ptrace_bpf_or_keyrings(tool):
    got = run_escape(tool, """
        import json, time
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        PTRACE_ATTACH, PTRACE_TRACEME = 16, 0
        res = {'ptrace_attach': err(libc.ptrace(PTRACE_ATTACH, child, 0, 0)),
               'process_vm_readv': sys_('process_vm_readv', child, 0, 0, 0, 0, 0),
               'bpf': sys_('bpf', 9999, 0, 0),  # an unknown command: EINVAL from the kernel, EPERM from us
               'keyctl': sys_('keyctl', 0, -3, 1),  # KEYCTL_GET_KEYRING_ID of the session keyring, create
               'add_key': sys_('add_key', 0, 0, 0, 0, 0),
               'seccomp': open('/proc/self/status').read().split('Seccomp:')[1].split()[0]}
        os.kill(child, 9)
        print(json.dumps(res))""")
    assert got == {"ptrace_attach": "EPERM", "process_vm_readv": "EPERM", "bpf": "EPERM", "keyctl": "EPERM",
                   "add_key": "EPERM", "seccomp": "2"}
    assert_clean(tool)


def test_filesystem_view_hides_data_project_caches_and_homes(root):
    planted = pathlib.Path(root, "data")  # a dataset the trainer reads: world-readable on the host
    planted.mkdir(exist_ok=True)
    (planted / "train.parquet").write_text(SECRET)
    (planted / "corpus.txt").write_text("public corpus")
    os.chmod(planted, 0o755)
    for f in planted.iterdir():
        os.chmod(f, 0o644)
    # The corpus directory is exposed on purpose; the parquet inside it is hidden explicitly.
    t = PythonTool(PythonSandboxConfig(timeout_s=10, tmp_root=root, preload_modules=(), expose_paths=(str(planted),),
                                       hide_paths=(str(planted / "train.parquet"),)))
    project = pathlib.Path(__file__).resolve().parents[1]
    probes = [str(project / "pyproject.toml"), str(project / "arpo_jax" / "__init__.py"), os.path.expanduser("~"),
              os.path.expanduser("~/.cache"), "/work/shared/data", root, *default_hidden_paths()]
    code = (f"import json, os\nres = {{}}\nfor p in {probes!r}:\n"
            "    try:\n        res[p] = os.listdir(p) if os.path.isdir(p) else open(p).read()[:40]\n"
            "    except OSError as e:\n        res[p] = type(e).__name__\n"
            f"res['corpus'] = open({str(planted / 'corpus.txt')!r}).read()\n"
            f"res['parquet'] = open({str(planted / 'train.parquet')!r}).read()\n"
            "print(json.dumps(res))")
    got = json.loads(t.execute(code))
    assert got.pop("corpus") == "public corpus" and got.pop("parquet") == ""  # hidden behind an empty file
    for path, seen in got.items():  # absent, or (an interpreter's ancestor) a directory with only its way down
        assert seen == "FileNotFoundError" or (isinstance(seen, list) and len(seen) <= 1), (path, seen)
    assert SECRET not in json.dumps(got)
    t.close()


def test_output_before_a_timeout_is_returned(tool):
    out = tool.execute("import sys\nprint('step 1')\nsys.stdout.write('step 2')\nsys.stderr.write('warn')\n"
                       "while True:\n    pass")
    assert out == "step 1\nstep 2\nwarn\nExecution timed out after 2 s."
    assert_clean(tool)


def test_hostile_suite_leaves_nothing(tool):
    programs = [
        f"import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n    for i in range(200):\n"
        f"        open(os.path.join(d, f'{MARK}_{{i}}'), 'w').write('x' * 1000)",
        f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    open('/tmp/{MARK}_d', 'w')\n    time.sleep(60)\n"
        "print('parent exits')",
        f"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.unshare(0x10000000 | 0x20000)\n"
        f"libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None)\nopen('/dev/shm/{MARK}', 'w')\nwhile True:\n    pass",
        "import os\nwhile True:\n    os.fork()",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nIPC_PRIVATE, IPC_CREAT = 0, 0o1000\n"
        "ids = [libc.shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0o600), libc.semget(IPC_PRIVATE, 1, IPC_CREAT | 0o600),"
        " libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)]\nassert min(ids) >= 0, (ids, ctypes.get_errno())\nprint(ids)",
    ]
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(tool.execute, programs))
    assert outs[-1].startswith("["), outs[-1]  # the IPC objects were created (and must be gone with the call)
    assert_clean(tool)


def test_a_missing_library_is_refused_clearly(root, monkeypatch, caplog):
    monkeypatch.setattr(seccomp_filter, "LIBSECCOMP", "libseccomp-missing.so.9")
    seccomp_filter.sandbox_filter_bpf.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="libseccomp.so.2.*apt-get install libseccomp2.*allow_weaker_isolation"):
            PythonSandbox(PythonSandboxConfig(tmp_root=root))
        t = PythonTool(PythonSandboxConfig(tmp_root=root, allow_weaker_isolation=True, preload_modules=()))
        assert t.sandbox.weakened == ["seccomp"] and "WITHOUT seccomp" in caplog.text
        assert t.execute("print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])") == "0"
        t.close()
    finally:
        seccomp_filter.sandbox_filter_bpf.cache_clear()


def test_refused_namespaces_are_refused_clearly(root):
    # A trainer in a container whose seccomp profile refuses namespaces: the probe must say so, not run weaker.
    script = textwrap.dedent(f"""
        import ctypes, json, logging
        from arpo_jax.tools import _sandbox_child as child
        from arpo_jax.tools.python_sandbox import PythonSandboxConfig, PythonTool
        from arpo_jax.tools.seccomp_filter import sandbox_filter_bpf
        assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
        child.install_seccomp(sandbox_filter_bpf())  # from now on unshare() fails in this process tree
        res = {{}}
        try:
            PythonTool(PythonSandboxConfig(tmp_root={root!r}))
        except RuntimeError as e:
            res['error'] = str(e)
        logging.disable(logging.WARNING)
        t = PythonTool(PythonSandboxConfig(tmp_root={root!r}, allow_weaker_isolation=True, preload_modules=()))
        res['weakened'] = t.sandbox.weakened
        res['out'] = t.execute('6 * 7')
        t.close()
        # Same uid for every sandbox and no pid namespace: no sandbox may wait for the next call.
        shared = PythonTool(PythonSandboxConfig(tmp_root={root!r}, allow_weaker_isolation=True, preload_modules=(),
                                                drop_privileges=False))
        res['ready'] = (t.sandbox._ready.size, shared.sandbox._ready.size, shared.execute('6 * 8'))
        shared.close()
        print(json.dumps(res))""")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert "no mount or pid namespace" in got["error"] and "allow_weaker_isolation=True" in got["error"], got
    assert got["weakened"] == ["filesystem view", "namespaces"] and got["out"] == "42"
    assert got["ready"] == [PythonSandboxConfig.ready_sandboxes if AS_ROOT else 0, 0, "48"]
    assert [n for n in os.listdir(root) if n.startswith("arpo_py_")] == []
