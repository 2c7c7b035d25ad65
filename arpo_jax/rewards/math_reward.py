"""Math reward: Hendrycks-MATH string normalisation (spec §7.4) plus symbolic equivalence via ``math_verify``.

Named ``math_reward`` so that ``from arpo_jax.rewards import ...`` never shadows the stdlib ``math``.

Deviations from the reference ``math.py`` (string equality after ``strip_string`` only):
  * symbolic equivalence via ``math_verify`` when the strings differ (``2\\sqrt{2}`` = ``\\sqrt{8}``), except
    that a bare ``%`` on one side only never matches (below);
  * ``\\fbox{...}`` is graded like ``\\boxed{...}``: the reference's ``last_boxed_only_string`` finds it but its
    ``remove_boxed`` asserts ``\\boxed{`` and the answer scores 0.

As in the reference, ``strip_string`` removes ``\\%`` but keeps a bare ``%``, so ``\\boxed{50%}`` against ``50``
scores 0 (and ``\\boxed{50\\%}`` scores 1). math_verify would read ``50%`` as ``50``, so the symbolic check
refuses a bare ``%`` on one side only.

Thread and hang safety: ``math_verify`` bounds sympy with ``signal.alarm``, which only works in the main
thread, and no in-process timeout can stop a C-level bignum operation that holds the GIL. So symbolic checks
run in a small pool of child interpreters with a hard deadline: an overrunning child is killed and restarted.
Every failure (parse error, timeout, crash) reads as "not equivalent"; nothing raises, any thread may call.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import math
import re
import select
import subprocess
import sys
import threading

from arpo_jax.rewards.qa import as_references, extract_boxed

_SYMBOLIC_TIMEOUT_S = 5.0
_MAX_SYMBOLIC_CHARS = 1000  # sympy on long strings is slow and rarely meaningful
# Plain words: math_verify reads "Paris" as the product p*a*r*i*s, so anagrams would "match".
_PLAIN_WORDS = re.compile(r"^\s*[A-Za-z]{2,}(\s+[A-Za-z]+)*\s*$")
_TEXT_WRAPPER = re.compile(r"\\text\{([^{}]*)\}")

_LOG = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# Hendrycks MATH `strip_string` normalisation.
# ----------------------------------------------------------------------------------------------------------


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{72}`` -> ``\frac{1}{72}``; unchanged if malformed."""
    head, *rest = s.split("\\frac")
    out = head
    for sub in rest:
        out += "\\frac"
        if sub.startswith("{"):
            out += sub
        elif len(sub) < 2:
            return s  # the reference bails out on a truncated \frac
        elif sub[1] == "{":
            out += "{" + sub[0] + "}" + sub[1:]
        else:
            out += "{" + sub[0] + "}{" + sub[1] + "}" + sub[2:]
    return out


def _fix_a_slash_b(s: str) -> str:
    r"""``3/4`` -> ``\frac{3}{4}`` for plain integers only."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    r"""Drops a trailing ``\text{ units}`` (the space after the brace marks it as a unit)."""
    parts = s.split("\\text{ ")
    # The reference asserts exactly one unit block; with more we leave the string alone instead of raising.
    return parts[0] if len(parts) == 2 else s


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt3`` -> ``\sqrt{3}``."""
    head, *rest = s.split("\\sqrt")
    out = head
    for sub in rest:
        out += "\\sqrt" + (sub if sub.startswith("{") or not sub else "{" + sub[0] + "}" + sub[1:])
    return out


def strip_string(s: str) -> str:
    """Hendrycks MATH answer normalisation (order matters: it mirrors the reference step by step)."""
    s = str(s).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")  # degrees
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "")  # only the escaped percent: a bare % stays (the reference's strip_string)
    # " .5" / "{.5" / ".5" -> leading zero
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    # Drop a short left-hand side such as "x = " or "k=".
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv_string(pred: str, gold: str) -> bool:
    """The reference ``is_equiv``: equality after :func:`strip_string`."""
    return strip_string(pred) == strip_string(gold)


# ----------------------------------------------------------------------------------------------------------
# Symbolic equivalence (math_verify) in a killable child process.
# ----------------------------------------------------------------------------------------------------------

# The child: one JSON request per line in, "1"/"0" per line out. It runs math_verify in its own main thread
# with the library's alarm as a soft limit; the parent's deadline plus kill() is the hard one.
_CHILD_CODE = r"""
import json, logging, sys
logging.disable(logging.CRITICAL)
from math_verify import parse, verify
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    line = sys.stdin.readline()
    if not line:
        break
    ok = False
    try:
        req = json.loads(line)
        gold = parse("\\boxed{" + req["gold"] + "}", parsing_timeout=req["t"])
        pred = parse("\\boxed{" + req["pred"] + "}", parsing_timeout=req["t"])
        ok = bool(gold and pred and verify(gold, pred, timeout_seconds=req["t"]))  # gold first: asymmetric
    except BaseException:
        ok = False
    sys.stdout.write("1\n" if ok else "0\n"); sys.stdout.flush()
"""
_STARTUP_TIMEOUT_S = 60.0  # importing sympy in a cold child can take a few seconds on a loaded machine


