"""The LLM judge of spec 13.2, through any OpenAI-compatible *chat completions* endpoint.

The judge model (the reference: Qwen2.5-72B-Instruct behind vLLM) gets the question, the golden answer(s) and the
predicted answer, and replies Correct or Incorrect. The decision is the reference's, exactly:

    correct = equivalent(prediction, gold)
              or ("correct" in reply.lower() and none of "incorrect", "wrong", "not correct" in reply.lower())

where `reply` is the text inside `<judgment>...</judgment>` when the judge used those tags, else the whole reply,
and `equivalent` is a deterministic rule (default: normalised exact match against any golden answer, the QA
reward's `exact_match`). Since the rule alone already makes a prediction correct, a rule-equivalent prediction is
decided without a request (`source="rule"`) unless `always_ask` is set (then the reply is recorded but cannot
change the verdict). A prediction the rule rejects is decided by the reply (`source="judge"`); when the server
still fails after the retries, by the rule alone (`source="fallback"`, with the error recorded). The judge never
raises on server problems: an evaluation must not die because its judge went away.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from arpo_jax.json_http import JsonHttpClient, ServerError
from arpo_jax.rewards.qa import exact_match

logger = logging.getLogger(__name__)

NEGATIVE_MARKERS = ("incorrect", "wrong", "not correct")
_JUDGMENT = re.compile(r"<judgment>(.*?)</judgment>", re.DOTALL | re.IGNORECASE)

# The idea of the reference's prompt (spec 13.2), in our own words: golden options are alternatives, meaning over
# wording, a one-word verdict.
JUDGE_PROMPT = """\
You are grading the answer to a question against its reference answer.

Question: {question}

Golden answer(s): {gold}

Predicted answer: {prediction}

The predicted answer is correct if it agrees with the meaning and the key information of the golden answer. When \
several golden answers are listed, agreeing with any one of them is enough. Differences in wording, formatting, \
capitalisation or extra explanation do not matter; a different, incomplete or missing final answer does.

Reply with a single word: Correct or Incorrect."""


def default_equivalent(prediction: str, gold: Sequence[str]) -> bool:
    """Normalised exact match against any golden answer (the QA reward's normalisation)."""
    return bool(exact_match(prediction, list(gold)))


def reply_says_correct(reply: str | None) -> bool:
    """The reference's reading of a judge reply (inside `<judgment>` tags when present)."""
    if not reply:
        return False
    tagged = _JUDGMENT.findall(reply)
    text = (tagged[-1] if tagged else reply).lower()
    return "correct" in text and not any(marker in text for marker in NEGATIVE_MARKERS)


class LLMJudge:
    """Spec 13.2's LLM judge over `POST {base_url}/chat/completions`. Use as a context manager or `close()`.

    Args:
      base_url: the API root including the version, e.g. "http://127.0.0.1:8001/v1".
      model: the served judge model name.
      api_key_env: environment variable holding the API key (sent as a Bearer token), or None.
      retries: extra attempts after a transient failure (connection, timeout, 5xx, 408, 429) before falling back.
      timeout_s: socket timeout of one request.
      max_concurrency: requests in flight at once in `judge_many`.
      temperature: sampling temperature of the judge (0 = greedy).
      max_tokens: reply budget (the verdict is one word; a judge that reasons first needs more).
      equivalent: the deterministic rule `equivalent(prediction, gold_list) -> bool` (default: normalised exact
        match); e.g. a math-equivalence check for math benchmarks.
      always_ask: also ask the judge when the rule already accepts the prediction (the verdict stays correct).
      prompt_template: a format string with {question}, {gold} and {prediction}.
      backoff_s: first retry delay, at most (doubling; `json_http`).
      extra_body: fields added to every request body (e.g. {"seed": 0}).
    """

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = None, retries: int = 3,
                 timeout_s: float = 120.0, max_concurrency: int = 16, temperature: float = 0.0, max_tokens: int = 64,
                 equivalent: Callable[[str, Sequence[str]], bool] | None = None, always_ask: bool = False,
                 prompt_template: str = JUDGE_PROMPT, backoff_s: float = 1.0,
                 extra_body: Mapping[str, Any] | None = None):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model, self.temperature, self.max_tokens = model, float(temperature), int(max_tokens)
        self.equivalent = equivalent or default_equivalent
        self.always_ask, self.prompt_template = always_ask, prompt_template
        self.extra_body = dict(extra_body or {})
        self.max_concurrency = max_concurrency
        self.client = JsonHttpClient(base_url, api_key_env=api_key_env, timeout_s=timeout_s, retries=retries,
                                     backoff_s=backoff_s, pool_size=max_concurrency)

    def prompt(self, question: str, gold: Sequence[str], prediction: str) -> str:
        golds = " | ".join(str(g) for g in gold) if len(gold) > 1 else (str(gold[0]) if gold else "")
        return self.prompt_template.format(question=question, gold=golds, prediction=prediction)

    def judge(self, question: str, gold: Sequence[str] | str, prediction: str) -> dict:
        """Judges one prediction: {"correct", "source" ("judge" | "rule" | "fallback"), "reply", "error"}."""
        golds = [gold] if isinstance(gold, str) else [str(g) for g in gold]
        prediction = "" if prediction is None else str(prediction)
        by_rule = self._rule(prediction, golds)
        if by_rule and not self.always_ask:
            return {"correct": True, "source": "rule", "reply": None, "error": None}
        try:
            reply = self._ask(self.prompt(question, golds, prediction))
        except Exception as e:  # noqa: BLE001 - server problems of any kind fall back to the rule
            logger.warning("LLM judge at %s failed, falling back to the rule: %s", self.client.server, e)
            return {"correct": by_rule, "source": "rule" if by_rule else "fallback", "reply": None,
                    "error": f"{type(e).__name__}: {e}"}
        if by_rule:
            return {"correct": True, "source": "rule", "reply": reply, "error": None}
        return {"correct": reply_says_correct(reply), "source": "judge", "reply": reply, "error": None}

    def judge_many(self, items: Sequence[Mapping[str, Any] | Sequence[Any]]) -> list[dict]:
        """Judges `(question, gold, prediction)` tuples (or dicts with those keys) concurrently; order kept."""
        args = [(it["question"], it["gold"], it["prediction"]) if isinstance(it, Mapping) else tuple(it)
                for it in items]
        if not args:
            return []
        workers = min(self.max_concurrency, len(args))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="llm-judge") as pool:
            return list(pool.map(lambda a: self.judge(*a), args))

    def _rule(self, prediction: str, gold: list[str]) -> bool:
        try:
            return bool(self.equivalent(prediction, gold))
        except Exception as e:  # noqa: BLE001 - a rule that chokes on odd text means "not equivalent"
            logger.warning("equivalence rule raised on %r: %s", prediction[:100], e)
            return False

    def _ask(self, prompt: str) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": self.temperature, "max_tokens": self.max_tokens, "n": 1, **self.extra_body}
        answer = self.client.post("/chat/completions", body)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{self.client.server}: a chat answer without a message: {str(answer)[:300]}",
                              server=self.client.server) from None
        return content or ""

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
