"""Where a program's time goes: a `jax.profiler` trace of it, summed by kernel and by host activity.

`traced(dir)` records what runs inside it (Python's own tracer off: it would slow the host side it measures) into
`dir/plugins/profile/<time>/perfetto_trace.json.gz`; `summarise(dir)` reads the newest such file and returns

  * span_ms: first to last event of the trace;
  * device_busy_ms: the union of the device's kernel intervals (accelerator streams; on the CPU backend, XLA's own
    threads), so span - busy is the time the device waited for the host;
  * kernels: the `top` kernel names by summed time, with counts (per-step kernels show as count = steps x layers);
  * host: the same for the host's threads (jitted calls, transfers, the runtime's own work).

`phase_busy(dir)` splits the device's busy time by the annotated spans of the trainer's phases and the agent loop's
generation / tool waits (`phase/<name>`, `rollout/<name>`).

  python benchmarks/trace_summary.py DIR [--top 25]      # prints the summary as JSON
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
from collections import defaultdict
from pathlib import Path


@contextlib.contextmanager
def traced(log_dir: str | Path):
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's tracer records every call: it would slow the host side it measures
    with jax.profiler.trace(str(log_dir), create_perfetto_trace=True, profiler_options=options):
        yield


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def _top(events: list[dict], top: int) -> list[dict]:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        s = by_name[e["name"]]
        s[0] += e["dur"]
        s[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n[:160], "ms": round(ms / 1e3, 3), "count": c} for n, (ms, c) in ranked]


def _load(log_dir: str | Path):
    """(the newest trace's file, its complete spans, on_device(span), the accelerators' names)."""
    files = sorted(Path(log_dir).glob("plugins/profile/*/perfetto_trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(files[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    accelerator = {p for p, name in process.items() if "/device:" in name and "CPU" not in name}

    def on_device(e: dict) -> bool:
        if accelerator:
            return e["pid"] in accelerator
        name = thread.get((e["pid"], e.get("tid")), "")  # the CPU backend: its client's and Eigen's threads
        return ("XLAEigen" in name or "XLAPjRtCpuClient" in name) and not e["name"].startswith("ThreadpoolListener")

    return files[-1], spans, on_device, sorted(process[p] for p in accelerator)


def summarise(log_dir: str | Path, top: int = 25) -> dict:
    file, spans, on_device, devices = _load(log_dir)
    device = [e for e in spans if on_device(e)]
    host = [e for e in spans if not on_device(e)]
    t0 = min((e["ts"] for e in spans), default=0.0)
    t1 = max((e["ts"] + e["dur"] for e in spans), default=0.0)
    return {"trace": str(file), "span_ms": round((t1 - t0) / 1e3, 3),
            "device_busy_ms": round(_union_ms([(e["ts"], e["ts"] + e["dur"]) for e in device]), 3),
            "device_kernels": len(device), "devices": devices,
            "kernels": _top(device, top), "host": _top(host, top)}


def _clipped_ms(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """The union of `intervals` inside the union of `windows` (both in us), in ms."""
    inside = [(max(a, w0), min(b, w1)) for a, b in intervals for w0, w1 in windows if a < w1 and b > w0]
    return _union_ms(inside)


def phase_busy(log_dir: str | Path, prefixes: tuple[str, ...] = ("phase/", "rollout/")) -> dict:
    """The device's busy time inside each annotated span of the newest trace under `log_dir`: the trainer's phases
    (`phase/<name>`, `metrics.PhaseTimer`) and the agent loop's (`rollout/generate`, `rollout/tools`, ...), as
    {name: {"wall_ms", "busy_ms", "busy_share"}} (a name's spans taken as one union), plus "span": from the first
    annotated span's start to the last one's end (the whole step when the trace holds one step)."""
    _, spans, on_device, _ = _load(log_dir)
    device = [(e["ts"], e["ts"] + e["dur"]) for e in spans if on_device(e)]
    windows: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in spans:
        if e["name"].startswith(prefixes) and not on_device(e):
            windows[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    if windows:
        windows["span"] = [(min(a for ws in windows.values() for a, _ in ws),
                            max(b for ws in windows.values() for _, b in ws))]
    out = {}
    for name, ws in sorted(windows.items()):
        wall, busy = _union_ms(ws), _clipped_ms(device, ws)
        out[name] = {"wall_ms": round(wall, 3), "busy_ms": round(busy, 3),
                     "busy_share": round(busy / wall, 4) if wall else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(json.dumps(summarise(args.dir, args.top), indent=1))


if __name__ == "__main__":
    main()
