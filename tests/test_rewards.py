"""Tests for arpo_jax.rewards: hand-computed scores for every rule of spec §7.3, QA/math primitives, registry."""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from arpo_jax.rewards import REWARDS, get_reward_fn, qa, reward_name_for, score_responses
from arpo_jax.rewards import deep_research as dr
from arpo_jax.rewards import math_reward as mr

DATA_DIR = "/work/shared/data/rl"
BOTH_TOOLS = (
    "<think> look it up </think> <search> query </search> <result>\nsnippet\n</result> "
    "<think> compute </think> <python> print(1) </python> <result>\n1\n</result> "
)


def respond(answer: str, tools: str = "") -> str:
    """A well-formed response whose answer block is ``\\boxed{answer}``."""
    return f"<think> reasoning </think> {tools}<think> done </think> <answer> \\boxed{{{answer}}} </answer>"


def dr_score(response: str, gt) -> float:
    return dr.compute_score(response, gt)["score"]


# ----------------------------------------------------------------------------------------------------------
# deep_research: scoring
# ----------------------------------------------------------------------------------------------------------


def test_exact_answer_scores_one_with_logged_keys():
    out = dr.compute_score(respond("Paris"), "Paris")
    assert out == {"score": 1.0, "reason": "correct answer", "answer": "Paris", "f1_score": 1.0}


def test_partial_f1_hand_computed():
    # pred tokens: eleanor of lancaster duchess (4), gold: eleanor of lancaster (3), overlap 3:
    # P = 3/4, R = 1, F1 = 2 * 0.75 / 1.75 = 6/7.
    out = dr.compute_score(respond("Eleanor of Lancaster, Duchess"), "Eleanor Of Lancaster")
    assert out["f1_score"] == pytest.approx(6 / 7)
    assert out["score"] == pytest.approx(6 / 7)


def test_normalisation_articles_punctuation_case_and_latex():
    assert dr_score(respond("The Beatles"), "beatles") == 1.0  # article + case
    assert dr_score(respond("\\$1,000"), "1000") == 1.0  # `\ $ ,` are ASCII punctuation
    assert dr_score(respond("\\frac{1}{2}"), "\\frac{1}{2}") == 1.0  # nested braces kept in the answer
    # B14: "\frac{1}{2}" -> "frac12" and "1/2" -> "12" share no token, so a right maths answer scores 0.
    assert dr_score(respond("\\frac{1}{2}"), "1/2") == 0.0


def test_multiset_overlap_counts_repeats_once_per_match():
    # pred "new new york" (3), gold "new york" (2): overlap min(2,1)+min(1,1) = 2 -> P=2/3, R=1, F1=0.8.
    assert dr_score(respond("new new york"), "New York") == pytest.approx(0.8)


def test_list_ground_truth_takes_max_over_references():
    # vs "paris": P=1/2, R=1 -> 2/3; vs "city of paris": P=1/2, R=1/3 -> 0.4; max = 2/3.
    assert dr_score(respond("Paris France"), ["City of Paris", "Paris"]) == pytest.approx(2 / 3)
    assert dr_score(respond("Paris France"), np.array(["City of Paris", "Paris"])) == pytest.approx(2 / 3)
    assert dr_score(respond("Rome"), ["City of Paris", "Paris"]) == 0.0
    assert dr_score(respond("1000"), 1000) == 1.0  # non-string ground truth is compared as str


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("yes", "yes", 1.0),
        ("Yes.", "yes", 1.0),
        ("yes", "no", 0.0),
        ("yes", "yes indeed", 0.0),  # pred is special and differs -> 0 even with token overlap
        ("yes indeed", "yes", 0.0),  # gold is special and differs
        ("no answer", "noanswer", 0.0),  # "no answer" normalises to "no answer", not "noanswer"
        ("no", ["yes", "no"], 1.0),  # the rule applies per reference
    ],
)
def test_yes_no_noanswer_rule(pred, gold, expected):
    assert dr_score(respond(pred), gold) == expected


