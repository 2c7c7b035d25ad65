"""The data files of the maths-with-Python recipe (`configs/arpo_qwen25_coder_05b_gsm8k.py`), from the reference's
own files: ``python -m arpo_jax.eval.math_tool DIR`` writes them into DIR (idempotent: a file is rewritten only
when its rows change).

GSM8K has no train split in ../shared/data. Its test questions 300-999 stand in for one (the cold start, the RL
questions and the validation); 0-299 are the reported questions, and no phase reads a question from 1000 on
(``GSM8K_LIMIT``; `check_slices` runs at import).

* ``val.parquet``: the fixed validation subsets ``VAL_SLICES`` of GSM8K and MATH500 (``eval/<name>/test.jsonl``) in
  the reference RL schema, the question as the user turn after the reference system prompt (exactly the training and
  evaluation prompt), ``data_source`` = the benchmark's name (the trainer's ``val/<name>/...`` metrics). They are
  disjoint from ``EVAL_SLICES``, the questions the recipe's final evaluation reports, so no checkpoint or
  hyperparameter is chosen on the reported questions.
* ``cold_start_questions.jsonl``: ``TRAIN_SLICE`` as a file benchmark (id, question, answer): the questions the cold
  start's rejection sampling (`eval.cold_start`) runs on, and the RL phase's candidates.
* ``rl_candidates.jsonl`` (`rl_candidates`, after the cold start): a seeded sample of those, less the questions of the
  SFT set; ``train_gsm8k.parquet`` (`select_rl_questions`): the candidates the SFT model answered right in some but
  not all of its ``PASS_K`` samples, the RL phase's training set (why: there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from arpo_jax.data.prompts import NO_TOOLS_SYSTEM_PROMPT, REFERENCE_DATA_SYSTEM_PROMPT, chat_messages

VAL_FILE, COLD_START_FILE = "val.parquet", "cold_start_questions.jsonl"
CANDIDATES_FILE, RL_FILE = "rl_candidates.jsonl", "train_gsm8k.parquet"
NOTOOL = "_notool"  # the same rows with the tool-free system prompt (the recipe's `notool` flag): val_notool.parquet
GSM8K_LIMIT = 1000  # no phase reads GSM8K questions from here on
# (benchmark, offset, count): validation during training (~80 greedy answers: ~4 minutes on 2 CPU cores).
VAL_SLICES = (("gsm8k", 950, 50), ("math500", 400, 30))
# What the recipe reports (pass@1 greedy): the first 300 GSM8K questions (the untrained model's 0.24 +- 0.025 in
# benchmarks/RESULTS.md) and the first 200 of MATH500.
EVAL_SLICES = (("gsm8k", 0, 300), ("math500", 0, 200))
# GSM8K test questions 300-949: the cold start's questions and the RL candidates. (train_10k's maths, the recipe's
# first RL set, is competition maths: the untrained 0.5B model answered 0 of 64 few-shot samples right there, so
# every GRPO group scored 0 and RL had nothing to learn from; benchmarks/RESULTS.md.)
TRAIN_SLICE = ("gsm8k", 300, 650)
# Samples per candidate question when the SFT model's pass rate is measured: the RL group size (rollout.n).
PASS_K = 8


def check_slices(*slices: tuple[str, int, int]) -> None:
    """Raises ValueError when a slice reaches GSM8K questions from ``GSM8K_LIMIT`` on."""
    for name, offset, count in slices:
        if name == "gsm8k" and offset + count > GSM8K_LIMIT:
            raise ValueError(f"GSM8K slice {offset}-{offset + count - 1} reaches question {GSM8K_LIMIT} or later: "
                             f"no phase of the recipe may read those")


check_slices(*VAL_SLICES, *EVAL_SLICES, TRAIN_SLICE)


def shared_data_dir() -> Path:
    """``$ARPO_DATA``, else ``../shared/data`` beside the repository."""
    env = os.environ.get("ARPO_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


def rl_row(name: str, question: str, answer: str, qid: str, split: str,
           system_prompt: str = REFERENCE_DATA_SYSTEM_PROMPT) -> dict:
    """One row of the reference RL schema: the system prompt and the question as the user turn."""
    return {"data_source": name, "prompt": chat_messages(question, system_prompt), "ability": "math",
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"question": question, "id": qid, "split": split}}


def benchmark_rows(data_dir: str | os.PathLike, slices=VAL_SLICES, split: str = "val",
                   system_prompt: str = REFERENCE_DATA_SYSTEM_PROMPT) -> list[dict]:
    """RL rows (reference schema) of the benchmark slices ``(name, offset, count)``."""
    from arpo_jax.eval.benchmarks import load_benchmark

    check_slices(*slices)
    return [rl_row(name, s.question, s.answers[0], s.id, split, system_prompt)
            for name, offset, count in slices for s in load_benchmark(name, data_dir, offset=offset, limit=count)]


def _write_parquet(path: Path, rows: Sequence[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write_if_changed(path, lambda p: pq.write_table(pa.Table.from_pylist(rows), p))


def _notool(path: Path) -> Path:
    return path.with_name(path.stem + NOTOOL + path.suffix)


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


def _jsonl(rows: Sequence[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def prepare(out: str | os.PathLike, *, data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Writes ``val.parquet`` (+ ``_notool``) and ``cold_start_questions.jsonl`` into ``out``; returns their paths by
    name."""
    out, shared = Path(out), Path(data_dir) if data_dir else shared_data_dir()
    out.mkdir(parents=True, exist_ok=True)
    paths = {"val": out / VAL_FILE, "val_notool": _notool(out / VAL_FILE), "cold_start": out / COLD_START_FILE}
    _write_parquet(paths["val"], benchmark_rows(shared / "eval"))
    _write_parquet(paths["val_notool"], benchmark_rows(shared / "eval", system_prompt=NO_TOOLS_SYSTEM_PROMPT))
    questions = [{"id": r["extra_info"]["id"], "question": r["extra_info"]["question"],
                  "answer": r["reward_model"]["ground_truth"]} for r in benchmark_rows(shared / "eval", [TRAIN_SLICE])]
    _write_if_changed(paths["cold_start"], lambda p: p.write_text(_jsonl(questions), encoding="utf-8"))
    return {k: str(v) for k, v in paths.items()}


