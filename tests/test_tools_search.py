"""Bright Data search tool against a loopback server that speaks the protocol, with injected faults."""

import dataclasses
import email.utils
import json
import logging
import os
import pathlib
import time

import pytest

from arpo_jax.json_http import retry_after_s
from arpo_jax.tools import make_executor, make_tool
from arpo_jax.tools.fake_brightdata import FakeBrightData, free_port, organic_from_text
from arpo_jax.tools.search import (
    NO_RESULTS,
    BrightDataSearchTool,
    SearchConfig,
    build_request,
    clean_query,
    detect_language,
    format_results,
)
from arpo_jax.tools.search_cache import SearchCache

REFERENCE_CACHE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "search" / "search_cache.json"
SECRET = "sk-test-0f1e2d3c4b5a69788796a5b4c3d2e1f0"
KEY_ENV = "ARPO_TEST_BRIGHTDATA_KEY"


def real_results(n: int = 25) -> dict[str, str]:
    """Real cached results (the good responses are built from them); synthetic ones if the data is absent."""
    if REFERENCE_CACHE.exists():
        data = json.loads(REFERENCE_CACHE.read_text(encoding="utf-8"))
        return {q: r for q, r in list(data.items()) if r.startswith("Page 1: ")}  # all of them
    return {f"query {i}": "\n".join(f"Page {k}: snippet {i}.{k}" for k in range(1, 6)) for i in range(n)}


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


@pytest.fixture
def server(key):
    with FakeBrightData(real_results(), api_key=key) as srv:
        yield srv


class SleepRecorder:
    """Stands in for time.sleep: records the backoff the tool asked for, waits a token amount."""

    def __init__(self):
        self.waits = []

    def __call__(self, seconds):
        self.waits.append(seconds)


def make(server_url, **overrides):
    params = dict(api_key_env=KEY_ENV, base_url=server_url, request_timeout_s=2.0, max_attempts=3,
                  backoff_base_s=0.01, backoff_max_s=0.5)
    params.update(overrides)
    sleep = SleepRecorder()
    return BrightDataSearchTool(SearchConfig(**params), sleep=sleep), sleep


def test_format_results_reference_rules():
    data = {"organic": [{"description": "  first  "}, {"description": ""}, {"title": "no description"},
                        {"description": "first"}, {"description": "x" * 50}, {"description": "third"}]}
    assert format_results(data, max_results=10, result_length=1000) == "Page 1: first\nPage 2: " + "x" * 50 + \
        "\nPage 3: third"
    assert format_results(data, max_results=2, result_length=10) == "Page 1: first\nPage 2: " + "x" * 10
    assert format_results({}, 10, 1000) == NO_RESULTS
    assert format_results({"organic": None}, 10, 1000) == NO_RESULTS


def test_query_cleaning_and_language():
    assert clean_query('"Amy Smart" film') == "Amy Smart film"
    assert detect_language("Amy Smart film debut") == "en"
    assert detect_language("北京大学 成立时间") == "zh"
    assert detect_language("北京 population 2020") == "zh"
    assert detect_language("1990 2000") == "en"


def test_request_body_exactly_as_reference():
    cfg = SearchConfig(zone="serp_api1", location="cn")
    body = build_request("Amy Smart film", cfg)
    assert body == {"zone": "serp_api1", "format": "raw",
                    "url": "https://www.bing.com/search?q=Amy+Smart+film&mkt=en-US&setLang=en&brd_json=1&cc=cn"}
    zh = build_request("北京大学", SearchConfig(location="us"))
    assert "mkt=zh-CN&setLang=zh&brd_json=1&cc=us" in zh["url"]


def test_retry_after_parsing():
    assert retry_after_s("2") == 2.0
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert 0 <= retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") <= 0.001  # a date in the past: go now