def test_tool_bonus_only_for_correct_answers_using_both_tools():
    assert dr_score(respond("Paris", BOTH_TOOLS), "Paris") == pytest.approx(1.1)
    assert dr_score(respond("Eleanor of Lancaster, Duchess", BOTH_TOOLS), "Eleanor Of Lancaster") == pytest.approx(
        6 / 7 + 0.1
    )
    out = dr.compute_score(respond("Rome", BOTH_TOOLS), "Paris")  # wrong answer: no bonus
    assert out["score"] == 0.0 and out["reason"].startswith("wrong answer but good format")
    search_only = "<search> q </search> <result> r </result> "
    python_only = "<python> 1 </python> <result> 1 </result> "
    assert dr_score(respond("Paris", search_only), "Paris") == 1.0
    assert dr_score(respond("Paris", python_only), "Paris") == 1.0


def test_score_range():
    for resp, gt in [(respond("a b"), "b c"), (respond("x", BOTH_TOOLS), "x"), ("junk", "x"), (respond("q"), "z")]:
        s = dr_score(resp, gt)
        assert s == -1.0 or 0.0 <= s <= 1.1 + 1e-9


# ----------------------------------------------------------------------------------------------------------
# deep_research: format validation (-1) and extraction failures
# ----------------------------------------------------------------------------------------------------------

ANS = "<answer> \\boxed{Paris} </answer>"


@pytest.mark.parametrize(
    "response, reason",
    [
        (ANS, "<think> or </think> not found"),
        ("<think> a </think> <think> b " + ANS, "<think> </think> not paired"),
        ("<think> a </think> \\boxed{Paris}", "<answer> or </answer> not found"),
        ("<think> a </think> " + ANS + " " + ANS, "<answer> or </answer> not found"),
        ("<think> a </think> <answer> \\boxed{Paris}", "<answer> or </answer> not found"),
        ("<think> a </think> </answer> \\boxed{Paris} <answer>", "<answer> must be before </answer>"),
        ("<think> a </think> <answer> Paris </answer>", "answer is missing \\boxed{} format"),
        ("<think> a </think> <answer> \\boxed Paris </answer>", "answer is missing \\boxed{} format"),
        ("<think> a </think> <answer> \\boxed{Paris </answer>", "answer is missing \\boxed{} format"),
        ("<think> a </think> <answer> \\fbox{Paris} </answer>", "answer is missing \\boxed{} format"),
        # A trajectory that hit the call limit: unanswered call, then EOS.
        ("<think> a </think> <search> q </search>", "<answer> or </answer> not found"),
        ("<think> a </think> <search> q </search> " + ANS, "search/result tags are incomplete"),
        ("<think> a </think> <search> q " + ANS, "search/result tags are incomplete"),
        ("<think> a </think> <search> q </search> <result> r " + ANS, "search/result tags are incomplete"),
        ("<think> a </think> <python> x </python> " + ANS, "python/result tags are incomplete"),
        # `<result>` is searched from `<search>`, so one opened before `</search>` is "wrong order".
        ("<think> a </think> <search> q <result> r </search> </result> " + ANS, "nested in the wrong order"),
        ("<think> a </think> <python> q <result> r </python> </result> " + ANS, "nested in the wrong order"),
        # `</search>` is searched from `<search>` on: a closer before the opener does not count.
        ("<think> a </think> </search> <search> q <result> r </result> " + ANS, "search/result tags are incomplete"),
    ],
)
def test_format_failures_score_minus_one(response, reason):
    out = dr.compute_score(response, "Paris")
    assert out["score"] == -1.0
    assert reason in out["reason"] and out["reason"].startswith("bad format")
    assert out["answer"] == "" and out["f1_score"] == 0.0


def test_scan_resumes_after_each_result_block():
    ok = "<search> a </search> <result> r1 </result> <search> b </search> <result> r2 </result> "
    assert dr_score(respond("Paris", ok), "Paris") == 1.0
    # The second call is unanswered: only found because the scan resumes after the first </result>.
    bad = "<search> a </search> <result> r1 </result> <search> b </search> "
    assert "search/result tags are incomplete" in dr.compute_score(respond("Paris", bad), "Paris")["reason"]
    # A literal `<search>` inside a result block is skipped by the resume rule ...
    inner = "<search> a </search> <result> page says <search> here </result> "
    assert dr_score(respond("Paris", inner), "Paris") == 1.0
    # ... but each tool is scanned on its own: a `<python>` inside a search result needs its own blocks.
    inner_py = "<search> a </search> <result> page says <python> here </result> "
    assert "python/result tags are incomplete" in dr.compute_score(respond("Paris", inner_py), "Paris")["reason"]


