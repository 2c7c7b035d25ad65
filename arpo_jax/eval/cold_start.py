"""A cold start from the model's own work: rejection-sampled tool-use solutions for SFT (the maths recipe).

Why: Qwen2.5-Coder-0.5B-Instruct never calls the ``<python>`` tool with the reference prompt (0 calls in 400
answers, benchmarks/RESULTS.md): it writes a Markdown block and imagines its output. RL cannot reinforce a call it
never samples, and there is no ARPO-SFT-54K here. Shown a few worked examples in the tag format, the same model does
call the tool; the trajectories that end with the right answer and whose calls all ran are correct tool use in
the model's own words, which SFT on the plain prompt (no examples) then makes its default.

Which questions (``--questions-file``): the recipe uses GSM8K test questions 300-949 (``math_tool.TRAIN_SLICE``,
disjoint from the reported and the validation questions, standing in for GSM8K's train split). On train_10k's maths
(competition problems) the untrained model answered 0 of 64 few-shot samples right, 0 of 32 even on its plain word
problems (``math_tool.plain_question``, the default filter here, ``--all-questions`` to turn it off), at ~10 generated
tokens a second on a shared 2-core CPU: rejection sampling there yields nothing (benchmarks/RESULTS.md).

The steps (``python -m arpo_jax.eval.cold_start WORKDIR --questions-file FILE ...``; every step resumes):

1. sample: ``arpo-jax eval`` on a file of questions with the
   few-shot turns ``SHOTS`` before each question, ``k`` samples each at ``temperature`` (the evaluation's
   per-chunk seeds: the same seed gives the same samples), the real sandboxed Python tool;
2. complete (``completed``): a sample that stopped right after a Python result holding the right number gets the
   answer sentence appended (a template);
   filter (``accepted``): the answer is right (the evaluation's math rule), the response passes the reference's
   format check (think / answer tags, ``\\boxed{}``, every tool call followed by its result), at least one Python
   call printed a result and none failed, and it ended by itself (not cut at the length limit);
3. write ``sft.json`` (``--build-only``: from the samples so far): the first accepted sample of each question
   (``per_question``), as OpenAI messages with the reference system prompt and the bare question, i.e. exactly the
   RL prompt without the examples; the tool results stay inline in the assistant turn (``sft.mask_tool_results``
   keeps them out of the loss).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from arpo_jax.data.prompts import REFERENCE_DATA_SYSTEM_PROMPT, chat_messages
from arpo_jax.rewards.deep_research import validate_format
from arpo_jax.rewards.math_reward import math_equal

SFT_FILE, SHOTS_FILE, REPORT_FILE, QUESTIONS_FILE = "sft.json", "shots.json", "cold_start.json", "questions.jsonl"
SAMPLES_DIR = "samples"

# Three worked examples in the rollout's exact format: a word problem, algebra with sympy, counting. Short, so the
# prompt stays ~650 tokens (the reference system prompt is ~270), and each prints its result, as the tool needs.
SHOTS = (
    ("A baker makes 4 trays of 15 muffins. He sells 38 muffins at $2.50 each and gives the rest away. How much "
     "money does he make, and how many muffins does he give away? Give the money.",
     "<think> 4 trays of 15 muffins is 60 muffins. He sells 38 at $2.50 each. I will compute it in Python. </think>\n"
     "<python>\nmuffins = 4 * 15\nmoney = 38 * 2.50\nprint(muffins - 38, money)\n</python> <result>\n22 95.0\n"
     "</result>\n<think> He gives 22 muffins away and makes $95. </think>\n"
     "<answer> The final answer is \\[ \\boxed{95} \\] </answer>"),
    ("What is the sum of all real solutions of $x^2 - 7x + 5 = 0$?",
     "<think> I will solve the quadratic with sympy and add the solutions. </think>\n"
     "<python>\nimport sympy as sp\nx = sp.symbols('x')\nsolutions = sp.solve(x**2 - 7*x + 5, x)\n"
     "print(solutions, sp.simplify(sum(solutions)))\n</python> <result>\n"
     "[7/2 - sqrt(29)/2, sqrt(29)/2 + 7/2] 7\n</result>\n<think> Both solutions are real and they add up to 7. "
     "</think>\n<answer> The final answer is \\[ \\boxed{7} \\] </answer>"),
    ("How many positive integers less than 200 are divisible by 3 or 7 but not by both?",
     "<think> I will count them with a loop. </think>\n"
     "<python>\ncount = sum(1 for n in range(1, 200) if (n % 3 == 0) != (n % 7 == 0))\nprint(count)\n</python> "
     "<result>\n76\n</result>\n<think> 66 multiples of 3 and 28 of 7, minus twice the 9 multiples of 21: 76. "
     "</think>\n<answer> The final answer is \\[ \\boxed{76} \\] </answer>"),
)


def write_shots(path: str | os.PathLike) -> Path:
    """``SHOTS`` as the ``arpo-jax eval --few-shot`` file."""
    path = Path(path)
    path.write_text(json.dumps([{"question": q, "response": r} for q, r in SHOTS], indent=1), encoding="utf-8")
    return path


def accepted(record: dict) -> bool:
    """Whether an evaluation record (`eval.runner`) is a solution worth imitating (module docstring, step 2)."""
    ran = record.get("python_ok", 0) >= 1 and record.get("python_errors", 0) == 0
    calls_answered = record.get("python_ok", 0) + record.get("python_empty", 0) == record.get("python_calls", 0)
    ended = record.get("finish_reason") not in ("length", "error") and not record.get("truncated")
    return bool(record.get("correct")) and ran and calls_answered and ended and validate_format(record["output"])[0]


_NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?")


def completed(record: dict, answer: str) -> dict:
    """``record`` with its answer written out when the model stopped right after a Python result whose last number
    is the right answer (``answer``): ``<think> The result is X. </think> <answer> ... \\boxed{X} </answer>`` is
    appended and ``completed`` set. Else ``record`` unchanged.

    Why: with the few-shot prompt the model calls the tool in nearly every sample, then ends its turn right after the
    result more often than not (GSM8K: 31 of 32 samples called, all 4 right results ended there;
    benchmarks/RESULTS.md), so the filter alone keeps nothing. The reasoning and the code stay the model's own; only
    the answer sentence is a template, and SFT teaches the model to write it after a result.
    """
    out = record["output"].rstrip()
    if not out.endswith("</result>") or "<answer>" in out:
        return record
    numbers = [m.group(0).replace(",", "") for m in _NUMBER.finditer(out[out.rfind("<result>"):])]
    if not numbers:
        return record
    value = numbers[-1]
    value = str(int(float(value))) if float(value).is_integer() else value
    if not math_equal(value, [answer]):
        return record
    text = (f"{out}\n<think> The result is {value}. </think>\n<answer> The final answer is \\[ \\boxed{{{value}}} "
            "\\] </answer>")
    return {**record, "output": text, "prediction": value, "correct": True, "completed": True}


def sft_rows(records: Sequence[dict], questions: dict[str, dict], per_question: int = 1) -> list[dict]:
    """OpenAI-messages SFT rows of the first ``per_question`` accepted records of each question (records in file
    order, each `completed` first; ``questions``: id -> its file row, ``question`` and ``answer``)."""
    taken: dict[str, int] = {}
    rows = []
    for r in records:
        r = completed(r, questions[r["id"]]["answer"])
        if accepted(r) and taken.get(r["id"], 0) < per_question:
            taken[r["id"]] = taken.get(r["id"], 0) + 1
            messages = chat_messages(questions[r["id"]]["question"], REFERENCE_DATA_SYSTEM_PROMPT)
            rows.append({"id": r["id"], "completed": bool(r.get("completed")),
                         "messages": [*messages, {"role": "assistant", "content": r["output"]}]})
    return rows


def yield_report(records: Sequence[dict], rows: Sequence[dict]) -> dict:
    """How many samples and questions passed each filter, and the SFT set's size."""
    n = len(records)
    with_call = sum(r.get("python_calls", 0) > 0 for r in records)
    return {"samples": n, "questions": len({r["id"] for r in records}), "samples_correct": sum(bool(r["correct"])
                                                                                              for r in records),
            "samples_with_python_call": with_call, "samples_accepted": sum(accepted(r) for r in records),
            "sft_rows": len(rows), "sft_rows_completed": sum(r["completed"] for r in rows),
            "yield_per_sample": len(rows) / n if n else 0.0}


