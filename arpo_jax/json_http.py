"""JSON over HTTP with retries: the one client of the search tool, the OpenAI-compatible sampler and the LLM judge.

`JsonHttpClient.post(path, body)` sends `body` as JSON and returns the decoded JSON answer. It owns the retry policy
of every HTTP call in the package: connection errors, timeouts, 5xx, 408, 429 and a 2xx body that is not JSON (a
proxy's page, a truncated answer) are transient and retried up to `retries` times; any other 4xx raises at once.
Before retry k (0-based) it waits a random time in [0, min(backoff_max_s, backoff_s * 2**k)] ("full jitter": clients
that failed together do not come back together), or what the server's Retry-After header asks (seconds or an HTTP
date), capped at `backoff_max_s`. A final failure raises `ServerError`, which says what went wrong (`kind`,
`status`, the server's own message) and after how many attempts.

API keys go out as a Bearer token and never into a log line or an error message (they are redacted from both).
"""

from __future__ import annotations

import email.utils
import logging
import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import requests

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})  # request timeout / rate limited: transient although 4xx
_MAX_MESSAGE_CHARS = 1000


class ServerError(RuntimeError):
    """A request failed (after the retries where the failure was transient).

    Attributes:
      server: the base URL (without credentials).
      kind: "timeout", "connection", "status" (an HTTP error status) or "json" (an answer that is not JSON).
      status: the HTTP status, or None when no response came.
      server_message: the server's own error message (its `error.message`), if any.
      attempts: the requests made.
    """

    def __init__(self, message: str, *, server: str, kind: str = "status", status: int | None = None,
                 server_message: str | None = None, attempts: int = 1):
        super().__init__(message)
        self.server, self.kind, self.status, self.server_message = server, kind, status, server_message
        self.attempts = attempts


def retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class JsonHttpClient:
    """A JSON HTTP client with one retry policy (module docstring). Thread-safe for concurrent calls.

    Args:
      base_url: prefix of every request's URL (e.g. "http://127.0.0.1:8000/v1"; a path is appended per call).
      api_key_env: environment variable holding the API key, read once here (None: no Authorization header;
        a per-call key can be given to `post` instead).
      timeout_s: per-request socket timeout (connect and each read).
      retries: extra attempts after a transient failure (so at most 1 + retries requests).
      backoff_s: retry k waits up to backoff_s * 2**k (random, see the module docstring) ...
      backoff_max_s: ... and never longer than this, whatever Retry-After asks.
      pool_size: connections kept open (the caller's concurrency).
      trust_env: let requests pick up proxies and .netrc credentials from the environment.
      sleep: how to wait (tests record the waits instead).
    """

    def __init__(self, base_url: str, *, api_key_env: str | None = None, timeout_s: float = 600.0,
                 retries: int = 3, backoff_s: float = 0.5, backoff_max_s: float = 30.0, pool_size: int = 8,
                 trust_env: bool = True, sleep: Callable[[float], Any] = time.sleep):
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.server = display_url(self.base_url)
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        self.backoff_s, self.backoff_max_s = float(backoff_s), float(backoff_max_s)
        self._sleep = sleep
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        self._session = requests.Session()
        self._session.trust_env = trust_env
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max(1, pool_size), max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._key: str | None = None
        if api_key_env is not None:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise ValueError(f"the API key variable {api_key_env} is not set in the environment")

    def post(self, path: str, body: dict, *, api_key: str | None = None) -> Any:
        """POSTs `body` as JSON to `{base_url}{path}` and returns the decoded JSON answer (`api_key` overrides)."""
        return self._request("POST", path, body, api_key or self._key)

    def get(self, path: str) -> Any:
        return self._request("GET", path, None, self._key)

    def _request(self, method: str, path: str, body: dict | None, key: str | None) -> Any:
        url = self.base_url + path
        headers = {"Authorization": f"Bearer {key}"} if key else None
        redact = (lambda text: text.replace(key, "***")) if key else (lambda text: text)
        attempts = 1 + self.retries
        for attempt in range(attempts):
            status = message = wait = None
            try:
                response = self._session.request(method, url, json=body, headers=headers, timeout=self.timeout_s)
            except requests.Timeout:
                kind, problem = "timeout", f"no answer within {self.timeout_s:g} s (timed out)"
            except requests.RequestException as e:  # connection refused / reset, DNS, ...
                kind, problem = "connection", f"connection failed ({type(e).__name__}: {redact(str(e))[:300]})"
            else:
                status = response.status_code
                if status < 400:
                    try:
                        return response.json()
                    except ValueError:  # a proxy's HTML page, a truncated body: transient
                        kind = "json"
                        problem = f"HTTP {status} with a body that is not JSON: {redact(response.text[:200])!r}"
                else:
                    kind, message = "status", redact(_server_message(response))
                    problem = f"HTTP {status}: {message}"
                    if status < 500 and status not in RETRY_STATUS:
                        raise ServerError(f"{self.server} rejected {method} {path or '/'} with {problem}",
                                          server=self.server, kind=kind, status=status, server_message=message,
                                          attempts=attempt + 1)
                    wait = retry_after_s(response.headers.get("Retry-After"))
            if attempt + 1 < attempts:
                delay = self._backoff_s(attempt, wait)
                logger.warning("%s: %s %s failed (attempt %d/%d): %s; retrying in %.2f s", self.server, method,
                               path or "/", attempt + 1, attempts, problem, delay)
                self._sleep(delay)
        raise ServerError(f"{self.server}: {method} {path or '/'} failed after {attempts} attempt(s): {problem}",
                          server=self.server, kind=kind, status=status, server_message=message, attempts=attempts)

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        with self._rng_lock:
            if retry_after is not None:  # the server said when; a little jitter so clients do not stampede
                return min(self.backoff_max_s, retry_after) + self._rng.uniform(0, 0.1 * self.backoff_s)
            return self._rng.uniform(0, min(self.backoff_max_s, self.backoff_s * 2**attempt))

    def close(self) -> None:
        self._session.close()


def display_url(url: str) -> str:
    """The URL without any user:password part (never shown in logs or errors)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _server_message(response: requests.Response) -> str:
    """The error text of an OpenAI-style (`{"error": {"message": ...}}`), FastAPI or plain-text error answer."""
    try:
        data = response.json()
    except ValueError:
        return (response.text or response.reason or "").strip()[:_MAX_MESSAGE_CHARS]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "error"):
                if err.get(key):
                    return str(err[key])[:_MAX_MESSAGE_CHARS]
        elif err:
            return str(err)[:_MAX_MESSAGE_CHARS]
    return str(data)[:_MAX_MESSAGE_CHARS]