def test_extraction_failures_score_minus_one():
    # Last `\boxed` has no closing brace (format passes: the block has `\boxed{` and a `}`).
    out = dr.compute_score("<think> a </think> <answer> \\boxed{a}} \\boxed{b </answer>", "b")
    assert out["score"] == -1.0 and out["reason"].startswith("find box error")
    # Last `\boxed...` is not `\boxed{`: the reference's remove_boxed assertion fails.
    out = dr.compute_score("<think> a </think> <answer> \\boxed{1} \\boxedx{2} </answer>", "1")
    assert out["score"] == -1.0 and out["reason"].startswith("find box error")


def test_boxed_forms():
    think = "<think> a </think> "
    # Last braced \boxed of the answer block wins; a \boxed outside the block is ignored.
    assert dr.compute_score(think + "<answer> \\boxed{Paris} \\boxed{Rome} </answer>", "Rome")["answer"] == "Rome"
    assert dr_score("<think> \\boxed{Rome} </think> <answer> \\boxed{Paris} </answer>", "Paris") == 1.0
    # The `\boxed ` (space) form anywhere in the block wins over braces; it runs up to the next `$`.
    out = dr.compute_score(think + "<answer> \\boxed{Paris} then \\boxed London$ ok </answer>", "London")
    assert out["answer"] == "London" and out["score"] == 1.0
    assert dr.compute_score(think + "<answer> \\boxed{x} \\boxed Rome </answer>", "Rome")["answer"] == "Rome "
    # Nested braces are brace-matched.
    out = dr.compute_score(think + "<answer> \\boxed{\\text{{Ada} Lovelace}} </answer>", "Ada Lovelace")
    # `\text{{Ada}` normalises to the token "textada": tokens [textada, lovelace] vs [ada, lovelace] -> F1 1/2.
    assert out["answer"] == "\\text{{Ada} Lovelace}" and out["score"] == 0.5


def test_eos_stripping_is_harmless():
    resp = respond("Paris") + "<|im_end|>"
    assert dr.compute_score(resp, "Paris", {"eos_token": "<|im_end|>"})["score"] == 1.0

    class Tok:
        eos_token = "<|im_end|>"

    assert dr.compute_score(resp, "Paris", {"tokenizer": Tok()})["score"] == 1.0


# ----------------------------------------------------------------------------------------------------------
# QA primitives and rewards
# ----------------------------------------------------------------------------------------------------------


def test_normalize_answer():
    assert qa.normalize_answer("The  Quick, brown-fox!") == "quick brownfox"
    assert qa.normalize_answer("An apple a day") == "apple day"
    assert qa.normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert qa.normalize_answer("\\boxed{$3.5$}") == "boxed35"
    assert qa.normalize_answer("Café—Zürich") == "café—zürich"  # non-ASCII punctuation is kept


def test_em_f1_contains():
    assert qa.token_f1("Paris France", ["City of Paris", "Paris"]) == pytest.approx(2 / 3)
    assert qa.token_f1("anything", []) == 0.0
    assert qa.exact_match("the Paris.", "paris") == 1.0
    assert qa.exact_match("Paris France", ["paris", "rome"]) == 0.0
    assert qa.contains_gold("It is Paris, France.", "paris france") == 1.0
    assert qa.contains_gold("It is Paris", ["Rome", "Paris"]) == 1.0
    assert qa.contains_gold("It is Paris", "Rome") == 0.0
    assert qa.contains_gold("It is Paris", "the") == 0.0  # empty after normalisation never matches


def test_as_references():
    assert qa.as_references("a, b") == ["a, b"]
    assert qa.as_references("['a', 'b']", split_bracketed=True) == ["a", "b"]
    assert qa.as_references(np.array(["a", "b"])) == ["a", "b"]
    assert qa.as_references([1, ["x"]]) == ["1", "x"]
    assert qa.as_references(None) == []