def select_questions(questions_file: str | os.PathLike, out: Path, *, plain: bool) -> Path:
    """The questions to sample (all, or `math_tool.plain_question`'s), in the file's order, as a file benchmark."""
    from arpo_jax.eval.math_tool import plain_question
    from arpo_jax.train import metrics

    rows = [r for r in metrics.read_jsonl(questions_file) if not plain or plain_question(r)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
    return out


def run(workdir: str | os.PathLike, *, model: str, questions_file: str | os.PathLike, questions: int, k: int,
        temperature: float, seed: int, per_question: int = 1, engine: str = "vllm", batch_size: int = 16,
        max_response_length: int = 512, plain: bool = True, config_args: Sequence[str] = ()) -> dict:
    """Steps 1-3 (module docstring) in ``workdir``; returns the yield report (also ``cold_start.json``)."""
    from arpo_jax.eval import agent, runner

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    questions_file = select_questions(questions_file, workdir / QUESTIONS_FILE, plain=plain)
    shots = write_shots(workdir / SHOTS_FILE)
    cfg = agent.load_eval_config(["--config.tools.search.enabled=false", "--config.tools.call_limit=3",
                                   f"--config.data.max_response_length={max_response_length}", *config_args])
    opts = runner.EvalOptions(model=model, benchmarks=str(questions_file), workdir=workdir / SAMPLES_DIR, k=k,
                              limit=questions, engine=engine, batch_size=batch_size, seed=seed,
                              temperature=temperature, few_shot=str(shots))
    summary = runner.evaluate(cfg, opts)
    report = build(workdir, per_question) | {"model": model, "k": k, "temperature": temperature, "seed": seed,
                                             "wall_s": summary["wall_s"]}
    (workdir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def build(workdir: str | os.PathLike, per_question: int = 1) -> dict:
    """Step 3 from the samples written so far (the sampling may still be running, or stopped early): sft.json and
    the yield report (cold_start.json)."""
    from arpo_jax.eval import runner
    from arpo_jax.train import metrics

    workdir = Path(workdir)
    questions_file = workdir / QUESTIONS_FILE
    records = metrics.read_jsonl(workdir / SAMPLES_DIR / questions_file.stem / runner.SAMPLES_FILE)
    rows = sft_rows(records, {r["id"]: r for r in metrics.read_jsonl(questions_file)}, per_question)
    (workdir / SFT_FILE).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    report = yield_report(records, rows) | {"sft_file": str(workdir / SFT_FILE)}
    (workdir / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="rejection-sampled tool-use SFT data (arpo_jax/eval/cold_start.py)")
    p.add_argument("workdir", help="samples/ (the resumable evaluation), shots.json, sft.json, cold_start.json")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--questions-file", required=True, help="file benchmark of training questions "
                   "(`python -m arpo_jax.eval.math_tool DIR` writes DIR/train_math.jsonl)")
    p.add_argument("--questions", type=int, default=1000, help="how many of them (from the first)")
    p.add_argument("--k", type=int, default=2, help="samples per question")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same set)")
    p.add_argument("--per-question", type=int, default=1, help="accepted samples kept per question")
    p.add_argument("--engine", default="vllm", choices=["vllm", "jax"])
    p.add_argument("--batch-size", type=int, default=16, help="questions per generation call (x k samples)")
    p.add_argument("--max-response-length", type=int, default=512, help="an accepted solution is ~250 tokens; a "
                   "sampling round lasts as long as its longest response")
    p.add_argument("--all-questions", action="store_true", help="sample every question, not only the plain word "
                   "problems with a numeric answer (`math_tool.plain_question`)")
    p.add_argument("--build-only", action="store_true", help="no sampling: sft.json from the samples so far")
    args, config_args = p.parse_known_args(argv)
    if args.build_only:
        print(json.dumps(build(args.workdir, args.per_question)))
        return
    print(json.dumps(run(args.workdir, model=args.model, questions_file=args.questions_file,
                         questions=args.questions, k=args.k, temperature=args.temperature, seed=args.seed,
                         per_question=args.per_question, engine=args.engine, batch_size=args.batch_size,
                         max_response_length=args.max_response_length, plain=not args.all_questions,
                         config_args=config_args)))


if __name__ == "__main__":
    main()
