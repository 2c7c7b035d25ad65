"""Python tool start-up and throughput: cold interpreter per call vs the warm zygote pool.

Baseline: the reference's way (``subprocess.run([python, "-c", code])``, no sandbox). Measures sequential calls/s
for a trivial program and for one that imports numpy, the wall time of 64 concurrent calls through the
executor, and how long each hostile program takes to be contained. Prints a table and a final JSON line.

    python benchmarks/tools/tools_python.py [--calls 40] [--concurrent 64]
    python benchmarks/tools/tools_python.py --compare 6cbaf5e [--calls 200]   # pooled latency vs an older sandbox

``--compare REV`` loads the sandbox of git revision REV next to this one and times pooled ``print(1)`` calls of
the two *interleaved* (old, new, old, new...), so the machine's load affects both alike, then the wall time of
``--concurrent`` calls through the executor (3 rounds, interleaved).
"""

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from arpo_jax.tools import ExecutorConfig, PythonSandboxConfig, PythonTool, ToolExecutor

HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "sleep_past_timeout": "import time\ntime.sleep(60)",
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "memory_bomb": "b = []\nwhile True:\n    b.append(bytearray(50 * 1024 * 1024))",
    "100MB_output": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1000000)",
    "daemonised_child": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('bye')",
}


def time_calls(fn, code: str, n: int) -> list[float]:
    fn(code)  # warm-up (starts the zygote, fills page caches)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(code)
        out.append(time.perf_counter() - t0)
    return out


def reference_call(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout


def concurrent_wall(tool: PythonTool, n: int) -> float:
    ex = ToolExecutor([tool], ExecutorConfig(max_workers=n))
    ex.execute_batch([("python", "1")] * 4)
    t0 = time.perf_counter()
    outs = ex.execute_batch([("python", f"sum(range({i} * 1000))") for i in range(n)])
    wall = time.perf_counter() - t0
    assert outs == [str(sum(range(i * 1000))) for i in range(n)], outs[:3]
    ex.close(close_tools=False)
    return wall


def load_sandbox_at(rev: str, into: str):
    """The python_sandbox module of git revision ``rev`` (with its own _sandbox_child.py), imported from ``into``."""
    repo = pathlib.Path(__file__).resolve().parents[2]
    for name in ("python_sandbox.py", "_sandbox_child.py"):
        text = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:arpo_jax/tools/{name}"], check=True,
                              capture_output=True, text=True).stdout
        pathlib.Path(into, name).write_text(text)
    spec = importlib.util.spec_from_file_location(f"python_sandbox_{rev}", os.path.join(into, "python_sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(rev: str, calls: int, concurrent: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        old = load_sandbox_at(rev, tmp)
        tools = {rev: old.PythonTool(old.PythonSandboxConfig(pool=True)),
                 "this tree": PythonTool(PythonSandboxConfig(pool=True))}
        for t in tools.values():
            assert t.execute("print(1)") == "1"
        lat = {name: [] for name in tools}
        for _ in range(calls):
            for name, t in tools.items():
                t0 = time.perf_counter()
                t.execute("print(1)")
                lat[name].append(time.perf_counter() - t0)
        walls = {name: [] for name in tools}
        for _ in range(3):
            for name, t in tools.items():
                walls[name].append(concurrent_wall(t, concurrent))
        for t in tools.values():
            t.close()
    res = {name: round(statistics.median(v) * 1e3, 2) for name, v in lat.items()}
    res[f"concurrent{concurrent}_wall_s"] = {name: round(statistics.median(v), 3) for name, v in walls.items()}
    res["p90"] = {name: round(statistics.quantiles(v, n=10)[-1] * 1e3, 2) for name, v in lat.items()}
    res["ratio_median"] = round(res["this tree"] / res[rev], 3)
    res["load_avg"] = os.getloadavg()
    res["machine"] = f"{platform.processor() or platform.machine()} x{os.cpu_count()}, {platform.system()}"
    print(f"pooled print(1), {calls} interleaved calls each: median {rev} {res[rev]} ms, this tree "
          f"{res['this tree']} ms (x{res['ratio_median']}); {concurrent} concurrent calls (median of 3): "
          f"{res[f'concurrent{concurrent}_wall_s']}")
    print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--compare", metavar="REV", help="only compare pooled latency with the sandbox of git REV")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare, args.calls, args.concurrent)
    programs = {"print(1)": "print(1)", "import numpy": "import numpy\nprint(numpy.zeros(3).sum())"}
    tools = {"cold": PythonTool(PythonSandboxConfig(pool=False)), "pool": PythonTool(PythonSandboxConfig(pool=True))}
    t0 = time.perf_counter()
    tools["pool"].sandbox.start()
    zygote_start = time.perf_counter() - t0
    rows, res = [], {"zygote_start_s": zygote_start}
    for prog_name, code in programs.items():
        runners = {"reference (no sandbox)": reference_call, "sandbox cold": tools["cold"].execute,
                   "sandbox warm pool": tools["pool"].execute}
        for name, fn in runners.items():
            lat = time_calls(fn, code, args.calls)
            med = statistics.median(lat)
            rows.append((prog_name, name, med * 1e3, 1 / med))
            res[f"{prog_name}|{name}|median_ms"] = round(med * 1e3, 2)
    print(f"{'program':14} {'runner':24} {'median ms':>10} {'calls/s':>9}")
    for prog, name, ms, cps in rows:
        print(f"{prog:14} {name:24} {ms:10.1f} {cps:9.1f}")
    print(f"\nzygote start-up (one-off): {zygote_start * 1e3:.0f} ms")
    for mode in ("cold", "pool"):
        wall = concurrent_wall(tools[mode], args.concurrent)
        res[f"concurrent{args.concurrent}_{mode}_wall_s"] = round(wall, 3)
        print(f"{args.concurrent} concurrent calls, {mode:4}: {wall:.2f} s wall")
    hostile_tool = PythonTool(PythonSandboxConfig(pool=True, timeout_s=2.0, memory_mb=512, max_processes=32))
    print("\nhostile program       contained after (timeout 2 s)")
    for name, code in HOSTILE.items():
        t0 = time.perf_counter()
        hostile_tool.execute(code)
        dt = time.perf_counter() - t0
        res[f"hostile_{name}_s"] = round(dt, 3)
        print(f"{name:22} {dt:6.2f} s")
    for t in (*tools.values(), hostile_tool):
        t.close()
    cold = res["print(1)|sandbox cold|median_ms"]
    warm = res["print(1)|sandbox warm pool|median_ms"]
    res.update(speedup_pool_vs_cold=round(cold / warm, 2),
               speedup_pool_vs_cold_numpy=round(res["import numpy|sandbox cold|median_ms"]
                                                / res["import numpy|sandbox warm pool|median_ms"], 2),
               machine=f"{platform.processor() or platform.machine()} x{os.cpu_count()}, {platform.system()}",
               python=platform.python_version())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
