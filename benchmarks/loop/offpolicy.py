"""Step time of `arpo-jax train`, synchronous vs one step off-policy (`rollout.max_staleness`), per phase.

For each staleness (default 0 and 1), one `arpo-jax train` run of `--steps` steps on the toy config (`builtin:toy_cpu`,
tiny random model) with the vLLM engine (`--engine jax` for the JAX one), a text-dependent reward so every step
updates. Reports the mean over the steps after the first (compiles, and at staleness 1 its rollout is not generated
ahead) of the step's wall time and of each phase the trainer times (`time/<phase>` in metrics.jsonl): the main
thread's phases (rollout_wait, rollout_ahead, advantages, pack, old_logprob, update, weight_sync, metrics) add up to
the step; rollout and reward are the step's rollout's own times, wherever it ran (at staleness 1 in the background,
during the previous step's update), so with overlap rollout_wait ~ max(0, rollout + reward - the main thread's work).

  flock /tmp/heavy.lock python benchmarks/loop/offpolicy.py --workdir /tmp/offpolicy_bench [--steps 5] [--engine vllm]
      [--override actor.ppo_epochs=8 ...]

Prints one line per run, then a final JSON line with every run's per-phase means, the speed-up of each staleness
over staleness 0, and what the synchronous run's phases predict (`predict`): the step time and the idle fractions of
trainer and engine, synchronous and one step off-policy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (sum(map(ord, solution_str)) % 97) / 97.0}
'''
PHASES = ("rollout_wait", "rollout_ahead", "advantages", "pack", "old_logprob", "update", "weight_sync", "metrics",
          "rollout", "reward")


def run(workdir: Path, staleness: int, steps: int, engine: str, overrides: list[str]) -> dict:
    """One training run; the per-phase means over its steps after the first."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    reward = workdir.parent / "reward.py"
    reward.write_text(REWARD)
    cmd = [sys.executable, "-m", "arpo_jax.cli", "train", "--config=builtin:toy_cpu", f"--workdir={workdir}",
           f"--config.reward.custom_path={reward}", f"--config.trainer.max_steps={steps}",
           "--config.trainer.save_freq=0", "--config.trainer.progress=false", "--config.trainer.loggers=('jsonl',)",
           f"--config.rollout.engine={engine}", f"--config.rollout.max_staleness={staleness}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit((proc.stdout + proc.stderr)[-4000:])
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][1:]
    mean = lambda key: round(statistics.fmean(r.get(key, 0.0) for r in records), 3)
    return {"max_staleness": staleness, "steps_averaged": len(records), "run_wall_s": round(wall, 1),
            "step_s": mean("time/step"), **{p: mean(f"time/{p}") for p in PHASES},
            "staleness": [r["rollout/staleness"] for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/offpolicy_bench")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default="vllm", choices=("vllm", "jax"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--override", nargs="*", default=[], help="more config overrides, e.g. actor.ppo_epochs=8")
    args = parser.parse_args()
    runs = []
    for s in args.staleness:
        r = run(Path(args.workdir) / f"s{s}", s, args.steps, args.engine, [f"--config.{o}" for o in args.override])
        print(f"max_staleness={s}: step {r['step_s']} s (rollout {r['rollout']} s, update {r['update']} s, "
              f"waited for the rollout {r['rollout_wait']} s, weight sync {r['weight_sync']} s; "
              f"run {r['run_wall_s']} s)", flush=True)
        runs.append(r)
    base = runs[0]["step_s"]
    print(json.dumps({"engine": args.engine, "steps": args.steps, "overrides": args.override,
                      "load_avg": os.getloadavg()[0],
                      "speedup_vs_first": {r["max_staleness"]: round(base / r["step_s"], 3) for r in runs},
                      "predicted": predict(runs[0]), "runs": runs}))


def predict(sync: dict) -> dict:
    """From a synchronous run's phases: the step time and idle fractions of the trainer (main thread) and the engine,
    synchronous (rollout + trainer work + sync, one after another) and one step off-policy (the rollout overlaps the
    trainer's work: max of the two, then the sync, during which both wait)."""
    rollout = sync["rollout"] + sync["reward"]
    work = sum(sync[p] for p in ("advantages", "pack", "old_logprob", "update", "metrics"))
    fixed = sync["weight_sync"]
    step_sync, step_off = rollout + work + fixed, max(rollout, work) + fixed
    return {"step_s_sync": round(step_sync, 3), "step_s_off_policy": round(step_off, 3),
            "trainer_idle_sync": round(1 - work / step_sync, 3), "engine_idle_sync": round(1 - rollout / step_sync, 3),
            "trainer_idle_off_policy": round(1 - work / step_off, 3),
            "engine_idle_off_policy": round(1 - rollout / step_off, 3)}


if __name__ == "__main__":
    main()
