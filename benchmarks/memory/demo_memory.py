"""The demo's memory: every process it starts together (the JAX process, its vLLM worker, the tools' workers), sampled
once a second, per phase of the demo.

Runs `arpo-jax demo` under `/usr/bin/time -v` and polls /proc: each sample sums VmRSS (and Pss, which counts a page
shared by k processes as 1/k of it, so the sum is what the tree really holds) over the command and all of its
descendants. The phase is the demo's last `[demo] N/6` line. Run it under the shared lock: the demo takes minutes and
~10 GB.

  flock /tmp/heavy.lock python benchmarks/memory/demo_memory.py --workdir /tmp/demomem/run1 [--quick] [--cold-cache]
                                                         [-- extra demo args]

Prints the demo's output, then per phase the peak summed RSS / PSS and each kind of process's peak RSS; the last line
is all of it as JSON with the demo's own wall times per phase (`wall_s`) and `/usr/bin/time -v`'s maximum resident
set size (the largest single process, not the sum). `--cold-cache` gives the run a fresh JAX compilation cache in
the work dir (what a first run on a new machine compiles); by default it uses the shared one under $ARPO_CACHE.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1024**3


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from each /proc/<pid>/stat's parent id."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def process_memory(pid: int) -> tuple[str, int, int] | None:
    """(kind, RSS bytes, PSS bytes) of one process; None when it has gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {m[0]: int(m[1]) * 1024 for m in re.findall(r"^(\w+):\s+(\d+) kB", rollup, re.M)}
    return kind_of(cmdline), fields.get("Rss", 0), fields.get("Pss", 0)


def kind_of(cmdline: str) -> str:
    if "vllm_worker.py" in cmdline:
        return "vllm_worker"
    if "arpo_jax.cli" in cmdline or "arpo-jax" in cmdline or "demo_memory.py --child" in cmdline:
        return "demo"
    if cmdline.startswith("/usr/bin/time"):
        return "time"
    return "other"  # the tools' workers (Python sandbox, search), compilers


