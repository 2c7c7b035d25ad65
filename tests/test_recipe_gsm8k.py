"""The maths-with-Python recipe (`configs/arpo_qwen25_coder_05b_gsm8k.py`) with the tiny model: its real data files,
LoRA SFT on a cold-start set, the SFT adapter exported as PEFT, then one ARPO step continuing that adapter with the
`math_tool` reward and the validation on the GSM8K / MATH500 subsets, and the RL adapter exported; every step the
command a user runs (`arpo-jax sft / export / train`). The run reads a stand-in for the reference data in its formats
(`_reference_data`, so it runs in any clone); the real files' counts are checked where they are (skips without)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from arpo_jax import testing
from arpo_jax.eval import cold_start, math_tool
from arpo_jax.train import metrics

REPO = Path(__file__).resolve().parents[1]
TINY = ("--config.model.path=builtin:tiny", "--config.rollout.engine=jax", "--config.data.max_response_length=32",
        "--config.trainer.loggers=('jsonl',)", "--config.trainer.progress=false")
pytestmark = pytest.mark.slow  # three `arpo-jax` subprocesses (~2 minutes)


def _arpo(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "arpo_jax.cli", *args], env=testing.subprocess_env(1), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def _reference_data(root: Path) -> Path:
    """../shared/data's files the recipe reads, in their formats: rl/train_10k.parquet (the reference schema, 8
    maths and 8 qa rows) and eval/{gsm8k,math500}/test.jsonl with the real files' row counts (every slice of
    `math_tool` holds), small sums for questions."""
    rows = [{"data_source": "DR_grpo_mix", "prompt": [{"content": "Solve it.", "role": "system"},
                                                      {"content": f"What is {i} plus {i + 3}?", "role": "user"}],
             "ability": ("math", "qa")[i % 2], "reward_model": {"ground_truth": str(2 * i + 3), "style": "rule"},
             "extra_info": {"index": i, "need_tools_kwargs": True, "question": f"What is {i} plus {i + 3}?",
                            "split": "train"}} for i in range(16)]
    (root / "rl").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), root / "rl" / "train_10k.parquet")
    for name, n in (("gsm8k", 1319), ("math500", 500)):
        (root / "eval" / name).mkdir(parents=True)
        lines = [{"question": f"What is {i} times 3?", "answer": f"#### {3 * i}" if name == "gsm8k" else str(3 * i),
                  "idx": i} for i in range(n)]
        (root / "eval" / name / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root


def test_the_recipe_data_from_the_reference_files(eval_data_dir, tmp_path):
    data = tmp_path / "data"
    files = math_tool.prepare(data, data_dir=eval_data_dir.parent)
    train, val = pq.read_table(files["train"]), pq.read_table(files["val"]).to_pylist()
    assert train.num_rows == 5000 and set(train.column("ability").to_pylist()) == {"math"}
    assert [(s, sum(r["data_source"] == s for r in val)) for s in ("gsm8k", "math500")] == [("gsm8k", 50),
                                                                                          ("math500", 30)]
    questions = metrics.read_jsonl(files["questions"])
    assert len(questions) == 5000 and math_tool.prepare(data, data_dir=eval_data_dir.parent) == files  # idempotent


def test_the_recipe_data_sft_then_one_arpo_step_from_its_adapter(tmp_path):
    data = tmp_path / "data"
    files = math_tool.prepare(data, data_dir=_reference_data(tmp_path / "reference"))
    assert pq.read_table(files["train"]).num_rows == 8
    questions = metrics.read_jsonl(files["questions"])
    # A cold-start set as `eval.cold_start` writes it (a correct tool-using answer per question).
    answer = ("<think> compute </think>\n<python>\nprint(2 + 2)\n</python> <result>\n4\n</result>\n<think> so 4 "
              "</think>\n<answer> \\boxed{4} </answer>")
    records = [{"id": q["id"], "output": answer, "correct": True, "finish_reason": "stop", "python_calls": 1,
                "python_ok": 1, "python_empty": 0, "python_errors": 0} for q in questions[:4]]
    rows = cold_start.sft_rows(records, {q["id"]: q for q in questions[:4]})
    (data / "sft.json").write_text(json.dumps(rows))

    config = f"--config={REPO / 'configs' / 'arpo_qwen25_coder_05b_gsm8k.py'}:{data}"  # this checkout's
    # One SFT step at 10x the RL rate (no warm-up: its first step would be at rate 0), so that the SFT adapter's B
    # (~2e-3 each: Adam's first step moves a weight by its rate) stands out from what one RL step can move (<= 2e-4).
    _arpo("sft", config, *TINY, "--config.sft.batch_size=2", "--config.sft.max_steps=1", "--config.sft.lr=2e-3",
          "--config.sft.warmup_ratio=0", f"--workdir={tmp_path / 'sft'}")
    _arpo("export", "--format", "peft", "--ckpt", str(tmp_path / "sft" / "checkpoints"), "--out",
          str(tmp_path / "sft_adapter"))
    peft = json.loads((tmp_path / "sft_adapter" / "adapter_config.json").read_text())
    assert (peft["r"], peft["lora_alpha"]) == (16, 32.0)
    _arpo("train", config, *TINY, f"--config.model.lora.adapter={tmp_path / 'sft_adapter'}",
          "--config.trainer.max_steps=1", f"--workdir={tmp_path / 'arpo'}")
    logged = metrics.read_jsonl(tmp_path / "arpo" / "metrics.jsonl")
    vals = [r for r in logged if "val/accuracy" in r]
    assert len(vals) == 2  # before the first step and at the end
    assert {"val/gsm8k/reward/mean@1", "val/math500/reward/mean@1"} <= vals[0].keys()
    assert any("reward/mean" in r and r.get("step") == 1 for r in logged)
    # The recipe's reward scored the step: `math_tool`'s info (the maths reward's has no Python counts).
    trajectories = metrics.read_jsonl(tmp_path / "arpo" / "trajectories.jsonl")
    assert trajectories and all({"python_calls", "python_ok"} <= r["reward"].keys() for r in trajectories)
    _arpo("export", "--format", "peft", "--ckpt", str(tmp_path / "arpo" / "checkpoints"), "--out",
          str(tmp_path / "arpo_adapter"))
    # RL continued the SFT adapter: its B matrices are the SFT's moved by one step, not one step from a fresh B = 0
    # (which would be about the SFT's whole size away from them).
    sft, rl = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("sft_adapter", "arpo_adapter"))
    b = [k for k in sft if "lora_B" in k]
    assert b and sft.keys() == rl.keys()
    size = max(float(np.abs(sft[k]).max()) for k in b)
    moved = max(float(np.abs(rl[k] - sft[k]).max()) for k in b)
    assert size > 1e-3 and moved < size / 2, (moved, size)
