"""Runs one round of tool calls concurrently (spec 3.3 step 4 and 6.4), with an enforced per-call timeout.

The result strings follow the reference: a tool's text as is; ``Tool(<tag>) returned empty output.`` for an empty
result; ``Error: Tool(<tag>) execution failed with message: <e>`` when the call fails. Differences (B8, B9):
the timeout really bounds each call (the reference's is a no-op), and an empty result is final unless
``reference_compat`` (the reference re-runs code that prints nothing ``retry_count`` times).

``run_batch`` also says which calls failed (``ToolResult.failure``: ``tool_error`` when every attempt raised,
``tool_timeout`` when the call outlived ``timeout_s``), so the rollout can isolate those trajectories; a tool that
returns a text, even an error message about the model's input, has not failed.
"""

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time

import numpy as np

from arpo_jax.tools.base import Tool

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExecutorConfig:
    max_workers: int = 64  # thread-pool size (reference: 64 ARPO, 32 AEPO)
    timeout_s: float = 150.0  # per call, from its start: covers the tools' own timeouts plus slack
    retry_count: int = 3  # attempts per call (reference: 3 ARPO, 4 AEPO)
    reference_compat: bool = False  # an empty result counts as a failure and is retried, as in the reference
    latency_window: int = 10000  # recent latencies kept per tool for p50/p95


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees
    failure: str | None = None  # None, "tool_error" (every attempt raised) or "tool_timeout"


def empty_text(tag: str) -> str:
    return f"Tool({tag}) returned empty output."


def error_text(tag: str, message: str) -> str:
    return f"Error: Tool({tag}) execution failed with message: {message}"


class _Call:
    """One request's state, shared between the worker thread and the collector."""

    def __init__(self, tag: str, content: str):
        self.tag, self.content = tag, content
        self.started: float | None = None
        self.abandoned = False  # set when the collector gave up on it (timeout): its late outcome is not counted
        self.future: cf.Future | None = None


class ToolExecutor:
    """Executes ``(tag, content)`` requests on a thread pool and returns the result strings in request order."""

    def __init__(self, tools: dict[str, Tool] | list[Tool], config: ExecutorConfig = ExecutorConfig()):
        self.tools = {t.tag: t for t in tools} if isinstance(tools, list) else dict(tools)
        self.config = config
        self._pool = cf.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="tool")
        self._lock = threading.Lock()
        self.reset_metrics()

    @property
    def stop_strings(self) -> list[str]:
        """Generation stops after a closing tag of any registered tool (spec 3.1)."""
        return [f"</{tag}>" for tag in self.tools]

    def execute_batch(self, requests: list[tuple[str, str]]) -> list[str]:
        """Runs all requests concurrently; returns one text per request, in order. Never raises."""
        return [r.text for r in self.run_batch(requests)]

    def run_batch(self, requests: list[tuple[str, str]]) -> list[ToolResult]:
        """Like `execute_batch`, with each call's failure cause (None when the tool returned a text)."""
        calls = [_Call(tag, content) for tag, content in requests]
        for call in calls:
            call.future = self._pool.submit(self._run, call)
        results: list[ToolResult | None] = [None] * len(calls)
        pending = set(range(len(calls)))
        while pending:
            futures = [calls[i].future for i in pending]
            cf.wait(futures, timeout=self._next_deadline(calls, pending), return_when=cf.FIRST_COMPLETED)
            now = time.monotonic()
            for i in list(pending):
                call = calls[i]
                if call.future.done():
                    results[i] = call.future.result()  # _run never raises
                    pending.discard(i)
                elif call.started is not None and now - call.started > self.config.timeout_s:
                    # The thread cannot be killed; its tool has its own timeout and the result is dropped.
                    call.abandoned = True
                    results[i] = ToolResult(error_text(call.tag, f"timed out after {self.config.timeout_s:g} s"),
                                            "tool_timeout")
                    self._record(call.tag, "timeouts", now - call.started)
                    pending.discard(i)
        return results

    def execute(self, tag: str, content: str) -> str:
        return self.execute_batch([(tag, content)])[0]

    def _next_deadline(self, calls: list[_Call], pending: set[int]) -> float:
        starts = [calls[i].started for i in pending if calls[i].started is not None]
        if not starts:
            return 0.05  # nothing started yet: look again soon
        return max(0.0, min(starts) + self.config.timeout_s - time.monotonic()) + 0.001

    def _run(self, call: _Call) -> ToolResult:
        call.started = time.monotonic()
        tool = self.tools.get(call.tag)
        if tool is None:
            self._record(call.tag, "failures", 0.0)
            return ToolResult(error_text(call.tag, f"unknown tool (registered: {sorted(self.tools)})"), "tool_error")
        attempts = max(1, self.config.retry_count)
        error = None
        for attempt in range(attempts):
            if attempt:
                self._bump(call.tag, "retries")
            try:
                text = tool.execute(call.content)
            except Exception as e:  # a tool must not take the rollout down
                error = f"{type(e).__name__}: {e}"
                log.warning("tool %s raised %s (attempt %d/%d)", call.tag, error, attempt + 1, attempts)
                continue
            if not isinstance(text, str):
                text = "" if text is None else str(text)
            if text.strip() or not self.config.reference_compat:
                if not call.abandoned:
                    self._record(call.tag, "successes", time.monotonic() - call.started)
                return ToolResult(text if text.strip() else empty_text(call.tag))
        if not call.abandoned:
            self._record(call.tag, "failures", time.monotonic() - call.started)
        failure = None if error is None else "tool_error"  # compat: empty results, retried, are not a failure
        if error is None or self.config.reference_compat:
            return ToolResult(empty_text(call.tag), failure)  # the reference's text once the attempts are used up
        return ToolResult(error_text(call.tag, error), failure)

    # ---------------------------------------------------------------------------------------------- metrics
    def reset_metrics(self) -> None:
        with self._lock:
            self._counts = collections.defaultdict(collections.Counter)
            self._latency = collections.defaultdict(lambda: collections.deque(maxlen=self.config.latency_window))

    def _bump(self, tag: str, key: str) -> None:
        with self._lock:
            self._counts[tag][key] += 1

    def _record(self, tag: str, outcome: str, latency_s: float) -> None:
        with self._lock:
            self._counts[tag]["calls"] += 1
            self._counts[tag][outcome] += 1
            self._latency[tag].append(latency_s)

    def metrics(self) -> dict[str, float]:
        """Flat ``tools/<tag>/<name>`` metrics: calls, successes, failures, timeouts, retries, latency p50/p95."""
        out = {}
        with self._lock:
            for tag, counts in self._counts.items():
                for key in ("calls", "successes", "failures", "timeouts", "retries"):
                    out[f"tools/{tag}/{key}"] = float(counts[key])
                lat = np.asarray(self._latency[tag], dtype=np.float64)
                if lat.size:
                    out[f"tools/{tag}/latency_p50_s"] = float(np.percentile(lat, 50))
                    out[f"tools/{tag}/latency_p95_s"] = float(np.percentile(lat, 95))
        return out

    def close(self, close_tools: bool = True) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if close_tools:
            for tool in self.tools.values():
                tool.close()
