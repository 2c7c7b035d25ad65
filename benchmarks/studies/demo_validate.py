"""Greedy and sampled validation of the models a `demo_seeds.py` sweep left behind (no training).

For each seed's work dir: the cold-start SFT model and each algorithm's final exported model, validated on the
seed's held-out questions greedily (n 1, as in the demo) and sampled (`rollout.val_kwargs`: n samples a question
at temperature 1), so the sampled accuracy (less noisy: n x 48 answers) can be compared with the greedy one.

  python benchmarks/studies/demo_validate.py --workdir runs/demo_seeds [--seeds 0 1 2] [--algos arpo grpo] [--n 4]
                                     [--model NAME]

Prints one JSON line per model: {"seed", "model", "greedy": {...val metrics}, "sampled": {...}}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from arpo_jax import demo
from arpo_jax.train import trainer


def validate(workdir: Path, seed: int, model: str, *, sampled: bool, n: int, base: str) -> dict:
    """The demo's validation of `model` ("sft" or an algorithm's final export) in the seed's work dir; `base` is the
    demo's --model."""
    cfg = demo.demo_config(base, demo.FULL, "arpo", seed, demo.rollout_engine())
    with cfg.unlocked():
        cfg.model.path = base if model == "sft" else str(workdir / model / "rl" / "hf")
        cfg.model.init_checkpoint = str(workdir / "sft" / "checkpoints") if model == "sft" else ""
        cfg.data.train_files = (str(workdir / "data" / "toy_train.parquet"),)
        cfg.data.val_files = (str(workdir / "data" / "toy_val.parquet"),)
        cfg.trainer.progress = False
        cfg.trainer.loggers = ("jsonl",)
        cfg.rollout.val_kwargs.do_sample = sampled
        cfg.rollout.val_kwargs.n = n if sampled else 1
    with tempfile.TemporaryDirectory() as tmp:
        out = trainer.Trainer(cfg, Path(tmp) / "run").validate()
    return {k.removeprefix("val/"): round(v, 4) for k, v in out.items() if k.startswith("val/")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo_seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algos", nargs="+", default=["arpo", "grpo"], choices=demo.ALGOS)
    parser.add_argument("--n", type=int, default=4, help="samples per question in the sampled validation")
    parser.add_argument("--model", default=demo.DEFAULT_MODEL, help="the demo's --model")
    args = parser.parse_args()
    for seed in args.seeds:
        workdir = Path(args.workdir) / f"seed{seed}"
        for model in ("sft", *args.algos):
            row = {"seed": seed, "model": model,
                   "greedy": validate(workdir, seed, model, sampled=False, n=1, base=args.model),
                   "sampled": validate(workdir, seed, model, sampled=True, n=args.n, base=args.model)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
