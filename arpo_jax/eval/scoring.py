"""Scoring of evaluation outputs (spec 13.1-13.2) and pass@k aggregation.

``extract_prediction`` is the reference's ``extract_answer`` plus its "last 5 lines" fallback;
``score_output`` computes the per-output metrics of ``src/evaluator.py`` (``em``, ``acc``, ``f1``,
``math_equal``, tool calls, output length) and a binary ``correct`` verdict; ``aggregate`` turns the scored
outputs of one benchmark into pass@1 / pass@k (the reference has no pass@k code, spec 13.2 / B17: here it is the
unbiased estimator of Chen et al. 2021 over the ``n`` samples per question) and the reference's means.

The metric primitives are the training rewards' (``arpo_jax.rewards.qa`` / ``math_reward``), so evaluation and
training normalise answers identically. Every function here is linear in the output length: outputs are model
text, and a degenerate one (megabytes, thousands of unclosed tags) must not stall an evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from arpo_jax.eval.benchmarks import EvalSample
from arpo_jax.rewards.math_reward import is_equiv_string, math_equal
from arpo_jax.rewards.qa import contains_gold, exact_match, extract_boxed, extract_final_answer, token_f1
from arpo_jax.rewards.tool_use import EMPTY, ERROR, OK, python_outcomes

# Spec 13.2: the reference's `m1m2` bonus denominator: productivity = acc * T / (T + 0.1) * 100.
_PRODUCTIVITY_EPS = 0.1
_FALLBACK_LINES = 5  # spec 13.2: an empty prediction is replaced by the last 5 lines of the output
_MAX_ERROR_CHARS = 500
_MEAN_KEYS = ("em", "acc", "f1", "math_equal", "python_calls", "search_calls", "output_length", "response_tokens")


def _closed_spans(text: str, open_tag: str, close_tag: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each ``open_tag ... close_tag`` pair, left to right, non-overlapping.

    The same pairs as ``re.finditer(open + ".*?" + close, DOTALL)`` (leftmost opener, nearest closer), but in
    linear time: that regex rescans to the end of the text from every unclosed opener.
    """
    pos = 0
    while (start := text.find(open_tag, pos)) != -1:
        close = text.find(close_tag, start + len(open_tag))
        if close == -1:
            return
        pos = close + len(close_tag)
        yield start, pos


def strip_results(output: str) -> str:
    """``output`` without its closed ``<result>...</result>`` blocks (tool results are not model text)."""
    pieces, pos = [], 0
    for start, end in _closed_spans(output, "<result>", "</result>"):
        pieces.append(output[pos:start])
        pos = end
    pieces.append(output[pos:])
    return "".join(pieces)


def count_tool_calls(output: str) -> tuple[int, int]:
    """``(python_calls, search_calls)``: properly closed ``<python>``/``<search>`` pairs outside result blocks.

    Tags quoted inside a ``<result>`` (a fetched page, echoed code) are not calls; an unclosed tag (a
    truncated output) is not a call either.
    """
    visible = strip_results(output)
    return (sum(1 for _ in _closed_spans(visible, "<python>", "</python>")),
            sum(1 for _ in _closed_spans(visible, "<search>", "</search>")))


def _unwrap_text(answer: str) -> str:
    r"""``\text{X}`` -> ``X`` when the whole answer is one such group (not ``\text{a} + \text{b}``)."""
    if not (answer.startswith("\\text{") and answer.endswith("}")):
        return answer
    inner, depth = answer[len("\\text{") : -1], 0
    for ch in inner:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:  # the opening brace closes before the end: two groups
            return answer
    return inner.strip() if depth == 0 else answer


def _extract(output: str) -> tuple[str, bool]:
    """``(prediction, found)``; ``found`` is False when the last-lines fallback was used."""
    close = output.rfind("</answer>")
    start = output.rfind("<answer>", 0, close) if close != -1 else -1
    if start != -1:
        # The slice holds exactly the last closed block, so the first-block helper reads the last one.
        answer = extract_final_answer(output[start : close + len("</answer>")])
    else:
        answer = extract_boxed(output)  # no answer tags: the last \boxed{} anywhere
    answer = _unwrap_text((answer or "").strip())
    if answer:
        return answer, True
    return "\n".join(output.strip().rsplit("\n", _FALLBACK_LINES)[-_FALLBACK_LINES:]).strip(), False