def rl_candidates(out: str | os.PathLike, sft_rows: Sequence[dict], count: int, seed: int = 0) -> Path:
    """``out/rl_candidates.jsonl``: ``count`` of ``TRAIN_SLICE``'s questions (a seeded draw; all when ``count`` >= what
    is left) less those the SFT set holds (``sft_rows``: `cold_start.sft_rows`' rows), whose pass rate the SFT model
    would overstate after training on their solutions."""
    from arpo_jax.train import metrics

    out = Path(out)
    taken = {r["id"] for r in sft_rows}
    pool = [q for q in metrics.read_jsonl(out / COLD_START_FILE) if q["id"] not in taken]
    keep = sorted(np.random.default_rng(seed).permutation(len(pool))[:count])
    path = out / CANDIDATES_FILE
    _write_if_changed(path, lambda p: p.write_text(_jsonl([pool[i] for i in keep]), encoding="utf-8"))
    return path


def select_rl_questions(samples: Sequence[dict], candidates: Sequence[dict], out: str | os.PathLike,
                        lowest: int = 1, highest: int = PASS_K - 1) -> dict:
    """Writes the RL training set into the folder ``out`` (``train_gsm8k.parquet`` and its ``_notool`` twin, reference
    schema): the candidates whose samples (`arpo-jax eval` records of the SFT model at the rollout temperature,
    ``PASS_K`` a question) were right ``lowest`` to ``highest`` times, in the candidates' order. Returns the histogram
    of right answers a question and the kept count.

    Why: a GRPO group whose rewards are all equal (every rollout right, or every one wrong) has advantage 0 for each
    of them and teaches nothing; on train_10k's competition maths every group of the 0.5B model was all-wrong. A
    question answered right in some of the samples gives groups with both outcomes, so every step has a signal (the
    reason behind DAPO's dynamic sampling, done once here, before training, from the same model's own samples).
    """
    right: Counter = Counter()
    seen: Counter = Counter()
    for r in samples:
        seen[r["id"]] += 1
        right[r["id"]] += bool(r["correct"])
    short = sorted(i for i, n in seen.items() if n < PASS_K)
    if short:
        raise ValueError(f"{len(short)} candidates have fewer than {PASS_K} samples (e.g. {short[0]}): run the "
                         f"pass@{PASS_K} evaluation to the end (it resumes) before selecting")
    kept = [q for q in candidates if q["id"] in seen and lowest <= right[q["id"]] <= highest]
    for path, prompt in ((Path(out) / RL_FILE, REFERENCE_DATA_SYSTEM_PROMPT),
                         (_notool(Path(out) / RL_FILE), NO_TOOLS_SYSTEM_PROMPT)):
        _write_parquet(path, [rl_row("gsm8k", q["question"], q["answer"], q["id"], "train", prompt) for q in kept])
    return {"candidates": len(seen), "kept": len(kept), "lowest": lowest, "highest": highest,
            f"right_of_{PASS_K}": {str(c): sum(1 for i in seen if right[i] == c) for c in range(PASS_K + 1)},
            "mean_pass_rate": sum(right.values()) / max(1, sum(seen.values()))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for val.parquet and cold_start_questions.jsonl")
    parser.add_argument("--data-dir", default=None, help="the reference data (eval/); default $ARPO_DATA or "
                        "../shared/data")
    args = parser.parse_args(argv)
    print(json.dumps(prepare(args.out, data_dir=args.data_dir)))


if __name__ == "__main__":
    main()
