"""`arpo-jax eval`, `compare` and `chat` end to end: the real command line, model, tools, benchmarks and judge client.

Every evaluation is a subprocess of `python -m arpo_jax.cli eval` on one CPU device with the toy config (the tiny
random `builtin:tiny` model, the real sandboxed Python tool and the offline BM25 search), on real benchmark files
(gsm8k, hotpotqa, aime24). A random model answers nothing right, so rule-based scores are 0: the tests check
structure, counts and that every number in a report is the one its samples.jsonl gives. The LLM judge is a small
OpenAI-compatible chat-completions server on loopback (http.server in a thread), which makes non-zero, mixed
verdicts possible and so a pass@k check with teeth.

With data.max_prompt_length=512, the first aime24 question (594 prompt tokens with the toy tokenizer) is over the
limit: it is recorded as failed while the rest of its chunk and of the run is scored.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from statistics import mean

import pytest

from arpo_jax import cli, testing
from arpo_jax.eval import report as report_lib
from arpo_jax.eval import runner
from arpo_jax.eval.benchmarks import load_benchmark
from arpo_jax.eval.chat import format_transcript
from arpo_jax.eval.scoring import pass_at_k
from arpo_jax.train import metrics
from arpo_jax.weights import convert

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")
BENCHMARKS = ("gsm8k", "hotpotqa", "aime24")
LIMIT, K, BATCH = 3, 2, 2
OVERRIDES = ("--config.data.max_prompt_length=512", "--config.data.max_response_length=32")
# One worker runs the module (`--dist loadgroup`): its tests share the `evaluated` run (a subprocess evaluation),
# which each worker would otherwise run again.
pytestmark = pytest.mark.xdist_group("eval_runner")
HAS_MATPLOTLIB = bool(__import__("importlib").util.find_spec("matplotlib"))
VOLATILE = ("seconds",)  # wall time: the only record field that may differ between two runs


def _env() -> dict:
    return testing.subprocess_env(1, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")


def _eval_cmd(workdir: Path, model: str, *extra: str, benchmarks=BENCHMARKS, limit=LIMIT) -> list[str]:
    return [sys.executable, "-m", "arpo_jax.cli", "eval", f"--config={TOY}", *OVERRIDES, "--model", model,
            "--benchmarks", ",".join(benchmarks), "--k", str(K), "--limit", str(limit), "--batch-size", str(BATCH),
            "--workdir", str(workdir), "--no-progress", *extra]


def _run(cmd: list[str], env: dict, timeout: float = 600, stdin: str | None = None) -> dict:
    """Runs a command to completion; returns its last stdout line as JSON (the command's summary)."""
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, input=stdin)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _samples(workdir: Path, name: str) -> list[dict]:
    return metrics.read_jsonl(workdir / name / runner.SAMPLES_FILE)


