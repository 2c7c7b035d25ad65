"""The full demo over several seeds: does RL beat the SFT baseline beyond seed noise, and ARPO vs plain GRPO.

For each seed, one work dir (`<workdir>/seed<S>`): `arpo-jax demo` with each algorithm (`--algos`, default arpo then
grpo). The data and the cold-start SFT are built by the first run of a seed and reused by the others (the demo resumes
them), so both algorithms start from the same SFT model with the same rollout budget n and the same number of steps;
GRPO spends the budget on independent rollouts, ARPO branches at tool calls. The first algorithm runs on every seed
before the second starts, so a run cut short still has the first algorithm's seed spread; a finished run is resumed
(its summary re-read, the exported model answering again), so the script can be run again after an interruption.

  python benchmarks/studies/demo_seeds.py --workdir runs/demo_seeds [--seeds 0 1 2] [--algos arpo grpo]
      [--model NAME] [--lora]

Prints one line per run, then per algorithm the mean and spread (sample std, min..max) over seeds of the SFT
baseline and final greedy validation accuracy, their difference, and the tool calls per training trajectory over the
last 5 RL steps (the demo summary's); the last line is all of it as JSON. Wall times are per run (the first run of a
seed includes SFT).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arpo_jax import demo


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
            "min": round(min(values), 4), "max": round(max(values), 4), "values": [round(v, 4) for v in values]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo_seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algos", nargs="+", default=["arpo", "grpo"], choices=demo.ALGOS)
    parser.add_argument("--model", default=demo.DEFAULT_MODEL)
    parser.add_argument("--lora", action="store_true", help="the RL phase with LoRA adapters (`arpo-jax demo --lora`)")
    args = parser.parse_args()

    runs = []
    for algo in args.algos:
        for seed in args.seeds:
            s = demo.run_demo(Path(args.workdir) / f"seed{seed}", algo=algo, seed=seed, model=args.model,
                              vllm=False, lora=args.lora)
            run = {"seed": seed, "algo": algo, "baseline": s["baseline_val_accuracy"],
                   "final": s["final_val_accuracy"], "baseline_val": s["baseline_val"],
                   "final_val": s["final_val"], "tool_calls": s["tool_calls_per_trajectory_last"],
                   "wall_s": s["wall_s"]}
            runs.append(run)
            print("RUN " + json.dumps(run), flush=True)

    report = {"runs": runs, "algos": {}}
    for algo in args.algos:
        mine = [r for r in runs if r["algo"] == algo]
        report["algos"][algo] = {
            "baseline_val_accuracy": spread([r["baseline"] for r in mine]),
            "final_val_accuracy": spread([r["final"] for r in mine]),
            "gain": spread([r["final"] - r["baseline"] for r in mine]),
            "tool_calls_per_trajectory": spread([r["tool_calls"] for r in mine]),
        }
        a = report["algos"][algo]
        print(f"{algo:5s} SFT {a['baseline_val_accuracy']['mean']:.3f} +- {a['baseline_val_accuracy']['std']:.3f} -> "
              f"final {a['final_val_accuracy']['mean']:.3f} +- {a['final_val_accuracy']['std']:.3f} "
              f"(gain {a['gain']['mean']:+.3f}, min {a['gain']['min']:+.3f}); tool calls/trajectory "
              f"{a['tool_calls_per_trajectory']['mean']:.2f} +- {a['tool_calls_per_trajectory']['std']:.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
