"""An adapter carries the settings it was trained with (`training_settings.json`): `arpo-jax eval --adapter` uses
them unless a --config.* flag says otherwise; the committed GSM8K adapter needs no flag; an export from a LoRA run
writes them from the run's config.json; a malformed adapter_config.json is named in the error; a maths benchmark
does not ask for a search key."""

import json
import shutil
from pathlib import Path

import pytest

from arpo_jax.eval import agent, runner
from arpo_jax.weights import convert, lora_io

ADAPTER = Path(__file__).resolve().parents[1] / "benchmarks" / "artifacts" / "gsm8k_grpo_h200_adapter"


def test_the_committed_adapter_brings_the_settings_it_was_trained_with():
    cfg = agent.load_eval_config([], adapter=str(ADAPTER))
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.tools.call_limit) == (512, 512, 3)
    assert cfg.tools.search.enabled is False
    base = agent.load_eval_config([])
    assert (base.data.max_response_length, base.tools.search.enabled) != (512, False)  # they came from the file


def test_a_config_flag_or_no_tools_wins_over_the_adapters_settings():
    cfg = agent.load_eval_config(["--config.tools.call_limit=5"], adapter=str(ADAPTER))
    assert cfg.tools.call_limit == 5 and cfg.data.max_response_length == 512
    cfg = agent.load_eval_config([], no_tools=True, adapter=str(ADAPTER))
    assert cfg.tools.call_limit == 0 and cfg.data.system_prompt == "no_tools"


def test_malformed_adapter_files_are_named(tmp_path):
    bad = tmp_path / "adapter"
    shutil.copytree(ADAPTER, bad)
    (bad / lora_io.ADAPTER_CONFIG).write_text('{"r": 16\n"lora_alpha": 32}')
    with pytest.raises(ValueError, match=f"{bad / lora_io.ADAPTER_CONFIG}: not valid JSON \\(Expecting ','"):
        lora_io.read_peft_config(bad)
    (bad / lora_io.TRAINING_SETTINGS).write_text(json.dumps({"data.max_response_length": 512, "rollout.n": 3}))
    with pytest.raises(ValueError, match=r"training_settings.json: unknown field\(s\) \['rollout.n'\]"):
        agent.load_eval_config([], adapter=str(bad))


def test_an_export_copies_the_runs_settings(tmp_path):
    run_config = {"data": {"system_prompt": "auto", "max_prompt_length": 256, "max_response_length": 128},
                  "tools": {"call_limit": 2, "search": {"enabled": False}, "python": {"enabled": True}}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(run_config))
    out = tmp_path / "peft"
    out.mkdir()
    convert._copy_training_settings(out, tmp_path / "run" / "checkpoints", None)
    assert lora_io.read_training_settings(out) == {
        "data.system_prompt": "auto", "data.max_prompt_length": 256, "data.max_response_length": 128,
        "tools.call_limit": 2, "tools.search.enabled": False, "tools.python.enabled": True}


def test_a_maths_benchmark_does_not_ask_for_a_search_key(monkeypatch, eval_data_dir):
    from arpo_jax.eval.benchmarks import load_benchmark

    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    cfg = agent.load_eval_config([])
    assert cfg.tools.search.enabled and cfg.tools.search.backend == "brightdata"
    runner._search_only_where_needed(cfg, {"gsm8k": load_benchmark("gsm8k", eval_data_dir, limit=2)})
    assert cfg.tools.search.enabled is False
    cfg = agent.load_eval_config([])
    runner._search_only_where_needed(cfg, {"gsm8k": load_benchmark("gsm8k", eval_data_dir, limit=2),
                                           "hotpotqa": load_benchmark("hotpotqa", eval_data_dir, limit=2)})
    assert cfg.tools.search.enabled  # a QA benchmark needs it: validation then asks for the key
