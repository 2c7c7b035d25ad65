"""Tests for arpo_jax.eval.benchmarks: the 13 real benchmark files, malformed rows, names, the eval prompt."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from arpo_jax.eval import benchmarks as B

RL_DATA = Path("/work/shared/data/rl")
CJK = re.compile(r"[\u4e00-\u9fff]")
# Written out here rather than read from BENCHMARKS, so a wrong task in the table fails (spec 13.2).
EXPECTED_TASK = {"aime24": "math", "aime25": "math", "math500": "math", "gsm8k": "math", "hotpotqa": "qa",
                 "2wiki": "qa", "musique": "qa", "bamboogle": "qa", "SimpleQA": "qa", "webwalker": "qa",
                 "gaia": "qa", "hle": "qa", "xbench": "qa"}


@pytest.fixture(scope="module")
def loaded(eval_data_dir) -> dict[str, B.BenchmarkSamples]:
    return {name: B.load_benchmark(name, eval_data_dir) for name in B.BENCHMARKS}


def rows_in(path: Path) -> int:
    """Non-blank lines (xbench's last row has no trailing newline, so `wc -l` under-counts by one)."""
    return sum(1 for line in path.read_bytes().splitlines() if line.strip())


# ----------------------------------------------------------------------------------------------------------
# The real files
# ----------------------------------------------------------------------------------------------------------


def test_registry_has_the_13_benchmarks_with_their_tasks():
    assert {name: spec.task for name, spec in B.BENCHMARKS.items()} == EXPECTED_TASK


@pytest.mark.parametrize("name", list(EXPECTED_TASK))
def test_loader_reads_every_row_of_the_real_file(name, eval_data_dir, loaded):
    samples = loaded[name]
    path = eval_data_dir / name / "test.jsonl"
    assert samples.path == path
    assert len(samples) == rows_in(path) > 0
    assert samples.skipped == []
    assert len({s.id for s in samples}) == len(samples), "ids must be unique"
    for s in samples:
        assert s.benchmark == name and s.task == EXPECTED_TASK[name]
        assert isinstance(s.question, str) and s.question.strip()
        assert isinstance(s.answers, tuple) and s.answers
        assert all(isinstance(a, str) and a and a == a.strip() for a in s.answers)
        assert isinstance(s.id, str) and s.id


def test_row_counts_of_the_shipped_files(loaded):
    # Pinned so that a truncated or swapped data file is noticed (counted independently in the test above).
    assert {n: len(s) for n, s in loaded.items()} == {
        "aime24": 30, "aime25": 30, "math500": 500, "gsm8k": 1319, "hotpotqa": 200, "2wiki": 200, "musique": 200,
        "bamboogle": 125, "SimpleQA": 500, "webwalker": 200, "gaia": 103, "hle": 500, "xbench": 100}


def test_field_specific_parsing(loaded):
    gsm = loaded["gsm8k"]
    assert gsm[0].answers == ("18",) and gsm[0].id == "0"
    assert "####" in gsm[0].meta["raw_answer"]  # the solution is kept, the reference is the final number
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", s.answers[0]) for s in gsm), "thousands commas dropped"
    aime24 = loaded["aime24"]
    assert aime24[0].answers == ("204",) and aime24[0].id == "60"
    zero_padded = [s for s in aime24 if s.meta.get("raw_answer") == "025"]
    assert len(zero_padded) == 1 and zero_padded[0].answers == ("25",)
    assert loaded["aime25"][0].answers == ("70",)  # an int in the file
    gaia = loaded["gaia"]
    assert gaia[0].id == "17b5a6a3-bc87-42e8-b0fb-6ab0781ef2cc" and gaia[0].meta["level"] == 2
    assert gaia[0].question.startswith("I\u2019m researching species")  # read from `Question`
    assert loaded["2wiki"][0].answers[:3] == ("the five boroughs", "City of New York", "New York")
    hle = {s.id: s for s in loaded["hle"]}
    assert hle["668825f80a642802bdfeadfa"].answers == ("D",)
    # A list-valued HLE answer is one reference, not 8 (the reference's comma split would accept "11").
    assert ("[11,19,22,23,29,30,31,36]",) in {s.answers for s in hle.values()}


def test_chinese_benchmarks(loaded):
    xbench = loaded["xbench"]
    assert all(CJK.search(s.question) for s in xbench)
    assert all(s.meta["language"] == "zh" for s in xbench)
    assert xbench[0].answers == ("161.27元",)
    languages = {s.meta["language"] for s in loaded["webwalker"]}
    assert languages == {"zh", "en"}


def test_limit_takes_the_first_n(eval_data_dir, loaded):
    first = B.load_benchmark("gsm8k", eval_data_dir, limit=5)
    assert first == loaded["gsm8k"][:5]
    assert B.load_benchmark("gsm8k", eval_data_dir, limit=0) == []
    assert B.load_benchmark("aime25", eval_data_dir, limit=10_000) == loaded["aime25"]
    with pytest.raises(ValueError, match="limit"):
        B.load_benchmark("gsm8k", eval_data_dir, limit=-1)


# ----------------------------------------------------------------------------------------------------------
# Malformed rows, names, data dir
# ----------------------------------------------------------------------------------------------------------


def test_malformed_rows_are_skipped_counted_and_logged(tmp_path, caplog):
    lines = [
        json.dumps({"question": "Q1?", "answer": ["A1"]}).encode(),
        b'{"question": "broken", "answer": ',  # line 2: bad JSON
        json.dumps({"question": "no answer here"}).encode(),  # line 3
        b"",  # blank: ignored, not counted
        json.dumps({"question": "empty list", "answer": []}).encode(),  # line 5
        b'{"question": "\xff\xfe", "answer": ["x"]}',  # line 6: invalid UTF-8
        json.dumps(["not", "an", "object"]).encode(),  # line 7
        json.dumps({"answer": ["no question"]}).encode(),  # line 8
        json.dumps({"question": "Q2?", "answer": '["A2", "B, 2"]'}).encode(),  # a list literal as a string
    ]
    (tmp_path / "hotpotqa").mkdir()
    path = tmp_path / "hotpotqa" / "test.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="arpo_jax.eval.benchmarks"):
        samples = B.load_benchmark("hotpotqa", tmp_path)
    assert [(s.id, s.question, s.answers) for s in samples] == [
        ("hotpotqa-0", "Q1?", ("A1",)), ("hotpotqa-8", "Q2?", ("A2", "B, 2"))]
    assert [line for line, _ in samples.skipped] == [2, 3, 5, 6, 7, 8]
    reasons = dict(samples.skipped)
    assert "JSON" in reasons[2] and "no answer" in reasons[3] and "UTF-8" in reasons[6] and "no question" in reasons[8]
    text = caplog.text
    assert f"{path} line 2" in text and f"{path} line 8" in text and "skipped 6 malformed row(s)" in text


def test_duplicate_file_ids_are_made_unique(tmp_path):
    (tmp_path / "hle").mkdir()
    rows = [{"id": "x", "question": "q1", "answer": "a"}, {"id": "x", "question": "q2", "answer": "b"}]
    (tmp_path / "hle" / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert [s.id for s in B.load_benchmark("hle", tmp_path)] == ["x", "hle-1"]


def test_unknown_and_missing_benchmarks(tmp_path):
    with pytest.raises(ValueError, match="allowed: aime24, aime25, .*xbench"):
        B.load_benchmark("aime26", tmp_path)
    with pytest.raises(FileNotFoundError, match="ARPO_EVAL_DATA"):
        B.load_benchmark("gsm8k", tmp_path)


def test_parse_benchmarks():
    assert B.parse_benchmarks("aime24,gsm8k") == ["aime24", "gsm8k"]
    assert B.parse_benchmarks(" simpleqa , XBENCH,simpleqa ") == ["SimpleQA", "xbench"]
    assert B.parse_benchmarks("all") == list(EXPECTED_TASK)
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        B.parse_benchmarks("aime24,gsm9k")
    with pytest.raises(ValueError, match="no benchmark"):
        B.parse_benchmarks(" , ")


def test_default_data_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ARPO_EVAL_DATA", str(tmp_path))
    assert B.default_data_dir() == tmp_path
    monkeypatch.setenv("ARPO_EVAL_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        B.default_data_dir()
    # Neither the variable nor <repo root>/../shared/data/eval: the error says what to do.
    monkeypatch.delenv("ARPO_EVAL_DATA")
    monkeypatch.setattr(B, "__file__", str(tmp_path / "repo" / "arpo_jax" / "eval" / "benchmarks.py"))
    with pytest.raises(FileNotFoundError, match="pass --data-dir or set ARPO_EVAL_DATA"):
        B.default_data_dir()


def test_normalize_answers():
    norm = B.normalize_answers
    assert norm(588) == ("588",)
    assert norm([" NYC ", "NYC", "", "New York"]) == ("NYC", "New York")
    assert norm('["a", "b, c"]', split_list_strings=True) == ("a", "b, c")  # JSON literal: commas inside kept
    assert norm("['a', 'b']", split_list_strings=True) == ("a", "b")  # Python literal
    assert norm("[Z, Z/2Z]", split_list_strings=True) == ("Z", "Z/2Z")  # not a literal: the reference's split
    assert norm("[0, 1]") == ("[0, 1]",)  # an interval stays one answer unless the benchmark says otherwise
    assert norm("Step 1\n#### 1,234", answer_format="gsm8k") == ("1234",)
    assert norm("007", answer_format="integer") == ("7",) and norm("x", answer_format="integer") == ("x",)
    assert norm({"a": 1}) == () and norm(None) == ()


def test_samples_compare_without_meta():
    a = B.EvalSample("gsm8k", "1", "q", ("1",), "math", meta={"line": 1})
    b = B.EvalSample("gsm8k", "1", "q", ("1",), "math", meta={"line": 2})
    assert a == b and hash(a) == hash(b)


# ----------------------------------------------------------------------------------------------------------
# The evaluation prompt is the training prompt (spec B17)
# ----------------------------------------------------------------------------------------------------------


def test_build_messages_reproduces_the_training_prompts_byte_for_byte():
    pq = pytest.importorskip("pyarrow.parquet")
    files = sorted(RL_DATA.glob("*.parquet"))
    if not files:
        pytest.skip(f"no RL parquet files in {RL_DATA}")
    for f in files:  # math and deep-search files alike: one system prompt
        for row in pq.read_table(f, columns=["prompt"]).to_pylist():
            messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
            assert B.build_messages(messages[1]["content"]) == messages, f.name


def test_training_system_prompt_keeps_the_backspace_artifact():
    prompt = B.build_messages("What is 2+2?")[0]["content"]
    assert prompt.count("\x08oxed{") == 2 and "\\boxed" not in prompt  # spec 2.3 / B13
    for tag in ("<python>", "<search>", "<answer>", "<result>", "<think>"):
        assert tag in prompt
    clean = B.build_messages("q", system_prompt="S")
    assert clean == [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]


def test_no_tools_baseline_prompt_and_config():
    """`--no-tools`: a prompt without a word about tools (same answer format, so the same reward), call limit 0; an
    unknown prompt name is refused naming the field and the allowed values."""
    from arpo_jax.assemble import components
    from arpo_jax.assemble import validate as config_lib
    from arpo_jax.data import prompts
    from arpo_jax.eval import agent

    cfg = agent.load_eval_config(["--config.tools.call_limit=3"], no_tools=True)
    assert cfg.tools.call_limit == 0 and components.system_prompt_for(cfg) == prompts.NO_TOOLS_SYSTEM_PROMPT
    for tag in ("<python>", "<search>", "tool"):
        assert tag not in prompts.NO_TOOLS_SYSTEM_PROMPT
    assert "\\boxed{answer}" in prompts.NO_TOOLS_SYSTEM_PROMPT and "<answer>" in prompts.NO_TOOLS_SYSTEM_PROMPT
    assert agent.load_eval_config([]).data.system_prompt == "auto"
    with pytest.raises(ValueError, match=r"data.system_prompt.*allowed: auto \| reference \| toy \| demo \| no_tools"):
        config_lib.validate(agent.load_eval_config(["--config.data.system_prompt=chatty"]), command="eval",
                            check_files=False)


def test_the_eval_prompt_is_the_prompt_of_the_training_data():
    """A model trained on the built-in toy tasks saw a real \\boxed, one trained on the reference files the
    backspace artifact: `components.system_prompt_for` gives each its own (the eval agent's prompt_ids use it)."""
    from ml_collections import ConfigDict

    from arpo_jax.assemble import components
    from arpo_jax.data import prompts, toy

    toy_cfg = ConfigDict({"data": {"train_files": [toy.BUILTIN], "system_prompt": "auto"}})
    assert components.system_prompt_for(toy_cfg) == prompts.SYSTEM_PROMPT and "\\boxed{" in prompts.SYSTEM_PROMPT
    for files in (["/data/train_10k.parquet"], [toy.BUILTIN, "/data/more.parquet"], []):
        cfg = ConfigDict({"data": {"train_files": files, "system_prompt": "auto"}})
        assert components.system_prompt_for(cfg) == prompts.REFERENCE_DATA_SYSTEM_PROMPT
    toy_cfg.data.system_prompt = "demo"  # named explicitly: whatever the training files
    assert components.system_prompt_for(toy_cfg) == prompts.DEMO_SYSTEM_PROMPT
    row = toy.toy_rows("val", 1)[0]
    assert row["prompt"] == prompts.chat_messages(row["extra_info"]["question"], prompts.SYSTEM_PROMPT)
