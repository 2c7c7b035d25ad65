"""Python tool start-up and throughput: cold interpreter per call vs the warm zygote pool.

Baseline: the reference's way (``subprocess.run([python, "-c", code])``, no sandbox). Measures sequential calls/s
for a trivial program and for one that imports numpy, the wall time of 64 concurrent calls through the
executor, and how long each hostile program takes to be contained. Prints a table and a final JSON line.

    python benchmarks/tools_python.py [--calls 40] [--concurrent 64]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--concurrent", type=int, default=64)
    args = p.parse_args()
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
