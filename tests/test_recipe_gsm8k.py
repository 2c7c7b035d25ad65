"""The GSM8K study (`benchmarks/studies/gsm8k_tool.py`, the recipe `configs/arpo_qwen25_coder_05b_gsm8k.py`) end to
end at tiny size, on benchmark files the test writes itself (so it runs in a clean clone, without ../shared/data): data,
the cold start (the random model solves nothing: the phase says so and stops), then with a cold-start set written as
`eval.cold_start` writes it: SFT, the pass@8 selection, ARPO from the SFT adapter and GRPO without tools from the
untrained model, every evaluation and the report, the RL runs and evaluations side by side as the GPU study runs
them (`--parallel`: a process per run, merged into one work dir).

The GSM8K file holds 1,319 questions like the real one, and from question 1000 on each says FORBIDDEN: no phase may
read them (issue 62), so no file the study writes may hold that word."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from arpo_jax import testing
from arpo_jax.data.prompts import NO_TOOLS_SYSTEM_PROMPT, REFERENCE_DATA_SYSTEM_PROMPT
from arpo_jax.eval import cold_start, math_tool
from arpo_jax.train import metrics

REPO = Path(__file__).resolve().parents[1]
STUDY = [sys.executable, str(REPO / "benchmarks" / "studies" / "gsm8k_tool.py"), "--size", "tiny",
         "--model", "builtin:tiny", "--set", "data.max_response_length=32", "--set", "rollout.engine=jax",
         "--set", "trainer.loggers=('jsonl',)",
         "--set", "trainer.progress=false", "--set", "sft.batch_size=2", "--set", "sft.max_steps=1",
         "--set", "sft.warmup_ratio=0.0", "--set", "data.val_max_samples=4",
         # One SFT step moves the adapter 100x an RL step (lr 2e-5): an RL adapter that continued it stays near it.
         "--set", "sft.lr=2e-3"]
pytestmark = pytest.mark.slow  # one study process (~3 minutes)
FORBIDDEN = "FORBIDDEN"


def write_benchmarks(root: Path) -> Path:
    """gsm8k (1,319 questions, FORBIDDEN from 1000 on) and math500 (500) test files in the shipped formats."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(1319):
        a, b = rng.integers(2, 90, 2)
        text = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        rows.append({"question": (f"{FORBIDDEN} " if i >= 1000 else "") + text, "answer": f"{a}+{b}\n#### {a + b}",
                     "idx": i})
    (root / "eval" / "gsm8k").mkdir(parents=True)
    (root / "eval" / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval" / "math500").mkdir()
    (root / "eval" / "math500" / "test.jsonl").write_text("".join(
        json.dumps({"question": f"What is ${i} + 1$?", "answer": str(i + 1)}) + "\n" for i in range(500)))
    return root


def _study(workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*STUDY, "--workdir", str(workdir), *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=1500)


def _lora_b(folder: Path) -> np.ndarray:
    weights = load_file(folder / "adapter_model.safetensors")
    return np.concatenate([v.ravel() for k, v in sorted(weights.items()) if "lora_B" in k])


def test_the_study_at_tiny_size(tmp_path):
    shared = write_benchmarks(tmp_path / "shared")
    env = testing.subprocess_env(1, ARPO_DATA=str(shared), ARPO_EVAL_DATA=str(shared / "eval"))
    work = tmp_path / "study"

    proc = _study(work, env, "--phases", "data,cold_start")
    assert proc.returncode != 0 and "the cold start kept no sample of 4" in proc.stderr, proc.stderr[-3000:]
    # A cold-start set as `eval.cold_start` writes it: a right, tool-using answer to each of the first 4 questions.
    questions = metrics.read_jsonl(work / "data" / math_tool.COLD_START_FILE)
    assert [q["id"] for q in questions] == [str(i) for i in range(300, 950)]
    records = [{"id": q["id"], "correct": True, "finish_reason": "stop", "python_calls": 1, "python_ok": 1,
                "python_empty": 0, "python_errors": 0,
                "output": (f"<think> add </think>\n<python>\nprint({q['answer']})\n</python> <result>\n{q['answer']}"
                           f"\n</result>\n<think> so {q['answer']} </think>\n<answer> \\boxed{{{q['answer']}}} "
                           "</answer>")} for q in questions[:4]]
    sft_set = cold_start.sft_rows(records, {q["id"]: q for q in questions})
    (work / "data" / "sft.json").write_text(json.dumps(sft_set))

    # The random model answers nothing right: `--keep 0,8` keeps every candidate (the real study keeps 1-7 of 8).
    # `--parallel` as on a GPU: the RL runs (and the evaluations) in a process each, merged into one report.
    proc = _study(work, env, "--phases", "sft,select,rl,eval,report", "--keep", "0,8", "--parallel")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    selected = json.loads((work / "select.json").read_text())
    assert selected["candidates"] == selected["kept"] == 4 and sum(selected["right_of_8"].values()) == 4
    train = pq.read_table(work / "data" / math_tool.RL_FILE).to_pylist()
    notool = pq.read_table(work / "data" / "train_gsm8k_notool.parquet").to_pylist()
    ids = [r["extra_info"]["id"] for r in train]
    assert ids == [r["extra_info"]["id"] for r in notool] and len(ids) == 4
    assert all(300 <= int(i) < 950 for i in ids) and not set(ids) & {r["id"] for r in sft_set}
    assert {r["prompt"][0]["content"] for r in train} == {REFERENCE_DATA_SYSTEM_PROMPT}
    assert {r["prompt"][0]["content"] for r in notool} == {NO_TOOLS_SYSTEM_PROMPT}

    for run, reward, python in (("arpo", "math_tool", True), ("grpo_notool", "math", False)):
        config = json.loads((work / f"{run}_s0" / "config.json").read_text())
        assert (config["reward"]["name"], config["tools"]["python"]["enabled"]) == (reward, python)
        assert any(r.get("step") == 1 and "reward/mean" in r for r in metrics.read_jsonl(work / f"{run}_s0" /
                                                                                         "metrics.jsonl"))
    # The recipe's reward scored ARPO's step: `math_tool`'s info (the maths reward's has no Python counts).
    trajectories = metrics.read_jsonl(work / "arpo_s0" / "trajectories.jsonl")
    assert trajectories and all({"python_calls", "python_ok"} <= r["reward"].keys() for r in trajectories)
    # ARPO continues the SFT adapter (one step moves it a little); the no-tool run starts from a fresh one (B = 0).
    sft_b, arpo_b, notool_b = (_lora_b(work / p) for p in ("sft_adapter", "arpo_s0/adapter", "grpo_notool_s0/adapter"))
    assert np.abs(sft_b).max() > 0
    assert np.abs(arpo_b - sft_b).max() < np.abs(sft_b).max()
    assert np.abs(notool_b).max() < np.abs(sft_b).max() / 2

    rows = {(r["model"], r["benchmark"]): r for r in report["rows"]}
    models = ("untrained", "sft", "untrained_notool", "arpo_s0", "grpo_notool_s0")
    assert set(rows) == {(m, b) for m in models for b in ("gsm8k", "math500")}
    assert all(r["questions"] == 2 for r in rows.values())
    assert not rows["untrained_notool", "gsm8k"]["tools"] and rows["arpo_s0", "gsm8k"]["rl_steps"] == 1
    # Each RL run paired with the model it started from (ARPO: the SFT model; the tool-free run: the untrained one).
    assert rows["arpo_s0", "gsm8k"]["vs_start"]["questions"] == rows["grpo_notool_s0", "math500"]["vs_start"][
        "questions"] == 2
    assert rows["sft", "gsm8k"]["vs_start"] is None
    assert (work / "report.md").read_text().count("\n") == 2 + len(rows)
    # Each run's process trained it and evaluated it with a share of the baselines, in its own work dir.
    assert {p.name for p in (work / "parallel").iterdir()} == {"arpo", "grpo_notool"}
    assert {p.name for p in (work / "parallel" / "arpo" / "eval").iterdir()} == {"arpo_s0", "untrained",
                                                                                 "untrained_notool"}
    assert {p.name for p in (work / "parallel" / "grpo_notool" / "eval").iterdir()} == {"grpo_notool_s0", "sft"}
    for path in work.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".parquet", ".md"):
            assert FORBIDDEN.encode() not in path.read_bytes(), path


def test_parallel_refuses_gpus_another_process_holds(tmp_path, monkeypatch):
    """--parallel's processes preallocate their share each: with 107 GB of an H200 taken (as a benchmark left running
    took it on 2026-11-28), three x 0.3 is refused before any starts, naming the GPU and what to do; one x 0.2 fits."""
    import importlib.util

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, GPU-0, NVIDIA H200, 580.159.04, Default, 143771, 107000'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = importlib.util.spec_from_file_location("gsm8k_tool", REPO / "benchmarks" / "studies" / "gsm8k_tool.py")
    study = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gsm8k_tool", study)  # its dataclasses look their module up there
    spec.loader.exec_module(study)
    with pytest.raises(SystemExit, match=r"GPU 0 has 107000 of 143771 MiB in use; 3 processes .* --mem-fraction"):
        study.check_gpus_free(3, 0.3)
    study.check_gpus_free(1, 0.2)
