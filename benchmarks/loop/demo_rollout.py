"""ARPO's rollout against GRPO's in the FULL demo with the JAX engine: the streaming schedule, the round schedule and
an older checkout (issue 69's before and after), from one SFT model, at the same trajectories a step.

For each tree (this checkout, and `--before DIR`: another checkout run from its own sources) and each schedule
(`rollout.schedule`; an older tree has only its own), `arpo-jax demo --engine jax --set trainer.max_steps=N` runs
ARPO, then GRPO, all in one work dir: the first run builds the data and the SFT model, every later run resumes them
(`trainer.allow_config_change`: their configs differ in the schedule, or the tree, only), so every run starts from the
same SFT model and draws the same prompts; each RL run's folder is moved to `runs/<tree>_<schedule>_<algo>` after
it. From each RL run's metrics.jsonl: the median over RL steps 2..N of `time/rollout` (the step's rollout, rewards
included), `rollout/decode_steps` (the engine's sequential decode iterations: what an accelerator pays for),
`rollout/rounds`, `time/step` and the engine's counts; then ARPO / GRPO of each.

  python benchmarks/loop/demo_rollout.py --workdir runs/demo_rollout [--steps 4] [--before /path/to/old/checkout]

Each run is a subprocess (its JAX and engine memory go with it). Prints a table, then a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("time/rollout", "rollout/decode_steps", "rollout/rounds", "time/step", "rollout/critical_path_steps",
        "rollout/rows_per_decode_step", "rollout/computed_row_steps", "rollout/sampled_tokens",
        "rollout/prefill_tokens", "rollout/speculative_tokens_discarded", "rollout/trajectories")


def run_demo(tree: Path, workdir: Path, algo: str, steps: int, schedule: str | None, resume: bool, log) -> dict:
    """One demo run; its RL steps' metrics."""
    cmd = [sys.executable, "-m", "arpo_jax.cli", "demo", "--workdir", str(workdir), "--engine", "jax", "--algo", algo,
           "--set", f"trainer.max_steps={steps}"]
    if schedule:
        cmd += ["--set", f"rollout.schedule={schedule}"]
    if resume:  # the SFT model of an earlier run, whose config differs in the schedule or the tree only
        cmd += ["--set", "trainer.allow_config_change=true"]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=tree, check=True, stdout=log, stderr=subprocess.STDOUT)
    records = [json.loads(line) for line in (workdir / algo / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "time/rollout" in r]
    return {"wall_s": round(time.perf_counter() - t0, 1), "steps": train}


def median_of(steps: list[dict], key: str, first: int = 2) -> float | None:
    values = [s[key] for s in steps if s.get("step", 0) >= first and s.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo_rollout")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--schedules", nargs="+", default=["stream", "rounds"])
    parser.add_argument("--algos", nargs="+", default=["arpo", "grpo"])
    parser.add_argument("--before", type=Path, help="an older checkout, run with its own rollout")
    args = parser.parse_args()
    root = Path(args.workdir).absolute()
    runs = [("after", ROOT, s) for s in args.schedules] + ([("before", args.before.absolute(), None)]
                                                            if args.before else [])
    workdir, done = root / "demo", root / "runs"
    rows, log_path = [], root / "runs.log"
    done.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        for label, tree, schedule in runs:
            for algo in args.algos:
                out = run_demo(tree, workdir, algo, args.steps, schedule, bool(rows) or (workdir / "sft").exists(), log)
                (workdir / algo).rename(done / f"{label}_{schedule or 'own'}_{algo}")
                row = {"tree": label, "schedule": schedule or "rounds (its own)", "algo": algo, "wall_s": out["wall_s"]}
                row |= {k: median_of(out["steps"], k) for k in KEYS}
                rows.append(row)
                print(json.dumps(row), flush=True)
    ratios = {}
    for label, _, schedule in runs:
        mine = {r["algo"]: r for r in rows if r["tree"] == label and r["schedule"] == (schedule or "rounds (its own)")}
        if {"arpo", "grpo"} <= mine.keys():
            ratios[f"{label}/{schedule or 'own'}"] = {
                k: round(mine["arpo"][k] / mine["grpo"][k], 3)
                for k in ("time/rollout", "rollout/decode_steps", "rollout/rounds", "time/step")
                if mine["arpo"].get(k) and mine["grpo"].get(k)}
    print(f"\n{'tree':7} {'schedule':17} {'algo':5} {'rollout s':>9} {'decode steps':>12} {'rounds':>6} {'step s':>7}")
    for r in rows:
        print(f"{r['tree']:7} {r['schedule']:17} {r['algo']:5} {r['time/rollout'] or 0:9.1f} "
              f"{r['rollout/decode_steps'] or 0:12.0f} {r['rollout/rounds'] or 0:6.1f} {r['time/step'] or 0:7.1f}")
    print("ARPO / GRPO (medians of RL steps 2.."f"{args.steps}):", json.dumps(ratios))
    print(json.dumps({"runs": rows, "arpo_over_grpo": ratios, "log": str(log_path)}))


if __name__ == "__main__":
    main()