def test_extract_boxed_and_answer_tag():
    assert qa.extract_boxed("so \\boxed{a{b}c} end") == "a{b}c"
    assert qa.extract_boxed("\\boxed{1} and \\boxed{2}") == "2"
    assert qa.extract_boxed("\\fbox{3}") == "3"
    assert qa.extract_boxed("$\\boxed 5$ units") == "5"
    assert qa.extract_boxed("\\boxed{open") is None
    assert qa.extract_boxed("no box") is None
    assert qa.extract_answer_tag(" <answer>a</answer> <answer>b</answer>") == "a"
    assert qa.extract_answer_tag("<answer>\nmulti\nline</answer>") == "\nmulti\nline"
    assert qa.extract_answer_tag("no tag") is None


def test_qa_rewards():
    assert qa.qa_em(respond("The Paris"), "paris")["score"] == 1.0
    assert qa.qa_em("<answer> Paris France </answer>", "paris")["score"] == 0.0
    assert qa.qa_f1("<answer> Paris France </answer>", "paris")["score"] == pytest.approx(2 / 3)
    assert qa.qa_f1("final: \\boxed{Paris}", "paris")["score"] == 1.0  # no tag: last boxed anywhere
    assert qa.qa_f1("Paris", "paris") == {"score": 0.0, "reason": "no answer found", "answer": ""}
    assert 0.0 <= qa.qa_f1(respond("a b c"), "b")["score"] <= 1.0


# ----------------------------------------------------------------------------------------------------------
# Math
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac{1}{2}"),  # leading zero added, then the 0.5 rule
        ("x = 5", "5"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("3/4", "\\frac{3}{4}"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("90^\\circ", "90"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("10\\%", "10"),
        ("50%", "50%"),  # the reference removes only the escaped percent (fidelity 4a)
        ("\\$5", "5"),
        ("5 \\text{ cm}", "5"),
        ("1\n0", "10"),
        ("", ""),
    ],
)
def test_strip_string(raw, expected):
    assert mr.strip_string(raw) == expected


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "0.5"),
        ("2\\sqrt{2}", "\\sqrt{8}"),
        ("\\{3, 2, 1\\}", "\\{1,2,3\\}"),
        ("[0, 1)", "[0,1)"),
        ("(-\\infty, 2] \\cup [3, \\infty)", "(-\\infty,2]\\cup[3,\\infty)"),
        ("(x+1)^2", "x^2+2x+1"),
        ("3", "x = 3"),
        ("1,000", "1000"),
        ("\\text{Paris}", "Paris"),
    ],
)
def test_math_equal_equivalences(pred, gold):
    assert mr.math_equal(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("(0, 1]", "[0,1)"),
        ("2", "3"),
        ("2\\sqrt{3}", "\\sqrt{8}"),
        ("\\{1, 2\\}", "\\{1,2,3\\}"),
        ("Sirap", "Paris"),  # math_verify alone would read both as the product p*a*r*i*s
        ("", "1"),
        ("\\frac{", "1"),  # unparseable: False, never raises
    ],
)
def test_math_equal_non_equivalences(pred, gold):
    assert not mr.math_equal(pred, gold)


def test_math_compute_score():
    out = mr.compute_score("We get $x = \\boxed{\\dfrac{1}{2}}$.", "0.5")
    assert out == {"score": 1.0, "reason": "string match", "answer": "\\dfrac{1}{2}"}
    assert mr.compute_score("so \\boxed{2\\sqrt{2}}", ["\\sqrt{8}"])["reason"] == "symbolic match"
    assert mr.compute_score("so \\boxed{3}", "4")["score"] == 0.0
    assert mr.compute_score("no box: 3", "3")["score"] == 0.0


