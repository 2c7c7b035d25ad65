"""A rollout's tool calls (spec 3.3 steps 3-4): the call's content, its result's text and tokens, and running them.

`ToolCalls` runs the calls of the round schedule (`agent_loop.py`): each starts as soon as its segment is back where
the executor runs calls one by one, and the round's results are appended together at its end. `ToolRunner` runs
the streaming schedule's (`streaming.py`): every call on a pool thread from the moment its segment is back, each
result handed back alone as it comes (`done`), while the engine decodes the other trajectories.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import time
from typing import Protocol


class Executor(Protocol):
    """What the loop needs from `arpo_jax.tools.ToolExecutor`."""

    stop_strings: list[str]

    def execute_batch(self, requests: list[tuple[str, str]]) -> list[str]: ...

    # Optional: `run_batch(requests) -> list[ToolResult]` (text and failure cause); without it no call fails.


def extract_tool_content(text: str, tag: str) -> str:
    """The text between the last `<tag>` preceding the last `</tag>`, stripped ("" if either is missing)."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, max(end, 0))
    if end < 0 or start < 0:
        return ""
    return text[start + len(tag) + 2:end].strip()


def wrap_tool_result(text: str) -> str:
    return " <result>\n" + text + "\n</result>"


def encode_tool_result(tokenizer, text: str, reference_compat: bool = False) -> list[int]:
    """Token ids of the wrapped result (B11: the reference's `encode` adds BOS and parses special tokens)."""
    wrapped = wrap_tool_result(text)
    if reference_compat:
        return list(tokenizer.encode(wrapped))
    try:
        return list(tokenizer(wrapped, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    except TypeError:  # tokenizers without split_special_tokens
        return list(tokenizer.encode(wrapped, add_special_tokens=False))


def run_calls(executor: Executor, requests: list[tuple[str, str]]) -> list[tuple[str, str | None]]:
    """(text, failure cause or None) per tool call; executors without `run_batch` never report a failure."""
    if hasattr(executor, "run_batch"):
        return [(r.text, r.failure) for r in executor.run_batch(requests)]
    return [(text, None) for text in executor.execute_batch(requests)]


def _pool_size(executor: Executor) -> int:
    return getattr(getattr(executor, "config", None), "max_workers", 32)


Queued = tuple  # a round's tool call: ((trajectory, tag, content), its Future when started at once, else None)


class ToolCalls:
    """The round schedule's tool calls. With an executor that runs calls one by one (`run_batch`: the real one), each
    starts as soon as its segment is back, on a thread of its own that waits for it; else the round's calls run
    together at its end. Either way the results are returned in the round's order (`end`)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.seconds = 0.0  # the calls' seconds, summed (a batch of calls run together: its seconds each)

    @contextlib.contextmanager
    def running(self):
        if not hasattr(self.executor, "run_batch"):
            yield
            return
        with concurrent.futures.ThreadPoolExecutor(_pool_size(self.executor),
                                                   thread_name_prefix="rollout-call") as pool:
            self.pool = pool
            try:
                yield
            finally:
                self.pool = None

    def start(self, call: tuple, queued: list[Queued]) -> None:
        queued.append((call, self.pool.submit(timed_calls, self.executor, [call[1:]]) if self.pool else None))

    def end(self, order: list, queued: list[Queued]) -> list[tuple[object, str, str | None, float]]:
        """(trajectory, result text, failure or None, seconds) of each queued call, in the order of `order` (the
        round's trajectories); the calls not started yet run now, all at once. The next round starts when the last
        is back: its branching and refill rules (4.2, 4.3) read the whole round."""
        rank = {id(t): k for k, t in enumerate(order)}
        queued = sorted(queued, key=lambda q: rank[id(q[0][0])])
        later = [(tag, content) for (_, tag, content), future in queued if future is None]
        results, seconds = timed_calls(self.executor, later) if later else ([], 0.0)
        batch = iter(results)
        out = []
        for (t, _, _), future in queued:
            if future is not None:
                (result,), took = future.result()
            else:
                result, took = next(batch), seconds
            self.seconds += took
            out.append((t, *result, took))
        return out


def timed_calls(executor: Executor, requests: list[tuple[str, str]]) -> tuple[list[tuple[str, str | None]], float]:
    """`run_calls` and the seconds it took."""
    t0 = time.perf_counter()
    results = run_calls(executor, requests)
    return results, time.perf_counter() - t0


class ToolRunner:
    """The streaming schedule's tool calls: `start` runs one on a pool thread at once, `done` hands back the finished
    ones (blocking up to `timeout` for the first when asked). Counts each call's seconds (`seconds`) and the
    seconds the rollout waited with nothing else to do (`waited`): the rest was hidden behind decoding."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.running = 0
        self.seconds = 0.0
        self.waited = 0.0
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def open(self):
        with concurrent.futures.ThreadPoolExecutor(_pool_size(self.executor),
                                                   thread_name_prefix="rollout-call") as pool:
            self.pool = pool
            try:
                yield self
            finally:
                self.pool = None

    def start(self, owner, tag: str, content: str) -> None:
        self.running += 1
        self.pool.submit(self._run, owner, tag, content)

    def _run(self, owner, tag: str, content: str) -> None:
        t0 = time.perf_counter()
        try:
            (text, failure), = run_calls(self.executor, [(tag, content)])
            out = (owner, text, failure, None)
        except BaseException as e:  # noqa: BLE001 - raised again in the rollout's thread (`done`)
            out = (owner, "", None, e)
        self.finished.put(out + (time.perf_counter() - t0,))

    def done(self, block: bool) -> list[tuple[object, str, str | None, float]]:
        """(owner, result text, failure or None, seconds) of every call finished since the last look; with
        `block`, waits for at least one (there must be one running)."""
        out = []
        if block and self.running:
            t0 = time.perf_counter()
            out.append(self.finished.get())
            self.waited += time.perf_counter() - t0
        while True:
            try:
                out.append(self.finished.get_nowait())
            except queue.Empty:
                break
        self.running -= len(out)
        results = []
        for owner, text, failure, error, seconds in out:
            self.seconds += seconds
            if error is not None:
                raise error
            results.append((owner, text, failure, seconds))
        return results
