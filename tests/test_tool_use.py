"""Python call outcomes read from a response, the math reward with its tool bonus, and the cold start's filter."""

import json

import pytest

from arpo_jax import rewards
from arpo_jax.data.prompts import REFERENCE_DATA_SYSTEM_PROMPT
from arpo_jax.eval import cold_start
from arpo_jax.rewards.tool_use import EMPTY, ERROR, NO_RESULT, OK, TOOL_BONUS, math_tool_score, python_outcomes
from arpo_jax.tools.executor import empty_text, error_text


def _call(code: str, result: str | None) -> str:
    # The rollout's bytes: the model's call, then " <result>\n" + text + "\n</result>" (agent_loop.wrap_tool_result).
    return f"<python>\n{code}\n</python>" + ("" if result is None else f" <result>\n{result}\n</result>")


TRACEBACK = 'Traceback (most recent call last):\n  File "/tmp/x.py", line 1, in <module>\nNameError: name \'y\' is ...'
SYNTAX = '  File "/tmp/x.py", line 1\n    print(\n         ^\nSyntaxError: \'(\' was never closed'


@pytest.mark.parametrize("result, outcome", [
    ("42", OK), ("Error count 3 of 5", OK), ("", EMPTY), (empty_text("python"), EMPTY), (TRACEBACK, ERROR),
    (SYNTAX, ERROR), ("ZeroDivisionError: division by zero", ERROR),
    ("partial\nExecution timed out after 10 s.", ERROR),
    ("Process killed by signal SIGKILL (killed: memory, CPU or process limit).", ERROR),
    ("Execution exception: sandbox failure", ERROR), (error_text("python", "boom"), ERROR),
])
def test_each_result_text_has_its_outcome(result, outcome):
    assert python_outcomes("<think> x </think> " + _call("print(1)", result)) == [outcome]


def test_calls_are_read_left_to_right_and_tags_inside_results_are_not_calls():
    quoted = "<python>print(2)</python>"  # a result that echoes a tag: not a call of the model
    text = " ".join([_call("a", "1"), _call("b", quoted), _call("c", TRACEBACK), _call("d", None), "<python> open"])
    assert python_outcomes(text) == [OK, OK, ERROR, NO_RESULT]
    assert python_outcomes("```python\nprint(1)\n```") == []
    assert python_outcomes(_call("a", "1") + " <result> never closed") == [OK]


def test_math_tool_score_adds_the_bonus_once_for_a_right_answer_with_a_call_that_printed():
    right = "<answer> \\boxed{18} </answer>"
    cases = {
        _call("9*2", "18") + _call("9+9", "18") + right: 1.0 + TOOL_BONUS,  # twice: still one bonus
        right: 1.0,
        _call("x", TRACEBACK) + right: 1.0,  # the call failed
        _call("x=1", empty_text("python")) + right: 1.0,  # it printed nothing
        _call("9*3", "27") + "<answer> \\boxed{27} </answer>": 0.0,  # wrong: no bonus
    }
    for text, score in cases.items():
        assert math_tool_score(text, "18")["score"] == pytest.approx(score), text
    registered = rewards.get_reward_fn("math_tool")("any", _call("9*2", "18") + right, "18")
    assert registered["score"] == pytest.approx(1.1) and registered["python_ok"] == 1


def _record(output, *, correct=True, finish="stop", **counts):
    outcomes = python_outcomes(output)
    base = {"python_calls": len(outcomes), "python_ok": outcomes.count(OK), "python_empty": outcomes.count(EMPTY),
            "python_errors": outcomes.count(ERROR)}
    return {"id": "q1", "output": output, "correct": correct, "finish_reason": finish, "truncated": False,
            **base, **counts}


GOOD = "<think> a </think>\n" + _call("print(9*2)", "18") + "\n<think> b </think>\n<answer> \\boxed{18} </answer>"


