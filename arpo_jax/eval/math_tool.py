"""The data files of the maths-with-Python recipe (`configs/arpo_qwen25_coder_05b_gsm8k.py`), from the reference's
own files: ``python -m arpo_jax.eval.math_tool DIR`` writes them into DIR (idempotent: a file is rewritten only
when its rows change).

* ``train_math.parquet``: the 5000 ``ability == "math"`` rows of ``rl/train_10k.parquet`` (competition-style maths
  with a single answer; the 5000 ``qa`` rows need the search tool), in the reference schema, bytes unchanged.
* ``val.parquet``: the fixed validation subsets ``VAL_SLICES`` of GSM8K and MATH500 (``eval/<name>/test.jsonl``) in
  the same schema, the question as the user turn after the reference system prompt (exactly the training and
  evaluation prompt), ``data_source`` = the benchmark's name (the trainer's ``val/<name>/...`` metrics). They are
  disjoint from ``EVAL_SLICES``, the questions the recipe's final evaluation reports, so no checkpoint or
  hyperparameter is chosen on the reported questions.
* ``train_math.jsonl``: the same training questions as a file benchmark (`eval.benchmarks.FILE_SPEC`: id,
  question, answer) in a seeded order.
* ``cold_start_questions.jsonl``: the questions the cold start's rejection sampling (`eval.cold_start`) runs on,
  ``COLD_START_SLICE`` (why: there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import numpy as np

from arpo_jax.data.prompts import REFERENCE_DATA_SYSTEM_PROMPT, chat_messages

TRAIN_FILE, VAL_FILE, QUESTIONS_FILE = "train_math.parquet", "val.parquet", "train_math.jsonl"
COLD_START_FILE = "cold_start_questions.jsonl"
# (benchmark, offset, count): validation during training (~80 greedy answers: ~4 minutes on 2 CPU cores).
VAL_SLICES = (("gsm8k", 1000, 50), ("math500", 400, 30))
# What the recipe reports (pass@1 greedy): the first 300 GSM8K questions (the untrained model's 0.24 +- 0.025 in
# benchmarks/RESULTS.md) and the first 200 of MATH500.
EVAL_SLICES = (("gsm8k", 0, 300), ("math500", 0, 200))
# The cold start's questions: GSM8K test questions 300-999, disjoint from EVAL_SLICES and VAL_SLICES, standing in for
# GSM8K's train split (not in ../shared/data). train_10k's maths is competition maths: the untrained 0.5B model with
# the few-shot tool prompt answered 0 of 64 samples right (benchmarks/RESULTS.md), so rejection sampling there
# yields nothing.
COLD_START_SLICE = ("gsm8k", 300, 700)


def shared_data_dir() -> Path:
    """``$ARPO_DATA``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("ARPO_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def math_rows(train_10k: str | os.PathLike):
    """The ``ability == "math"`` rows of train_10k as a pyarrow table (schema and bytes as stored)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(train_10k)
    return table.filter(pc.equal(table["ability"], "math"))


def benchmark_rows(data_dir: str | os.PathLike, slices=VAL_SLICES) -> list[dict]:
    """RL rows (reference schema) of the benchmark slices ``(name, offset, count)``."""
    from arpo_jax.eval.benchmarks import load_benchmark

    rows = []
    for name, offset, count in slices:
        for s in load_benchmark(name, data_dir, offset=offset, limit=count):
            rows.append({"data_source": name, "prompt": chat_messages(s.question, REFERENCE_DATA_SYSTEM_PROMPT),
                         "ability": "math", "reward_model": {"ground_truth": s.answers[0], "style": "rule"},
                         "extra_info": {"question": s.question, "id": s.id, "split": "val"}})
    return rows


def question_records(table, seed: int) -> list[dict]:
    """The training questions as file-benchmark rows (id = the row's ``extra_info.index``), in a seeded order."""
    rows = table.select(["prompt", "reward_model", "extra_info"]).to_pylist()
    order = np.random.default_rng(seed).permutation(len(rows))
    return [{"id": f"train10k-{rows[i]['extra_info']['index']}", "question": rows[i]["prompt"][-1]["content"],
             "answer": rows[i]["reward_model"]["ground_truth"]} for i in order]


_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def plain_question(record: dict) -> bool:
    """A word problem with a number for an answer: no LaTeX command, at most one inline formula, under 400
    characters. About 700 of the 5000; a 0.5B model solves a few of them where it solves almost none of the rest (the
    cold start's first 32 samples of the whole set: 0 correct, benchmarks/RESULTS.md)."""
    q = record["question"]
    return bool(_NUMBER.fullmatch(record["answer"].strip())) and "\\" not in q and q.count("$") <= 2 and len(q) < 400


def _write_if_changed(path: Path, write, content: bytes | None = None) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    if path.is_file() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
    else:
        os.replace(tmp, path)


def prepare(out: str | os.PathLike, *, data_dir: str | os.PathLike | None = None, seed: int = 0) -> dict[str, str]:
    """Writes the recipe's files into ``out`` (module docstring); returns their paths by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out, shared = Path(out), Path(data_dir) if data_dir else shared_data_dir()
    out.mkdir(parents=True, exist_ok=True)
    table = math_rows(shared / "rl" / "train_10k.parquet")
    val = pa.Table.from_pylist(benchmark_rows(shared / "eval"))
    paths = {"train": out / TRAIN_FILE, "val": out / VAL_FILE, "questions": out / QUESTIONS_FILE}
    _write_if_changed(paths["train"], lambda p: pq.write_table(table, p))
    _write_if_changed(paths["val"], lambda p: pq.write_table(val, p))
    lines = "".join(json.dumps(r) + "\n" for r in question_records(table, seed))
    _write_if_changed(paths["questions"], lambda p: p.write_text(lines, encoding="utf-8"))
    paths["cold_start"] = out / COLD_START_FILE
    cold = "".join(json.dumps({"id": r["extra_info"]["id"], "question": r["extra_info"]["question"],
                               "answer": r["reward_model"]["ground_truth"]}) + "\n"
                   for r in benchmark_rows(shared / "eval", [COLD_START_SLICE]))
    _write_if_changed(paths["cold_start"], lambda p: p.write_text(cold, encoding="utf-8"))
    return {k: str(v) for k, v in paths.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for train_math.parquet, val.parquet, train_math.jsonl")
    parser.add_argument("--data-dir", default=None, help="the reference data (rl/, eval/); default $ARPO_DATA or "
                        "../shared/data")
    parser.add_argument("--seed", type=int, default=0, help="order of train_math.jsonl's questions")
    args = parser.parse_args(argv)
    print(json.dumps(prepare(args.out, data_dir=args.data_dir, seed=args.seed)))


if __name__ == "__main__":
    main()
