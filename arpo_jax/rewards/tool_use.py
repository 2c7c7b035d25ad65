"""How a response's Python tool calls went, read from its text; and the math reward with a tool-use bonus.

The rollout splices each executed call's output right after its ``</python>`` as ``" <result>\\n" + text +
"\\n</result>"`` (`rollout.agent_loop.wrap_tool_result`). So from the decoded response alone each closed
``<python> ... </python>`` pair outside a result block has one of four outcomes:

* ``ok``: it ran and printed something;
* ``empty``: it ran without error and printed nothing (``Tool(python) returned empty output.``);
* ``error``: the program raised, timed out, was killed or the sandbox failed (a traceback, ``NameError: ...``,
  ``Execution timed out ...``, ``Process killed ...``, ``Error: Tool(python) execution failed ...``);
* ``no_result``: no result block follows it (the trajectory ended there: call limit, length limit).

``math_tool_score`` is the reference math reward (`math_reward.compute_score`: the last ``\\boxed{}`` against the
ground truth, 1 or 0) plus ``TOOL_BONUS`` when the answer is right AND at least one Python call ran and printed
(``ok``). Why a bonus at all: small models trained with tool RL stop calling the tool when calling earns nothing
(verl#1569); a small reward per valid call kept them calling (verl PR#4998). Why only on a correct answer and at most
once: a bonus on wrong answers or per call would pay for calls that do not help (the reference's own multi-tool
bonus, `deep_research.TOOL_BONUS`, also needs a correct answer); and ``score > 0`` stays "the answer is right", which
is what the trainer's ``val/accuracy`` counts.
"""

from __future__ import annotations

import re

from arpo_jax.rewards import math_reward

OK, EMPTY, ERROR, NO_RESULT = "ok", "empty", "error", "no_result"
OUTCOMES = (OK, EMPTY, ERROR, NO_RESULT)
TOOL_BONUS = 0.1
_EMPTY_TEXT = "Tool(python) returned empty output."
# The first line of every failure text the Python tool and the executor produce (python_sandbox.format_result,
# executor.error_text), and the last line of a Python traceback ("NameError: name 'x' is not defined").
_ERROR_LINE = re.compile(r"^(Traceback \(most recent call last\)|[A-Z]\w*(Error|Exception|Interrupt|Exit)(:|$)|"
                         r"Execution exception:|Execution timed out|Process killed by signal|Process exited with "
                         r"status|Error: Tool\()", re.MULTILINE)


def result_outcome(text: str) -> str:
    """``ok``, ``empty`` or ``error`` for the text inside one ``<result>`` block."""
    body = text.strip()
    if not body or body == _EMPTY_TEXT:
        return EMPTY
    return ERROR if _ERROR_LINE.search(body) else OK


def python_outcomes(response: str) -> list[str]:
    """The outcome (module docstring) of each closed ``<python>`` call outside result blocks, left to right.

    Linear in the response's length: one forward scan, never a regex over the whole text from each tag.
    """
    outcomes, pos = [], 0
    while True:
        call, result = response.find("<python>", pos), response.find("<result>", pos)
        if call == -1:
            return outcomes
        if result != -1 and result < call:  # a result block: tags quoted inside it are not calls
            end = response.find("</result>", result)
            if end == -1:
                return outcomes
            pos = end + len("</result>")
            continue
        close = response.find("</python>", call)
        if close == -1:  # unclosed (a truncated response): not a call
            return outcomes
        pos = close + len("</python>")
        after = response[pos:].lstrip()
        end = after.find("</result>") if after.startswith("<result>") else -1
        outcomes.append(NO_RESULT if end == -1 else result_outcome(after[len("<result>"):end]))


def math_tool_score(response: str, ground_truth) -> dict:
    """The math reward plus ``TOOL_BONUS`` for a correct answer with a Python call that ran and printed.

    Returns:
      ``{"score", "reason", "answer", "python_calls", "python_ok"}``: score in {0, 1, 1 + TOOL_BONUS}.
    """
    out = math_reward.compute_score(response, ground_truth)
    outcomes = python_outcomes(response)
    ok = outcomes.count(OK)
    if out["score"] > 0 and ok:
        out = {**out, "score": out["score"] + TOOL_BONUS, "reason": out["reason"] + " with a Python call that ran"}
    return {**out, "python_calls": len(outcomes), "python_ok": ok}