def test_good_responses_parse_to_the_real_cached_texts(server):
    tool, _ = make(server.url)
    queries = list(server.results)[:40]
    for q in queries:
        assert tool.execute(q) == server.results[q]
    req = server.requests[0]
    assert req["path"] == "/request"
    assert req["headers"]["Authorization"] == f"Bearer {SECRET}"
    assert req["headers"]["Content-Type"] == "application/json"
    assert req["body"]["zone"] == "serp_api1" and req["body"]["format"] == "raw"
    assert req["params"]["q"] == [queries[0]] and req["params"]["brd_json"] == ["1"]
    assert req["params"]["cc"] == ["cn"] and req["params"]["mkt"] == ["en-US"]


def test_no_organic_results(server):
    tool, _ = make(server.url)
    assert tool.execute("a query the server does not know") == NO_RESULTS


def test_retries_5xx_then_succeeds(server):
    tool, sleep = make(server.url)
    q = next(iter(server.results))
    server.push_faults(("status", 500, {}), ("status", 503, {}))
    assert tool.execute(q) == server.results[q]
    assert len(server.requests) == 3
    assert len(sleep.waits) == 2 and all(0 <= w <= 0.5 for w in sleep.waits)


def test_429_honours_retry_after(server):
    tool, sleep = make(server.url)
    q = next(iter(server.results))
    server.push_faults(("status", 429, {"Retry-After": "0.3"}))
    assert tool.execute(q) == server.results[q]
    assert len(sleep.waits) == 1 and sleep.waits[0] >= 0.3


def test_retry_after_is_capped(server):
    tool, sleep = make(server.url, backoff_max_s=0.2)
    server.push_faults(("status", 429, {"Retry-After": "3600"}))
    tool.execute(next(iter(server.results)))
    assert sleep.waits[0] < 0.25


def test_slow_response_times_out_and_is_retried(server):
    tool, _ = make(server.url, request_timeout_s=0.2)
    q = next(iter(server.results))
    server.push_faults(("slow", 1.0))
    assert tool.execute(q) == server.results[q]
    assert len(server.requests) == 2


@pytest.mark.parametrize("fault", [("truncated",), ("reset",)])
def test_truncated_json_and_connection_reset_are_retried(server, fault):
    tool, _ = make(server.url)
    q = next(iter(server.results))
    server.push_faults(fault, fault)
    assert tool.execute(q) == server.results[q]
    assert len(server.requests) == 3


def test_final_failure_text_after_all_attempts(server):
    tool, sleep = make(server.url, max_attempts=4)
    server.push_faults(*[("status", 502, {})] * 4)
    out = tool.execute("anything")
    assert out.startswith("Search failed:") and "HTTP 502" in out and "4 attempts" in out
    assert len(server.requests) == 4 and len(sleep.waits) == 3
    server.push_faults(*[("truncated",)] * 4)
    assert "malformed JSON" in tool.execute("anything")


def test_connection_refused(key):
    tool, _ = make(f"http://127.0.0.1:{free_port()}/request")
    out = tool.execute("anything")
    assert out.startswith("Search failed:") and "connection error" in out


def test_client_errors_are_not_retried(key):
    with FakeBrightData({}, api_key="a-different-key") as srv:
        tool, sleep = make(srv.url)
        out = tool.execute("anything")
    assert "HTTP 401" in out and len(srv.requests) == 1 and sleep.waits == []


def test_missing_key_is_a_clear_text(monkeypatch, server):
    monkeypatch.delenv(KEY_ENV)
    tool, _ = make(server.url)
    out = tool.execute("anything")
    assert KEY_ENV in out and out.startswith("Search failed:") and server.requests == []


def test_reference_compat_returns_empty_on_failure(server):
    tool, _ = make(server.url, reference_compat=True)
    server.push_faults(*[("status", 500, {})] * 3)
    assert tool.execute("anything") == ""


