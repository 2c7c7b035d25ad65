"""The JAX KV-cache sampler: parity with transformers, cache reuse across calls, stop strings, sampling, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import arpo_jax
from arpo_jax import compile_log, sharding, testing
from arpo_jax.rollout import jax_sampler, jax_stream
from arpo_jax.rollout.jax_decode import sample_categorical
from arpo_jax.rollout.jax_sampler import JaxSampler, pow2_buckets
from arpo_jax.rollout.jax_stream import HostRow as _Row
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings

GREEDY = SamplingSettings(temperature=0.0, stop=(), logprobs=10, logprob_positions=20)
EOS = 2  # the tiny models' and the tiny tokenizer's EOS (<|im_end|>)


@pytest.fixture(scope="module")
def tokenizer():
    return testing.make_tiny_tokenizer()


def _prompts(lengths, seed=0, vocab=400):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, vocab, n).tolist() for n in lengths]


def _sampler(path, tokenizer, **kw):
    kw.setdefault("restrict_to_tokenizer", False)  # the model's vocab (512) is larger than the tokenizer's (406)
    return JaxSampler(arpo_jax.from_pretrained(path, mesh=kw.get("mesh")), tokenizer, max_len=kw.pop("max_len", 96),
                      **kw)


def _torch_logprobs(ref, ids):
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits.float(), -1)[0].numpy()


def _assert_same_results(a, b, atol=1e-4):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.stop_string, x.text) == (y.finish_reason, y.stop_string, y.text)
        assert len(x.top_logprobs) == len(y.top_logprobs)
        for dx, dy in zip(x.top_logprobs, y.top_logprobs):
            assert dx.keys() == dy.keys()
            np.testing.assert_allclose([dx[k] for k in dx], [dy[k] for k in dx], atol=atol)


@pytest.mark.parametrize("variant", ["qwen2", "llama31"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_hf_dir, tokenizer, variant):
    path, ref = tiny_hf_dir(variant)
    sampler = _sampler(path, tokenizer, decode_chunk=8, prefill_chunk=16)  # the 30-token prompt takes 2 chunks
    prompts = _prompts([5, 13, 30], seed=1)  # ragged rows in one batch
    results = sampler.generate([SampleRequest(p, 24) for p in prompts], GREEDY)
    for prompt, res in zip(prompts, results):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=EOS,
                               pad_token_id=0)
        assert res.token_ids == out[0, len(prompt):].tolist()
        assert res.finish_reason == ("eos" if res.token_ids[-1] == EOS else "length")
        # Top-10 log-probs of the first 20 positions == transformers' log_softmax there.
        logp = _torch_logprobs(ref, prompt + res.token_ids)[len(prompt) - 1:]
        assert len(res.top_logprobs) == min(20, len(res.token_ids))
        for t, d in enumerate(res.top_logprobs):
            top10 = np.argsort(-logp[t])[:10]
            assert set(d) == set(top10.tolist()) | {res.token_ids[t]}
            np.testing.assert_allclose([d[k] for k in d], logp[t][list(d)], atol=1e-4)


def test_continuing_a_slot_after_a_tool_result_equals_a_fresh_prefill(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    cached, fresh = _sampler(path, tokenizer), _sampler(path, tokenizer)
    p0, p1 = _prompts([9, 17], seed=2)
    first = cached.generate([SampleRequest(p0, 10, slot_id=0), SampleRequest(p1, 10, slot_id=1)], GREEDY)
    tool = tokenizer.encode(" <result>\n42\n</result>")
    ctx0 = p0 + first[0].token_ids + tool
    ctx1 = p1 + first[1].token_ids + tool
    new = _prompts([6], seed=3)[0]  # a new trajectory in the same call
    reqs = [SampleRequest(ctx0, 12, slot_id=0), SampleRequest(new, 12, slot_id=7), SampleRequest(ctx1, 12, slot_id=1)]
    got = cached.generate(reqs, GREEDY)
    # Only the last generated token (never written to the cache) and the tool result were prefilled.
    held = len(p0) + len(first[0].token_ids) - 1 + len(p1) + len(first[1].token_ids) - 1
    assert cached.last_stats["reused_tokens"] == held
    assert cached.last_stats["prefill_tokens"] == 2 * (len(tool) + 1) + len(new)
    want = fresh.generate([SampleRequest(r.token_ids, 12) for r in reqs], GREEDY)
    assert fresh.last_stats["reused_tokens"] == 0
    _assert_same_results(got, want)


def test_a_failed_call_forgets_the_cached_slots(tiny_hf_dir, tokenizer, monkeypatch):
    """Regression: a call that raised after taking the cache (here an injected device error in the prefill) kept its
    slots, so the next call prefilled only their suffixes onto a fresh, empty cache (silently wrong tokens)."""
    path, _ = tiny_hf_dir("qwen2")
    sampler, fresh = _sampler(path, tokenizer), _sampler(path, tokenizer)
    (p0,) = _prompts([9], seed=4)
    first = sampler.generate([SampleRequest(p0, 6, slot_id=0)], GREEDY)
    ctx = p0 + first[0].token_ids + tokenizer.encode(" <result>\n7\n</result>")
    def failing_prefill(call, fills):
        raise RuntimeError("RESOURCE_EXHAUSTED: injected")

    monkeypatch.setattr(jax_stream.JaxStream, "_prefill", failing_prefill)
    with pytest.raises(RuntimeError, match="injected"):
        sampler.generate([SampleRequest(ctx, 4, slot_id=0)], GREEDY)
    monkeypatch.undo()
    got = sampler.generate([SampleRequest(ctx, 8, slot_id=0)], GREEDY)
    assert sampler.last_stats["reused_tokens"] == 0
    _assert_same_results(got, fresh.generate([SampleRequest(ctx, 8)], GREEDY))


def test_a_branch_copies_its_parents_cache_row(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    cached, fresh = _sampler(path, tokenizer), _sampler(path, tokenizer)
    prompt = _prompts([12], seed=4)[0]
    first = cached.generate([SampleRequest(prompt, 8, slot_id=3)], GREEDY)[0]
    ctx = prompt + first.token_ids + tokenizer.encode(" <result>\nok\n</result>")
    settings = SamplingSettings(temperature=1.0, seed=5, stop=())
    # The parent continues and two branches start from copies of its row (same context, different PRNG streams).
    reqs = [SampleRequest(ctx, 10, slot_id=3), SampleRequest(ctx, 10, slot_id=4, parent_id=3),
            SampleRequest(ctx, 10, slot_id=5, parent_id=3)]
    got = cached.generate(reqs, settings)
    assert cached.last_stats["reused_tokens"] == 3 * (len(prompt) + len(first.token_ids) - 1)
    _assert_same_results(got, fresh.generate([SampleRequest(ctx, 10)] * 3, settings))
    assert len({tuple(r.token_ids) for r in got}) > 1  # the branches sample independently


def test_a_branch_forked_mid_decode_samples_as_a_fresh_prefill(tiny_hf_dir, tokenizer):
    """The stream (ARPO's default branch): a trajectory continues after its tool result; when its entropy window is
    full (it decodes on) a branch starts from the same state, copying the parent's row while the parent still writes
    it. The branch's tokens and log-probs are those of a fresh engine prefilling the same context."""
    path, _ = tiny_hf_dir("qwen2")
    cached, fresh = _sampler(path, tokenizer, decode_chunk=4), _sampler(path, tokenizer, decode_chunk=4)
    settings = SamplingSettings(temperature=1.0, seed=9, stop=(), logprobs=5, logprob_positions=6,
                                token_logprobs=True)
    prompt = _prompts([11], seed=8)[0]
    stream = cached.stream(settings)
    stream.submit(SampleRequest(prompt, 5, slot_id=0, key=21), handle=0)
    first = []
    while stream.busy():
        first += [e.result for e in stream.step() if e.done]
    ctx = prompt + first[0].token_ids + tokenizer.encode(" <result>\nok\n</result>")
    stream.submit(SampleRequest(ctx, 40, slot_id=0, key=21), handle=1)  # the parent goes on after its result
    events = []
    while not any(not e.done and e.handle == 1 for e in events):
        events += stream.step()
    stream.submit(SampleRequest(ctx, 12, slot_id=1, parent_id=0, key=22), handle=2)  # the branch, mid-decode
    results = {}
    while stream.busy():
        results |= {e.handle: e.result for e in stream.step() if e.done}
    assert len(results[1].token_ids) == 40  # the parent decoded on past the fork
    assert stream.stats["copies"] == 1 and stream.stats["reused_tokens"] >= len(ctx) - 1
    want = fresh.generate([SampleRequest(ctx, 12, key=22)], settings)
    _assert_same_results([results[2]], want)
    np.testing.assert_allclose(results[2].token_logprobs, want[0].token_logprobs, atol=1e-5)
    assert results[2].token_ids != results[1].token_ids[:12]  # its own draws: another key


def test_a_decode_call_returns_at_the_step_a_row_finishes(tiny_hf_dir, tokenizer):
    """Calls of up to 16 steps: the one in which a 3-token request ends stops after its 3rd step, so the host sees
    the finish at once (its row free for the next request) and the rollout's decode steps are the longest request's
    tokens, not whole calls. The tokens are those of 4-step calls."""
    path, _ = tiny_hf_dir("qwen2")
    long, short = _sampler(path, tokenizer, decode_chunk=16), _sampler(path, tokenizer, decode_chunk=4)
    a, b = _prompts([7, 9], seed=3)
    reqs = [SampleRequest(a, 3), SampleRequest(b, 30)]
    stream = long.stream(GREEDY)
    for handle, req in enumerate(reqs):
        stream.submit(req, handle)
    results, steps_at = {}, {}
    while stream.busy():
        for e in stream.step():
            if e.done:
                results[e.handle] = e.result
                steps_at[e.handle] = stream.stats["decode_steps"]
    assert [results[h].finish_reason for h in (0, 1)] == ["length", "length"]
    assert steps_at[0] == 3  # the first call stopped where the short request ended
    assert stream.stats["decode_steps"] == 30 == steps_at[1]  # 3 + 16 + 11: no step past the last token
    assert stream.stats["decode_calls"] == 4  # the 4th, dispatched before the 3rd was read, runs no step
    _assert_same_results([results[0], results[1]], short.generate(reqs, GREEDY))


def test_a_request_without_a_row_does_not_hold_up_one_that_continues_in_its_own(tiny_hf_dir, tokenizer):
    """Two rows, both held by trajectories between segments. A speculative branch (it takes only a row nobody
    holds) waits; a speculative trajectory's next segment behind it in the queue still goes on in its own row."""
    path, _ = tiny_hf_dir("qwen2")
    stream = _sampler(path, tokenizer, slots=2, decode_chunk=4).stream(GREEDY)
    a, b = _prompts([7, 9], seed=5)
    stream.submit(SampleRequest(a, 3, slot_id=0), handle=0, priority=3)  # a speculative trajectory
    stream.submit(SampleRequest(b, 3, slot_id=1), handle=1)  # a committed one
    first = {}
    while stream.busy():
        first |= {e.handle: e.result for e in stream.step() if e.done}
    stream.submit(SampleRequest(b + first[1].token_ids + [5, 6], 4, slot_id=2, parent_id=1), handle=2, priority=2)
    stream.submit(SampleRequest(a + first[0].token_ids + [7, 8], 4, slot_id=0), handle=3, priority=3)
    stream.step()
    assert stream.reqs[2].row is None and stream.reqs[3].row == stream.e.table.lookup(0, set())
    stream.close()


def test_a_cached_prefix_that_does_not_match_falls_back_to_prefill(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    cached, fresh = _sampler(path, tokenizer), _sampler(path, tokenizer)
    prompt = _prompts([15], seed=6)[0]
    cached.generate([SampleRequest(prompt, 6, slot_id=0)], GREEDY)
    edited = prompt[:7] + [prompt[7] + 1] + prompt[8:]  # differs from the cached row at token 7
    got = cached.generate([SampleRequest(edited, 8, slot_id=0)], GREEDY)
    assert cached.last_stats["reused_tokens"] == 7
    _assert_same_results(got, fresh.generate([SampleRequest(edited, 8)], GREEDY))
    # A slot absent from a call is freed: its id no longer gives a cached row.
    cached.generate([SampleRequest(prompt, 2, slot_id=1)], GREEDY)
    cached.generate([SampleRequest(edited, 2, slot_id=0)], GREEDY)
    assert cached.last_stats["reused_tokens"] == 0


def _feed(tokenizer, ids, stop, context=(3,)):
    row = _Row(tokenizer, np.asarray(context), limit=1000, stop=stop)
    for t in ids:
        row.add(int(t), frozenset({EOS}), None)
        if row.finish:
            break
    return row


def _char_ends(tokenizer, ids):
    return [len(tokenizer.decode(ids[:n + 1])) for n in range(len(ids))]


def test_stop_strings_multi_token_and_straddling(tokenizer):
    text = "print(1+2) </python> and the rest"
    ids = tokenizer.encode(text)
    ends = _char_ends(tokenizer, ids)
    # A multi-token stop string: generation stops at the token that completes it; its ids are kept.
    row = _feed(tokenizer, ids, ("</search>", "</python>"))
    n = next(i for i, e in enumerate(ends) if e >= text.index("</python>") + len("</python>")) + 1
    assert (row.finish, row.stop_string, row.text, row.gen) == ("stop", "</python>", "print(1+2) ", ids[:n])
    assert len(tokenizer.encode("</python>")) > 1
    # A stop string that ends inside a token: that token is the last one; the text is cut before the stop string.
    end = next(e for e in ends if e > text.index("and") + 2) - 1  # strictly inside a multi-char token
    a = text.index("python>")
    stop = text[a:end]
    row = _feed(tokenizer, ids, (stop,))
    assert ends[len(row.gen) - 1] > end and (len(row.gen) < 2 or ends[len(row.gen) - 2] < end)
    assert (row.finish, row.stop_string, row.text) == ("stop", stop, text[:a])
    # No match: generation goes on; EOS ends it with reason "eos" (and is not in the text).
    row = _feed(tokenizer, ids + [EOS, 7], ("</answer>",))
    assert (row.finish, row.text, row.gen[-1]) == ("eos", text, EOS)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_stop_strings_end_to_end(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    sampler = _sampler(path, tokenizer, restrict_to_tokenizer=True)
    prompt = tokenizer.encode("the answer is")
    base = sampler.generate([SampleRequest(prompt, 40)], GREEDY)[0]
    ends = _char_ends(tokenizer, base.token_ids)
    # A stop string from the generated text that spans >= 2 tokens and ends inside a token.
    for n in range(2, len(ends)):
        a, end = ends[n - 2], ends[n] - 1
        stop = base.text[a:end]
        clean = base.text[:ends[n]] == tokenizer.decode(base.token_ids[:n + 1]) and "\ufffd" not in stop
        if ends[n] - ends[n - 1] >= 2 and clean and stop.isprintable() and base.text.find(stop) == a:
            break
    else:
        pytest.skip("no clean multi-token span in the generated text")
    res = sampler.generate([SampleRequest(prompt, 40), SampleRequest(prompt, 40)],
                           SamplingSettings(temperature=0.0, stop=("zzzz", stop)))
    for r in res:
        assert (r.finish_reason, r.stop_string, r.text) == ("stop", stop, base.text[:a])
        assert r.token_ids == base.token_ids[:n + 1]


def test_finish_reasons_length_eos_and_max_len(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    prompt = _prompts([8], seed=7)[0]
    base = _sampler(path, tokenizer).generate([SampleRequest(prompt, 12)], GREEDY)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    eos_tok = base.token_ids[4]
    first = base.token_ids.index(eos_tok)
    sampler = _sampler(path, tokenizer, eos_ids=[eos_tok], max_len=24)
    res = sampler.generate([SampleRequest(prompt, 12), SampleRequest(prompt, 3), SampleRequest(prompt * 2, 30)],
                           GREEDY)
    assert (res[0].finish_reason, res[0].token_ids) == ("eos", base.token_ids[:first + 1])
    want = ("eos", base.token_ids[:first + 1]) if first < 3 else ("length", base.token_ids[:3])
    assert (res[1].finish_reason, res[1].token_ids) == want
    # max_len: 16 context tokens leave room for 8 new ones.
    r = res[2]
    assert len(r.token_ids) == 8 and r.finish_reason == "length" or r.finish_reason == "eos" and len(r.token_ids) <= 8
    with pytest.raises(ValueError, match="max_len"):
        sampler.generate([SampleRequest(prompt * 3, 4)], GREEDY)


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    sampler = _sampler(path, tokenizer)
    reqs = [SampleRequest(p, 16) for p in _prompts([5, 9, 9, 20], seed=8)]
    s1 = SamplingSettings(temperature=1.0, seed=1, stop=())
    a, b = sampler.generate(reqs, s1), sampler.generate(reqs, s1)
    c = sampler.generate(reqs, SamplingSettings(temperature=1.0, seed=2, stop=()))
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert a[1].token_ids != a[2].token_ids  # the same prompt in two rows: independent streams


def test_sample_categorical_draws_the_softmax_distribution():
    """The inverse-CDF sampler: frequencies within 5 sigma of softmax(z) for every token, -inf never drawn, across
    a vocabulary of three blocks (the last one partial) with heavy tokens in each."""
    v, n = 700, 20000
    rng = np.random.RandomState(0)
    z = rng.randn(v) * 2
    z[rng.rand(v) < 0.3] = -np.inf
    z[[5, 300, 650]] = [4.0, 4.5, 3.5]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(n))
    draws = np.asarray(jax.jit(sample_categorical)(keys, jnp.broadcast_to(jnp.asarray(z, jnp.float32), (n, v))))
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    assert np.isfinite(z[draws]).all()
    freq = np.bincount(draws, minlength=v) / n
    assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs * (1 - probs) / n) + 1e-9)
    assert len(set(draws.tolist())) > 100  # not only the heavy tokens


def _first_token_draws(sampler, prompt, settings, n=256):
    res = sampler.generate([SampleRequest(prompt, 1)] * n, settings)
    return np.array([r.token_ids[0] for r in res]), res


def test_top_k_and_top_p_restrict_the_support(tiny_hf_dir, tokenizer):
    path, ref = tiny_hf_dir("qwen2")
    sampler = _sampler(path, tokenizer, restrict_to_tokenizer=True)  # 256 requests through 32 rows
    prompt = _prompts([10], seed=9)[0]
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1].double().numpy()
    logits[len(tokenizer):] = -np.inf  # restricted to tokenizer ids
    temp = 0.5
    probs = np.exp((logits - logits.max()) / temp)
    probs /= probs.sum()
    order = np.argsort(-probs)

    # top-k = 3: only the 3 most likely tokens, with their renormalised probabilities (binomial 5-sigma bounds).
    draws, res = _first_token_draws(sampler, prompt, SamplingSettings(temperature=temp, top_k=3, seed=0))
    top3 = order[:3]
    assert set(draws) <= set(top3)
    p3 = probs[top3] / probs[top3].sum()
    freq = np.array([(draws == t).mean() for t in top3])
    assert np.all(np.abs(freq - p3) <= 5 * np.sqrt(p3 * (1 - p3) / len(draws)) + 1e-9)
    # The processed distribution's log-probs: 3 finite entries that sum to 1.
    d = res[0].top_logprobs[0]
    assert set(d) == set(top3.tolist()) and abs(sum(np.exp(list(d.values()))) - 1) < 1e-5

    # top-p = 0.3: the smallest prefix whose mass before each kept token is < 0.3.
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < 0.3].tolist())
    draws, _ = _first_token_draws(sampler, prompt, SamplingSettings(temperature=temp, top_p=0.3, seed=1))
    assert set(draws.tolist()) <= nucleus and len(set(draws.tolist())) > 1
    # Without truncation, tokens outside both sets are drawn (so the checks above can fail).
    draws, _ = _first_token_draws(sampler, prompt, SamplingSettings(temperature=temp, seed=2))
    assert not set(draws.tolist()) <= nucleus | set(top3.tolist())


