"""The search tool: Bright Data's SERP API for Bing (spec 6.2), behind a persistent shared cache.

Request, parsing and formatting follow the reference exactly. Added: retries of the shared HTTP client
(`json_http`: jittered exponential backoff, 429 honouring Retry-After, 5xx, timeouts, connection errors, malformed
JSON), a clear failure text for the model instead of an empty string, and an API key that is read from the
environment at call time and never stored in the config, a repr, a log line or a result.

One owner of retries: the HTTP client retries a query `max_attempts` times and the search returns the failure text,
which the executor does not retry. With `reference_compat` a failure returns "" as in the reference, and the
executor's retries of empty results are the only ones (one HTTP attempt each, as the reference).
"""

import dataclasses
import logging
import os
import re
import time
import urllib.parse

from arpo_jax.json_http import JsonHttpClient, ServerError, retry_after_s
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
    max_attempts: int = 4  # HTTP attempts per query before the failure text (1 with reference_compat)
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


__all__ = ["BrightDataSearchTool", "SearchConfig", "build_request", "clean_query", "detect_language",
           "format_results", "retry_after_s"]  # retry_after_s: json_http's, re-exported


class BrightDataSearchTool(Tool):
    """``<search>`` tool over Bright Data's Bing SERP API, with the shared cache in front of it."""

    tag = "search"

    def __init__(self, config: SearchConfig | None = None, *, cache: SearchCache | None = None, sleep=time.sleep,
                 **params):
        self.config = config or SearchConfig(**params)
        self.cache = cache
        if cache is None and self.config.cache_file:
            self.cache = SearchCache(self.config.cache_file, refresh_s=self.config.cache_refresh_s)
        cfg = self.config
        self.client = JsonHttpClient(cfg.base_url, timeout_s=cfg.request_timeout_s, backoff_s=cfg.backoff_base_s,
                                     backoff_max_s=cfg.backoff_max_s, trust_env=False, sleep=sleep,
                                     retries=0 if cfg.reference_compat else max(0, cfg.max_attempts - 1))

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
        self.client.close()
        if self.cache is not None:
            self.cache.close()

    def search(self, query: str) -> tuple[str, bool]:
        """Queries the API (the client retries transient failures). Returns (text for the model, success)."""
        cfg = self.config
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            return self._failure(f"no API key (the environment variable {cfg.api_key_env} is not set)"), False
        try:
            data = self.client.post("", build_request(query, cfg), api_key=key)
        except ServerError as e:
            return self._failure(f"{_reason(e)} (after {e.attempts} attempts)"), False
        return format_results(data, cfg.max_results, cfg.result_length), True

    def _failure(self, reason: str) -> str:
        log.warning("search failed: %s", reason)
        return "" if self.config.reference_compat else f"Search failed: {reason}."


def _reason(e: ServerError) -> str:
    """The model's short reason for a failed query (the server's own message may quote the request: left out)."""
    if e.kind == "timeout":
        return "the search API timed out"
    if e.kind == "connection":
        return "connection error"
    if e.kind == "json":
        return "malformed JSON from the search API"
    return "rate limited (HTTP 429)" if e.status == 429 else f"HTTP {e.status} from the search API"