def extract_prediction(output: str) -> str:
    r"""The prediction a model output is graded on (spec 13.1 ``extract_answer``, 13.2 fallback).

    1. The last ``<answer>...</answer>`` block: its last brace-matched ``\boxed{...}`` if any, else the whole
       block content;
    2. no closed answer block: the last ``\boxed{...}`` of the output;
    3. a single ``\text{...}`` wrapping the result is unwrapped;
    4. still empty: the last 5 lines of the output.

    Args:
      output: the model's full response text, tool results included.

    Returns:
      The stripped prediction ("" only for an empty output).
    """
    return _extract(output)[0]


def score_output(output: str, sample: EvalSample) -> dict:
    """Per-output metrics of one model response against ``sample``'s references (max over references).

    Keys: ``benchmark``, ``id`` (from the sample); ``prediction``; ``has_answer`` (an answer block or a boxed
    answer was found, i.e. no fallback; the reference's ``num_valid_answer``); ``em`` (normalised equality),
    ``acc`` (a normalised reference is a substring of the normalised prediction), ``f1`` (token F1),
    ``math_equal`` (math: Hendrycks normalisation then symbolic equivalence in a killable child process;
    qa: Hendrycks string equivalence only, the reference's ``is_equiv``, no sympy on free text), all floats in
    {0, 1} except ``f1``; ``python_calls``, ``search_calls`` (closed pairs outside results); ``python_ok``,
    ``python_empty``, ``python_errors`` (Python calls that printed, ran silently, failed: `tool_use.python_outcomes`,
    read from their result blocks); ``output_length``
    (characters outside ``<result>`` blocks); ``correct`` (bool, the pass@k verdict without an LLM judge:
    math -> ``math_equal``, qa -> ``em``); ``error`` (None, or what went wrong: the output then counts as
    wrong with the metrics computed so far).

    Never raises for any ``output`` (non-strings included).
    """
    record: dict = {"benchmark": sample.benchmark, "id": sample.id, "prediction": "", "has_answer": False,
                    "em": 0.0, "acc": 0.0, "f1": 0.0, "math_equal": 0.0, "python_calls": 0, "search_calls": 0,
                    "python_ok": 0, "python_empty": 0, "python_errors": 0, "output_length": 0, "correct": False,
                    "error": None}
    try:
        if not isinstance(output, str):
            raise TypeError(f"output is a {type(output).__name__}, expected str")
        record["output_length"] = len(strip_results(output))
        record["python_calls"], record["search_calls"] = count_tool_calls(output)
        outcomes = python_outcomes(output)
        record.update(python_ok=outcomes.count(OK), python_empty=outcomes.count(EMPTY),
                      python_errors=outcomes.count(ERROR))
        pred, record["has_answer"] = _extract(output)
        record["prediction"] = pred
        refs = list(sample.answers)
        record["em"] = float(exact_match(pred, refs))
        record["acc"] = float(contains_gold(pred, refs))
        record["f1"] = float(token_f1(pred, refs))
        if sample.task == "math":
            equal = math_equal(pred, refs)
        else:
            equal = any(is_equiv_string(pred, g) for g in refs)
        record["math_equal"] = float(equal)
        record["correct"] = bool(equal) if sample.task == "math" else record["em"] == 1.0
    except Exception as e:  # a scoring bug must cost one output, not the evaluation
        record["error"] = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        record["correct"] = False
    return record


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (Chen et al. 2021), which never forms the binomials.

    Raises:
      ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    n, c, k = int(n), int(c), int(k)
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _stderr(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (population variance: sqrt(p (1 - p) / n) for 0/1 values)."""
    mean = _mean(values)
    return math.sqrt(_mean([(v - mean) ** 2 for v in values]) / len(values)) if values else 0.0


def aggregate(records: list[dict], k: int) -> dict:
    """Benchmark-level figures from the scored outputs of one benchmark.

    Args:
      records: one dict per (question id, sample index), as from ``score_output`` (at least ``id`` and
        ``correct``; missing metrics count as 0). Records are grouped into questions by (``benchmark``, ``id``).
      k: the k of pass@k. A question with fewer than k samples uses its own n (pass@n_i), so a partly failed
        run still reports a number rather than dropping the question.

    Returns:
      ``k``; ``n_samples`` (questions); ``n_outputs``; ``samples_per_question`` (mean n_i); ``pass@1`` and
      ``pass@k`` (mean over questions of the unbiased estimator with n_i, c_i); ``pass@1_stderr`` (the standard
      error of that mean over questions); ``accuracy`` (mean ``correct``
      over outputs); means over outputs of ``em``, ``acc``, ``f1``, ``math_equal``, ``python_calls``,
      ``search_calls``, ``output_length``, ``response_tokens``; ``tool_calls`` (mean python + search per output);
      ``python_ran_share`` (of the Python calls that got a result, the share that ran without error, silent ones
      included; None without such calls);
      ``tool_usage_rate`` (outputs with a call); ``answer_rate`` (outputs with ``has_answer``); ``failed``
      (outputs whose record has an ``error``); ``tool_productivity`` = accuracy * T / (T + 0.1) * 100 with
      T = ``tool_calls`` (spec 13.2, whose accuracy is the judge's mean: here the mean of ``correct``, which is
      the judge's verdict when one is used).

    Raises:
      ValueError: no records, or k < 1.
    """
    if not records:
        raise ValueError("aggregate() needs at least one record")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    questions: dict[tuple, list[bool]] = {}
    for r in records:
        questions.setdefault((r.get("benchmark"), r["id"]), []).append(bool(r["correct"]))
    counts = [(len(v), sum(v)) for v in questions.values()]
    out: dict = {
        "k": k,
        "n_samples": len(questions),
        "n_outputs": len(records),
        "samples_per_question": _mean([n for n, _ in counts]),
        "pass@1": _mean(p1 := [pass_at_k(n, c, 1) for n, c in counts]),
        "pass@1_stderr": _stderr(p1),
        "pass@k": _mean([pass_at_k(n, c, min(k, n)) for n, c in counts]),
        "accuracy": _mean([float(bool(r["correct"])) for r in records]),
    }
    for key in _MEAN_KEYS:
        out[key] = _mean([float(r.get(key) or 0) for r in records])
    calls = [float(r.get("python_calls") or 0) + float(r.get("search_calls") or 0) for r in records]
    out["tool_calls"] = _mean(calls)
    ran = sum(int(r.get("python_ok") or 0) + int(r.get("python_empty") or 0) for r in records)
    executed = ran + sum(int(r.get("python_errors") or 0) for r in records)
    out["python_ran_share"] = ran / executed if executed else None
    out["tool_usage_rate"] = _mean([float(c > 0) for c in calls])
    out["answer_rate"] = _mean([float(bool(r.get("has_answer"))) for r in records])
    out["failed"] = sum(1 for r in records if r.get("error"))
    t = out["tool_calls"]
    out["tool_productivity"] = out["accuracy"] * t / (t + _PRODUCTIVITY_EPS) * 100
    return out


def macro_average(per_benchmark: dict[str, dict]) -> dict:
    """Unweighted mean of ``pass@1`` and ``pass@k`` over benchmarks (each benchmark counts once).

    Args:
      per_benchmark: benchmark name -> ``aggregate`` output; all with the same ``k``.

    Returns:
      ``{"k", "n_benchmarks", "pass@1", "pass@k"}``.

    Raises:
      ValueError: empty input, or benchmarks aggregated with different k (their pass@k do not average).
    """
    if not per_benchmark:
        raise ValueError("macro_average() needs at least one benchmark")
    ks = {m.get("k") for m in per_benchmark.values()}
    if len(ks) > 1:
        raise ValueError(f"benchmarks were aggregated with different k: {sorted(ks, key=str)}")
    return {
        "k": ks.pop(),
        "n_benchmarks": len(per_benchmark),
        "pass@1": _mean([m["pass@1"] for m in per_benchmark.values()]),
        "pass@k": _mean([m["pass@k"] for m in per_benchmark.values()]),
    }
