"""The pool of ready Python sandboxes (``ready_sandboxes``): the same outputs as sandboxes started on demand, no
state from one call in the next, dead and hung ready sandboxes replaced, nothing left running after ``close``.
The hostile-program suite runs with the pool too (tests/test_tools_python.py, the ``pool`` tool)."""

import concurrent.futures as cf
import os
import shutil
import signal
import tempfile
import time

import pytest

from arpo_jax.tools import make_tool, python_sandbox
from arpo_jax.tools.python_sandbox import PythonSandbox, PythonSandboxConfig, PythonTool

AS_ROOT = os.geteuid() == 0

# What a model's programs do: print, a bare last expression, a traceback, a syntax error, an exit status, stderr
# only, unicode, output over the cap, nothing at all, a timeout; none prints anything that differs between runs.
PROGRAMS = [
    "print(2 + 3)", "```python\nx = 16 - 3 - 4\nx * 2\n```", "1 / 0", "def f(:\n    pass", "import sys; sys.exit(3)",
    "import sys; sys.stderr.write('only stderr')", "print('héllo ✓')", "print('x' * 5000)", "pass",
    "import sys; sys.exit('bye')", "import math, json; json.dumps([math.factorial(10)])", "while True: pass",
]


@pytest.fixture(scope="module")
def root():
    path = tempfile.mkdtemp(prefix="arpo_pool_test_")  # traversable by the sandbox's private uid (mode 0755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tool(root, ready: int, pool: bool = True, **kw) -> PythonTool:
    return PythonTool(PythonSandboxConfig(timeout_s=1.0, max_output_chars=1000, ready_sandboxes=ready, pool=pool,
                                          preload_modules=("math", "json"), tmp_root=root, **kw))


