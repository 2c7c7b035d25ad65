"""The maths-with-Python recipe end to end (issue 56): Qwen2.5-Coder-0.5B-Instruct, cold start, ARPO / GRPO, GSM8K.

  python benchmarks/gsm8k_tool.py --workdir runs/gsm8k_tool [--phases data,cold_start,sft,rl,eval]
                                  [--algo arpo|grpo] [--seed 0] [--gpu]

Phases (each resumes where it stopped; run the command again after an interruption):
  data        `python -m arpo_jax.eval.math_tool W/data`: train_math.parquet, val.parquet, train_math.jsonl
  cold_start  `python -m arpo_jax.eval.cold_start W/cold_start`: few-shot tool-use samples of GSM8K questions
              300-999 (`math_tool.COLD_START_SLICE`), the correct ones whose calls ran -> W/data/sft.json
  sft         `arpo-jax sft` (LoRA) of the config `arpo_qwen25_coder_05b_gsm8k`, then its adapter as a PEFT folder
              (W/sft_adapter)
  rl          `arpo-jax train` from that adapter (`--algo`, `--seed`) in W/<algo>_s<seed>, then its final adapter
              (W/<algo>_s<seed>/adapter)
  eval        `arpo-jax eval` (vLLM, greedy) of the untrained model, the SFT adapter and each finished RL adapter on
              the first 300 GSM8K and 200 MATH500 questions (`math_tool.EVAL_SLICES`), in W/eval/<model>/<benchmark>

Before each phase it prints what it will take on the machine the numbers were measured on (2-core x86 CPU shared
with other jobs, benchmarks/RESULTS.md "ARPO on GSM8K"); on another machine scale them by its speed. The last line
is a JSON summary of every evaluation done so far.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from arpo_jax.eval import cold_start, math_tool

# This checkout's file (`builtin:arpo_qwen25_coder_05b_gsm8k` is the installed package's copy of it).
CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "arpo_qwen25_coder_05b_gsm8k.py")
MODEL = "qwen2.5-coder-0.5b-instruct"
PHASES = ("data", "cold_start", "sft", "rl", "eval")
# Minutes on the 2-core CPU shared with other jobs (RESULTS.md "ARPO on GSM8K"): the cold start ~28 s a sample (64 in
# 29 min), SFT ~50 s a conversation an epoch (9 x 4 epochs in 38 min, compiles included; ~14% of 700 samples kept,
# 2 epochs); RL from the demo's LoRA steps (~3 min alone) x 3 for the load, 20 steps + 5 validations, not measured on
# this recipe yet; the evaluation from the untrained model's ~3.5 s a question alone, x 3.
EXPECTED_MIN = {"data": 0.2, "cold_start": 330, "sft": 170, "rl": 240, "eval": 90}
COLD_START = {"questions": 700, "k": 1, "temperature": 0.7, "seed": 0}


def _say(msg: str) -> None:
    print(f"[gsm8k_tool] {msg}", flush=True)


def _run(cmd: list[str]) -> None:
    _say("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def _config(workdir: Path, algo: str, gpu: bool) -> str:
    flags = [f for f, on in (("grpo", algo == "grpo"), ("gpu", gpu)) if on]
    return f"--config={CONFIG}:{','.join([str(workdir / 'data'), *flags])}"


def phase_cold_start(workdir: Path) -> None:
    out = workdir / "cold_start"
    _run([sys.executable, "-m", "arpo_jax.eval.cold_start", str(out), "--questions-file",
          str(workdir / "data" / math_tool.COLD_START_FILE), "--all-questions", "--batch-size", "32", "--questions",
          str(COLD_START["questions"]), "--k", str(COLD_START["k"]), "--temperature", str(COLD_START["temperature"]),
          "--seed", str(COLD_START["seed"])])
    shutil.copyfile(out / cold_start.SFT_FILE, workdir / "data" / "sft.json")


def export_adapter(ckpt: Path, out: Path) -> Path:
    """The newest checkpoint's adapters as a PEFT folder (once)."""
    if not (out / "adapter_config.json").is_file():
        _run(["arpo-jax", "export", "--format", "peft", "--ckpt", str(ckpt), "--out", str(out)])
    return out


def phase_rl(workdir: Path, algo: str, seed: int, gpu: bool) -> Path:
    run = workdir / f"{algo}_s{seed}"
    _run(["arpo-jax", "train", _config(workdir, algo, gpu), f"--config.model.lora.adapter={workdir / 'sft_adapter'}",
          f"--config.seed={seed}", f"--workdir={run}"])
    return export_adapter(run / "checkpoints", run / "adapter")


def evaluate(workdir: Path, name: str, adapter: Path | None) -> dict:
    """pass@1 (greedy) of the model (+ adapter) on each `EVAL_SLICES`; the reports' figures by benchmark."""
    out = {}
    for bench, offset, count in math_tool.EVAL_SLICES:
        wd = workdir / "eval" / name / bench
        cmd = ["arpo-jax", "eval", "--model", MODEL, "--benchmarks", bench, "--offset", str(offset), "--limit",
               str(count), "--k", "1", "--temperature", "0", "--engine", "vllm", "--batch-size", "25",
               "--config.tools.search.enabled=false", "--config.data.max_response_length=1024", "--workdir",
               str(wd), "--no-progress", *(["--adapter", str(adapter)] if adapter else [])]
        _run(cmd)
        out[bench] = json.loads((wd / "report.json").read_text())["benchmarks"][bench]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/gsm8k_tool")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--algo", default="arpo", choices=["arpo", "grpo"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true", help="the config's gpu flag (bfloat16, vLLM on the GPU)")
    args = parser.parse_args()
    workdir = Path(args.workdir).absolute()
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"--phases: unknown {unknown}; allowed: {', '.join(PHASES)}")
    for phase in [p for p in PHASES if p in phases]:
        _say(f"phase {phase}: expected ~{EXPECTED_MIN[phase]:g} min on a 2-core CPU")
        t = time.perf_counter()
        if phase == "data":
            math_tool.prepare(workdir / "data")
        elif phase == "cold_start":
            phase_cold_start(workdir)
        elif phase == "sft":
            _run(["arpo-jax", "sft", _config(workdir, "arpo", args.gpu), f"--workdir={workdir / 'sft'}"])
            export_adapter(workdir / "sft" / "checkpoints", workdir / "sft_adapter")
        elif phase == "rl":
            phase_rl(workdir, args.algo, args.seed, args.gpu)
        _say(f"phase {phase} done in {(time.perf_counter() - t) / 60:.1f} min")
    if "eval" in phases:
        models = {"untrained": None, "sft": workdir / "sft_adapter"}
        models |= {p.name: p / "adapter" for p in sorted(workdir.glob("*_s*")) if (p / "adapter").is_dir()}
        print(json.dumps({name: evaluate(workdir, name, adapter) for name, adapter in models.items()}))


if __name__ == "__main__":
    main()
