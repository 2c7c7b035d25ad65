"""The Python tool under concurrent load, through the entry point the rollout uses (issue 69, part 5).

The streaming rollout (`arpo_jax/rollout/tool_calls.py`, `ToolRunner`) runs every tool call on a pool thread of its
own with `executor.run_batch([(tag, content)])`, over the executor `assemble/components.make_tool_executor` builds
(`make_executor({"python": {...}}, ...)`). This benchmark does exactly that: C client threads, each calling
`run_batch([("python", program)])` in a loop, for C = 1, 16 and 128 (the executor's `max_workers` is raised to C
so that C calls really run at once).

The program is what a GSM8K agent writes: a fenced block of a few assignments and an arithmetic expression left
bare on the last line (the sandbox prints it), with numbers that differ per call; every answer is checked.

    ```python
    eggs_per_day = 16
    eaten = 5  # 3 + i % 5 in call i
    baked = 4
    price = 2
    (eggs_per_day - eaten - baked) * price
    ```

Per level: calls/s (calls / wall), p50/p99 latency of one `run_batch`, and a cost breakdown from the same program
with two `time.monotonic()` stamps around it (CLOCK_MONOTONIC is shared with the sandbox): start-up (call made ->
first line of the program runs), run, and return (last line -> result back in the caller).

The soak runs `--soak` calls (default 10,000) at `--soak-concurrency` (default 64, the rollout's `tools.max_workers`)
and counts: wrong answers, errors (`Execution exception`, failure causes), sandbox timeouts, executor timeouts and
hung calls: a watchdog counts every call still out after the tool's timeout + 5 s (the sandbox's own backstop).
Afterwards no process may be left under the sandbox's uids and the caller's open fds and threads are compared.

    python benchmarks/tools/sandbox_load.py [--ready 0,4] [--soak-ready 4] [--soak 10000] [--levels 1,16,128]

``--ready`` sets `ready_sandboxes` (the pool of started sandboxes waiting for a program; 0 = start on demand);
several values are run one after the other at each level, so that the machine's load affects them alike.
Prints a table and a final JSON line.
"""

import argparse
import json
import os
import platform
import subprocess
import threading
import time

import numpy as np

from arpo_jax.tools import make_executor, python_sandbox

TOOL_TIMEOUT_S = 10.0  # the sandbox kills a program after this; a call out longer than this + 5 s is hung
HUNG_AFTER_S = TOOL_TIMEOUT_S + 5.0


def program(i: int, stamped: bool = False) -> tuple[str, str]:
    """The GSM8K-style program of call ``i`` and the answer it must print."""
    body = f"eggs_per_day = 16\neaten = {3 + i % 5}\nbaked = 4\nprice = 2\n(eggs_per_day - eaten - baked) * price"
    answer = str((16 - (3 + i % 5) - 4) * 2)
    if stamped:  # the stamps go around the same statements; the answer is printed before the end stamp
        body = ("import time as _t\n_t0 = _t.monotonic()\n" + body.replace("\n(eggs", "\nprint((eggs") + ")\n"
                "print(_t0, _t.monotonic())")
    return f"```python\n{body}\n```", answer


def make(concurrency: int, ready: int | None):
    params = {"timeout_s": TOOL_TIMEOUT_S, "memory_mb": 4096}
    if ready is not None:
        params["ready_sandboxes"] = ready
    return make_executor({"python": params}, max_workers=max(64, concurrency), timeout_s=TOOL_TIMEOUT_S + 5,
                         retry_count=3)


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {"ok": 0, "wrong": 0, "error": 0, "sandbox_timeout": 0, "executor_timeout": 0, "hung": 0}
        self.latencies: list[float] = []
        self.stamps: list[tuple[float, float, float]] = []

    def add(self, key: str, latency: float, stamp=None) -> None:
        with self.lock:
            self.c[key] += 1
            self.latencies.append(latency)
            if stamp is not None:
                self.stamps.append(stamp)


def classify(result, answer: str) -> str:
    text = result.text
    if result.failure == "tool_timeout":
        return "executor_timeout"
    if result.failure is not None or text.startswith(("Execution exception", "Error: Tool(")):
        return "error"
    if "Execution timed out" in text:
        return "sandbox_timeout"
    return "ok" if text.split("\n")[0] == answer else "wrong"


def drive(ex, concurrency: int, calls_per_thread: int, stamped: bool = False, counts: Counts | None = None,
          watch: bool = False) -> tuple[Counts, float]:
    """``concurrency`` threads, each making ``calls_per_thread`` calls one after the other, as ToolRunner does."""
    counts = counts or Counts()
    inflight: dict[int, float] = {}  # thread -> start of its call in flight
    flagged: set[tuple[int, float]] = set()
    stop = threading.Event()

    def client(k: int) -> None:
        for j in range(calls_per_thread):
            code, answer = program(k * calls_per_thread + j, stamped)
            t0 = time.monotonic()
            inflight[k] = t0
            (res,) = ex.run_batch([("python", code)])
            t1 = time.monotonic()
            del inflight[k]
            kind = classify(res, answer)
            stamp = None
            if stamped and kind == "ok":
                start, end = map(float, res.text.split("\n")[1].split())
                stamp = (start - t0, end - start, t1 - end)
            counts.add(kind, t1 - t0, stamp)

    def watchdog() -> None:  # a hung call is counted once, while it is still out
        while not stop.wait(1.0):
            now = time.monotonic()
            for k, t0 in list(inflight.items()):
                if now - t0 > HUNG_AFTER_S and (k, t0) not in flagged:
                    flagged.add((k, t0))
                    with counts.lock:
                        counts.c["hung"] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    dog = threading.Thread(target=watchdog, daemon=True)
    if watch:
        dog.start()
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    stop.set()
    return counts, wall


