"""The maths-with-Python recipe (`configs/arpo_qwen25_coder_05b_gsm8k.py`) with the tiny model: its real data files,
LoRA SFT on a cold-start set, the SFT adapter exported as PEFT, then one ARPO step continuing that adapter with the
`math_tool` reward and the validation on the GSM8K / MATH500 subsets, and the RL adapter exported; every step the
command a user runs (`arpo-jax sft / export / train`). Needs the reference data beside the repo (skips without)."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

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


def test_the_recipe_data_sft_then_one_arpo_step_from_its_adapter(eval_data_dir, tmp_path):
    data = tmp_path / "data"
    files = math_tool.prepare(data, data_dir=eval_data_dir.parent)
    train, val = pq.read_table(files["train"]), pq.read_table(files["val"]).to_pylist()
    assert train.num_rows == 5000 and set(train.column("ability").to_pylist()) == {"math"}
    assert [(s, sum(r["data_source"] == s for r in val)) for s in ("gsm8k", "math500")] == [("gsm8k", 50),
                                                                                          ("math500", 30)]
    questions = metrics.read_jsonl(files["questions"])
    assert len(questions) == 5000 and math_tool.prepare(data, data_dir=eval_data_dir.parent) == files  # idempotent
    # A cold-start set as `eval.cold_start` writes it (a correct tool-using answer per question).
    answer = ("<think> compute </think>\n<python>\nprint(2 + 2)\n</python> <result>\n4\n</result>\n<think> so 4 "
              "</think>\n<answer> \\boxed{4} </answer>")
    records = [{"id": q["id"], "output": answer, "correct": True, "finish_reason": "stop", "python_calls": 1,
                "python_ok": 1, "python_empty": 0, "python_errors": 0} for q in questions[:4]]
    rows = cold_start.sft_rows(records, {q["id"]: q for q in questions[:4]})
    (data / "sft.json").write_text(json.dumps(rows))

    config = f"--config={REPO / 'configs' / 'arpo_qwen25_coder_05b_gsm8k.py'}:{data}"  # this checkout's
    _arpo("sft", config, *TINY, "--config.sft.batch_size=2", "--config.sft.max_steps=1",
          f"--workdir={tmp_path / 'sft'}")
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
    _arpo("export", "--format", "peft", "--ckpt", str(tmp_path / "arpo" / "checkpoints"), "--out",
          str(tmp_path / "arpo_adapter"))
    assert (tmp_path / "arpo_adapter" / "adapter_model.safetensors").is_file()