def _stable(records: list[dict]) -> dict:
    return {(r["id"], r["sample"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in records}


def _by_hand(records: list[dict], k: int) -> tuple[float, float]:
    """pass@1 and pass@k from scoring.pass_at_k over each question's (n, c)."""
    per_q: dict[str, list[bool]] = {}
    for r in records:
        per_q.setdefault(r["id"], []).append(bool(r["correct"]))
    p1 = [pass_at_k(len(v), sum(v), 1) for v in per_q.values()]
    pk = [pass_at_k(len(v), sum(v), k) for v in per_q.values()]
    return sum(p1) / len(p1), sum(pk) / len(pk)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return root, _env()


@pytest.fixture(scope="module")
def evaluated(shared, eval_data_dir):  # the command reads the benchmarks from eval_data_dir (skips without them)
    """An uninterrupted evaluation of builtin:tiny: (workdir, summary)."""
    root, env = shared
    workdir = root / "uninterrupted"
    return workdir, _run(_eval_cmd(workdir, "builtin:tiny"), env)


@pytest.fixture(scope="module")
def tiny_model(evaluated) -> str:
    """The HF folder `builtin:tiny` was built into (later runs load it instead of building it again)."""
    return str(evaluated[0] / "builtin_tiny")


# ------------------------------------------------------------------------------------------------ a judge server


@contextlib.contextmanager
def judge_server(verdict):
    """An OpenAI chat-completions server on loopback; `verdict(prompt)` -> (HTTP status, reply text).

    Yields (base_url, prompts): the prompts received.
    """
    prompts = []

    def respond(n, path, body):
        prompt = body["messages"][-1]["content"]
        prompts.append(prompt)
        status, reply = verdict(prompt)
        return status, {"id": "chat-1", "object": "chat.completion", "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply}}]}, 0.0

    with testing.scripted_server(respond) as (url, _):
        yield url, prompts


JUDGED_QUESTIONS = 4  # hotpotqa's first four: the judge fails on the first, says "Correct" to the second, mixes


def _verdict(questions: list[str]):
    """The judge's reply by question: 500 for the first, "Correct" for the second, and for the others a verdict that
    depends on the prediction only (deterministic whatever the order of the concurrent requests)."""
    def verdict(prompt):
        if f"Question: {questions[0]}\n" in prompt:
            return 500, "server error"
        if f"Question: {questions[1]}\n" in prompt:
            return 200, "Correct"
        return 200, "Correct" if zlib.crc32(prompt.encode()) % 2 else "Incorrect"
    return verdict


@pytest.fixture(scope="module")
def judged(shared, tiny_model):
    """One evaluation with an LLM judge on loopback: (workdir, summary, prompts the judge received, questions)."""
    root, env = shared
    workdir = root / "judged"
    questions = [s.question for s in load_benchmark("hotpotqa", limit=JUDGED_QUESTIONS)]
    with judge_server(_verdict(questions)) as (url, prompts):
        summary = _run(_eval_cmd(workdir, tiny_model, "--judge-url", url, "--judge-model", "judge",
                                 "--config.data.max_response_length=16", benchmarks=("hotpotqa",),
                                 limit=JUDGED_QUESTIONS), env)
    return workdir, summary, prompts, questions


# ------------------------------------------------------------------------------------------------------- tests


def test_end_to_end_reports_and_counts(evaluated):
    workdir, summary = evaluated
    rep = json.loads((workdir / "report.json").read_text())
    assert list(rep["benchmarks"]) == list(BENCHMARKS) and rep["k"] == K and rep["engine"] == "jax"
    assert rep["config"]["tools"]["search"]["backend"] == "local" and rep["judge"] is None
    # The JAX engine's rows are what the command generates at once, not the training batch's trajectories.
    assert rep["config"]["rollout"]["jax"]["slots"] == BATCH * K
    for name in BENCHMARKS:
        m, records = rep["benchmarks"][name], _samples(workdir, name)
        assert len(records) == LIMIT * K == m["n_outputs"] and m["n_samples"] == LIMIT
        assert {(r["question_index"], r["sample"]) for r in records} == {(q, j) for q in range(LIMIT)
                                                                          for j in range(K)}
        assert m["pass@k"] >= m["pass@1"]
        assert m["failed"] == sum(1 for r in records if r["error"])
        assert summary["benchmarks"][name] == {key: m[key] for key in ("pass@1", "pass@k", "n_samples", "failed")}
        for key in ("em", "f1", "tool_calls"):
            values = [r[key] if key != "tool_calls" else r["python_calls"] + r["search_calls"] for r in records]
            assert m[key] == pytest.approx(sum(values) / len(values))
    assert summary["chunks"] == {"total": 6, "reused": 0, "run": 6, "failed": 0}
    assert summary["macro_average"] == rep["macro_average"] and rep["macro_average"]["n_benchmarks"] == 3
    md = (workdir / "report.md").read_text()
    assert ("| benchmark | questions | pass@1 (%) | pass@2 (%) | ± s.e. (pass@1) | em (%) | f1 (%) | tool calls | "
            "Python calls ran (%) | response tokens | failed |") in md
    assert all(f"| {name} | {LIMIT} |" in md for name in BENCHMARKS)
    assert (workdir / "report.png").is_file() == HAS_MATPLOTLIB
    assert json.loads((workdir / runner.RUN_FILE).read_text())["k"] == K


def test_an_overlong_prompt_is_recorded_failed_and_the_rest_is_scored(evaluated):
    workdir, _ = evaluated
    records = _samples(workdir, "aime24")
    failed = [r for r in records if r["error"]]
    assert {r["question_index"] for r in failed} == {0} and len(failed) == K
    assert all("more than data.max_prompt_length=512" in r["error"] and not r["correct"] and r["output"] == ""
               for r in failed)
    scored = [r for r in records if not r["error"]]
    assert len(scored) == (LIMIT - 1) * K and all(r["output"] and r["finish_reason"] != "error" for r in scored)
    assert all(r["response_tokens"] > 0 for r in scored)


def test_pass_at_k_equals_pass_at_k_of_the_samples(evaluated):
    workdir, _ = evaluated
    rep = json.loads((workdir / "report.json").read_text())
    for name in BENCHMARKS:
        p1, pk = _by_hand(_samples(workdir, name), K)
        assert rep["benchmarks"][name]["pass@1"] == pytest.approx(p1)
        assert rep["benchmarks"][name]["pass@k"] == pytest.approx(pk)


@pytest.mark.slow  # `arpo-jax eval` / chat subprocess runs
def test_sigkill_and_a_torn_write_resume_to_the_uninterrupted_report(evaluated, tiny_model, shared):
    root, env = shared
    workdir = root / "killed"
    cmd = _eval_cmd(workdir, tiny_model)
    first = workdir / "gsm8k" / runner.SAMPLES_FILE
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (first.is_file() and len(first.read_bytes().splitlines()) >= BATCH * K):
            assert proc.poll() is None and time.monotonic() < deadline, "the first chunk never appeared"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    # A torn write: the last line loses its second half (its chunk is now partial and must be run again).
    lines = first.read_bytes().splitlines(keepends=True)
    first.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    done = {name: runner.read_done_chunks(workdir / name / runner.SAMPLES_FILE,
                                          load_benchmark(name, limit=LIMIT), K, BATCH) for name in BENCHMARKS}
    reusable = sum(len(d) for d in done.values())

    resumed = _run(cmd, env)
    assert resumed["chunks"] == {"total": 6, "reused": reusable, "run": 6 - reusable, "failed": 0}
    again = _run(cmd, env)  # a finished evaluation started again: nothing is generated, the report is the same
    assert again["chunks"] == {"total": 6, "reused": 6, "run": 0, "failed": 0}

    reference = json.loads((evaluated[0] / "report.json").read_text())
    rep = json.loads((workdir / "report.json").read_text())
    for name in BENCHMARKS:
        assert rep["benchmarks"][name] == reference["benchmarks"][name]
        records = _samples(workdir, name)
        assert len(records) == LIMIT * K  # the partial chunk's records were dropped, not duplicated
        assert _stable(records) == _stable(_samples(evaluated[0], name))
    assert again["benchmarks"] == resumed["benchmarks"] == evaluated[1]["benchmarks"]


@pytest.mark.slow  # `arpo-jax eval` subprocess run (with a judge)
def test_the_judge_decides_a_failing_judge_falls_back_and_pass_at_k_is_the_samples(judged):
    workdir, summary, prompts, questions = judged
    records = _samples(workdir, "hotpotqa")
    assert len(records) == JUDGED_QUESTIONS * K and summary["chunks"]["failed"] == 0
    by_question = [[r for r in records if r["question_index"] == q] for q in range(JUDGED_QUESTIONS)]
    failing, correct, mixed = by_question[0], by_question[1], by_question[2] + by_question[3]
    # The failing judge was retried, then the rule decided (a random model's prediction is wrong by the rule).
    assert sum(f"Question: {questions[0]}\n" in p for p in prompts) > K
    assert all(r["judge_source"] == "fallback" and r["judge_error"] and not r["correct"] for r in failing)
    # A judge that says correct decides, whatever the rule says.
    assert all(r["correct"] and r["llm_equal"] == 1.0 and r["judge_source"] == "judge" for r in correct)
    # Mixed verdicts: pass@1 and pass@k are those of the samples.
    assert 0 < sum(r["correct"] for r in mixed) < len(mixed)
    assert all(r["judge_source"] == "judge" and r["judge_error"] is None for r in mixed)
    p1, pk = _by_hand(records, K)
    assert summary["benchmarks"]["hotpotqa"]["pass@1"] == pytest.approx(p1)
    assert summary["benchmarks"]["hotpotqa"]["pass@k"] == pytest.approx(pk)
    assert json.loads((workdir / "report.json").read_text())["judge"] == {"model": "judge"}


def test_compare_puts_eval_and_training_runs_side_by_side(evaluated, shared, capsys):
    root, _ = shared
    train = root / "train_run"
    with metrics.MetricsLogger(train, loggers=("jsonl",)) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": 0.125 * step, "tools/calls_per_trajectory/mean": 0.5 + step})
        logger.log(3, {"val/accuracy": 0.375})
    runs = [str(evaluated[0]), str(train)]
    out = root / "compare"
    assert cli.main(["compare", *runs, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    md = (out / report_lib.COMPARE_MD).read_text()
    assert list(summary["runs"]) == [Path(r).name for r in runs]
    for name in summary["runs"]:
        assert f"**{name}**" in md
    assert summary["runs"]["train_run"]["training"] == {"reward/mean": 0.375, "val/accuracy": 0.375,
                                                        "tools/calls_per_trajectory/mean": 3.5, "steps": 3}
    assert "| reward/mean | – |" in md and "| 0.375 |" in md
    rep = json.loads((evaluated[0] / "report.json").read_text())
    for name, m in rep["benchmarks"].items():
        assert f"| {name} | {report_lib.pct(m['pass@1'])} / {report_lib.pct(m['pass@k'])} |" in md
    assert (out / report_lib.COMPARE_PNG).is_file() == HAS_MATPLOTLIB


def test_compare_pairs_two_evaluations_question_by_question(evaluated, shared, capsys):
    """`compare` of an evaluation and a copy with two questions' samples rewritten (one all right, one all wrong,
    each the other way from the original where it can be; torn and repeated lines as a kill and a resume leave
    them): the paired counts are those two questions, the p value the sign test's."""
    root, _ = shared
    base = evaluated[0]
    other = root / "rewritten"
    (other / "gsm8k").mkdir(parents=True, exist_ok=True)
    records = _samples(base, "gsm8k")
    scores = {}
    for r in records:
        scores.setdefault(r["id"], []).append(bool(r["correct"]))
    first, second = sorted(scores)[:2]
    forced = {first: mean(scores[first]) < 1, second: not mean(scores[second]) > 0}  # a change where one is possible
    rewritten = [r | {"correct": forced.get(r["id"], r["correct"])} for r in records]
    lines = [json.dumps(r) for r in [records[0], *rewritten]] + ['{"id": "torn", "sam']  # the first line replaced
    (other / "gsm8k" / runner.SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    (other / report_lib.REPORT_JSON).write_text((base / report_lib.REPORT_JSON).read_text())
    gained = sum(forced[q] and mean(scores[q]) < 1 for q in forced)
    lost = sum(not forced[q] and mean(scores[q]) > 0 for q in forced)
    assert gained + lost == 2

    assert cli.main(["compare", str(base), str(other), "--out", str(root / "paired")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pairs = summary["runs"]["rewritten"]["paired_with_first"]
    assert pairs["gsm8k"] == {"questions": LIMIT, "gained": gained, "lost": lost,
                              "p": report_lib.sign_test(gained, lost)}
    assert set(pairs) == {"gsm8k"}  # the other benchmarks' samples are not in the copy
    assert summary["runs"]["uninterrupted"]["paired_with_first"] is None
    md = (root / "paired" / report_lib.COMPARE_MD).read_text()
    assert f"| rewritten | gsm8k | {LIMIT} | {gained} | {lost} |" in md


@pytest.mark.slow  # `arpo-jax eval` / chat subprocess runs
def test_chat_from_piped_stdin_with_an_orbax_checkpoint(shared, tiny_model):
    root, env = shared
    ckpt = root / "orbax"
    convert.hf_to_orbax(tiny_model, ckpt)  # keeps the tokenizer in ckpt/tokenizer, where eval and chat find it
    cmd = [sys.executable, "-m", "arpo_jax.cli", "chat", "--model", str(ckpt), f"--config={TOY}",
           "--config.data.max_response_length=24"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
                          input="What is 2 + 2?\n\nnot read\n")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "user: What is 2 + 2?" in proc.stdout and "\nanswer: " in proc.stdout and "tool call(s)" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["questions"] == 1 and len(summary["answers"]) == 1


def test_transcript_shows_text_tool_calls_results_and_the_answer():
    response = ("Let me compute. <python>print(6 * 7)</python> <result>\n42\n</result> So it is 42. "
                "<search>capital of France</search> <result>\nPage 1: Paris\n</result> <answer>\\boxed{42}</answer>")
    text = format_transcript("What is 6 * 7?", response, tool_calls=2, finish_reason="eos", seconds=1.0)
    assert text.splitlines() == [
        "user: What is 6 * 7?", "assistant: Let me compute. <python>print(6 * 7)</python>", "python result:",
        "    42", "assistant: So it is 42. <search>capital of France</search>", "search result:", "    Page 1: Paris",
        "assistant: <answer>\\boxed{42}</answer>", "answer: 42", "[2 tool call(s), finish: eos, 1.0 s]"]


def test_bad_eval_arguments_fail_before_loading_a_model(tmp_path, capsys):
    assert cli.main(["eval", "--model", "builtin:tiny", "--benchmarks", "gsm8k,nope", "--workdir",
                     str(tmp_path / "w")]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert cli.main(["eval", "--model", "builtin:tiny", "--benchmarks", "gsm8k", "--k", "0", "--workdir",
                     str(tmp_path / "w")]) == 2
    assert "--k must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
