"""Tests for arpo_jax.eval.scoring: prediction extraction, per-output metrics, pass@k and aggregation."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest

from arpo_jax.eval.benchmarks import EvalSample, normalize_answers
from arpo_jax.eval.scoring import aggregate, extract_prediction, macro_average, pass_at_k, score_output


def qa(*answers: str) -> EvalSample:
    return EvalSample("hotpotqa", "q1", "question?", tuple(answers), "qa")


def math_sample(*answers: str) -> EvalSample:
    return EvalSample("math500", "m1", "question?", tuple(answers), "math")


def boxed(answer: str) -> str:
    return f"<think> done </think> <answer> The final answer is \\[ \\boxed{{{answer}}} \\] </answer>"


# ----------------------------------------------------------------------------------------------------------
# extract_prediction
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output, expected", [
    (boxed("\\frac{\\sqrt{3}}{2}"), "\\frac{\\sqrt{3}}{2}"),  # nested braces, brace-matched
    (boxed("\\text{Paris}"), "Paris"),  # one \text{} unwrapped
    (boxed("\\text{a} + \\text{b}"), "\\text{a} + \\text{b}"),  # two groups: not one wrapper, kept
    ("<answer>\\boxed{1} or rather \\boxed{2}</answer>", "2"),  # last boxed inside the block
    ("<answer>\\boxed{1}</answer> wait <answer>\\boxed{3}</answer>", "3"),  # last answer block
    ("<answer>  Paris, France </answer>", "Paris, France"),  # no boxed: whole block content
    ("I think \\boxed{7}, no: \\boxed{8}.", "8"),  # no answer tags: last boxed of the output
    ("<answer> \\boxed{5} (truncated", "5"),  # unclosed block: no block, last boxed
    ("<answer>\\boxed{1}</answer> <answer> \\boxed{9}", "1"),  # trailing unclosed block ignored
    ("", ""),
    ("  \n ", ""),
    ("l1\nl2\nl3\nl4\nl5\nl6\nl7\n", "l3\nl4\nl5\nl6\nl7"),  # nothing found: the last 5 lines
    ("<answer> </answer>\nx", "<answer> </answer>\nx"),  # empty block: the last lines too
    ("<answer>\\boxed{北京}</answer>", "北京"),
])
def test_extract_prediction(output, expected):
    assert extract_prediction(output) == expected


# ----------------------------------------------------------------------------------------------------------
# score_output
# ----------------------------------------------------------------------------------------------------------


def test_qa_metrics_hand_computed():
    r = score_output(boxed("The capital is Paris"), qa("Paris"))
    # normalised "capital is paris" vs "paris": P = 1/3, R = 1, F1 = 0.5; gold contained; not equal.
    assert (r["em"], r["acc"], r["f1"], r["math_equal"], r["correct"]) == (0.0, 1.0, 0.5, 0.0, False)
    assert r["prediction"] == "The capital is Paris" and r["has_answer"] and r["error"] is None
    r = score_output(boxed("the Paris"), qa("Paris"))
    assert (r["em"], r["acc"], r["f1"], r["correct"]) == (1.0, 1.0, 1.0, True)  # articles dropped


def test_multiple_references_take_the_max():
    sample = qa(*normalize_answers('["New York City", "NYC", "Big Apple"]', split_list_strings=True))
    assert sample.answers == ("New York City", "NYC", "Big Apple")
    r = score_output(boxed("nyc"), sample)
    assert r["em"] == 1.0 and r["correct"]
    r = score_output(boxed("New York"), sample)
    # best reference "New York City": P = 1, R = 2/3, F1 = 0.8
    assert r["em"] == 0.0 and r["f1"] == pytest.approx(0.8) and not r["correct"]


def test_chinese_answer():
    sample = EvalSample("xbench", "x1", "问题", ("161.27元",), "qa")
    assert score_output(boxed("161.27元"), sample)["correct"]
    r = score_output(boxed("约 161.27元"), sample)
    assert (r["em"], r["acc"], r["correct"]) == (0.0, 1.0, False)


def test_math_equivalence_uses_normalisation_and_symbolic_checks():
    r = score_output(boxed("\\frac{1}{2}"), math_sample("0.5"))
    assert r["math_equal"] == 1.0 and r["correct"] and r["em"] == 0.0
    # Not equal as normalised strings, only symbolically (math_verify in the child process).
    assert score_output(boxed("0.50"), math_sample("\\frac{1}{2}"))["correct"]
    assert score_output(boxed("2^{10}"), math_sample("1024"))["correct"]
    assert score_output(boxed("\\dfrac{14}{3}"), math_sample("\\frac{14}{3}"))["correct"]
    wrong = score_output(boxed("3"), math_sample("0.5"))
    assert wrong["math_equal"] == 0.0 and not wrong["correct"]


def test_qa_correct_is_exact_match_not_string_equivalence():
    # For qa, math_equal is only the Hendrycks string check, and `correct` follows em.
    r = score_output(boxed("\\frac{1}{2}"), qa("1/2"))
    assert r["math_equal"] == 1.0 and r["em"] == 0.0 and not r["correct"]


def test_tool_calls_and_output_length():
    output = ("<think> a </think> <python>print(1)</python> <result>\n<python>echoed</python>\n</result>"
              " <search>q</search> <result>page</result> <search>q2</search>"
              " <python> never closed")
    r = score_output(output, qa("x"))
    assert (r["python_calls"], r["search_calls"]) == (1, 2)  # result contents and the unclosed tag do not count
    assert score_output("ab <result>xyz</result>cd<result>unclosed", qa("x"))["output_length"] == len(
        "ab cd<result>unclosed")


def test_hostile_inputs_never_raise():
    rng = random.Random(0)
    alphabet = "ab <>/\\{}$^_answerpythonsearchresultboxedtext\n北"
    noise = "".join(rng.choice(alphabet) for _ in range(2_000_000))
    for output in (noise, "<answer>" * 200_000, "<python>" * 200_000 + "\\boxed{" * 100_000, "}" * 1_000_000):
        for sample in (qa("x"), math_sample("1")):
            r = score_output(output, sample)
            assert r["error"] is None and r["correct"] is False
    for bad in (None, b"bytes", 12):
        r = score_output(bad, qa("x"))
        assert r["error"].startswith("TypeError") and r["correct"] is False


# ----------------------------------------------------------------------------------------------------------
# pass@k and aggregation
# ----------------------------------------------------------------------------------------------------------


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                expected = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
    exact = 1 - Fraction(math.comb(150, 100), math.comb(200, 100))
    assert pass_at_k(200, 50, 100) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 4, 1), (3, -1, 1), (3, 1, 0), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def record(qid, correct, **kw):
    base = {"benchmark": "b", "id": qid, "correct": correct, "em": float(correct), "acc": 0.0, "f1": 0.0,
            "math_equal": 0.0, "python_calls": 0, "search_calls": 0, "output_length": 10, "has_answer": True,
            "error": None}
    return {**base, **kw}


def test_aggregate_hand_computed():
    records = [
        # q1: 4 samples, 1 correct -> pass@1 = 1/4, pass@3 = 1 - C(3,3)/C(4,3) = 3/4
        record("q1", True, python_calls=2, search_calls=1, acc=1.0, f1=1.0, output_length=100),
        record("q1", False, python_calls=1),
        record("q1", False),
        record("q1", False, has_answer=False),
        # q2: 4 samples, none correct -> 0, 0; one failed scoring
        record("q2", False, search_calls=1),
        record("q2", False),
        record("q2", False, error="ValueError: x"),
        record("q2", False),
        # q3: only 2 samples (< k) -> its own n: pass@1 = 1/2, pass@2 = 1 - C(1,2)/C(2,2) = 1
        record("q3", True, math_equal=1.0, f1=0.5),
        record("q3", False),
    ]
    out = aggregate(records, k=3)
    assert out["k"] == 3 and out["n_samples"] == 3 and out["n_outputs"] == 10
    assert out["samples_per_question"] == pytest.approx(10 / 3)
    assert out["pass@1"] == pytest.approx((1 / 4 + 0 + 1 / 2) / 3)
    assert out["pass@k"] == pytest.approx((3 / 4 + 0 + 1) / 3)
    assert out["accuracy"] == pytest.approx(0.2) and out["em"] == pytest.approx(0.2)
    assert out["acc"] == pytest.approx(0.1) and out["f1"] == pytest.approx(0.15)
    assert out["math_equal"] == pytest.approx(0.1)
    assert out["python_calls"] == pytest.approx(0.3) and out["search_calls"] == pytest.approx(0.2)
    assert out["tool_calls"] == pytest.approx(0.5) and out["tool_usage_rate"] == pytest.approx(0.3)
    assert out["output_length"] == pytest.approx((100 + 9 * 10) / 10)
    assert out["answer_rate"] == pytest.approx(0.9) and out["failed"] == 1
    assert out["tool_productivity"] == pytest.approx(0.2 * 0.5 / 0.6 * 100)


def test_aggregate_groups_by_id_not_by_order_and_validates():
    records = [record("a", True), record("b", False), record("a", False), record("b", True)]
    out = aggregate(records, k=2)
    assert out["n_samples"] == 2 and out["pass@1"] == 0.5 and out["pass@k"] == 1.0
    assert aggregate([record("a", False)], k=1)["tool_productivity"] == 0.0  # no tool calls: T = 0
    with pytest.raises(ValueError):
        aggregate([], k=1)
    with pytest.raises(ValueError):
        aggregate(records, k=0)


def test_standard_error_and_the_share_of_python_calls_that_ran():
    records = [record("a", True) | {"python_ok": 2, "python_errors": 1}, record("b", False) | {"python_empty": 1},
               record("c", False), record("d", True), record("e", False)]
    out = aggregate(records, k=1)
    # pass@1 = 2/5; s.e. = sqrt(0.4 * 0.6 / 5); 3 of the 4 Python calls that got a result ran (one silently)
    assert out["pass@1_stderr"] == pytest.approx((0.4 * 0.6 / 5) ** 0.5)
    assert out["python_ran_share"] == pytest.approx(3 / 4)
    assert aggregate([record("a", True)], k=1)["python_ran_share"] is None  # no call: no share
    scored = score_output("<python>x</python> <result>\nNameError: x\n</result> <python>1</python> <result>\n1\n"
                          "</result>" + boxed("1"), math_sample("1"))
    assert (scored["python_ok"], scored["python_empty"], scored["python_errors"]) == (1, 0, 1)


def test_macro_average():
    per = {"x": {"k": 5, "pass@1": 0.2, "pass@k": 0.5}, "y": {"k": 5, "pass@1": 0.4, "pass@k": 0.7}}
    assert macro_average(per) == pytest.approx({"k": 5, "n_benchmarks": 2, "pass@1": 0.3, "pass@k": 0.6})
    with pytest.raises(ValueError, match="different k"):
        macro_average({**per, "z": {"k": 3, "pass@1": 0.0, "pass@k": 0.0}})
    with pytest.raises(ValueError):
        macro_average({})


def test_scored_outputs_aggregate_end_to_end():
    sample = math_sample("\\frac{1}{2}")
    outputs = [boxed("0.5"), "<python>1/2</python> <result>0.5</result>" + boxed("1/3"), "no answer"]
    out = aggregate([score_output(o, sample) for o in outputs], k=2)
    # n = 3, c = 1: pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3
    assert out["pass@1"] == pytest.approx(1 / 3) and out["pass@k"] == pytest.approx(2 / 3)
    assert out["python_calls"] == pytest.approx(1 / 3) and out["answer_rate"] == pytest.approx(2 / 3)


def test_markdown_report_has_one_pass_column_for_k_1_and_two_otherwise():
    """With k = 1, pass@k is pass@1: the table shows it once; with k > 1 both, under their names."""
    from arpo_jax.eval.report import markdown_report

    bench = {"n_samples": 4, "pass@1": 0.25, "pass@k": 0.5, "em": 0.25, "f1": 0.3, "tool_calls": 1.5, "failed": 0,
             "pass@1_stderr": 0.217, "python_ran_share": 0.75, "response_tokens": 312.4}
    base = {"model": "m", "engine": "jax", "judge": None, "benchmarks": {"gsm8k": bench},
            "macro_average": {"n_benchmarks": 1, "pass@1": 0.25, "pass@k": 0.5}}
    extra = "| ± s.e. (pass@1) | em (%) | f1 (%) | tool calls | Python calls ran (%) | response tokens | failed |"
    one = markdown_report(base | {"k": 1}).splitlines()
    assert one[4] == "| benchmark | questions | pass@1 (%) " + extra
    assert one[6] == "| gsm8k | 4 | 25.0 | 21.7 | 25.0 | 30.0 | 1.50 | 75.0 | 312 | 0 |"
    assert one[5].count("|") == one[4].count("|")
    four = markdown_report(base | {"k": 4}).splitlines()
    assert four[4] == "| benchmark | questions | pass@1 (%) | pass@4 (%) " + extra
    assert four[6] == "| gsm8k | 4 | 25.0 | 50.0 | 21.7 | 25.0 | 30.0 | 1.50 | 75.0 | 312 | 0 |"
    assert four[7].count("|") == four[4].count("|")  # the macro row has every column


def test_sign_test_is_the_exact_two_sided_binomial_over_the_changed_questions():
    from scipy import stats

    from arpo_jax.eval.report import sign_test

    assert sign_test(0, 0) == 1.0  # nothing changed: no evidence
    assert sign_test(5, 0) == sign_test(0, 5) == pytest.approx(2 / 2**5)  # by hand: both 5-0 splits
    assert sign_test(3, 3) == 1.0
    # The GSM8K study's pairs (RESULTS.md): GRPO with the tool vs SFT 22 / 8, ARPO 20 steps vs SFT 14 / 11.
    for gained, lost in ((22, 8), (14, 11), (42, 27), (1, 0)):
        assert sign_test(gained, lost) == pytest.approx(stats.binomtest(gained, gained + lost, 0.5).pvalue)
    assert sign_test(22, 8) == pytest.approx(0.01612, abs=1e-5)
