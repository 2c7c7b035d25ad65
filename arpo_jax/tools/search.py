"""The search tool: Bright Data's SERP API for Bing (spec 6.2), behind a persistent shared cache.

Request, parsing and formatting follow the reference exactly. Added: retries with exponential backoff and jitter
(429 honouring Retry-After, 5xx, timeouts, connection errors, malformed JSON), a clear failure text for the model
instead of an empty string, and an API key that is read from the environment at call time and never stored in
the config, a repr, a log line or a result.
"""

import dataclasses
import email.utils
import logging
import os
import random
import re
import threading
import time
import urllib.parse

import requests

from arpo_jax.tools.base import Tool
from arpo_jax.tools.search_cache import SearchCache

log = logging.getLogger(__name__)
NO_RESULTS = "No search results found."


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Settings of the Bright Data search tool. Holds the *name* of the key's environment variable, not the key."""

    api_key_env: str = "BRIGHTDATA_API_KEY"  # the key is read from os.environ[api_key_env] at each call
    zone: str = "serp_api1"  # Bright Data zone (reference default)
    base_url: str = "https://api.brightdata.com/request"  # tests point this at a loopback server
    location: str = "cn"  # Bing `cc` country code (reference default)
    max_results: int = 10  # snippets kept per query
    result_length: int = 1000  # characters kept per snippet
    request_timeout_s: float = 60.0  # per HTTP attempt (reference: 60)
    max_attempts: int = 4  # HTTP attempts per query before the failure text
    backoff_base_s: float = 1.0  # attempt k waits uniform(0, min(backoff_max_s, backoff_base_s * 2**k))
    backoff_max_s: float = 30.0  # also caps a server's Retry-After
    cache_file: str | None = None  # reference-format JSON snapshot; None disables caching
    cache_refresh_s: float = 15.0  # how often a miss re-reads what other processes cached
    reference_compat: bool = False  # failures return "" (the reference), so the executor's retries apply


def clean_query(query: str) -> str:
    """The reference removes every double quote; the cleaned query is the cache key."""
    return query.replace('"', "")


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return 0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2A6DF or 0xF900 <= o <= 0xFAFF


def detect_language(query: str) -> str:
    """``"zh"`` or ``"en"``. The reference asks ``langid``; here a query is Chinese when it has at least as many
    CJK characters as Latin words (one CJK character carries about a word), which needs no model download."""
    cjk = sum(_is_cjk(c) for c in query)
    latin_words = len(re.findall(r"[^\W\d_]+", "".join(" " if _is_cjk(c) else c for c in query)))
    return "zh" if cjk and cjk >= latin_words else "en"


def build_request(query: str, cfg: SearchConfig) -> dict:
    """The JSON body of the Bright Data request (spec 6.2): a Bing URL with q/mkt/setLang/brd_json/cc."""
    mkt, set_lang = ("zh-CN", "zh") if detect_language(query) == "zh" else ("en-US", "en")
    url = ("https://www.bing.com/search?" + urllib.parse.urlencode({"q": query, "mkt": mkt, "setLang": set_lang})
           + "&brd_json=1&cc=" + cfg.location)
    return {"zone": cfg.zone, "url": url, "format": "raw"}


def format_results(data: dict, max_results: int = 10, result_length: int = 1000) -> str:
    """``Page k: snippet`` lines from ``data["organic"][*]["description"]`` (stripped, non-empty, de-duplicated)."""
    snippets: list[str] = []
    organic = data.get("organic") if isinstance(data, dict) else None
    for item in organic if isinstance(organic, list) else []:
        text = item.get("description") if isinstance(item, dict) else None
        text = text.strip() if isinstance(text, str) else ""
        if text and text not in snippets:
            snippets.append(text)
    lines = [f"Page {k}: {s[:result_length]}" for k, s in enumerate(snippets[:max_results], start=1)]
    return "\n".join(lines) if lines else NO_RESULTS


