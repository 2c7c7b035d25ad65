"""benchmarks/device/gpu_scale.py, the one-call GPU benchmark (issue 60): its tiny run on CPU, and its arithmetic."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_jax import testing
from benchmarks.device import gpu_scale

REPO = Path(__file__).resolve().parents[1]


def test_device_table_and_flag_overrides():
    assert gpu_scale.device_rates("NVIDIA H100 80GB HBM3", None, None) == (3.35e12, 989e12)
    assert gpu_scale.device_rates("NVIDIA H100 PCIe", None, None) == (2.0e12, 756e12)
    assert gpu_scale.device_rates("NVIDIA H200", None, None) == (4.8e12, 989e12)
    assert gpu_scale.device_rates("NVIDIA A100-SXM4-80GB", None, None) == (2.0e12, 312e12)
    assert gpu_scale.device_rates("cpu", None, None) == (None, None)
    assert gpu_scale.device_rates("NVIDIA H200", 4.0, 900.0) == (4.0e12, 900e12)


def test_dot_operand_bytes_of_a_compiled_program():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a, b: jnp.tanh(a @ b))
    hlo = f.lower(jnp.ones((8, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)).compile().as_text()
    assert gpu_scale.dot_operand_bytes(hlo) == (8 * 64 + 64 * 32) * 4


def test_the_lora_ratio_pairs_the_cases():
    lines = [{"case": "loop:32", "status": "ok", "step_s": 2.0}, {"case": "lora:32", "status": "ok", "step_s": 2.2},
             {"case": "loop:256", "status": "timeout"}]
    assert gpu_scale._lora_ratio(lines) == 1.1
    assert gpu_scale._lora_ratio(lines[:1]) is None


@pytest.mark.slow  # ~2-3 min on 2 cores (engine 26 s, loop 62 s, LoRA loop 36 s): a process and a warm-up each
def test_the_tiny_run_measures_every_case_kind(tmp_path):
    """`gpu_scale.py --tiny` on CPU: the engine alone (rows x contexts, with the programs' counts), the RL loop and the
    LoRA loop (generated tokens, the device's busy share per phase from the profiler trace, no compile after the
    warm-up), one JSON line per case with its wall time, and the summary with the LoRA / full step ratio."""
    out = tmp_path / "lines.jsonl"
    proc = subprocess.run([sys.executable, "benchmarks/device/gpu_scale.py", "--tiny",
                           "--cases", "engine:tiny,loop:8,lora:8", "--workdir", str(tmp_path / "work"),
                           "--out", str(out), "--budget-s", "1500"],
                          cwd=REPO, env=testing.subprocess_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by = {x["case"]: x for x in lines}
    assert [x["case"] for x in lines] == ["engine:tiny", "loop:8", "lora:8", "summary"]
    assert all(by[c]["status"] == "ok" and by[c]["wall_s"] > 0 for c in ("engine:tiny", "loop:8", "lora:8")), lines
    engine = by["engine:tiny"]
    assert {(p["rows"], p["context"]) for p in engine["programs"]} == {(8, 64), (8, 256), (32, 64), (32, 256)}
    for p in engine["programs"]:
        assert p["tokens_per_s"] > 0 and p["dot_operand_bytes_per_step"] > 0 and p["fraction_of_bound"] is None
    for case in ("loop:8", "lora:8"):
        loop = by[case]
        assert loop["generated_tokens_per_s"] > 0 and all(s["tokens"] > 0 for s in loop["steps"])
        assert loop["compiles_after_warmup"][1:] == [0, 0]
        assert all(0 < s["host_reads_per_token"] <= 1 and s["idle_rows_per_decode_step"] >= 0 for s in loop["steps"])
        busy = loop["device_busy"]
        assert busy["generation"]["wall_ms"] > 0 and busy["update"]["busy_ms"] > 0 and busy["sync"] is not None
        assert 0 < busy["step"]["busy_share"] <= 1
    assert by["summary"]["lora_over_full_step"] > 0 and by["summary"]["device"] == "cpu"