class Sampler(threading.Thread):
    """Polls the tree below `root` every `interval` seconds; `phase` is set by the reader of the demo's output."""

    def __init__(self, root: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.phase = "start"
        self.peaks: dict[str, dict] = {}
        self.timeline: list[tuple[float, str, float, dict]] = []  # (time, phase, summed RSS GB, per kind)
        self.done = threading.Event()
        self.t0 = time.perf_counter()

    def sample(self) -> None:
        rss = pss = 0
        kinds: dict[str, int] = {}
        for pid in descendants(self.root):
            mem = process_memory(pid)
            if mem is None:
                continue
            kind, r, p = mem
            rss, pss = rss + r, pss + p
            kinds[kind] = kinds.get(kind, 0) + r
        peak = self.peaks.setdefault(self.phase, {"rss": 0, "pss": 0, "by_kind_rss": {}})
        peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
        for kind, r in kinds.items():
            peak["by_kind_rss"][kind] = max(peak["by_kind_rss"].get(kind, 0), r)
        self.timeline.append((round(time.time(), 1), self.phase, round(rss / GB, 3),
                              {k: round(r / GB, 3) for k, r in sorted(kinds.items())}))

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.sample()


PHASE = re.compile(r"^\[demo\] (\d)/6 (\S+)")
PHASE_NAMES = {"1": "setup", "2": "sft", "3": "rl", "4": "transcript", "5": "plots", "6": "report"}


def live_arrays_child(demo_args: list[str], out_file: Path, interval: float = 2.0) -> int:
    """Runs the demo in this process (as `arpo-jax demo` would, huge pages included) while a thread writes the bytes
    of JAX's live arrays (`jax.live_arrays()`) every `interval` seconds to `out_file`: (time, bytes, arrays)."""
    from arpo_jax import cli, hugepages

    hugepages.reexec_with_hugepages()
    import jax

    samples: list[tuple[float, int, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            arrays = jax.live_arrays()
            samples.append((round(time.time(), 1), sum(a.nbytes for a in arrays), len(arrays)))
            # Dropped before the next poll: a list held across polls keeps its arrays alive, and the next list
            # then holds them too (the first version of this probe kept SFT's state alive for the whole run).
            del arrays
            out_file.write_text(json.dumps(samples))

    threading.Thread(target=poll, daemon=True).start()
    try:
        return cli.main(["demo", *demo_args])
    finally:
        stop.set()
        out_file.write_text(json.dumps(samples))


def live_by_phase(timeline: list, live: list) -> dict[str, float]:
    """The largest live-array total (GB) within each phase, phases from the RSS timeline's times."""
    peaks: dict[str, float] = {}
    for t, nbytes, _ in live:
        phase = next((p for tt, p, *_ in reversed(timeline) if tt <= t), "start")
        peaks[phase] = max(peaks.get(phase, 0.0), round(nbytes / GB, 2))
    return peaks


def max_rss_of_time(stderr: str) -> float | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return round(int(m[1]) * 1024 / GB, 3) if m else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold-cache", action="store_true")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--live-arrays", action="store_true",
                        help="run the demo inside a child of this script that also samples jax.live_arrays()")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more `arpo-jax demo` arguments (after --)")
    args = parser.parse_args()

    demo_args = ["--workdir", args.workdir, *(["--quick"] if args.quick else []), *args.extra]
    live_file = Path(args.workdir).absolute().with_name(Path(args.workdir).name + "_live_arrays.json")
    if args.child:
        sys.exit(live_arrays_child(demo_args, live_file))
    env = dict(os.environ)
    if args.cold_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = str(Path(args.workdir).absolute() / "jax_compilation")
    if args.live_arrays:
        live_file.unlink(missing_ok=True)
        cmd = ["/usr/bin/time", "-v", sys.executable, os.path.abspath(__file__), "--child", "--workdir", args.workdir,
               *(["--quick"] if args.quick else []), "--", *args.extra]
    else:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "arpo_jax.cli", "demo", *demo_args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    sampler = Sampler(proc.pid, args.interval)
    sampler.start()
    stderr_lines: list[str] = []
    drain = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)
    drain.start()
    last_json = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if m := PHASE.match(line):
            sampler.sample()  # the previous phase's last sample
            sampler.phase = PHASE_NAMES[m[1]]
        if line.startswith("{"):
            last_json = line
    proc.wait()
    sampler.done.set()
    sampler.join()
    drain.join()
    stderr = "".join(stderr_lines)
    print(stderr[-3000:], file=sys.stderr)

    demo_summary = json.loads(last_json) if last_json else {}
    phases = {phase: {"rss_gb": round(p["rss"] / GB, 2), "pss_gb": round(p["pss"] / GB, 2),
                      "by_kind_rss_gb": {k: round(v / GB, 2) for k, v in sorted(p["by_kind_rss"].items())}}
              for phase, p in sampler.peaks.items()}
    for phase, p in phases.items():
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_rss_gb"].items())
        print(f"{phase:>10}: peak summed RSS {p['rss_gb']:.2f} GB, PSS {p['pss_gb']:.2f} GB ({kinds})")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (Path(args.workdir) / "memory_timeline.json").write_text(json.dumps(sampler.timeline))
    live = json.loads(live_file.read_text()) if args.live_arrays and live_file.is_file() else []
    result = {
        "returncode": proc.returncode,
        "peak_sum_rss_gb": max((p["rss_gb"] for p in phases.values()), default=None),
        "peak_sum_pss_gb": max((p["pss_gb"] for p in phases.values()), default=None),
        "time_v_max_rss_gb": max_rss_of_time(stderr),
        "wall_s": round(time.perf_counter() - t0, 1),
        "demo_wall_s": demo_summary.get("wall_s"),
        "phases": phases,
        "live_arrays_peak_gb": live_by_phase(sampler.timeline, live) if live else None,
        "cold_cache": args.cold_cache,
        "quick": args.quick,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