def retry_after_s(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date)."""
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


class _Retryable(Exception):
    def __init__(self, reason: str, wait_s: float | None = None):
        super().__init__(reason)
        self.wait_s = wait_s


class _Fatal(Exception):
    pass


class BrightDataSearchTool(Tool):
    """``<search>`` tool over Bright Data's Bing SERP API, with the shared cache in front of it."""

    tag = "search"

    def __init__(self, config: SearchConfig | None = None, *, cache: SearchCache | None = None, sleep=time.sleep,
                 **params):
        self.config = config or SearchConfig(**params)
        self.cache = cache
        if cache is None and self.config.cache_file:
            self.cache = SearchCache(self.config.cache_file, refresh_s=self.config.cache_refresh_s)
        self._sleep = sleep
        self._local = threading.local()  # requests.Session is not documented as thread-safe: one per thread
        self._rng = random.Random()

    def __repr__(self) -> str:
        return f"BrightDataSearchTool({self.config!r})"

    def execute(self, content: str) -> str:
        query = clean_query(content)
        hit = self._cache_call("get", query)
        if hit is not None:
            return hit
        result, ok = self.search(query)
        if ok:
            self._cache_call("put", query, result)
        return result

    def _cache_call(self, method: str, *args):
        # A cache problem (full disk, unreadable file) must cost a cache hit, never the tool call.
        if self.cache is None:
            return None
        try:
            return getattr(self.cache, method)(*args)
        except Exception as e:
            log.error("search cache %s failed: %s", method, e)
            return None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def search(self, query: str) -> tuple[str, bool]:
        """Queries the API with retries. Returns (text for the model, success)."""
        cfg = self.config
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            return self._failure(f"no API key (the environment variable {cfg.api_key_env} is not set)"), False
        reason = "no attempt made"
        for attempt in range(cfg.max_attempts):
            try:
                return format_results(self._request(query, key), cfg.max_results, cfg.result_length), True
            except _Fatal as e:
                return self._failure(str(e)), False
            except _Retryable as e:
                reason = str(e)
                if attempt + 1 == cfg.max_attempts:
                    break
                wait = self._backoff_s(attempt, e.wait_s)
                log.warning("search attempt %d/%d failed (%s); retrying in %.2f s",
                            attempt + 1, cfg.max_attempts, reason, wait)
                self._sleep(wait)
        return self._failure(f"{reason} (after {cfg.max_attempts} attempts)"), False

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        cfg = self.config
        if retry_after is not None:  # the server said when; add a little jitter so clients do not stampede
            return min(cfg.backoff_max_s, retry_after) + self._rng.uniform(0, 0.1 * cfg.backoff_base_s)
        return self._rng.uniform(0, min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** attempt))  # full jitter

    def _request(self, query: str, key: str) -> dict:
        cfg = self.config
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.trust_env = False  # no proxies or .netrc credentials picked up from the environment
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        try:
            resp = session.post(cfg.base_url, json=build_request(query, cfg), headers=headers,
                                timeout=cfg.request_timeout_s)
        except requests.Timeout:
            raise _Retryable("the search API timed out") from None
        except requests.RequestException as e:  # connection refused/reset, DNS, ...: the type says enough
            raise _Retryable(f"connection error ({type(e).__name__})") from None
        if resp.status_code == 429:
            raise _Retryable("rate limited (HTTP 429)", retry_after_s(resp.headers.get("Retry-After")))
        if resp.status_code >= 500:
            raise _Retryable(f"HTTP {resp.status_code} from the search API")
        if resp.status_code != 200:
            raise _Fatal(f"HTTP {resp.status_code} from the search API")
        try:
            return resp.json()
        except (ValueError, requests.RequestException):
            raise _Retryable("malformed JSON from the search API") from None

    def _failure(self, reason: str) -> str:
        log.warning("search failed: %s", reason)
        return "" if self.config.reference_compat else f"Search failed: {reason}."