def wait_until(condition, what: str, within_s: float = 20.0) -> None:
    """Liveness, not timing: the pool refills in the background, so wait (bounded) for what must happen."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {within_s} s"
        time.sleep(0.02)


def fill(t: PythonTool, n: int) -> None:
    assert t.execute("1") == "1"  # the first call starts the pool
    wait_until(lambda: t.sandbox._ready.idle() == n, "the pool filling")


def ready_pids(t: PythonTool) -> list[tuple[int, int]]:
    """(monitor, user process) of each sandbox waiting in the pool."""
    out = []
    for sb in list(t.sandbox._ready._ready):
        pids = {k: m[k] for m in sb.msgs for k in ("pid", "monitor") if k in m}
        out.append((pids["monitor"], pids["pid"]))
    return out


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def sandbox_uid_processes(t: PythonTool) -> list[int]:
    return python_sandbox.sandbox_pids(t.config.uid_base)


@pytest.mark.parametrize("pool", [True, False], ids=["zygote", "cold"])
def test_the_pool_gives_the_same_outputs_as_on_demand(root, pool):
    on_demand, pooled = tool(root, 0, pool), tool(root, 2, pool)
    try:
        want = [on_demand.execute(p) for p in PROGRAMS]
        assert want[:3] == ["5", "18", want[2]] and want[2].endswith("ZeroDivisionError: division by zero")
        assert want[-1] == "Execution timed out after 1 s."
        assert [pooled.execute(p) for p in PROGRAMS] == want
        with cf.ThreadPoolExecutor(8) as ex:  # more calls at once than ready sandboxes: the rest start on demand
            assert list(ex.map(pooled.execute, PROGRAMS[:-1] * 3)) == want[:-1] * 3
    finally:
        on_demand.close()
        pooled.close()


@pytest.mark.parametrize("pool", [True, False], ids=["zygote", "cold"])
def test_a_call_sees_nothing_of_the_one_before(root, pool):
    t = tool(root, 1, pool)
    try:
        fill(t, 1)
        first = t.execute(
            "import os, sys, json, builtins\n"
            "for d in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n"
            "    open(os.path.join(d, 'left_by_first'), 'w').write('x')\n"
            "open('leftmod.py', 'w').write('VALUE = 1')\nimport leftmod\n"
            "os.environ['LEFT_BY_FIRST'] = '1'\njson.LEFT = 1\nbuiltins.LEFT = 1\nLEFT_GLOBAL = 1\n"
            "sys.modules['left_module'] = json\nprint(os.getcwd())")
        second = t.execute(
            "import os, sys, json, builtins\n"
            "print([os.path.exists(os.path.join(d, 'left_by_first')) for d in ('.', '/tmp', '/var/tmp', '/dev/shm')],"
            " 'LEFT_BY_FIRST' in os.environ, hasattr(json, 'LEFT'), hasattr(builtins, 'LEFT'),"
            " 'LEFT_GLOBAL' in globals(), 'left_module' in sys.modules, 'leftmod' in sys.modules, os.getcwd())")
        assert second.startswith("[False, False, False, False] False False False False False False /tmp/arpo_py_")
        assert not second.endswith(first), "the second call ran in the first one's working directory"
    finally:
        t.close()


def test_the_timeout_starts_with_the_program_not_with_the_sandbox(root):
    t = tool(root, 2)
    try:
        fill(t, 2)
        time.sleep(1.5)  # the ready sandboxes have now waited longer than timeout_s
        assert t.execute("import time; time.sleep(0.2); print('in time')") == "in time"
    finally:
        t.close()


@pytest.mark.parametrize("victim", ["user process", "monitor"])
def test_a_killed_ready_sandbox_is_replaced(root, victim):
    t = tool(root, 2)
    try:
        fill(t, 2)
        killed = ready_pids(t)
        victims = [user if victim == "user process" else monitor for monitor, user in killed]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(running(p) for p in victims), "the kills")  # dead while waiting, not mid-call
        assert t.execute("6 * 7") == "42"
        wait_until(lambda: not any(running(p) for pair in killed for p in pair), "the killed sandboxes going away")
        wait_until(lambda: t.sandbox._ready.idle() == 2, "the pool refilling")
        assert not set(ready_pids(t)) & set(killed)
        assert t.execute("6 * 8") == "48"
    finally:
        t.close()


def test_a_hung_ready_sandbox_is_replaced(root):
    t = tool(root, 2, start_timeout_s=1.0)  # a sandbox that does not take its program within 1 s is replaced
    try:
        fill(t, 2)
        stopped = ready_pids(t)
        for _, user in stopped:
            os.kill(user, signal.SIGSTOP)  # alive, its sockets open, but it will never read a program
        assert t.execute("6 * 7") == "42"
        wait_until(lambda: not any(running(p) for pair in stopped for p in pair), "the hung sandboxes being killed")
    finally:
        t.close()


@pytest.mark.parametrize("pool", [True, False], ids=["zygote", "cold"])
def test_close_leaves_no_process(root, pool):
    t = tool(root, 3, pool)
    fill(t, 3)
    pids = [p for pair in ready_pids(t) for p in pair]
    if pool:
        pids.append(t.sandbox._zygote.proc.pid)
    assert all(running(p) for p in pids)
    t.close()
    wait_until(lambda: not any(running(p) for p in pids), "every sandbox process ending", within_s=5)
    if AS_ROOT:
        assert sandbox_uid_processes(t) == []
    assert t.execute("2 + 2") == "4"  # usable again: the zygote and the pool start again
    t.close()


@pytest.mark.parametrize("bad", [-1, 2.0, "4", True])
def test_ready_sandboxes_is_validated(root, bad):
    with pytest.raises(ValueError, match=r"ready_sandboxes must be an int >= 0 .*0 starts each on demand.*got"):
        PythonSandbox(PythonSandboxConfig(ready_sandboxes=bad, tmp_root=root))


def test_make_tool_takes_the_pool_size(root):
    t = make_tool("python", ready_sandboxes=0, tmp_root=root, preload_modules=())
    assert t.sandbox._ready.size == 0 and t.execute("print(7)") == "7"
    t.close()