def test_math_bare_percent_follows_the_reference():
    """Fidelity 4a: the reference's strip_string keeps a bare %, so 50% is not 50 (math_verify alone says it is)."""
    assert mr.compute_score("so \\boxed{50%}", "50") == {"score": 0.0, "reason": "wrong answer", "answer": "50%"}
    assert mr.compute_score("so \\boxed{50\\%}", "50")["reason"] == "string match"
    assert mr.compute_score("so \\boxed{50%}", "50%")["reason"] == "string match"
    assert not mr.math_equal("50%", "50") and not mr.math_equal("50", "50%")
    assert mr.math_equal("0.5%", "\\frac{1}{2}%")  # % on both sides: still compared symbolically


def test_math_fbox_is_graded_as_a_documented_deviation():
    """Fidelity 4b, kept: \\fbox{} counts like \\boxed{} (the reference's remove_boxed asserts and scores 0);
    documented in the math_reward module docstring."""
    assert mr.compute_score("so \\fbox{3}", "3") == {"score": 1.0, "reason": "string match", "answer": "3"}
    assert "fbox" in mr.__doc__


def test_math_pathological_input_is_cut_off_and_the_worker_recovers():
    # 3^(3^27) is one GIL-holding C bignum pow inside sympy: only killing the child process stops it.
    for _ in mr._WORKERS:  # warm every child (round robin) so the timing below excludes start-up
        mr.symbolic_equal("2\\sqrt{2}", "\\sqrt{8}")
    start = time.monotonic()
    assert not mr.symbolic_equal("3^{3^{3^{3}}}", "2^{2^{2^{2^{2}}}}", timeout_s=0.5)
    assert time.monotonic() - start < 5.0
    assert all(mr.symbolic_equal("2\\sqrt{2}", "\\sqrt{8}") for _ in range(2))  # killed child restarted


def test_math_child_start_failure_reads_as_not_equal(monkeypatch):
    monkeypatch.setattr(mr, "_CHILD_CODE", "import sys; sys.exit(3)")
    worker = mr._SymbolicWorker()
    monkeypatch.setattr(mr, "_WORKERS", [worker])
    assert mr.symbolic_equal("2\\sqrt{2}", "\\sqrt{8}") is False
    worker.close()


def test_rewards_from_eight_threads_match_main_thread():
    cases = [
        ("math", "so \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("math", "so \\boxed{\\{1,2\\}}", "\\{2,1\\}"),
        ("math", "so \\boxed{(0,1]}", "[0,1)"),
        ("math", "so \\boxed{x^2-1}", "(x-1)(x+1)"),
        ("deep_research", respond("Paris", BOTH_TOOLS), "Paris"),
        ("qa_f1", respond("Paris France"), "Paris"),
    ]
    expected = [REWARDS[name]("src", resp, gt)["score"] for name, resp, gt in cases]

    def run_all(_):
        return [REWARDS[name]("src", resp, gt)["score"] for name, resp, gt in cases]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run_all, range(16)))
    assert expected == [1.0, 1.0, 0.0, 1.0, pytest.approx(1.1), pytest.approx(2 / 3)]
    assert all(r == expected for r in results)


# ----------------------------------------------------------------------------------------------------------
# Registry, custom rewards, batch scoring
# ----------------------------------------------------------------------------------------------------------


def test_registry_names_and_unknown_name():
    assert set(REWARDS) == {"deep_research", "math", "math_tool", "qa_em", "qa_f1"}
    assert get_reward_fn() is REWARDS["deep_research"]
    with pytest.raises(ValueError, match="allowed: auto, deep_research, math, math_tool, qa_em, qa_f1"):
        get_reward_fn("nope")


@pytest.mark.parametrize(
    "source, name",
    [
        ("DR_grpo_mix", "deep_research"),
        ("DR_math500", "deep_research"),
        ("openai/gsm8k", "math"),
        ("lighteval/MATH", "math"),
        ("MATH500", "math"),
        ("math_dapo", "math"),
        ("aime24", "math"),
        ("nq", "qa_f1"),
        ("hotpotqa_dev", "qa_f1"),
        ("2wikimultihopqa", "qa_f1"),
        ("bamboogle", "qa_f1"),
        ("something_else", "deep_research"),
    ],
)
def test_auto_dispatch_table(source, name):
    assert reward_name_for(source) == name