class _SymbolicWorker:
    """One child interpreter answering equivalence queries; killed and lazily restarted when a query overruns."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one query in flight per child

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self._readline(proc, _STARTUP_TIMEOUT_S) != "ready":
            self._kill(proc)
            raise RuntimeError("math_verify child process failed to start (is math-verify installed?)")
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout_s: float) -> str | None:
        """One stripped line from the child, or None on timeout/EOF (lines are tiny, so written atomically)."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = proc.stdout.readline()
        return line.strip() if line else None

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()

    def query(self, pred: str, gold: str, timeout_s: float) -> bool:
        """True iff the child verifies ``pred`` against ``gold`` within ``timeout_s``; False otherwise."""
        if not self._lock.acquire(timeout=_STARTUP_TIMEOUT_S):
            return False
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            request = json.dumps({"pred": pred, "gold": gold, "t": max(1, math.ceil(timeout_s))})
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
            answer = self._readline(self._proc, timeout_s)
            if answer is None:  # overran (or died): the only way to stop sympy holding the GIL is to kill it
                self._kill(self._proc)
                self._proc = None
            return answer == "1"
        finally:
            self._lock.release()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._kill(self._proc)
        self._proc = None


# A small fixed pool, so concurrent reward threads do not queue behind one slow query.
_WORKERS = [_SymbolicWorker() for _ in range(2)]
_NEXT_WORKER = itertools.count()
atexit.register(lambda: [w.close() for w in _WORKERS])


def _has_bare_percent(s: str) -> bool:
    """Whether ``s`` holds a ``%`` that is not ``\\%`` (which ``strip_string`` removes)."""
    return "%" in s.replace("\\%", "")


def symbolic_equal(pred: str, gold: str, timeout_s: float = _SYMBOLIC_TIMEOUT_S) -> bool:
    """Symbolic/numeric equivalence via ``math_verify``; never raises, never hangs.

    Each query is cut off after ``timeout_s`` (callers may also queue behind other threads' queries).

    The check runs in a child process: sympy can sit in one C call (e.g. evaluating ``3^{3^{3^3}}``) that
    holds the GIL, which neither a signal alarm nor a watchdog thread can interrupt; only kill() can.
    The first call also pays the child's start-up (importing sympy, ~1 s).
    """
    if len(pred) > _MAX_SYMBOLIC_CHARS or len(gold) > _MAX_SYMBOLIC_CHARS:
        return False
    if _has_bare_percent(pred) != _has_bare_percent(gold):
        return False  # the reference's strip_string keeps a bare %, so "50%" is not "50" (module docstring)
    pred_text, gold_text = _TEXT_WRAPPER.sub(r"\1", pred), _TEXT_WRAPPER.sub(r"\1", gold)
    if _PLAIN_WORDS.match(pred_text) or _PLAIN_WORDS.match(gold_text):
        # Words are compared as words (case-insensitive), never symbolically (see _PLAIN_WORDS).
        return pred_text.lower().split() == gold_text.lower().split()
    worker = _WORKERS[next(_NEXT_WORKER) % len(_WORKERS)]
    try:
        return worker.query(pred, gold, timeout_s)
    except Exception as e:  # e.g. the child cannot start: degrade to "not equivalent", loudly once per call
        _LOG.warning("symbolic check failed: %s: %s", type(e).__name__, e)
        return False


def math_equal(pred: str, gold, timeout_s: float = _SYMBOLIC_TIMEOUT_S) -> bool:
    """True if ``pred`` matches any reference by normalised string equality or symbolic equivalence."""
    pred = str(pred)
    refs = as_references(gold)
    if any(is_equiv_string(pred, g) for g in refs):
        return True
    return any(symbolic_equal(pred, g, timeout_s) for g in refs)


def compute_score(response: str, ground_truth, timeout_s: float = _SYMBOLIC_TIMEOUT_S) -> dict:
    """Math reward: last ``\\boxed{}`` of the whole response vs the ground truth; 1.0 if equivalent else 0.0.

    Returns:
      ``{"score", "reason", "answer"}``.
    """
    answer = extract_boxed(response)
    if answer is None:
        return {"score": 0.0, "reason": "no \\boxed{} answer", "answer": ""}
    refs = as_references(ground_truth)
    if any(is_equiv_string(answer, g) for g in refs):
        return {"score": 1.0, "reason": "string match", "answer": answer}
    if any(symbolic_equal(answer, g, timeout_s) for g in refs):
        return {"score": 1.0, "reason": "symbolic match", "answer": answer}
    return {"score": 0.0, "reason": "wrong answer", "answer": answer}
