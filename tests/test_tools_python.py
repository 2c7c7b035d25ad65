"""The sandboxed Python tool: reference preprocessing/formatting, isolation, and a hostile-program suite."""

import concurrent.futures as cf
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import time

import pytest

from arpo_jax.tools import make_tool
from arpo_jax.tools.python_sandbox import (
    PythonSandbox,
    PythonSandboxConfig,
    PythonTool,
    preprocess_code,
    sandbox_env,
    strip_code_fences,
)

SECRET = "planted-secret-7c1d9e0b5a"
AS_ROOT = os.geteuid() == 0


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
    # Planted before the sandbox starts: the code must not see it, nor proxies picked up from the caller.
    os.environ["ARPO_PLANTED_SECRET"] = SECRET
    os.environ["HTTPS_PROXY"] = "http://proxy.invalid:3128"
    cfg = PythonSandboxConfig(timeout_s=2.0, cpu_time_s=30, memory_mb=512, max_processes=32, max_output_chars=2000,
                              tmp_root=os.path.join(root, "work"), pool=request.param == "pool",
                              preload_modules=("math", "json"))
    os.makedirs(cfg.tmp_root, mode=0o755, exist_ok=True)
    t = PythonTool(cfg)
    yield t
    t.close()
    del os.environ["ARPO_PLANTED_SECRET"], os.environ["HTTPS_PROXY"]


def leftovers(root: str) -> list[int]:
    """Processes whose working directory is (or was) under ``root``: anything the code left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(root):
                found.append(int(pid))
        except OSError:
            continue
    return found


def assert_clean(tool: PythonTool) -> None:
    root = tool.config.tmp_root
    deadline = time.monotonic() + 5.0  # a pid namespace is torn down asynchronously after its init dies
    while leftovers(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(root) == [], "processes left running"
    assert os.listdir(root) == [], "working directories left behind"


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
    assert "PermissionError" in out and not os.path.exists(target)
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