def test_one_owner_of_retries(server):
    """The HTTP client retries a query; the executor does not retry it again (a failure text is not empty). With
    reference_compat the executor's retries of the empty result are the only ones: one request each."""
    ex = make_executor({"search": dict(backend="brightdata", api_key_env=KEY_ENV, base_url=server.url,
                                       max_attempts=3, backoff_base_s=0.001)}, retry_count=3)
    server.push_faults(*[("status", 500, {})] * 20)
    assert ex.execute("search", "anything").startswith("Search failed:") and len(server.requests) == 3
    ex.close()
    compat = make_executor({"search": dict(backend="brightdata", api_key_env=KEY_ENV, base_url=server.url,
                                           max_attempts=3, backoff_base_s=0.001, reference_compat=True)},
                           retry_count=3, reference_compat=True)
    assert compat.execute("search", "anything") == "Tool(search) returned empty output."
    assert len(server.requests) == 3 + 3  # was 3 x 3: the client's retries nested inside the executor's
    compat.close()


def test_retry_after_on_503_and_as_an_http_date(server):
    """Retry-After is honoured on any retried status (here 503), in seconds or as an HTTP date."""
    tool, sleep = make(server.url, backoff_max_s=5.0)
    later = email.utils.formatdate(time.time() + 3, usegmt=True)
    server.push_faults(("status", 503, {"Retry-After": "0.3"}), ("status", 503, {"Retry-After": later}))
    assert tool.execute(next(iter(server.results))) == next(iter(server.results.values()))
    assert 0.3 <= sleep.waits[0] < 0.31 and 1.0 < sleep.waits[1] <= 3.01  # the date has whole seconds


def test_api_key_never_leaks(server, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    cfg = SearchConfig(api_key_env=KEY_ENV, base_url=server.url, max_attempts=2, backoff_base_s=0.01,
                       request_timeout_s=0.2, cache_file=str(tmp_path / "cache.json"))
    tool = BrightDataSearchTool(cfg, sleep=lambda s: None)
    q = next(iter(server.results))
    outputs = [tool.execute(q)]
    server.push_faults(("status", 500, {}), ("status", 429, {"Retry-After": "0"}), ("slow", 0.5), ("truncated",),
                       ("reset",), ("status", 403, {}))
    outputs += [tool.execute(f"failing {i}") for i in range(3)]
    outputs.append(make(f"http://127.0.0.1:{free_port()}/request")[0].execute("refused"))
    tool.close()
    texts = outputs + [caplog.text, repr(tool), repr(cfg), str(cfg), json.dumps(dataclasses.asdict(cfg))]
    texts += [p.read_text() for p in tmp_path.rglob("*") if p.is_file()]
    assert outputs[0] == server.results[q] and any("Search failed" in o for o in outputs[1:])
    for text in texts:
        assert SECRET not in text
    assert all(r["headers"]["Authorization"] == f"Bearer {SECRET}" for r in server.requests)


def test_cache_in_front_of_the_api(server, tmp_path):
    cache_file = tmp_path / "search_cache.json"
    tool, _ = make(server.url, cache_file=str(cache_file))
    q = next(iter(server.results))
    assert tool.execute(f'"{q}"') == server.results[q]  # quotes are cleaned: same key
    assert tool.execute(q) == server.results[q]
    assert len(server.requests) == 1
    server.push_faults(*[("status", 500, {})] * 3)
    assert tool.execute("failing query").startswith("Search failed")
    tool.close()
    reopened = SearchCache(str(cache_file), read_only=True)
    assert reopened.get(q) == server.results[q]
    assert reopened.get("failing query") is None  # failures are not cached


def test_registry_builds_the_search_backends(server, tmp_path):
    tool = make_tool("search", api_key_env=KEY_ENV, base_url=server.url)
    assert tool.tag == "search" and isinstance(tool, BrightDataSearchTool)
    q = next(iter(server.results))
    assert tool.execute(q) == server.results[q]
    with pytest.raises(ValueError, match="backend"):
        make_tool("search", backend="nope")
    assert organic_from_text(NO_RESULTS) == []
    assert os.environ[KEY_ENV] == SECRET