def sandbox_processes() -> int:
    """Processes under this process's sandbox uids (PythonSandboxConfig.uid_base) or left children."""
    return len(python_sandbox.sandbox_pids(python_sandbox.PythonSandboxConfig().uid_base))


def level(concurrency: int, calls_per_thread: int, ready: int | None) -> dict:
    ex = make(concurrency, ready)
    ex.run_batch([("python", program(0)[0])] * min(concurrency, 8))  # warm-up: zygote started, pool filled
    time.sleep(0.5)
    counts, wall = drive(ex, concurrency, calls_per_thread)
    load = os.getloadavg()[0]
    stamps, _ = drive(ex, concurrency, max(4, calls_per_thread // 4), stamped=True)
    ex.close()
    lat = np.asarray(counts.latencies) * 1e3
    st = np.asarray(stamps.stamps) * 1e3 if stamps.stamps else np.zeros((1, 3))
    n = len(counts.latencies)
    return {"concurrency": concurrency, "calls": n, "calls_per_s": round(n / wall, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2),
            "startup_p50_ms": round(float(np.median(st[:, 0])), 2), "run_p50_ms": round(float(np.median(st[:, 1])), 2),
            "return_p50_ms": round(float(np.median(st[:, 2])), 2), "load1": round(load, 2),
            "not_ok": {k: v for k, v in counts.c.items() if k != "ok" and v}}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(n: int, concurrency: int, ready: int | None) -> dict:
    fds, threads = open_fds(), threading.active_count()  # before the tool exists: after close(), the same
    ex = make(concurrency, ready)
    ex.run_batch([("python", program(0)[0])])
    per_thread = -(-n // concurrency)
    counts, wall = drive(ex, concurrency, per_thread, watch=True)
    load = os.getloadavg()[0]
    lat = np.asarray(counts.latencies) * 1e3
    res = {"calls": len(counts.latencies), "concurrency": concurrency, "wall_s": round(wall, 1),
           "calls_per_s": round(len(counts.latencies) / wall, 1), "p50_ms": round(float(np.percentile(lat, 50)), 2),
           "p99_ms": round(float(np.percentile(lat, 99)), 2), "max_ms": round(float(lat.max()), 1), **counts.c,
           "load1_end": round(load, 2)}
    ex.close()
    time.sleep(1.0)  # the executor's idle threads exit once told to
    res |= {"fds_before_after": (fds, open_fds()), "threads_before_after": (threads, threading.active_count())}
    deadline = time.monotonic() + 5  # pid namespaces are torn down asynchronously
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    res["processes_left_after_close"] = sandbox_processes()
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ready", default="", help="ready_sandboxes values, e.g. 0,4 (default: the config's default)")
    p.add_argument("--soak-ready", type=int, default=None, help="ready_sandboxes of the soak (default: the default)")
    p.add_argument("--levels", default="1,16,128")
    p.add_argument("--calls-per-thread", type=int, default=0, help="0: 300 calls at 1, then 40 per thread")
    p.add_argument("--soak", type=int, default=10000)
    p.add_argument("--soak-concurrency", type=int, default=64)
    args = p.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    readies = [int(r) for r in args.ready.split(",")] if args.ready else [None]
    out = {"machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()}", "commit": rev,
           "load_start": os.getloadavg(), "levels": []}
    print(f"{'ready':>7} {'conc':>5} {'calls':>6} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} | {'start-up':>8} "
          f"{'run':>6} {'return':>7} (p50 ms) | load1  not ok")
    for c, ready in ((int(c), r) for c in args.levels.split(",") if c for r in readies):
        per = args.calls_per_thread or (300 if c == 1 else 40 if c <= 16 else 20)
        r = level(c, per, ready) | {"ready_sandboxes": ready}
        out["levels"].append(r)
        print(f"{'default' if ready is None else ready:>7} {c:5d}"
              f" {r['calls']:6d} {r['calls_per_s']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} | "
              f"{r['startup_p50_ms']:8.2f} {r['run_p50_ms']:6.2f} {r['return_p50_ms']:7.2f}          | "
              f"{r['load1']:5.2f}  {r['not_ok'] or '-'}", flush=True)
    if args.soak:
        s = soak(args.soak, args.soak_concurrency, args.soak_ready) | {"ready_sandboxes": args.soak_ready}
        out["soak"] = s
        print(f"\nsoak: {s['calls']} calls at {s['concurrency']} concurrent in {s['wall_s']} s "
              f"({s['calls_per_s']} calls/s, p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms): "
              f"ok {s['ok']}, wrong {s['wrong']}, errors {s['error']}, sandbox timeouts {s['sandbox_timeout']}, "
              f"executor timeouts {s['executor_timeout']}, hung {s['hung']}; fds {s['fds_before_after']}, threads "
              f"{s['threads_before_after']} (before the tool, after its close), processes left "
              f"{s['processes_left_after_close']}")
    out["load_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
