"""The concurrent executor: order, reference failure texts, retries, enforced timeouts, metrics, registry."""

import threading
import time

import pytest

from arpo_jax.tools import ExecutorConfig, PythonTool, Tool, ToolExecutor, make_executor, make_tool


class Echo(Tool):
    tag = "echo"

    def execute(self, content):
        time.sleep(float(content.split()[0]) if content[:1].isdigit() else 0)  # later requests may finish first
        return f"echo:{content}"


class Flaky(Tool):
    """Raises ``fails`` times, then answers; counts its calls."""

    tag = "flaky"

    def __init__(self, fails):
        self.fails, self.calls = fails, 0
        self.lock = threading.Lock()

    def execute(self, content):
        with self.lock:
            self.calls += 1
            if self.calls <= self.fails:
                raise ConnectionError(f"boom {self.calls}")
        return "ok"


class Empty(Tool):
    tag = "python"

    def __init__(self):
        self.calls = 0

    def execute(self, content):
        self.calls += 1
        return "   "


class Hang(Tool):
    tag = "hang"

    def __init__(self):
        self.release = threading.Event()

    def execute(self, content):
        self.release.wait(30)
        return "late"


def test_results_in_request_order():
    ex = ToolExecutor([Echo()], ExecutorConfig(max_workers=4))
    reqs = [("echo", f"{d} req{i}") for i, d in enumerate([0.2, 0.0, 0.1, 0.0, 0.05])]
    assert ex.execute_batch(reqs) == [f"echo:{c}" for _, c in reqs]
    assert ex.execute_batch([]) == []
    ex.close()


def test_retries_then_success_and_then_error_text():
    flaky = Flaky(fails=2)
    ex = ToolExecutor([flaky], ExecutorConfig(retry_count=3))
    assert ex.execute("flaky", "x") == "ok" and flaky.calls == 3
    always = Flaky(fails=100)
    ex2 = ToolExecutor([always], ExecutorConfig(retry_count=3))
    assert ex2.execute("flaky", "x") == "Error: Tool(flaky) execution failed with message: ConnectionError: boom 3"
    m = ex2.metrics()
    assert m["tools/flaky/calls"] == 1 and m["tools/flaky/failures"] == 1 and m["tools/flaky/retries"] == 2
    compat = ToolExecutor([Flaky(fails=100)], ExecutorConfig(retry_count=2, reference_compat=True))
    assert compat.execute("flaky", "x") == "Tool(flaky) returned empty output."
    for e in (ex, ex2, compat):
        e.close()


def test_empty_output_is_final_unless_reference_compat():
    empty = Empty()
    ex = ToolExecutor([empty], ExecutorConfig(retry_count=4))
    assert ex.execute("python", "x = 1") == "Tool(python) returned empty output." and empty.calls == 1
    ref = Empty()
    ex_ref = ToolExecutor([ref], ExecutorConfig(retry_count=4, reference_compat=True))
    assert ex_ref.execute("python", "x = 1") == "Tool(python) returned empty output." and ref.calls == 4  # B9
    assert ex_ref.metrics()["tools/python/retries"] == 3
    ex.close()
    ex_ref.close()


def test_timeout_is_enforced_per_call():
    hang = Hang()
    ex = ToolExecutor([hang, Echo()], ExecutorConfig(timeout_s=0.3, max_workers=4))
    out = ex.execute_batch([("echo", "a"), ("hang", "x"), ("echo", "b")])
    assert out == ["echo:a", "Error: Tool(hang) execution failed with message: timed out after 0.3 s", "echo:b"]
    hang.release.set()
    m = ex.metrics()
    assert m["tools/hang/timeouts"] == 1 and m["tools/hang/calls"] == 1 and m["tools/echo/successes"] == 2
    ex.close()


def test_unknown_tag_and_metrics_keys():
    ex = ToolExecutor([Echo()])
    assert ex.execute("browse", "x").startswith("Error: Tool(browse) execution failed with message: unknown tool")
    ex.execute_batch([("echo", "a")] * 5)
    m = ex.metrics()
    assert m["tools/echo/calls"] == 5 and m["tools/echo/successes"] == 5
    assert 0 <= m["tools/echo/latency_p50_s"] <= m["tools/echo/latency_p95_s"]
    assert ex.stop_strings == ["</echo>"]
    ex.reset_metrics()
    assert ex.metrics() == {}
    ex.close()


def test_registry_and_real_tools_together(tmp_path):
    py = make_tool("python", timeout_s=5, pool=False, preload_modules=())
    assert isinstance(py, PythonTool) and py.tag == "python"
    with pytest.raises(ValueError, match="unknown tool"):
        make_tool("browser")
    cache = tmp_path / "c.json"
    cache.write_text('{"q": "Page 1: cached"}')
    ex = make_executor({"python": {"timeout_s": 5, "preload_modules": ()},
                        "search": {"backend": "cache", "cache_file": str(cache)}}, max_workers=8)
    assert sorted(ex.tools) == ["python", "search"] and sorted(ex.stop_strings) == ["</python>", "</search>"]
    reqs = [("python", f"print({i} * 3)") for i in range(6)] + [("search", "q"), ("python", "x = 1")]
    assert ex.execute_batch(reqs) == [str(i * 3) for i in range(6)] + ["Page 1: cached",
                                                                        "Tool(python) returned empty output."]
    ex.close()
    py.close()


def test_run_batch_names_the_failed_calls():
    """A text (even an error message from the tool) is not a failure; every retry raising, or a timeout, is."""
    hang = Hang()
    ex = ToolExecutor([Flaky(fails=100), Echo(), hang], ExecutorConfig(timeout_s=0.3, retry_count=2, max_workers=4))
    out = ex.run_batch([("echo", "a"), ("flaky", "x"), ("hang", "y"), ("browse", "z")])
    hang.release.set()
    assert [r.failure for r in out] == [None, "tool_error", "tool_timeout", "tool_error"]
    assert [r.text for r in out[:3]] == ["echo:a", "Error: Tool(flaky) execution failed with message: "
                                         "ConnectionError: boom 2", "Error: Tool(hang) execution failed with "
                                         "message: timed out after 0.3 s"]
    assert ToolExecutor([Flaky(fails=1)]).run_batch([("flaky", "x")])[0].failure is None  # a retry succeeded
    assert ToolExecutor([Empty()]).run_batch([("python", "x")])[0].failure is None  # empty output: final, not failed
    ex.close()