@pytest.mark.slow  # > 10 s (compile-bound)
def test_sampling_is_restricted_to_tokenizer_ids(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    prompt = _prompts([6], seed=10)[0]
    settings = SamplingSettings(temperature=1.0, seed=3, stop=())
    for restrict in (True, False):
        sampler = _sampler(path, tokenizer, restrict_to_tokenizer=restrict)
        ids = np.concatenate([r.token_ids for r in sampler.generate([SampleRequest(prompt, 32)] * 8, settings)])
        assert (ids.max() < len(tokenizer)) == restrict


@pytest.mark.parametrize("mesh_shape", [None, (1, 1, 1), (1, 2, 1)], ids=["no_mesh", "mesh_1", "mesh_fsdp2"])
def test_no_call_compiles_after_the_warm_up(tiny_hf_dir, tokenizer, mesh_shape):
    """The engine's programs follow from its sizes alone: after `warm_up` no call compiles anything, whatever its
    batch (more requests than rows included), prompt lengths, continuations, branches and sampling settings.

    On meshes too, as the trainer builds the engine: the warm-up compiles on pool threads, which start without the
    engine's mesh context (compiled outside it, each program compiled again at its first call on the 1-device mesh);
    the state the programs return keeps one layout (on the fsdp mesh a prefill returned the hidden states split
    otherwise, and the decode compiled again). And after new weights laid out otherwise than the first (as the
    train step's outputs are): the engine puts them in the first weights' shardings, else every program compiled
    again after a weight sync."""
    path, _ = tiny_hf_dir("qwen2")
    mesh = None if mesh_shape is None else sharding.make_mesh(mesh_shape, jax.devices()[:int(np.prod(mesh_shape))])
    sampler = _sampler(path, tokenizer, mesh=mesh, max_len=64, slots=4, decode_chunk=4, prefill_chunk=64)
    smallest_decode = "decode_2" if mesh_shape == (1, 2, 1) else "decode_1"  # rows: a multiple of the batch shards
    assert sorted(sampler.programs()) == sorted(["copy", smallest_decode, "decode_4", "init", "prefill_1x64",
                                                 "prefill_2x32"])
    before = compile_log.counts()
    sampler.warm_up()
    assert compile_log.total(compile_log.since(before)) == len(sampler.programs())
    assert sampler.warm_up() == 0  # done once
    other = jax.devices()[1] if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sampler.update_weights(jax.device_put(nnx.state(arpo_jax.from_pretrained(path)), other))
    rng = np.random.RandomState(11)
    settings = [GREEDY, SamplingSettings(temperature=0.7, top_k=5, seed=1, stop=("zz",), token_logprobs=True),
                SamplingSettings(temperature=1.0, top_p=0.9, logprobs=0, stop=("a", "b c"))]
    before = compile_log.counts()
    for k, (batch, length, new) in enumerate([(1, 5, 4), (3, 9, 12), (6, 20, 4), (2, 40, 8), (9, 3, 30)]):
        reqs = [SampleRequest(rng.randint(3, 400, length).tolist(), new, slot_id=i) for i in range(batch)]
        out = sampler.generate(reqs, settings[k % 3])
        tool = rng.randint(3, 400, 3 + k).tolist()
        more = [SampleRequest(r.token_ids + o.token_ids + tool, 5, slot_id=r.slot_id) for r, o in zip(reqs, out)]
        more.append(SampleRequest(more[0].token_ids, 5, slot_id=100, parent_id=0))  # a branch
        sampler.generate(more, settings[(k + 1) % 3])
        assert sampler.last_stats["reused_tokens"] > 0
    assert compile_log.since(before) == {}


def test_update_weights_swaps_the_params(tiny_hf_dir, tokenizer):
    path_a, _ = tiny_hf_dir("qwen2")
    path_b, _ = tiny_hf_dir("qwen2", seed=1)
    sampler = _sampler(path_a, tokenizer)
    prompt = _prompts([7], seed=12)[0]
    old = sampler.generate([SampleRequest(prompt, 8, slot_id=0)], GREEDY)
    seconds = sampler.update_weights(arpo_jax.from_pretrained(path_b))
    assert seconds >= 0
    new = sampler.generate([SampleRequest(prompt, 8, slot_id=0)], GREEDY)
    assert sampler.last_stats["reused_tokens"] == 0  # the old weights' cache is not reused
    _assert_same_results(new, _sampler(path_b, tokenizer).generate([SampleRequest(prompt, 8)], GREEDY))
    assert new[0].token_ids != old[0].token_ids
    sampler.update_weights(str(path_a))  # an HF folder (the exported policy)
    _assert_same_results(sampler.generate([SampleRequest(prompt, 8)], GREEDY), old)
    sampler.update_weights(nnx.to_pure_dict(nnx.state(arpo_jax.from_pretrained(path_b))))  # a train-step param dict
    _assert_same_results(sampler.generate([SampleRequest(prompt, 8)], GREEDY), new)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_sharded_equals_unsharded(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    mesh = sharding.make_mesh((2, 2, 2))
    sharded, single = _sampler(path, tokenizer, mesh=mesh, slots=6), _sampler(path, tokenizer)
    prompts = _prompts([4, 11, 19], seed=13)
    reqs = [SampleRequest(p, 10, slot_id=i) for i, p in enumerate(prompts)]
    got = sharded.generate(reqs, GREEDY)
    assert sharded.shape.slots == 8  # rounded up to a multiple of data * fsdp
    k = sharded._ds.cache.k  # [L, B, K, S, H], or on CPU a tuple of L [B, K, S, H]
    rows_spec = k[0].sharding.spec[0] if isinstance(k, tuple) else k.sharding.spec[1]
    assert rows_spec == ("data", "fsdp")  # cache rows split over the batch axes
    _assert_same_results(got, single.generate(reqs, GREEDY))
    # Continuing through the sharded cache.
    tool = tokenizer.encode(" <result>\n1\n</result>")
    reqs = [SampleRequest(p + r.token_ids + tool, 6, slot_id=i) for i, (p, r) in enumerate(zip(prompts, got))]
    got = sharded.generate(reqs[:2], GREEDY)
    assert sharded.last_stats["reused_tokens"] > 0
    _assert_same_results(got, single.generate([SampleRequest(r.token_ids, 6) for r in reqs[:2]], GREEDY))


def test_top_k_alone_cuts_everything_past_the_kth_token():
    """Regression: with top_p = 1 the nucleus rule `cumsum(p) - p < 1` also kept the zero-probability tokens past
    the k-th whenever the float cumsum of the top k ended below 1, so top-k sampled from the whole vocabulary."""
    import jax.numpy as jnp

    from arpo_jax.rollout.jax_decode import process_logits

    logits = jnp.asarray(np.random.RandomState(0).randn(4, 600).astype(np.float32) * 3)
    allowed = jnp.asarray(np.arange(600) < 520)
    for top_k, top_p in ((3, 1.0), (3, 0.999), (40, 1.0)):
        z = process_logits(logits, allowed, jnp.float32(0.5), jnp.int32(top_k), jnp.float32(top_p), greedy=False,
                           truncate=True)
        kept = np.isfinite(np.asarray(z))
        if top_p == 1.0:
            assert (kept.sum(-1) == top_k).all()
        masked = np.where(np.asarray(allowed)[None], np.asarray(logits), -np.inf)
        assert ((kept.sum(-1) >= 1) & (kept.sum(-1) <= top_k)).all()
        best = [set(np.argsort(-r)[:c]) for r, c in zip(masked, kept.sum(-1))]
        assert [set(np.flatnonzero(k)) for k in kept] == best


def test_bucket_steps():
    """Cache lengths step by 1.5x / 2x, prefill chunks by 1.25x (a 150-token prompt pads to 160, not 192)."""
    assert pow2_buckets(64, 300, half_steps=True) == (64, 96, 128, 192, 256, 384, 512)
    assert pow2_buckets(16, 256, quarter_steps=True) == (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160,
                                                         192, 224, 256)
    assert pow2_buckets(1, 16) == (1, 2, 4, 8, 16)


def test_chunked_calls_equal_one_call(tiny_hf_dir, tokenizer):
    """A token budget of 2 rows x 96 slots runs 4 requests through 2 rows (each waiting for a free one), greedy,
    then continues them (tool results, a branch) with seeded sampling: the same tokens, text and log-probs as an
    engine with a row for each (per-request seeds); the second round reuses only the rows that survived (the cache
    kept between calls is bounded too)."""
    path, _ = tiny_hf_dir("qwen2")
    kw = dict(prefill_chunk=16)  # one prefill width: fewer compiles
    whole, chunked = _sampler(path, tokenizer, **kw), _sampler(path, tokenizer, max_tokens_per_call=2 * 96, **kw)
    reqs = [SampleRequest(p, 16, slot_id=i) for i, p in enumerate(_prompts([5, 17, 9, 30], seed=21))]
    seeded = SamplingSettings(temperature=1.0, seed=3, stop=(), logprobs=5, logprob_positions=8, token_logprobs=True)
    tool = tokenizer.encode(" <result>\n42\n</result>")
    for rnd, settings in enumerate((GREEDY, seeded)):
        want, got = whole.generate(reqs, settings), chunked.generate(reqs, settings)
        _assert_same_results(got, want)
        assert chunked.shape.slots == 2 and chunked.last_stats["batch_bucket"] == 2
        assert chunked.last_stats["batch"] == len(reqs) == whole.last_stats["batch"]
        if rnd:  # slot 3 and its branch come from the cache of the last chunk; slots 0 and 1 prefill again
            assert 0 < chunked.last_stats["reused_tokens"] < whole.last_stats["reused_tokens"]
            np.testing.assert_allclose(np.concatenate([r.token_logprobs for r in got]),
                                       np.concatenate([r.token_logprobs for r in want]), atol=1e-4)
        reqs = [SampleRequest(r.token_ids + res.token_ids + tool, 16, slot_id=r.slot_id) for r, res in zip(reqs, want)]
        reqs[2] = SampleRequest(reqs[3].token_ids, 16, slot_id=9, parent_id=3)  # a branch of slot 3


def test_a_budget_below_one_row_is_refused(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    with pytest.raises(ValueError, match=r"max_tokens_per_call=50 .*allowed: 0 \(no limit\) or >= 96"):
        _sampler(path, tokenizer, max_tokens_per_call=50)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_weights_are_kept_in_the_compute_dtype(tiny_hf_dir, tokenizer, monkeypatch):
    """float32 master weights, bfloat16 compute: the sampler holds a bfloat16 copy (half the bytes) and samples what
    it did from the float32 weights: the same greedy tokens up to a near-tie, log-probs within bfloat16 rounding
    (XLA's CPU upcasts bf16 dots to float32 and may then read the float32 weights unrounded, so they are not bitwise
    equal here, and a near-tie on a random tiny model may go either way)."""
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path, dtype="bfloat16", param_dtype="float32")
    reqs = [SampleRequest(p, 12) for p in _prompts([6, 15], seed=23)]
    settings = dataclasses.replace(GREEDY, token_logprobs=True)
    cast = JaxSampler(model, tokenizer, max_len=64, restrict_to_tokenizer=False)
    assert {x.dtype for x in jax.tree.leaves(cast._state)} == {jnp.dtype(jnp.bfloat16)}
    monkeypatch.setattr(jax_sampler, "decode_weights", lambda state, dtype: jax.tree.map(jnp.copy, state))
    master = JaxSampler(model, tokenizer, max_len=64, restrict_to_tokenizer=False)
    assert {x.dtype for x in jax.tree.leaves(master._state)} == {jnp.dtype(jnp.float32)}
    for a, b in zip(cast.generate(reqs, settings), master.generate(reqs, settings), strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert same >= 4, (a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.token_logprobs[:same], b.token_logprobs[:same], atol=0.05)
        if same < len(a.token_ids):  # the two picks are a near-tie: their log-probs within bf16 rounding
            assert abs(a.token_logprobs[same] - b.token_logprobs[same]) < 0.05, (same, a, b)


def test_sleep_frees_the_weights_until_the_next_update(tiny_hf_dir, tokenizer):
    path, _ = tiny_hf_dir("qwen2")
    sampler = _sampler(path, tokenizer)
    req = [SampleRequest(_prompts([7], seed=24)[0], 6, slot_id=0)]
    before = sampler.generate(req, GREEDY)
    sampler.sleep()
    assert sampler._state is None and sampler._ds is None
    with pytest.raises(RuntimeError, match="update_weights first"):
        sampler.generate(req, GREEDY)
    sampler.update_weights(arpo_jax.from_pretrained(path))
    _assert_same_results(sampler.generate(req, GREEDY), before)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_scanned_layout_samples_as_the_unrolled_one(tiny_hf_dir, tokenizer):
    """`layout="scanned"` (one lax.scan over the stacked layers and cache: what GPUs and TPUs run by default) draws the
    same seeded samples and log-probs as the unrolled CPU layout, in a first call and in a continuation after a tool
    result (the cache regathered), so the accelerators' decode path is checked on CPU too."""
    path, _ = tiny_hf_dir("qwen2")
    sampled = SamplingSettings(temperature=1.0, stop=(), logprobs=5, logprob_positions=8, seed=11)
    tool = tokenizer.encode(" <result>\n42\n</result>")
    runs = []
    for layout in ("unrolled", "scanned"):
        sampler = _sampler(path, tokenizer, layout=layout, decode_chunk=4)
        assert sampler._unrolled == (layout == "unrolled")
        prompts = _prompts([7, 12], seed=5)
        first = sampler.generate([SampleRequest(p, 10, slot_id=i) for i, p in enumerate(prompts)], sampled)
        ctx = [p + r.token_ids + tool for p, r in zip(prompts, first)]
        runs.append(first + sampler.generate([SampleRequest(c, 8, slot_id=i) for i, c in enumerate(ctx)], sampled))
        assert sampler.last_stats["reused_tokens"] > 0
    _assert_same_results(*runs)
    assert len({tuple(r.token_ids) for r in runs[0]}) == 4  # not degenerate: four different samples
    with pytest.raises(ValueError, match="layout='stacked'; allowed: auto, unrolled, scanned"):
        _sampler(path, tokenizer, layout="stacked")


def test_the_slot_table_keeps_rows_the_next_requests_need():
    """Rows of trajectories a call does not name are forgotten; a free row is an empty one first, then one whose
    trajectory no waiting request continues or branches from, least recently used first; a trajectory that moves
    leaves its old row."""
    from arpo_jax.rollout.jax_slots import SlotTable

    t = SlotTable(4)
    t.begin(set())
    for row, slot in enumerate((10, 11, 12, 13)):
        t.take(row, slot)
        t.held[row] = np.arange(row + 1, dtype=np.int32)
        t.release(row)
    t.begin({10, 11, 13})  # 12 is over: its row is empty now
    assert (t.lookup(12), t.lookup(13), len(t.held[2])) == (None, 3, 0)
    assert t.free_row(protect={10, 11, 13}) == 2
    t.take(2, 20)
    assert t.free_row(protect={10, 13}) == 1  # 11 is needed by no waiting request
    t.take(1, 21)
    assert t.free_row(protect={13}) == 0  # least recently used of the rest
    t.take(0, 13)  # trajectory 13 moves to row 0: row 3 no longer holds it
    assert (t.lookup(13), t.slot[3], t.free_row(protect=set())) == (0, None, 3)


@pytest.mark.slow  # > 20 s on 2 cores: two engines' programs, three decode lengths
def test_decode_length_buckets_sample_as_the_whole_cache_and_read_less(tiny_hf_dir, tokenizer):
    """Issue 60: decode programs over the first 1/4, 1/2 and all of the cache's slots (`decode_lengths="halves"`),
    picked by the live rows' lengths: the same tokens, text and log-probs as the engine that always attends over
    the whole cache, through calls that continue rows (tool results) and branch (a copied row), with more requests
    than rows; each step's matmuls read the picked length's slots (the compiled programs' dot operands grow by the
    same bytes per slot), and the host counts fewer slots read."""
    path, _ = tiny_hf_dir("qwen2")
    kw = dict(max_len=256, slots=4, decode_chunk=8, prefill_chunk=64, decode_rows="all")
    whole, buckets = (_sampler(path, tokenizer, decode_lengths=mode, **kw) for mode in ("all", "halves"))
    assert buckets.shape.lengths == (64, 128, 256) and whole.shape.lengths == (256,)
    assert sorted(n for n in buckets.programs() if n.startswith("decode")) == ["decode_4x128", "decode_4x256",
                                                                               "decode_4x64"]
    reqs = [SampleRequest(p, 24, slot_id=i) for i, p in enumerate(_prompts([5, 40, 9, 70, 20], seed=31))]
    seeded = SamplingSettings(temperature=1.0, seed=5, stop=(), logprobs=5, logprob_positions=30, token_logprobs=True)
    tool = tokenizer.encode(" <result>\n42\n</result>")
    read = {}
    for settings in (seeded, GREEDY, seeded):
        want, got = whole.generate(reqs, settings), buckets.generate(reqs, settings)
        _assert_same_results(got, want, atol=1e-5)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.token_logprobs or [], b.token_logprobs or [], atol=1e-5)
        read = {"whole": read.get("whole", 0) + whole.last_stats["kv_slots_read"],
                "buckets": read.get("buckets", 0) + buckets.last_stats["kv_slots_read"]}
        reqs = [SampleRequest(r.token_ids + res.token_ids + tool, 24, slot_id=r.slot_id) for r, res in zip(reqs, want)]
        reqs[1] = SampleRequest(reqs[3].token_ids, 24, slot_id=9, parent_id=3)  # a branch of slot 3
    assert read["buckets"] < 0.75 * read["whole"], read
    from benchmarks.device import gpu_scale

    dots = {n: gpu_scale.dot_operand_bytes(fn.lower(*a).compile().as_text())
            for n, (fn, a) in buckets.programs().items() if n.startswith("decode")}
    per_slot = (dots["decode_4x128"] - dots["decode_4x64"]) / 64
    assert per_slot > 0 and dots["decode_4x256"] - dots["decode_4x128"] == 128 * per_slot, dots
    cfg = buckets.config  # what one slot costs a step's attention matmuls: every layer's k and v, and the float32
    assert per_slot == cfg.num_layers * 4 * (2 * cfg.num_kv_heads * cfg.head_dim + cfg.num_heads) * 4  # probabilities


def test_kv_cache_dtype_and_lengths_by_backend(tiny_hf_dir, tokenizer, monkeypatch):
    """`rollout.jax.kv_dtype` / `decode_lengths` "auto": the compute dtype and one length on CPU, bfloat16 and three
    lengths on an accelerator. A bfloat16 cache under a float32 model: the cache holds bfloat16, and the log-probs
    (the prefill attends over the cache too) are the float32 engine's within bf16 rounding while the tokens agree."""
    from arpo_jax.rollout import jax_decode

    assert jax_decode.kv_cache_dtype("auto") is None and jax_decode.decode_length_buckets("auto", 2080) == (2080,)
    monkeypatch.setattr(jax_decode.jax, "default_backend", lambda: "gpu")
    assert jax_decode.kv_cache_dtype("auto") == "bfloat16" and jax_decode.kv_cache_dtype("compute") is None
    assert jax_decode.decode_length_buckets("auto", 2080) == (544, 1056, 2080)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="kv_dtype='fp8'; allowed: auto, bfloat16, float32, compute"):
        jax_decode.kv_cache_dtype("fp8")
    path, _ = tiny_hf_dir("qwen2")
    f32, bf16 = (_sampler(path, tokenizer, kv_dtype=kv, slots=2, decode_chunk=4, prefill_chunk=32)
                 for kv in ("compute", "bfloat16"))
    assert bf16.shape.kv_dtype == "bfloat16" and f32.shape.kv_dtype is None
    prompts = _prompts([6, 11], seed=41)
    want, got = (s.generate([SampleRequest(p, 6) for p in prompts], GREEDY) for s in (f32, bf16))
    assert all(x.dtype == jnp.bfloat16 for x in bf16._ds.cache.k) and f32._ds.cache.k[0].dtype == jnp.float32
    # The decode program's cache arguments (what a step reads) are half the bytes. (XLA's CPU dots convert bfloat16
    # operands to float32 first, so on CPU the matmuls' operands are not smaller: an accelerator's are.)
    args = [s.programs()["decode_2"] for s in (f32, bf16)]
    sizes = [fn.lower(*a).compile().memory_analysis().argument_size_in_bytes for fn, a in args]
    kv = 2 * bf16.shape.cache_len * bf16.config.num_layers * 2 * bf16.config.num_kv_heads * bf16.config.head_dim
    assert sizes[0] - sizes[1] == kv * 2, sizes  # rows x slots x layers x (k, v) x heads x head_dim x 2 bytes
    for a, b in zip(got, want):
        assert a.token_ids[0] == b.token_ids[0]
        same = next((t for t in range(len(a.token_ids)) if a.token_ids[t] != b.token_ids[t]), len(a.token_ids))
        for t in range(same):
            np.testing.assert_allclose([a.top_logprobs[t][k] for k in b.top_logprobs[t] if k in a.top_logprobs[t]],
                                       [b.top_logprobs[t][k] for k in b.top_logprobs[t] if k in a.top_logprobs[t]],
                                       atol=3e-2)