def test_the_cold_start_keeps_right_well_formed_answers_whose_calls_ran():
    assert cold_start.accepted(_record(GOOD))
    rejected = {
        "wrong": _record(GOOD, correct=False),
        "no call": _record("<think> a </think>\n<answer> \\boxed{18} </answer>"),
        "a failed call": _record(GOOD.replace(_call("print(9*2)", "18"),
                                              _call("x", TRACEBACK) + _call("print(9*2)", "18"))),
        "cut at the length limit": _record(GOOD, finish="length"),
        "no think tags": _record(GOOD.replace("<think> a </think>\n", "").replace("<think> b </think>\n", "")),
        "a call without its result": _record(GOOD + _call("print(1)", None)),
    }
    assert [why for why, r in rejected.items() if cold_start.accepted(r)] == []


def test_sft_rows_are_the_plain_prompt_and_the_first_accepted_answer_per_question(tmp_path):
    from transformers import AutoTokenizer

    from arpo_jax.assemble import policy
    from arpo_jax.data import sft_data

    records = [_record(GOOD, correct=False), _record(GOOD), _record(GOOD.replace("a </think>", "c </think>")),
               {**_record(GOOD), "id": "q2"}]
    rows = cold_start.sft_rows(records, {"q1": {"question": "What is 9 times 2?", "answer": "18"},
                                         "q2": {"question": "Nine twos?", "answer": "18"}})
    assert [r["id"] for r in rows] == ["q1", "q2"]
    assert rows[0]["messages"] == [{"role": "system", "content": REFERENCE_DATA_SYSTEM_PROMPT},
                                   {"role": "user", "content": "What is 9 times 2?"},
                                   {"role": "assistant", "content": GOOD}]
    report = cold_start.yield_report(records, rows)
    assert (report["samples_accepted"], report["sft_rows"], report["sft_rows_completed"]) == (3, 2, 0)
    # The SFT loader reads the file; the tool result is in the text but out of the loss.
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(rows))
    tokenizer = AutoTokenizer.from_pretrained(policy.build_tiny_model(tmp_path / "tiny"))
    data = sft_data.load_sft_examples([str(path)], tokenizer, cutoff_len=2048)
    ids, mask = data[0]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "print(9*2)" in trained and "\\boxed{18}" in trained and "\n18\n" not in trained


def test_plain_questions_are_word_problems_with_a_numeric_answer(tmp_path):
    from arpo_jax.eval.math_tool import plain_question

    rows = [{"id": "a", "question": "A van has 4 seats. How many ways can 3 people sit?", "answer": "24"},
            {"id": "b", "question": "Find $\\frac{1}{2} + x$ when $x = 1$.", "answer": "1.5"},  # a LaTeX command
            {"id": "c", "question": "Solve $x + 1 = 2$ and $y = 3$.", "answer": "1"},  # two inline formulas
            {"id": "d", "question": "What is the price?", "answer": "9.80"},
            {"id": "e", "question": "Name the set.", "answer": "a=2, k=5"}]  # not a number
    assert [r["id"] for r in rows if plain_question(r)] == ["a", "d"]
    source = tmp_path / "all.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    picked = cold_start.select_questions(source, tmp_path / "picked.jsonl", plain=True)
    assert [json.loads(line)["id"] for line in picked.read_text().splitlines()] == ["a", "d"]


def test_a_sample_that_stopped_after_the_right_result_gets_its_answer_written_out():
    stopped = "<think> a </think>\n" + _call("print(9 * 2.0)", "18.0")
    done = cold_start.completed(_record(stopped), "18")
    assert done["completed"] and done["correct"] and cold_start.accepted(done)
    assert done["output"].endswith("<answer> The final answer is \\[ \\boxed{18} \\] </answer>")
    assert math_tool_score(done["output"], "18")["score"] == pytest.approx(1.0 + TOOL_BONUS)
    for output, answer in [(stopped, "19"),  # the wrong number
                           ("<think> a </think>\n" + _call("print(1)", TRACEBACK), "18"),  # a failed call
                           (GOOD, "18"),  # it answered itself: nothing to complete
                           (stopped + " and then", "18")]:  # it went on after the result
        assert "completed" not in cold_start.completed(_record(output), answer)
