"""The demo's arithmetic decision, teacher-forced: how often would a model multiply, and would it compute at all?

For every arithmetic question of a demo validation file, the model's next-token probabilities (transformers, the
question rendered as in training) at two points of the taught response format:

  * after `<think> I need to compute this. </think> <python> print(A`: P(" *") / (P(" *") + P(" +")), the taught
    mistake (`a + b` for `a * b`, `toy.flawed_text`) against the right operation;
  * after `<think> I need to`: P(" compute") / (P(" compute") + P(" look")), the Python tool against a search.

A cold start leaves RL a fixable mistake when the greedy choice is wrong (share < 0.5) but the right one is sampled
often enough for a group of n rollouts to contain both outcomes (benchmarks/RESULTS.md, "Demo").

  python benchmarks/studies/demo_probe.py DEMO_WORKDIR [DEMO_WORKDIR ...]   # probes <dir>/sft/hf and <dir>/<algo>/rl/hf

Prints one JSON line per model: the mean shares and how many of the questions would be decided right greedily.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def next_token_share(model, tokenizer, text: str, first: str, second: str) -> float:
    """P(first) / (P(first) + P(second)) for the next token after `text` (each candidate's first token)."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(ids).logits[0, -1].float().softmax(-1)
    p1, p2 = (float(probs[tokenizer(c, add_special_tokens=False).input_ids[0]]) for c in (first, second))
    return p1 / (p1 + p2)


def probe(model_dir: Path, val_file: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    multiply, compute = [], []
    for row in pq.read_table(val_file).to_pylist():
        if row["data_source"] != "toy_arith":
            continue
        a = re.findall(r"\d+", row["extra_info"]["question"])[0]
        prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        multiply.append(next_token_share(model, tokenizer, prompt + f"<think> I need to compute this. </think> "
                                         f"<python> print({a}", " *", " +"))
        compute.append(next_token_share(model, tokenizer, prompt + "<think> I need to", " compute", " look"))
    n = len(multiply)
    return {"model": str(model_dir), "questions": n, "p_multiply": round(sum(multiply) / n, 3),
            "greedy_multiply": sum(p > 0.5 for p in multiply), "p_compute": round(sum(compute) / n, 3),
            "greedy_compute": sum(p > 0.5 for p in compute)}


def main() -> None:
    for workdir in map(Path, sys.argv[1:]):
        for model_dir in [workdir / "sft" / "hf", *sorted(workdir.glob("*/rl/hf"))]:
            if model_dir.is_dir():
                print(json.dumps(probe(model_dir, workdir / "data" / "toy_val.parquet")), flush=True)


if __name__ == "__main__":
    main()