def test_auto_dispatch_calls_the_selected_reward():
    auto = get_reward_fn("auto")
    assert auto("openai/gsm8k", "\\boxed{0.5}", "\\frac{1}{2}")["score"] == 1.0
    assert auto("DR_grpo_mix", "\\boxed{0.5}", "\\frac{1}{2}")["score"] == -1.0  # no tags: bad format
    assert auto("hotpotqa", "<answer> Paris France </answer>", "Paris")["score"] == pytest.approx(2 / 3)


def test_custom_reward_float_and_dict(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth)\n"
        "def as_dict(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 2, 'why': data_source}\n"
    )
    fn = get_reward_fn("math", custom_path=str(path))  # custom_path wins over the name
    assert fn("src", "a", "a") == {"score": 1.0}
    assert fn("src", "a", "b") == {"score": 0.0}
    out = get_reward_fn(custom_path=str(path), custom_name="as_dict")("src", "a", "b")
    assert out == {"score": 2.0, "why": "src"} and isinstance(out["score"], float)


def test_custom_reward_errors(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match="reward.custom_path") as err:
        get_reward_fn(custom_path=missing)
    assert missing in str(err.value)
    path = tmp_path / "r.py"
    path.write_text("def other(*a):\n    return 1.0\n")
    with pytest.raises(AttributeError, match="'compute_score'.*reward.custom_name"):
        get_reward_fn(custom_path=str(path))
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match="SyntaxError"):
        get_reward_fn(custom_path=str(broken))


def test_score_responses_isolates_bad_rows():
    def flaky(data_source, response, ground_truth, extra_info=None):
        if response == "boom":
            raise KeyError("gt")
        if response == "nan":
            return math.nan
        return {"score": 1, "reason": extra_info["why"] if extra_info else ""}

    out = score_responses(flaky, ["s"] * 3, ["ok", "boom", "nan"], ["g"] * 3, [{"why": "w"}, None, None])
    assert out[0] == {"score": 1.0, "reason": "w"}
    assert out[1] == {"score": 0.0, "reason": "reward_error: KeyError: 'gt'", "error": True}
    assert out[2]["score"] == 0.0 and out[2]["error"] and "non-finite" in out[2]["reason"]
    # A malformed row reaching a real reward (response None) is an error dict too, not a crash.
    bad = score_responses(REWARDS["deep_research"], ["DR_x", "DR_x"], [None, respond("a")], ["a", "a"])
    assert bad[0]["error"] and bad[0]["reason"].startswith("reward_error: AttributeError")
    assert bad[1] == dr.compute_score(respond("a"), "a")
    with pytest.raises(ValueError, match="length mismatch"):
        score_responses(flaky, ["s"], ["a", "b"], ["g", "g"])


# ----------------------------------------------------------------------------------------------------------
# Real rows from the shared parquet files
# ----------------------------------------------------------------------------------------------------------


def _ground_truths(name: str) -> list[tuple[str, object]]:
    if not os.path.isdir(DATA_DIR):
        pytest.skip(f"shared data dir {DATA_DIR} is absent")
    import pyarrow.parquet as pq

    table = pq.read_table(os.path.join(DATA_DIR, f"{name}.parquet"), columns=["data_source", "reward_model"])
    sources = table.column("data_source").to_pylist()
    return [(s, rm["ground_truth"]) for s, rm in zip(sources, table.column("reward_model").to_pylist())]


@pytest.mark.parametrize("name", ["valid", "hard_search_1k"])
def test_real_rows(name):
    rows = _ground_truths(name)
    assert len(rows) > 100
    fn = get_reward_fn("auto")
    for source, gt in rows:  # every row: ~1.3k rows, well under a second
        assert source.startswith("DR_")
        assert fn(source, respond(gt), gt)["score"] == 1.0, gt
    for source, gt in rows[:25]:
        assert fn(source, respond(gt, BOTH_TOOLS), gt)["score"] == pytest.approx(1.1)
        assert fn(source, respond("xyzzy plugh"), gt)["score"] == 0.0
        assert fn(source, respond(gt).replace("</answer>", ""), gt)["score"] == -1.0
        assert fn(source, respond(gt, "<search> q </search> "), gt)["score"] == -1.0  # call limit hit
